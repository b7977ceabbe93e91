# %% [markdown]
# # Lesson 7 — Data vs model parallelism (and the hybrid), eq. 2 on a slow link
#
# **Time:** about 30 minutes. **Needs:** one machine; part 6 (a real throttled link) needs root on
# Linux, optionally a second machine.
#
# Three ways to share training among devices:
#
# * **model parallelism** — the paper's, and tinyconv's default: every device gets the *same images*
#   and a slice of each convolution's *kernels*. What crosses the wire is the input and the feature
#   maps: it grows with the batch. The master keeps every weight.
# * **data parallelism** — every device holds a *whole copy* of the network and gets a slice of
#   the *batch*; after the backward the gradients are summed and every copy updated. What crosses
#   the wire is the gradients and the weights: as many as the network has parameters, whatever
#   the batch.
# * **the hybrid** — Krizhevsky's "one weird trick": the convolutional layers by data (each device
#   its slice of the images, the conv weights whole), the fully connected layer and the loss on the
#   master alone, over the whole batch. What crosses the wire is the conv weights and gradients and,
#   for every image, its features (the last pool's output) out and their gradient back.
#
# Which one moves fewer bytes depends on the network and the batch; you will compute all three,
# find where they cross, check your formulas against the bytes tinyconv's own runs move, and see
# what that costs on the paper's 5 MB/s Wi-Fi.
#
# **What exists in tinyconv.** All three, in `examples/cifar10_dist.py` and `tc.distribute`:
# `--parallel model` (the default), `--parallel data` (`tinyconv/distributed/replica/server.py`, a
# parameter server) and `--parallel hybrid` (`tinyconv/distributed/replica/hybrid.py`, the cut in
# `conv_part.py`); `docs/how-it-works.md`, "Model, data or hybrid parallelism", compares them. The
# paper's eq. 2 and tinyconv's own byte counts: `tinyconv comm`. The simulator: `tinyconv simulate`
# (model parallelism). A throttled link on one Linux machine: `benchmarks/throttled_link.py` (root).
# Part 4 runs one tiny step of each split here and holds your formulas against its bytes.

# %% tags=["setup"]
import math

import numpy as np
from charts import QUICK, show  # noqa: E402 -- beside the lessons: their size, their charts

import tinyconv as tc

# %%
from tinyconv.distributed.replica.conv_part import conv_part, feature_shape  # noqa: E402
from tinyconv.lab.eq2 import ConvShape, conv_shapes, eq2_bytes, equal_counts, kernel_split_bytes  # noqa: E402
from tinyconv.lab.plot.lines import Panel, Series, line_chart  # noqa: E402
from tinyconv.lab.plot.svg import colors  # noqa: E402

# %% [markdown]
# ## 1. Model parallelism: the paper's eq. 2
#
# Marques et al. count, for every conv layer, its input maps, its kernels and its output maps, in
# doubles:
#
# $$\text{eq. 2} = 8 \sum_{\text{conv layers}} \left( in^2 \cdot inCh \cdot batch + k^2 \cdot numK \cdot inCh
#   + out^2 \cdot numK \cdot batch \right)$$
#
# Read for a split among the master and its workers: the input goes to *every* worker with
# kernels, the kernels and maps of the workers' shares once; the master's own share moves
# nothing. That is the forward pass only; tinyconv's paper split also moves the backward
# (`tinyconv comm` prints both, `tinyconv/lab/eq2.py` derives them).

# %%
net = tc.paper_net("50:500", backend="numpy")
for p in (2, 3, 4):
    convs = conv_shapes(net, 64)
    counts = equal_counts(convs, p)
    to, back = kernel_split_bytes(convs, counts)
    print(
        f"50:500, batch 64, {p} participants: eq. 2 {eq2_bytes(convs, counts) / 1e6:6.1f} MB (doubles),"
        f" tinyconv's paper split {(to + back) / 1e6:6.1f} MB (float32, forward and backward)"
    )

# %% [markdown]
# ## 2. Data parallelism's bytes
#
# tinyconv's data parallelism is a parameter server (the master): every step it sends worker $i$
# its $n_i$ images (uint8 in the dataset, float32 on the wire, $C H W$ values each), their labels
# (8 bytes each) and the current weights; the worker sends back its gradient and its logits
# ($K$ classes per image). With $P$ parameters, in float32:
#
# $$\text{bytes}_i = 4\,(2P + n_i (C H W + K)) + 8 n_i$$
#
# — nearly independent of the batch: the weights dominate. (A ring all-reduce, without a master,
# would move $2 (W-1)/W \cdot 4P$ per worker instead.)


# %%
def parameters(net: "tc.Network") -> int:
    return sum(v.size for layer in net.layers for v in layer.params.values())


archs = ["50:500"] if QUICK else ["50:500", "150:800", "300:1000"]
nets = {a: tc.paper_net(a, backend="numpy") for a in archs}
for a, n in nets.items():
    print(f"{a}: {parameters(n):,} parameters = {4 * parameters(n) / 1e6:.1f} MB in float32")

# %% [markdown]
# ## 3. The hybrid's bytes
#
# A hybrid step is two rounds (`Hybrid._step` in `tinyconv/distributed/replica/hybrid.py`):
#
# 1. **forward**: the master sends worker $i$ its $n_i$ images (float32) and the conv part's
#    weights, all $P_{conv}$ of them; the worker runs the convolutional part on its images and
#    sends back each image's $F$ features ($F = C_2 H' W'$: the last pool's output, flattened);
# 2. **backward**: the master runs the classifier and the loss over the whole batch, then sends
#    each worker the gradient of its own rows of features; the worker runs the conv part's
#    backward from them and sends back its conv gradient.
#
# The labels never leave the master (the loss is its own), and neither do the classifier's
# weights; everything travels in float32. Exercise 3 turns this into bytes. What it needs for the
# paper's networks:

# %%
for a, n in nets.items():
    p_conv, f = parameters(conv_part(n)), math.prod(feature_shape(n, 32))
    print(
        f"{a}: the conv part {p_conv:,} parameters, the classifier {parameters(n) - p_conv:,};"
        f" F = {f:,} features an image ({4 * f / 1e3:.0f} KB in float32, the image itself 12 KB)"
    )

# %% [markdown]
# ## Exercises (then the charts use them)
#
# 1. `eq2(convs, counts, word=8)`: eq. 2 for layers of `ConvShape`s (`x` = (N, C, H, W),
#    `w` = (F, C, K, K), `y` = (N, F, OH, OW)) split by `counts` (per layer, the master's first and
#    moving nothing), in words of `word` bytes. The input goes once to each worker with kernels.
# 2. `data_parallel_bytes(n_params, images, image_values, classes)`: the bytes of part 2, to and
#    from one worker with `images` images of `image_values` values each, in one step.
# 3. `hybrid_bytes(n_conv_params, images, image_values, features)`: the bytes of part 3's two
#    rounds, to and from one worker with `images` images of `image_values` values and `features`
#    features each, in one step.
# 4. `break_even_batch(model_bytes_at, data_bytes, largest=4096)`: the smallest batch (1 to `largest`)
#    at which model parallelism moves at least as many bytes as data parallelism: `model_bytes_at`
#    is a function batch -> bytes. `None` if none does.
#
# Part 4 holds 2 and 3 against the bytes tinyconv's own steps move. Grade:
# `pytest course/ --student-dir YOUR_FOLDER -k lesson7`.


# %% tags=["exercise"]
def eq2(convs: list[ConvShape], counts: list[list[int]], word: int = 8) -> int:
    """The paper's eq. 2 for this split, in bytes: per layer, x to each worker with kernels, plus the
    workers' kernels and their output maps."""
    # BEGIN SOLUTION
    # TODO: per layer, which workers hold kernels? Each gets the whole input; their kernels and maps move once
    total = 0
    for conv, layer_counts in zip(convs, counts, strict=True):
        n, c, h, w = conv.x
        k = conv.w[2]
        oh, ow = conv.y[2:]
        workers = [kk for kk in layer_counts[1:] if kk]
        total += len(workers) * h * w * c * n + k * k * sum(workers) * c + oh * ow * sum(workers) * n
    return total * word
    # END SOLUTION


def data_parallel_bytes(n_params: int, images: int, image_values: int, classes: int) -> int:
    """Bytes to and from one worker in a step: weights out and gradient back (float32), its images
    (float32) and labels (8 bytes each) out, its logits (float32) back."""
    # BEGIN SOLUTION
    # TODO: list what goes out and what comes back, how many numbers each, and each one's size in bytes
    return 4 * (2 * n_params + images * (image_values + classes)) + 8 * images
    # END SOLUTION


def hybrid_bytes(n_conv_params: int, images: int, image_values: int, features: int) -> int:
    """Bytes to and from one worker in a hybrid step (float32): the conv weights and its images out,
    its features back; then its rows of the features' gradient out, its conv gradient back."""
    # BEGIN SOLUTION
    # TODO: the four messages of part 3's two rounds, each counted in float32 numbers; no labels travel
    return 4 * (2 * n_conv_params + images * (image_values + 2 * features))
    # END SOLUTION


def break_even_batch(model_bytes_at, data_bytes: int, largest: int = 4096) -> int | None:
    """The smallest batch in 1..largest with model_bytes_at(batch) >= data_bytes, or None."""
    # BEGIN SOLUTION
    # TODO: try batches in order (or bisect: the bytes grow with the batch)
    return next((b for b in range(1, largest + 1) if model_bytes_at(b) >= data_bytes), None)
    # END SOLUTION


# %% [markdown]
# ## 4. The three, built: one tiny step of each
#
# Now the real thing. `tc.distribute(net, "inproc", 2, parallel=...)` starts two workers as
# threads of this process (the same worker code as over ZeroMQ, without the sockets) and shares
# one training step of a tiny network on 8 synthetic images by each split. The step's record
# (`last_step`; a `step` event in a metrics file) counts the array bytes to and from each
# participant (`participant_bytes_sent`, `participant_bytes_recv`; the master's are 0). Eight
# images among three participants do not divide evenly, so the workers get different slices: your
# formulas must hold for each. Model parallelism runs the paper's split (`split="kernels",
# fuse=False`, the main job's `--split kernels --fuse off`), which `kernel_split_bytes` counts.

# %%
tiny_arch, size = "8:16", 32  # a tiny network, so that each step takes a moment: the formulas hold at any size
tiny_data = tc.synthetic_dataset(n_train=8, n_test=8, seed=0)
x, y = tiny_data.x_train.astype(np.float32) / 255 - 0.5, tiny_data.y_train
measured = {}
for parallel in ("model", "data", "hybrid"):
    tiny = tc.paper_net(tiny_arch, backend="numpy", image_size=size)
    options = {"split": "kernels", "fuse": False} if parallel == "model" else {}
    with tc.distribute(
        tiny, "inproc", 2, parallel=parallel, calibrate=False, rebalance=False, batch_size=len(x),
        image_size=size, announce=lambda _: None, **options,
    ) as runtime:  # fmt: skip
        if parallel == "model":
            tiny.train_step(x, y)  # the runtime put its sharded layers into the network
        else:
            runtime.train_batch(tiny, x, y)
        step = runtime.last_step
    sent, recv = step["participant_bytes_sent"][1:], step["participant_bytes_recv"][1:]
    measured[parallel] = [s + r for s, r in zip(sent, recv, strict=True)]
    if parallel == "model":  # tinyconv's own count, for the workers together
        convs = conv_shapes(tiny, len(x), size)
        want = [sum(kernel_split_bytes(convs, [step["shares"][c.name] for c in convs]))]
        got, what = [sum(measured[parallel])], f"kernels {[step['shares'][c.name] for c in convs]}"
    else:
        images = step["shares"]["batch"][1:]
        p_conv, f = parameters(conv_part(tiny)), math.prod(feature_shape(tiny, size))
        if parallel == "data":
            want = [data_parallel_bytes(parameters(tiny), n, 3 * size * size, 10) for n in images]
        else:
            want = [hybrid_bytes(p_conv, n, 3 * size * size, f) for n in images]
        got, what = measured[parallel], f"images {step['shares']['batch']}"
    verdict = "ok" if got == want else "look again"
    print(f"--parallel {parallel:6s} ({what}): measured {got} bytes, formula {want}: {verdict}")

# %% [markdown]
# ## 5. Where they cross
#
# One worker beside the master, as fast as it: half the kernels (model parallelism, the paper's
# split in tinyconv's float32 bytes, forward and backward: `kernel_split_bytes`), or half the
# images (data parallelism and the hybrid).

# %%
batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
series, palette = [], colors(3 * len(nets))
for i, (a, n) in enumerate(nets.items()):
    p_conv, f = parameters(conv_part(n)), math.prod(feature_shape(n, 32))

    def model_bytes_at(batch: int, n=n) -> int:
        convs = conv_shapes(n, batch)
        return sum(kernel_split_bytes(convs, equal_counts(convs, 2)))

    def data_bytes_at(batch: int, n=n) -> int:
        return data_parallel_bytes(parameters(n), batch // 2, 3 * 32 * 32, 10)

    def hybrid_bytes_at(batch: int, p_conv=p_conv, f=f) -> int:
        return hybrid_bytes(p_conv, batch // 2, 3 * 32 * 32, f)

    data = data_bytes_at(64)
    # data's bytes grow a little with the batch too (its images): compare the difference with 0
    cross = break_even_batch(lambda b, m=model_bytes_at, d=data_bytes_at: m(b) - d(b), 0, largest=1024)
    hybrid_cross = break_even_batch(lambda b, h=hybrid_bytes_at, d=data_bytes_at: h(b) - d(b), 0, largest=1024)
    at64 = conv_shapes(n, 64)
    print(
        f"{a}: model parallelism moves more than data parallelism from batch {cross} on, the hybrid from"
        f" batch {hybrid_cross} on (data at batch 64: {data / 1e6:.1f} MB a step, hybrid"
        f" {hybrid_bytes_at(64) / 1e6:.1f} MB; eq. 2: {eq2(at64, equal_counts(at64, 2)) / 1e6:.1f} MB)"
    )
    for j, (kind, at) in enumerate(
        (("model (kernels)", model_bytes_at), ("data (replicas)", data_bytes_at), ("hybrid", hybrid_bytes_at))
    ):
        series.append(Series(f"{a} {kind}", [(b, at(b) / 1e6) for b in batches], palette[3 * i + j], dash=j == 1))
show(
    line_chart(
        "Bytes per step, master + 1 worker",
        [Panel(series, "batch size", "MB per step", xlog=True, ylog=True, yfrom0=False)],
    ),
    "lesson7_bytes.svg",
)

# %% [markdown]
# The hybrid saves each worker the classifier's weights and gradient, and pays $2F$ numbers an
# image for it: here $F$ is large (32,000 for `50:500`) and the classifier small, so it moves fewer
# bytes than data parallelism only for slices of fewer images than about the number of classes.
# AlexNet, the trick's network, is the other way round: its classifier is most of its weights.
#
# ## 6. On a slow link
#
# At the paper's 5 MB/s, every MB is 0.2 s. The simulator puts the bytes, a link model (Wi-Fi's
# shared half-duplex channel or switched Ethernet) and measured device speeds together, for 1 to
# 128 nodes:
#
#     tinyconv simulate --measure runs/devices.json --arch 300:1000 --bandwidth 5 100
#     tinyconv comm --arch 300:1000 --batch 64 --measure      # eq. 2 beside tinyconv's bytes, checked
#
# and a real link throttled to 5 MB/s between two network namespaces on one Linux machine (root):
#
#     sudo .venv/bin/python benchmarks/throttled_link.py --rate 5MB/s --check           # what it carries
#     sudo .venv/bin/python benchmarks/throttled_link.py --rate 5MB/s --check-worker    # one step across it
#
# The seconds below are the bytes above at the link's rate: arithmetic, nothing measured. To
# measure the three splits, run each and read `bytes_sent`, `bytes_recv` and `comm_s` from the
# step events as in lesson 6 — on loopback, or inside the throttled link:
#
#     python examples/cifar10_dist.py --parallel model --transport zmq --workers 1 --dataset synthetic \
#         --steps 20 --metrics-out model.jsonl
#     python examples/cifar10_dist.py --parallel data --transport zmq --workers 1 --dataset synthetic \
#         --steps 20 --metrics-out data.jsonl
#     python examples/cifar10_dist.py --parallel hybrid --transport zmq --workers 1 --dataset synthetic \
#         --steps 20 --metrics-out hybrid.jsonl
#
# (`docs/metrics.md` lists what a data-parallel step records; a hybrid step records the same, with
# two ops, forward and backward.) The simulator predicts model parallelism only.

# %%
for a, n in nets.items():
    convs = conv_shapes(n, 64)
    model = sum(kernel_split_bytes(convs, equal_counts(convs, 2)))
    data = data_parallel_bytes(parameters(n), 32, 3 * 32 * 32, 10)
    hybrid = hybrid_bytes(parameters(conv_part(n)), 32, 3 * 32 * 32, math.prod(feature_shape(n, 32)))
    for rate in (5, 100):
        print(
            f"{a} batch 64 over {rate:3d} MB/s: model {model / (rate * 1e6):6.2f} s a step, "
            f"data {data / (rate * 1e6):6.2f} s, hybrid {hybrid / (rate * 1e6):6.2f} s (transfers only)"
        )

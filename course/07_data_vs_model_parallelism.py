# %% [markdown]
# # Lesson 7 — Data vs model parallelism, and the paper's eq. 2 on a slow link
#
# **Time:** about 30 minutes. **Needs:** one machine; part 4 (a real throttled link) needs root on
# Linux, part 3 optionally a second machine.
#
# Two ways to share training among devices:
#
# * **model parallelism** — the paper's, and tinyconv's: every device gets the *same images* and a
#   slice of each convolution's *kernels*. What crosses the wire is the input and the feature maps:
#   it grows with the batch. The master keeps every weight.
# * **data parallelism** — every device holds a *whole copy* of the network and gets a slice of
#   the *batch*; after the backward the gradients are summed and every copy updated. What crosses
#   the wire is the gradients and the weights: as many as the network has parameters, whatever
#   the batch.
#
# Which one moves fewer bytes depends on the network and the batch; you will compute both and
# find where they cross, then what that costs on the paper's 5 MB/s Wi-Fi.
#
# **What exists in tinyconv.** Model parallelism: all of it (`--parallel model`, the default).
# Data parallelism: `--parallel data` in `examples/cifar10_dist.py` (`tinyconv/distributed/replica/`, a
# parameter server; `docs/how-it-works.md`, "Model, data or hybrid parallelism") — new as this
# lesson is written, so the cell below checks that your copy has it. A hybrid of the two: not built.
# The paper's eq. 2 and tinyconv's own byte counts: `tinyconv comm`. The simulator:
# `tinyconv simulate` (model parallelism). A throttled link on one Linux machine:
# `benchmarks/throttled_link.py` (root). This lesson computes both splits' bytes; part 4 says how
# to measure them.

# %% tags=["setup"]
import subprocess
import sys
from pathlib import Path

from charts import QUICK, show  # noqa: E402 -- beside the lessons: their size, their charts

import tinyconv as tc

# %%
from tinyconv.lab.eq2 import ConvShape, conv_shapes, eq2_bytes, equal_counts, kernel_split_bytes  # noqa: E402
from tinyconv.lab.plot.lines import Panel, Series, line_chart  # noqa: E402
from tinyconv.lab.plot.svg import colors  # noqa: E402

root = Path(tc.__file__).resolve().parent.parent
example = root / "examples" / "cifar10_dist.py"
if example.is_file():
    help_text = subprocess.run(
        [sys.executable, str(example), "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    print("this copy's main job has --parallel data:", "--parallel" in help_text)
else:
    print("examples/cifar10_dist.py is not here (an installed tinyconv without the repository)")

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
# ## Exercises (then the charts use them)
#
# 1. `eq2(convs, counts, word=8)`: eq. 2 for layers of `ConvShape`s (`x` = (N, C, H, W),
#    `w` = (F, C, K, K), `y` = (N, F, OH, OW)) split by `counts` (per layer, the master's first and
#    moving nothing), in words of `word` bytes. The input goes once to each worker with kernels.
# 2. `data_parallel_bytes(n_params, images, image_values, classes)`: the bytes above, to and from
#    one worker with `images` images of `image_values` values each, in one step.
# 3. `break_even_batch(model_bytes_at, data_bytes, largest=4096)`: the smallest batch (1 to `largest`)
#    at which model parallelism moves at least as many bytes as data parallelism: `model_bytes_at`
#    is a function batch -> bytes. `None` if none does.
#
# Grade: `pytest course/ --student-dir YOUR_FOLDER -k lesson7`.


# %% tags=["exercise"]
def eq2(convs: list[ConvShape], counts: list[list[int]], word: int = 8) -> int:
    """The paper's eq. 2 for this split, in bytes: per layer, x to each worker with kernels, plus the
    workers' kernels and their output maps."""
    # BEGIN SOLUTION
    # TODO: per layer, workers = counts[1:] above 0: len(workers)*H*W*C*N + K*K*sum(workers)*C + OH*OW*sum(workers)*N
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
    # TODO: 4 * (2 * n_params + images * (image_values + classes)) + 8 * images
    return 4 * (2 * n_params + images * (image_values + classes)) + 8 * images
    # END SOLUTION


def break_even_batch(model_bytes_at, data_bytes: int, largest: int = 4096) -> int | None:
    """The smallest batch in 1..largest with model_bytes_at(batch) >= data_bytes, or None."""
    # BEGIN SOLUTION
    # TODO: try batches in order (or bisect: the bytes grow with the batch)
    return next((b for b in range(1, largest + 1) if model_bytes_at(b) >= data_bytes), None)
    # END SOLUTION


# %% [markdown]
# ## 3. Where they cross
#
# One worker beside the master, as fast as it: half the kernels (model parallelism, the paper's
# split in tinyconv's float32 bytes, forward and backward: `kernel_split_bytes`), or half the
# images (data parallelism).

# %%
batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
series, palette = [], colors(2 * len(nets))
for i, (a, n) in enumerate(nets.items()):

    def model_bytes_at(batch: int, n=n) -> int:
        convs = conv_shapes(n, batch)
        return sum(kernel_split_bytes(convs, equal_counts(convs, 2)))

    def data_bytes_at(batch: int, n=n) -> int:
        return data_parallel_bytes(parameters(n), batch // 2, 3 * 32 * 32, 10)

    data = data_bytes_at(64)
    # data's bytes grow a little with the batch too (its images): compare the difference with 0
    cross = break_even_batch(lambda b, m=model_bytes_at, d=data_bytes_at: m(b) - d(b), 0, largest=1024)
    at64 = conv_shapes(n, 64)
    print(
        f"{a}: model parallelism moves more than data parallelism from batch {cross} on "
        f"(data at batch 64: {data / 1e6:.1f} MB a step; eq. 2: {eq2(at64, equal_counts(at64, 2)) / 1e6:.1f} MB)"
    )
    series.append(Series(f"{a} model (kernels)", [(b, model_bytes_at(b) / 1e6) for b in batches], palette[2 * i]))
    series.append(
        Series(f"{a} data (replicas)", [(b, data_bytes_at(b) / 1e6) for b in batches], palette[2 * i + 1], dash=True)
    )
show(
    line_chart(
        "Bytes per step, master + 1 worker",
        [Panel(series, "batch size", "MB per step", xlog=True, ylog=True, yfrom0=False)],
    ),
    "lesson7_bytes.svg",
)

# %% [markdown]
# ## 4. On a slow link
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
# measure both splits (if the check at the top printed `True`), run each and read `bytes_sent`,
# `bytes_recv` and `comm_s` from the step events as in lesson 6 — on loopback, or inside the
# throttled link:
#
#     python examples/cifar10_dist.py --parallel model --transport zmq --workers 1 --dataset synthetic \
#         --steps 20 --metrics-out model.jsonl
#     python examples/cifar10_dist.py --parallel data --transport zmq --workers 1 --dataset synthetic \
#         --steps 20 --metrics-out data.jsonl
#
# (`docs/metrics.md` lists what a data-parallel step records.) The simulator predicts model
# parallelism only.

# %%
for a, n in nets.items():
    convs = conv_shapes(n, 64)
    model = sum(kernel_split_bytes(convs, equal_counts(convs, 2)))
    data = data_parallel_bytes(parameters(n), 32, 3 * 32 * 32, 10)
    for rate in (5, 100):
        print(
            f"{a} batch 64 over {rate:3d} MB/s: model {model / (rate * 1e6):6.2f} s a step, "
            f"data {data / (rate * 1e6):6.2f} s (transfers only)"
        )

# %% [markdown]
# # Lesson 8 — Reduced precision on the wire: what bf16 or fp16 saves, and costs
#
# **Time:** about 25 minutes. **Needs:** one machine (parts 1 and 4 run tinyconv's in-process
# workers, threads of this process).
#
# **tinyconv can narrow what crosses the wire:** the main job's `--wire-precision` (`fp32`, the
# default; `bf16`, `fp16`, `adt24`, `s8` or `adaptive`), `wire_precision=` on `tc.distribute`, for
# the paper's split (`--parallel model`: data parallelism and the hybrid send float32 only). Only
# the transfer is narrowed: the master keeps every weight in float32 and all arithmetic stays
# float32; each side narrows an array right before sending it and widens it right after receiving
# it (`tinyconv/distributed/wire_precision.py` the formats, `wire_codec.py` the codec at the edges;
# `docs/how-it-works.md`, "Narrower words on the wire"). In this lesson you write bfloat16's
# rounding yourself, hold it against the built one bit for bit, and compute, then measure, what a
# 16-bit wire saves in bytes (eq. 2, lesson 7) and costs in error.
#
# Two 16-bit formats:
#
# | format | sign | exponent | mantissa | largest | relative step ($2^{-m}$) |
# | --- | --- | --- | --- | --- | --- |
# | float32 | 1 | 8 | 23 | 3.4e38 | 1.2e-7 |
# | **bfloat16** | 1 | 8 | 7 | 3.4e38 | 7.8e-3 |
# | **float16** | 1 | 5 | 10 | 65504 | 9.8e-4 |
#
# bfloat16 is float32 with the low 16 bits of the mantissa dropped: the same range, less
# precision. float16 keeps more precision but overflows past 65504 and loses tiny values.

# %% tags=["setup"]

import numpy as np
from charts import QUICK, show  # noqa: E402 -- beside the lessons: their size, their charts

import tinyconv as tc

# %%
from tinyconv.distributed.wire_precision import narrow, widen  # noqa: E402
from tinyconv.lab.eq2 import conv_shapes, eq2_bytes, equal_counts, kernel_split_bytes, measure  # noqa: E402
from tinyconv.lab.plot.bars import Bar, Group, stacked_bars  # noqa: E402

# %% [markdown]
# ## Exercises first (the lesson's charts use them)
#
# 1. `to_bfloat16(x)`: float32 in, float32 out, every value rounded to the nearest bfloat16, ties
#    to even, and `x` left as it was. A bfloat16 is a float32's top 16 bits; your job is to decide
#    which way the 16 bits being dropped round what is kept. Look at the float32's bits as an
#    unsigned integer: for numbers of one sign, a larger integer is a larger magnitude, and the
#    kept bits' last place is one bfloat16 step. Past half a step the kept part goes up one, below
#    half it stays, at exactly half it goes to the neighbour whose last kept bit is 0 (the even
#    one). A carry that runs out of the mantissa into the exponent is right: the next power of 2.
#    (NaN and infinities: leave them out of scope.)
# 2. `relative_error(approx, exact)`: $\max |a - e| / \max |e|$, the yardstick of lesson 2.
# 3. `wire_bytes(float32_bytes, word)`: the same arrays in words of `word` bytes instead of 4.
#
# Grade: `pytest course/ --student-dir YOUR_FOLDER -k lesson8`.


# %% tags=["exercise"]
def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (round to nearest, ties to even), returned as float32."""
    # BEGIN SOLUTION
    # TODO: round to nearest, ties to even, on the 16 low bits being dropped: work on the float32's bits as an integer
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)
    # END SOLUTION


def relative_error(approx: np.ndarray, exact: np.ndarray) -> float:
    """max |approx - exact| / max |exact| (0 if exact is all zeros and approx equals it)."""
    # BEGIN SOLUTION
    # TODO: in float64, the largest difference over the largest magnitude
    a, e = np.asarray(approx, np.float64), np.asarray(exact, np.float64)
    scale = np.abs(e).max()
    diff = np.abs(a - e).max()
    return float(diff / scale) if scale > 0 else float(diff)
    # END SOLUTION


def wire_bytes(float32_bytes: int, word: int) -> int:
    """The bytes of arrays that take float32_bytes as float32, in words of word bytes."""
    # BEGIN SOLUTION
    # TODO: float32 is 4 bytes a value
    return float32_bytes // 4 * word
    # END SOLUTION


# %% [markdown]
# ## 1. The bytes
#
# Narrowing changes the word, not the count: every term of eq. 2 scales with it. For the paper's
# networks at batch 64, split between the master and one worker:

# %%
archs = ["50:500"] if QUICK else ["50:500", "150:800", "300:1000"]
groups = []
for arch in archs:
    convs = conv_shapes(tc.paper_net(arch, backend="numpy"), 64)
    counts = equal_counts(convs, 2)
    f32 = sum(kernel_split_bytes(convs, counts))
    print(
        f"{arch}: eq. 2 {eq2_bytes(convs, counts) / 1e6:.1f} MB in doubles (the paper's count); tinyconv moves "
        f"{f32 / 1e6:.1f} MB in float32, {wire_bytes(f32, 2) / 1e6:.1f} MB in 16 bits: "
        f"{wire_bytes(f32, 2) / 5e6:.1f} s instead of {f32 / 5e6:.1f} s a step at 5 MB/s"
    )
    groups.append(
        Group(
            arch,
            [
                Bar(name, {"bytes": wire_bytes(f32, word) / 1e6})
                for name, word in (("float64", 8), ("float32", 4), ("16-bit", 2))
            ],
        )
    )
show(
    stacked_bars(
        "Bytes one step moves, master + 1 worker, batch 64", "MB", groups, [("bytes", "MB per step", "#1f77b4")]
    ),
    "lesson8_bytes.svg",
)

# %% [markdown]
# Now measured: `measure` (what `tinyconv comm --measure` runs) takes one real training step of a
# tiny network with the master and one in-process worker, the paper's split, at each
# `--wire-precision`, and returns the array bytes the step's record counted, out and back. Your
# `wire_bytes` of the float32 step should give the 16-bit steps' bytes exactly: every array, the
# biases too, goes in 2-byte words, and none fell back to float32.

# %%
moved = {fmt: sum(measure("8:16", 8, 2, wire_precision=fmt)) for fmt in ("fp32", "bf16", "fp16")}
for fmt, nbytes in moved.items():
    predicted = wire_bytes(moved["fp32"], 4 if fmt == "fp32" else 2)
    verdict = "ok" if predicted == nbytes else "look again"
    print(f"--wire-precision {fmt}: {nbytes:,} bytes measured, {predicted:,} from wire_bytes: {verdict}")

# %% [markdown]
# ## 2. Your rounding against the built one
#
# `narrow(x, "bf16")` is what a worker does before it sends `x`: it returns the 16-bit words (as
# `uint16`) that travel; `widen` is what the receiver does with them. Their round trip is the value
# the other side computes with, so it must equal your `to_bfloat16` bit for bit, over float32's
# whole range. The built fp16 is IEEE half (numpy's `float16`), with one difference: an array with a
# value that would overflow to infinity travels in float32 instead, and the step counts it
# (`wire_fallbacks` in the metrics).

# %%
draw = np.random.default_rng(1)
count = 10_000 if QUICK else 200_000
x = (draw.standard_normal(count) * 10.0 ** draw.integers(-30, 30, count)).astype(np.float32)
ties = ((draw.integers(0x0080, 0x7F00, 1_000).astype(np.uint32) << 16) | 0x8000).view(np.float32)  # half a step
x = np.concatenate([x, ties, -ties])
built = widen(narrow(x, "bf16").carried, "bf16")
same = np.sum(built.view(np.uint32) == to_bfloat16(x).view(np.uint32))
verdict = "ok" if same == x.size else "look again"
print(f"bf16: your rounding equals the built one on {same:,} of {x.size:,} values: {verdict}")
fits = x[np.abs(x) <= 65504]  # one value past float16's range would send the whole array in float32
same = np.array_equal(widen(narrow(fits, "fp16").carried, "fp16"), fits.astype(np.float16).astype(np.float32))
print(f"fp16: the built round trip equals numpy's float16 on the {fits.size:,} values within its range: {same}")
overflow = narrow(np.float32([70000.0, 1.0]), "fp16")
print(f"fp16 of [70000, 1]: travels as {overflow.fmt} (fell back: {overflow.fell_back}), not as infinity")

# %% [markdown]
# ## 3. The error in a feature map
#
# A worker narrows its output maps before sending them (and the master its inputs and kernels).
# How far is a convolution's output from float32's? The reference is the float64 convolution;
# each row narrows x and w, convolves in float32, and narrows the result.

# %%
rng = np.random.default_rng(0)
n, c, f, size = (4, 16, 16, 8) if QUICK else (16, 50, 64, 16)
data = tc.synthetic_dataset(n_train=n, n_test=8, seed=0)
x = (data.x_train[:, :, :size, :size].astype(np.float32) / 255 - 0.5).repeat(-(-c // 3), axis=1)[:, :c]
w = (rng.standard_normal((f, c, 5, 5)) * np.sqrt(2 / (c * 25))).astype(np.float32)  # He, as tinyconv's
b = np.zeros(f, np.float32)
be = tc.get_backend("numpy")
exact, _ = be.conv2d_forward(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), 1, 2)
narrow_to = {
    "float32": lambda a: a,
    "bfloat16": to_bfloat16,
    "float16": lambda a: a.astype(np.float16).astype(np.float32),
}
errors = {}
for name, cast in narrow_to.items():
    y, _ = be.conv2d_forward(cast(x), cast(w), b, 1, 2)
    errors[name] = relative_error(cast(y), exact)
    print(f"{name:8s}: relative error of the output maps {errors[name]:.1e}")
with np.errstate(over="ignore"):  # the overflow is the point
    print("float16's range: a map value of 70000 becomes", np.float32(70000).astype(np.float16))

# %% [markdown]
# ## 4. Training on a 16-bit wire
#
# The same few steps of SGD on the same images, with one in-process worker, at each
# `--wire-precision`: what the narrowed words do to the loss. (The main job's own, for a real run:
# `python examples/cifar10_dist.py --wire-precision bf16 --transport zmq --workers 1`.)

# %%
steps, batch = 4, 8
train = tc.synthetic_dataset(n_train=steps * batch, n_test=8, seed=1)
losses = {}
for fmt in ("fp32", "bf16", "fp16"):
    net = tc.paper_net("8:16", backend="numpy")
    opt = tc.SGD(net, 0.05, momentum=0.9)
    with tc.distribute(
        net, "inproc", 1, wire_precision=fmt, calibrate=False, rebalance=False, batch_size=batch,
        announce=lambda _: None,
    ) as cluster:  # fmt: skip
        losses[fmt], fallbacks = [], 0
        for i in range(steps):
            images = train.x_train[i * batch : (i + 1) * batch].astype(np.float32) / 255 - 0.5
            losses[fmt].append(net.train_step(images, train.y_train[i * batch : (i + 1) * batch]))
            opt.step()
            fallbacks += cluster.last_step["wire_fallbacks"]  # arrays that had to go in float32
        words = cluster.last_step.get("wire_precision", {}).get("conv2", "float32 throughout")
        print(f"{fmt}: losses {np.round(losses[fmt], 5).tolist()}; conv2's words {words}; fallbacks {fallbacks}")
for fmt in ("bf16", "fp16"):
    print(
        f"{fmt}: the losses differ from fp32's by at most {relative_error(losses[fmt], losses['fp32']):.1e}, relative"
    )

# %% [markdown]
# What to take away: 16 bits halve every byte of eq. 2 — on a 5 MB/s link, half the comm of every
# step — at an error in the maps of a few $10^{-4}$ (float16) to a few $10^{-3}$ (bfloat16), far above
# float32's $10^{-7}$ but below the noise SGD adds anyway; mixed-precision training (Micikevicius et
# al. 2018) keeps a float32 master copy of the weights for the same reason, and so does tinyconv.
# Measured over longer runs (docs/results.md: `--preset quick --epochs 3`, a fixed equal
# split, the same seed), CIFAR-10's test accuracy was 68.92 % at fp32 and 69.39 % at bf16: within
# one run's noise. `--wire-precision s8` and `adaptive` go further (1 byte a map value, and a
# per-layer word for the weights): `tinyconv comm --wire-precision fp32 bf16 s8 adaptive` counts
# their bytes.

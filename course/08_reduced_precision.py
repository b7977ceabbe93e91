# %% [markdown]
# # Lesson 8 — Reduced precision on the wire: what bf16 or fp16 would save, and cost
#
# **Time:** about 20 minutes. **Needs:** one machine, numpy only.
#
# **This is a paper exercise: tinyconv has no reduced-precision wire option yet** (issue #15).
# Every array crosses the wire as float32 today. Here you compute, with numpy alone, what
# narrowing the feature maps and weights to 16 bits would do: to the bytes of eq. 2 (lesson 7),
# and to the values a worker sends back.
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
from tinyconv.lab.eq2 import conv_shapes, eq2_bytes, equal_counts, kernel_split_bytes  # noqa: E402
from tinyconv.lab.plot.bars import Bar, Group, stacked_bars  # noqa: E402

# %% [markdown]
# ## Exercises first (the lesson's charts use them)
#
# 1. `to_bfloat16(x)`: float32 in, float32 out, every value rounded to the nearest bfloat16
#    (ties to even): view the bits as `uint32`, add `0x7FFF` plus the lowest kept bit
#    (`(u >> 16) & 1`), clear the low 16 bits. (NaN and infinities: leave them out of scope.)
# 2. `relative_error(approx, exact)`: $\max |a - e| / \max |e|$, the yardstick of lesson 2.
# 3. `wire_bytes(float32_bytes, word)`: the same arrays in words of `word` bytes instead of 4.
#
# Grade: `pytest course/ --student-dir YOUR_FOLDER -k lesson8`.


# %% tags=["exercise"]
def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (round to nearest, ties to even), returned as float32."""
    # BEGIN SOLUTION
    # TODO: u = x.view(uint32); u += 0x7FFF + ((u >> 16) & 1); clear the low 16 bits; view as float32
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
        f"{f32 / 1e6:.1f} MB in float32, would move {wire_bytes(f32, 2) / 1e6:.1f} MB in 16 bits: "
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
# ## 2. The error in a feature map
#
# A worker would narrow its output maps before sending them (and the master its inputs and
# kernels). How far is a convolution's output from float32's? The reference is the float64
# convolution; each row narrows x and w, convolves in float32, and narrows the result.

# %%
rng = np.random.default_rng(0)
n, c, f, size = (4, 16, 16, 8) if QUICK else (16, 50, 64, 16)
data = tc.synthetic_dataset(n_train=n, n_test=8, seed=0)
x = (data.x_train[:, :, :size, :size].astype(np.float32) / 255 - 0.5).repeat(-(-c // 3), axis=1)[:, :c]
w = (rng.standard_normal((f, c, 5, 5)) * np.sqrt(2 / (c * 25))).astype(np.float32)  # He, as tinyconv's
b = np.zeros(f, np.float32)
be = tc.get_backend("numpy")
exact, _ = be.conv2d_forward(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), 1, 2)
narrow = {"float32": lambda a: a, "bfloat16": to_bfloat16, "float16": lambda a: a.astype(np.float16).astype(np.float32)}
errors = {}
for name, cast in narrow.items():
    y, _ = be.conv2d_forward(cast(x), cast(w), b, 1, 2)
    errors[name] = relative_error(cast(y), exact)
    print(f"{name:8s}: relative error of the output maps {errors[name]:.1e}")
with np.errstate(over="ignore"):  # the overflow is the point
    print("float16's range: a map value of 70000 becomes", np.float32(70000).astype(np.float16))

# %% [markdown]
# What to take away: 16 bits halve every byte of eq. 2 — on a 5 MB/s link, half the comm of every
# step — at an error in the maps of about $10^{-3}$ (float16) to $10^{-2}$ (bfloat16), far above
# float32's $10^{-7}$ but below the noise SGD adds anyway; mixed-precision training (Micikevicius et
# al. 2018) keeps a float32 master copy of the weights for the same reason. Whether tinyconv's
# training reaches the same accuracy with a 16-bit wire is what issue #15 would measure: nothing here
# says it does.

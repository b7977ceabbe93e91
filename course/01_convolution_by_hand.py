# %% [markdown]
# # Lesson 1 — A convolution by hand, then as one matrix product
#
# **Time:** about 30 minutes. **Needs:** one machine, nothing else running.
#
# A convolutional layer is most of what a CNN computes. In this lesson you will
#
# 1. read the convolution's definition and its output size,
# 2. watch tinyconv's reference compute one on a real image,
# 3. see *im2col* turn it into one matrix product (GEMM), which is how tinyconv and Caffe run it
#    (cuDNN's GEMM algorithms lower it the same way, without building the whole matrix),
# 4. and write all three yourself in the exercises at the end: the loops, im2col, the GEMM.
#
# Shapes are NCHW, float32: `x (N, C, H, W)`, weights `w (F, C, K, K)`, biases `b (F,)`.

# %% tags=["setup"]
import io
import lzma
import time
from pathlib import Path

import numpy as np
from charts import QUICK, show  # noqa: E402 -- beside the lessons: their size, their charts
from tqdm.auto import tqdm  # a bar that Jupyter draws as a widget, a terminal as text

import tinyconv as tc
from backends.numpy_backend import im2col
from tinyconv.cifar10 import LABEL_NAMES, default_data_dir, find_batches_dir, load_batch

# %%
from tinyconv.lab.plot.lines import Panel, Series, line_chart  # noqa: E402
from tinyconv.lab.plot.svg import colors  # noqa: E402


def heatmaps(maps: list[np.ndarray], titles: list[str], cell: int = 8) -> str:
    """Grey-scale pictures of 2-D arrays side by side (black = lowest, white = highest), as SVG."""
    parts, x0 = [], 10
    for m, t in zip(maps, titles, strict=True):
        lo, hi = float(m.min()), float(m.max())
        g = np.zeros_like(m) if hi == lo else (m - lo) / (hi - lo)
        parts.append(f'<text x="{x0}" y="14" font-size="12">{t}</text>')
        for (i, j), v in np.ndenumerate(g):
            c = int(255 * v)
            parts.append(
                f'<rect x="{x0 + j * cell}" y="{20 + i * cell}" width="{cell}" height="{cell}" '
                f'fill="rgb({c},{c},{c})"/>'
            )
        x0 += m.shape[1] * cell + 30
    height = 30 + max(m.shape[0] for m in maps) * cell
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{x0}" height="{height}" '
        f'font-family="sans-serif">{"".join(parts)}</svg>'
    )


# %% [markdown]
# ## 1. The definition
#
# With stride $s$ and zero padding $p$ (the input framed by $p$ zeros on each side, $x_{pad}$):
#
# $$y[n, f, o_h, o_w] = b[f] + \sum_{c=0}^{C-1} \sum_{i=0}^{K-1} \sum_{j=0}^{K-1}
#   w[f, c, i, j]\; x_{pad}[n, c,\; o_h s + i,\; o_w s + j]$$
#
# and the output is $O = \lfloor (H + 2p - K) / s \rfloor + 1$ pixels high (and wide).
# The paper's network uses $K = 5$, $p = 2$, $s = 1$: $O = H$, "same" size.
#
# Every output value is a dot product of $C K^2$ weights with a $C \times K \times K$ window of
# the input: $2 C K^2$ floating-point operations, and there are $N F O_h O_w$ of them.

# %%
be = tc.get_backend("numpy")  # the reference backend: what every other backend is checked against
for h, k, s, p in [(32, 5, 1, 2), (32, 5, 1, 0), (32, 3, 2, 1), (7, 3, 2, 0)]:
    y, _ = be.conv2d_forward(
        np.zeros((1, 1, h, h), np.float32),
        np.zeros((1, 1, k, k), np.float32),
        np.zeros(1, np.float32),
        stride=s,
        padding=p,
    )
    print(
        f"H={h:2d} K={k} stride={s} padding={p} -> output {y.shape[2]}x{y.shape[3]}  "
        f"(formula: {(h + 2 * p - k) // s + 1})"
    )

# %% [markdown]
# ## 2. One convolution on a real image
#
# CIFAR-10's images are 3 x 32 x 32, uint8. If the real data set is on this machine (tinyconv's data
# folder: `$TINYCONV_DATA`, else `~/.cache/tinyconv`, where `python examples/cifar10_dist.py` downloads
# it) the picture comes from its test batch; otherwise from the few images that ship with the course
# (`data/cifar10_sample.npz.xz` beside the lessons: an `.npz` compressed with xz). Either way it is
# test image 13, a horse.
#
# Two hand-made 3x3 kernels, a vertical and a horizontal edge detector (Sobel's), applied to all three
# colour channels and summed. First each channel's mean is taken away, as training normalises its
# images (lesson 3): then the zero padding around the image is its average colour, and the frame it
# adds is faint. (Try it without, on a bright picture: the border outshines every edge.)


# %%
def course_sample() -> dict[str, np.ndarray]:
    """The images that ship with the course, by name (x_train, pictures, ...): data/ beside the lessons."""
    here = Path(globals().get("__file__", "lesson")).resolve().parent  # a notebook has no __file__: its folder
    for path in (here / "data" / "cifar10_sample.npz.xz", Path("course/data/cifar10_sample.npz.xz")):
        if path.is_file():
            with np.load(io.BytesIO(lzma.decompress(path.read_bytes()))) as npz:
                return dict(npz)
    raise FileNotFoundError("data/cifar10_sample.npz.xz is not beside the lessons: copy the course's data/ folder")


HORSE = 13  # CIFAR-10's test image 13: a white horse on a dark ground
batches = find_batches_dir(default_data_dir())  # the real CIFAR-10's folder, or None
if batches is not None:
    images, labels = load_batch(batches / "test_batch")  # uint8 (10000, 3072): R, G, B planes of 32x32
    picture, label, where = images[HORSE].reshape(3, 32, 32), labels[HORSE], f"the real CIFAR-10 ({batches})"
else:
    sample = course_sample()
    chosen = sample["picture_index"] == HORSE
    picture, label, where = sample["pictures"][chosen][0], sample["picture_labels"][chosen][0], "the course's sample"
print(f"test image {HORSE}, a {LABEL_NAMES[label]}, from {where}")

x = picture[None].astype(np.float32) / 255  # (1, 3, 32, 32), in [0, 1]
x -= x.mean(axis=(2, 3), keepdims=True)  # each channel's mean taken away
edge = np.array([[-1, 0, 1], [-2, 0, 2], [-1, 0, 1]], np.float32)  # Sobel
w = np.stack([np.stack([edge] * 3), np.stack([edge.T] * 3)])  # (2, 3, 3, 3): two kernels
y, _ = be.conv2d_forward(x, w, np.zeros(2, np.float32), stride=1, padding=1)
print("x", x.shape, "w", w.shape, "-> y", y.shape)
show(
    heatmaps(
        [picture.mean(0), y[0, 0], y[0, 1]],
        ["input (mean of RGB)", "kernel 0: vertical edges", "kernel 1: horizontal edges"],
    ),
    "lesson1_edges.svg",
)

# %% [markdown]
# Mid-grey is about 0 in the two maps, white a strong positive response (darker on the left than on the right of
# that pixel, or above than below), black a strong negative one: the horse's outline, its legs
# upright in the first map, its back and belly level in the second.

# %% [markdown]
# ## 3. im2col: the convolution as one matrix product
#
# Copy every $C \times K \times K$ window of the input into a column of a matrix `cols`,
# of shape $(C K^2,\ N O_h O_w)$; the weights reshaped to $(F,\ C K^2)$ times `cols` is then every
# dot product at once:
#
# $$\underbrace{Y}_{F \times N O_h O_w} = \underbrace{W}_{F \times C K^2}\;
#   \underbrace{\mathrm{cols}}_{C K^2 \times N O_h O_w} + b$$
#
# The row order of `cols` is `(c, i, j)`, the same as `w.reshape(F, -1)`; its column order is
# `(n, o_h, o_w)`. The price is memory: each input pixel is copied up to $K^2$ times. The gain:
# one BLAS call at tens of GFLOP/s instead of loops. tinyconv's `im2col` builds `cols` with a
# single strided view and one copy (`backends/numpy_columns.py`).

# %%
cols = im2col(x, 3, 3, 1, 1)
print("cols", cols.shape, "= (C*K*K, N*OH*OW) =", (3 * 3 * 3, 1 * 32 * 32))
y_gemm = (w.reshape(2, -1) @ cols).reshape(2, 1, 32, 32).transpose(1, 0, 2, 3)
print("GEMM vs the backend's convolution, max |difference|:", float(np.abs(y_gemm - y).max()))

# %% [markdown]
# ## Exercises
#
# Write the three functions below, replacing each `raise NotImplementedError`. Use numpy only
# (not tinyconv's `im2col` nor its backend: the graders compare against those). Then run the
# cells after them, and grade yourself with
#
#     pytest course/ --student-dir YOUR_FOLDER -k lesson1
#
# **Exercise 1.** `conv2d_loops`: the definition above as loops over `n, f, o_h, o_w`, with one
# `np.sum` for the window's dot product. Pad with `np.pad`.
#
# **Exercise 2.** `im2col_loops`: the `(C*K*K, N*OH*OW)` matrix, by loops over the output
# positions (each fills one column). The rows in `(c, i, j)` order, the columns in `(n, o_h, o_w)`.
#
# **Exercise 3.** `conv2d_gemm`: your `im2col_loops`, one matrix product, the bias, and the
# reshape/transpose back to `(N, F, OH, OW)`.


# %% tags=["exercise"]
def conv2d_loops(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int = 1, padding: int = 0) -> np.ndarray:
    """x (N, C, H, W), w (F, C, K, K), b (F,) -> y (N, F, OH, OW), in x's dtype, by the definition."""
    # BEGIN SOLUTION
    # TODO: pad x; each output is its kernel's bias plus the kernel times the window under it (windows step by stride)
    n, c, h, wd = x.shape
    f, _, k, _ = w.shape
    oh, ow = (h + 2 * padding - k) // stride + 1, (wd + 2 * padding - k) // stride + 1
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    y = np.zeros((n, f, oh, ow), dtype=x.dtype)
    for i in range(n):
        for j in range(f):
            for r in range(oh):
                for s in range(ow):
                    window = xp[i, :, r * stride : r * stride + k, s * stride : s * stride + k]
                    y[i, j, r, s] = b[j] + np.sum(w[j] * window)
    return y
    # END SOLUTION


def im2col_loops(x: np.ndarray, k: int, stride: int = 1, padding: int = 0) -> np.ndarray:
    """x (N, C, H, W) -> cols (C*K*K, N*OH*OW): column (n, oh, ow) is the window at (oh, ow) of image n."""
    # BEGIN SOLUTION
    # TODO: pad x; one column per output position, in (n, oh, ow) order: the C x K x K window under it, flattened
    n, c, h, wd = x.shape
    oh, ow = (h + 2 * padding - k) // stride + 1, (wd + 2 * padding - k) // stride + 1
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    cols = np.empty((c * k * k, n * oh * ow), dtype=x.dtype)
    col = 0
    for i in range(n):
        for r in range(oh):
            for s in range(ow):
                cols[:, col] = xp[i, :, r * stride : r * stride + k, s * stride : s * stride + k].reshape(-1)
                col += 1
    return cols
    # END SOLUTION


def conv2d_gemm(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int = 1, padding: int = 0) -> np.ndarray:
    """The same convolution as conv2d_loops, as im2col_loops and one matrix product."""
    # BEGIN SOLUTION
    # TODO: each kernel flattened to a row in cols' (c, i, j) order; one product, the biases; then back to NCHW's axes
    n, _, h, wd = x.shape
    f, _, k, _ = w.shape
    oh, ow = (h + 2 * padding - k) // stride + 1, (wd + 2 * padding - k) // stride + 1
    y = w.reshape(f, -1) @ im2col_loops(x, k, stride, padding) + b[:, None]
    return y.reshape(f, n, oh, ow).transpose(1, 0, 2, 3)
    # END SOLUTION


# %% [markdown]
# ### Check your answers, then time them
#
# The three must agree with the backend to float32 round-off. Then the timing: the loops make
# one small numpy call per output value, the GEMM one big one. The chart shows how the gap
# grows with the image.

# %%
rng = np.random.default_rng(0)
xs = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
ws = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
bs = rng.standard_normal(4).astype(np.float32)
ref, _ = be.conv2d_forward(xs, ws, bs, stride=2, padding=1)
for fn in (conv2d_loops, conv2d_gemm):
    print(f"{fn.__name__:13s} max |difference| from the backend: {np.abs(fn(xs, ws, bs, 2, 1) - ref).max():.1e}")
print("im2col_loops equals tinyconv's im2col:", np.array_equal(im2col_loops(xs, 3, 2, 1), im2col(xs, 3, 3, 2, 1)))


def best_of(fn, *args, repeats: int = 3) -> float:
    """The fastest of a few runs, in seconds: the least disturbed by whatever else the machine does."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


sizes = [4, 6, 8] if QUICK else [8, 12, 16, 24, 32]
timings = {"loops": [], "im2col (yours) + GEMM": [], "tinyconv's backend": []}
for size in tqdm(sizes, desc="timing", unit="size", disable=None):  # None: no bar in a log
    xs = rng.standard_normal((2, 3, size, size)).astype(np.float32)
    ws = rng.standard_normal((8, 3, 5, 5)).astype(np.float32)
    bs = np.zeros(8, np.float32)
    timings["loops"].append(best_of(conv2d_loops, xs, ws, bs, 1, 2))
    timings["im2col (yours) + GEMM"].append(best_of(conv2d_gemm, xs, ws, bs, 1, 2))
    timings["tinyconv's backend"].append(best_of(be.conv2d_forward, xs, ws, bs, 1, 2))
ratio = timings["loops"][-1] / timings["tinyconv's backend"][-1]
print(f"at {sizes[-1]}x{sizes[-1]} pixels the loops take {ratio:.0f}x the backend's time")
series = [
    Series(name, [(s, t * 1e3) for s, t in zip(sizes, ts, strict=True)], color)
    for (name, ts), color in zip(timings.items(), colors(3), strict=True)
]
show(
    line_chart(
        "A 5x5 convolution, 3 -> 8 channels, batch 2",
        [Panel(series, "image height and width (pixels)", "milliseconds (best of 3)", ylog=True, yfrom0=False)],
    ),
    "lesson1_timing.svg",
)

# %% [markdown]
# # Lesson 2 — Backprop by hand, checked by finite differences
#
# **Time:** about 40 minutes. **Needs:** one machine.
#
# Training needs, for every layer, the gradient of the loss with respect to its input and its
# weights. tinyconv writes every one of them by hand (no autograd), so every one is checked
# against the definition of a derivative. You will
#
# 1. see what a layer's backward computes (a vector-Jacobian product),
# 2. check it with centred finite differences, and see why that needs float64,
# 3. meet the classic trap (LRN's cross-channel term),
# 4. and write the backward of ReLU, max pool, fully connected, softmax + cross-entropy,
#    convolution and LRN yourself, each checked by finite differences.

# %% tags=["setup"]

import numpy as np
from charts import QUICK, show  # noqa: E402 -- beside the lessons: their size, their charts

import tinyconv as tc
from backends.numpy_backend import col2im, im2col
from tinyconv.gradcheck import numeric_grad, rel_error

# %%
from tinyconv.lab.plot.lines import Panel, Series, line_chart  # noqa: E402
from tinyconv.lab.plot.svg import colors  # noqa: E402

be = tc.get_backend("numpy")  # the reference ops compute in their inputs' dtype: float64 in, float64 out

# %% [markdown]
# ## 1. What a backward computes
#
# A layer is $y = f(x)$. Backprop hands it $g = \partial L / \partial y$ (the "dy") and wants
# $\partial L / \partial x$. By the chain rule that is the Jacobian's transpose times $g$,
#
# $$dx_i = \sum_j g_j \frac{\partial y_j}{\partial x_i},$$
#
# a *vector-Jacobian product*: never the whole Jacobian, which would be $|y| \times |x|$.
#
# ## 2. Checking it: centred finite differences
#
# $$\frac{\partial}{\partial x_i} \sum_j g_j y_j \approx
#   \frac{\sum_j g_j \left(f(x + h e_i)_j - f(x - h e_i)_j\right)}{2h}, \quad \text{error } O(h^2).$$
#
# The error has two parts: truncation, $\sim h^2$, and round-off, $\sim \varepsilon / h$ with
# $\varepsilon$ the float's precision. The chart shows both, for the LRN, in float64 and float32:
# in float32 the best you can reach is about $10^{-3}$ — useless to tell a right backward from a
# slightly wrong one. So checks run in **float64**.

# %%
rng = np.random.default_rng(0)
x = rng.standard_normal((1, 4, 3, 3)) * 3
g = rng.standard_normal(x.shape)
steps = [10.0**-e for e in range(1, 10)] if not QUICK else [1e-1, 1e-3, 1e-5, 1e-7]
curves = {}
for dtype in (np.float64, np.float32):
    xd = x.astype(dtype)
    _, cache = be.lrn_forward(xd, 5, 1e-1, 0.75, 1.0)
    exact = be.lrn_backward(g.astype(dtype), cache)
    errs = []
    for h in steps:
        num = np.zeros_like(x)
        for i in np.ndindex(x.shape):  # by hand here, to see it in float32 (numeric_grad refuses float32)
            xp, xm = xd.copy(), xd.copy()
            xp[i] += dtype(h)
            xm[i] -= dtype(h)
            fp = be.lrn_forward(xp, 5, 1e-1, 0.75, 1.0)[0].astype(np.float64)
            fm = be.lrn_forward(xm, 5, 1e-1, 0.75, 1.0)[0].astype(np.float64)
            num[i] = np.sum((fp - fm) * g) / (2 * h)
        errs.append(max(rel_error(num, exact.astype(np.float64)), 1e-16))
    curves[np.dtype(dtype).name] = errs
for name, errs in curves.items():
    print(f"{name}: best relative error {min(errs):.1e} at h = {steps[int(np.argmin(errs))]:.0e}")
series = [
    Series(name, list(zip(steps, errs, strict=True)), c)
    for (name, errs), c in zip(curves.items(), colors(2), strict=True)
]
show(
    line_chart(
        "Finite differences against the LRN's backward",
        [Panel(series, "step h", "relative error", xlog=True, ylog=True, yfrom0=False)],
    ),
    "lesson2_finite_differences.svg",
)

# %% [markdown]
# tinyconv's checker does this for any op or layer: `check_op` for a backend op, `tc.check_layer`
# for a layer (every parameter too), `tc.check_network` for a whole network. Anything below about
# $10^{-7}$ is right; a wrong backward gives $10^{-2}$ or more.

# %%
from tinyconv.gradcheck import check_op  # noqa: E402

print(
    "conv2d",
    check_op(
        "conv2d",
        {"x": rng.standard_normal((2, 3, 5, 5)), "w": rng.standard_normal((4, 3, 3, 3)), "b": rng.standard_normal(4)},
        stride=2,
        padding=1,
    ),
)
print("LRN layer", tc.check_layer(tc.LocalResponseNorm(be, size=5, alpha=0.1), rng.standard_normal((2, 6, 3, 3))))

# %% [markdown]
# ## 3. The trap: LRN's cross-channel term
#
# LRN divides each channel by a sum over its neighbours' squares,
# $s_i = k + \frac{\alpha}{n}\sum_{j \in W(i)} x_j^2$, $y_i = x_i s_i^{-\beta}$ with
# $W(i) = [i - \lfloor n/2 \rfloor,\ i + \lfloor (n-1)/2 \rfloor]$. So $y_i$ depends on every
# $x_j$ in its window, and
#
# $$dx_j = dy_j\, s_j^{-\beta} - \frac{2\alpha\beta}{n}\, x_j \sum_{i:\ j \in W(i)} dy_i\, \frac{y_i}{s_i}.$$
#
# Keeping only the first term (the "diagonal") is the classic mistake. With tinyconv's small
# default $\alpha = 10^{-4}$ it is almost right, so a test with small inputs passes it; with the
# large $|x|$ of real feature maps it is not. Finite differences tell:

# %%
x = rng.standard_normal((1, 6, 2, 2)) * 10
dy = rng.standard_normal(x.shape)
y, cache = be.lrn_forward(x, 5, 1e-4, 0.75, 1.0)
s = (x / y) ** (1 / 0.75)  # s_i = (x_i / y_i)^(1/beta)
diagonal_only = dy * s**-0.75
numeric = numeric_grad(lambda v: be.lrn_forward(v, 5, 1e-4, 0.75, 1.0)[0], x, dy)
print(f"full backward:  {rel_error(be.lrn_backward(dy, cache), numeric):.1e}")
print(f"diagonal only:  {rel_error(diagonal_only, numeric):.1e}   <- wrong, and finite differences say so")

# %% [markdown]
# ## Exercises
#
# Write each backward from its forward's math, in numpy, for float64 inputs (the checks run in
# float64). The cell after them checks each one by finite differences on the reference forward;
# the graders (`pytest course/ --student-dir YOUR_FOLDER -k lesson2`) compare against the backend's
# backward on fixed seeds.
#
# 1. `relu_backward(dy, x)`: $y = \max(x, 0)$.
# 2. `maxpool_backward(dy, x, k)`: $k \times k$ windows, stride $k$, no padding; the gradient goes to
#    the window's maximum (the first one, in row-major order, if there is a tie).
# 3. `linear_backward(dy, x, w)`: $y = x w^T + b$ with $x$ (N, D), $w$ (M, D); returns (dx, dw, db).
# 4. `softmax_cross_entropy(logits, labels)`: the mean over the batch of $-\log \mathrm{softmax}(z)_{y}$
#    and its gradient, $(\mathrm{softmax}(z) - \mathrm{onehot}(y)) / N$. Subtract each row's max first
#    (exp overflows otherwise).
# 5. `conv2d_backward(dy, x, w, stride, padding)`: with `cols = im2col(x, K, K, stride, padding)` and
#    `dy` reshaped to (F, N*OH*OW): `dw = dY cols^T`, `db` = sum of dy over N, OH, OW,
#    `dx = col2im(w^T dY)`. (`im2col`, `col2im` are imported above; lesson 1 wrote im2col.)
# 6. `lrn_backward(dy, x, size, alpha, beta, k)`: the formula above, both terms.


# %% tags=["exercise"]
def relu_backward(dy: np.ndarray, x: np.ndarray) -> np.ndarray:
    """dx = dy where x > 0, else 0. Any shape."""
    # BEGIN SOLUTION
    # TODO: the ReLU passes the gradient where its input was positive
    return dy * (x > 0)
    # END SOLUTION


def maxpool_backward(dy: np.ndarray, x: np.ndarray, k: int) -> np.ndarray:
    """x (N, C, H, W), dy (N, C, H//k, W//k) -> dx (N, C, H, W): each dy to its window's (first) maximum."""
    # BEGIN SOLUTION
    # TODO: view x as (N, C, OH, k, OW, k) windows, find each one's first argmax, put dy there
    n, c, h, w = x.shape
    oh, ow = h // k, w // k
    windows = x[:, :, : oh * k, : ow * k].reshape(n, c, oh, k, ow, k).transpose(0, 1, 2, 4, 3, 5)
    flat = windows.reshape(n, c, oh, ow, k * k)
    winner = flat.argmax(axis=-1)  # argmax returns the first maximum
    dflat = np.zeros_like(flat)
    np.put_along_axis(dflat, winner[..., None], dy[..., None], axis=-1)
    dx = np.zeros_like(x)
    dx[:, :, : oh * k, : ow * k] = (
        dflat.reshape(n, c, oh, ow, k, k).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, oh * k, ow * k)
    )
    return dx
    # END SOLUTION


def linear_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y = x @ w.T + b, x (N, D), w (M, D), dy (N, M) -> (dx (N, D), dw (M, D), db (M,))."""
    # BEGIN SOLUTION
    # TODO: the chain rule on y = x w^T + b for x, w and b; each gradient's shape (its argument's) picks the product
    return dy @ w, dy.T @ x, dy.sum(axis=0)
    # END SOLUTION


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """logits (N, K), labels (N,) ints -> (mean loss, dlogits (N, K))."""
    # BEGIN SOLUTION
    # TODO: shifting a row leaves its softmax alone and keeps exp finite; work in log-probabilities; the mean brings 1/N
    n = logits.shape[0]
    z = logits - logits.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss = -log_p[np.arange(n), labels].mean()
    dlogits = np.exp(log_p)
    dlogits[np.arange(n), labels] -= 1
    return float(loss), dlogits / n
    # END SOLUTION


def conv2d_backward(
    dy: np.ndarray, x: np.ndarray, w: np.ndarray, stride: int, padding: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dy (N, F, OH, OW), x (N, C, H, W), w (F, C, K, K) -> (dx, dw, db) in the shapes of x, w, (F,)."""
    # BEGIN SOLUTION
    # TODO: the forward is one matrix product with im2col's cols: backprop it as the FC layer's, then col2im to pixels
    f, _, k, _ = w.shape
    cols = im2col(x, k, k, stride, padding)
    d = dy.transpose(1, 0, 2, 3).reshape(f, -1)
    dw = (d @ cols.T).reshape(w.shape)
    db = dy.sum(axis=(0, 2, 3))
    dx = col2im(w.reshape(f, -1).T @ d, x.shape, k, k, stride, padding)
    return dx, dw, db
    # END SOLUTION


def lrn_backward(dy: np.ndarray, x: np.ndarray, size: int, alpha: float, beta: float, k: float) -> np.ndarray:
    """x, dy (N, C, H, W) -> dx, for torch's LocalResponseNorm(size, alpha, beta, k)."""
    # BEGIN SOLUTION
    # TODO: recompute s and y from x; the diagonal term, then each j's sum over the outputs i whose window holds j
    c = x.shape[1]
    lo, hi = size // 2, (size - 1) // 2  # W(i) = [i - lo, i + hi]
    sq = x * x
    s = np.full_like(x, k)
    for i in range(c):
        s[:, i] += alpha / size * sq[:, max(0, i - lo) : min(c, i + hi + 1)].sum(axis=1)
    y = x * s**-beta
    t = dy * y / s
    dx = dy * s**-beta
    for j in range(c):  # {i : j in W(i)} = [j - hi, j + lo]
        dx[:, j] -= 2 * alpha * beta / size * x[:, j] * t[:, max(0, j - hi) : min(c, j + lo + 1)].sum(axis=1)
    return dx
    # END SOLUTION


# %% [markdown]
# ### Check them by finite differences
#
# Each forward is the reference backend's; each of your backwards is compared with `numeric_grad`
# (centred differences, float64). Inputs are drawn away from kinks (ReLU at 0, two equal values in
# a pooling window), where a finite difference is not a derivative.

# %%
rng = np.random.default_rng(1)
results = {}
x = rng.standard_normal((2, 3, 4, 4))
x = np.where(np.abs(x) < 0.05, 0.5, x)  # away from ReLU's kink
dy = rng.standard_normal(x.shape)
results["ReLU"] = rel_error(relu_backward(dy, x), numeric_grad(lambda v: be.relu_forward(v)[0], x, dy))

x = rng.permutation(np.arange(2 * 3 * 4 * 4, dtype=np.float64)).reshape(2, 3, 4, 4) / 10  # no ties
dy = rng.standard_normal((2, 3, 2, 2))
results["max pool"] = rel_error(
    maxpool_backward(dy, x, 2), numeric_grad(lambda v: be.maxpool_forward(v, 2, 2, 0)[0], x, dy)
)

x, w, b = rng.standard_normal((3, 5)), rng.standard_normal((4, 5)), rng.standard_normal(4)
dy = rng.standard_normal((3, 4))
dx, dw, db = linear_backward(dy, x, w)
results["FC dx"] = rel_error(dx, numeric_grad(lambda v: be.linear_forward(v, w, b)[0], x, dy))
results["FC dw"] = rel_error(dw, numeric_grad(lambda v: be.linear_forward(x, v, b)[0], w, dy))
results["FC db"] = rel_error(db, numeric_grad(lambda v: be.linear_forward(x, w, v)[0], b, dy))

z, labels = rng.standard_normal((4, 5)) * 3, np.array([0, 3, 4, 3])
loss, dz = softmax_cross_entropy(z, labels)
results["softmax loss"] = abs(loss - be.softmax_cross_entropy(z, labels)[0])
results["softmax dz"] = rel_error(dz, numeric_grad(lambda v: np.array(softmax_cross_entropy(v, labels)[0]), z))

x, w, b = rng.standard_normal((2, 3, 5, 5)), rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(4)
dy = rng.standard_normal((2, 4, 3, 3))
dx, dw, db = conv2d_backward(dy, x, w, 2, 1)
results["conv dx"] = rel_error(dx, numeric_grad(lambda v: be.conv2d_forward(v, w, b, 2, 1)[0], x, dy))
results["conv dw"] = rel_error(dw, numeric_grad(lambda v: be.conv2d_forward(x, v, b, 2, 1)[0], w, dy))
results["conv db"] = rel_error(db, numeric_grad(lambda v: be.conv2d_forward(x, w, v, 2, 1)[0], b, dy))

x = rng.standard_normal((2, 6, 3, 3)) * 5
dy = rng.standard_normal(x.shape)
results["LRN"] = rel_error(
    lrn_backward(dy, x, 4, 0.1, 0.75, 2.0), numeric_grad(lambda v: be.lrn_forward(v, 4, 0.1, 0.75, 2.0)[0], x, dy)
)
for name, err in results.items():
    print(f"{name:13s} {err:.1e}  {'ok' if err < 1e-7 else 'WRONG: look again'}")

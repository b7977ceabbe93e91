"""Every layer's backward against centred finite differences (float64, numpy reference math),
and every op against PyTorch as a second gold implementation (float32).

A correct backward agrees with the finite differences to ~1e-7 or better; a wrong one
is off by 1e-2 or more (see the tests that feed the checker deliberately wrong
backwards). Inputs are kept away from kinks (ReLU at 0, near-ties in a max), where a
finite difference is not a derivative; exact ties are tested separately, by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
from float32_expected import Expected, assert_close, conv2d_expected, linear_expected

from backends.conformance.runner import FN
from backends.numpy_backend import NumpyBackend, _channel_window_sum
from tinyconv.gradcheck import (
    check_layer,
    check_loss,
    check_network,
    check_op,
    numeric_grad,
    rel_error,
)
from tinyconv.layers import BatchNorm2D, Conv2D, Linear, LocalResponseNorm, MaxPool2D, ReLU, SoftmaxCrossEntropy
from tinyconv.model import paper_net

# A correct float64 backward lands at ~1e-10 (maxpool at ~3e-8: the reference returns its
# dx in float32, see numpy_maxpool._max_stage_backward); a wrong one at 1e-2 or more.
TOL = 1e-6
# The network check differences a scalar loss (round-off ~1e-10) for a few entries each.
NET_TOL = 1e-5


def assert_grads(errors: dict[str, float], tol: float = TOL) -> None:
    bad = {k: v for k, v in errors.items() if not v < tol}
    assert not bad, f"gradients off (rel_error > {tol}): {bad}; all: {errors}"


def spaced(rng: np.random.Generator, shape: tuple[int, ...], gap: float = 0.05) -> np.ndarray:
    """Distinct values at least ``gap`` apart in random order: no near-ties for a max to straddle."""
    n = int(np.prod(shape))
    return (rng.permutation(n) - n / 2 + 0.5).reshape(shape) * gap  # +0.5: none is 0 either


# ---------------------------------------------------------------- the checker itself


def test_rel_error_is_zero_for_equal_and_one_for_opposite():
    a = np.array([1.0, -2.0, 3.0])
    assert rel_error(a, a) == 0.0
    assert rel_error(a, -a) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="shapes differ"):
        rel_error(a, a[:2])


def test_numeric_grad_of_a_known_function(rng):
    x = rng.standard_normal((3, 4))
    df = rng.standard_normal((3, 4))
    got = numeric_grad(lambda v: v**3, x, df)  # d/dx sum(x^3 * df) = 3 x^2 df
    assert rel_error(got, 3 * x**2 * df) < 1e-8
    scalar = numeric_grad(lambda v: float(np.sum(np.sin(v))), x)
    assert rel_error(scalar, np.cos(x)) < 1e-8


def test_numeric_grad_refuses_float32(rng):
    with pytest.raises(ValueError, match="float64"):
        numeric_grad(lambda v: v, rng.standard_normal(3).astype(np.float32), np.ones(3))


def test_check_op_leaves_the_callers_arrays_alone(rng):
    x = rng.standard_normal((1, 2, 5, 5))
    w = rng.standard_normal((3, 2, 3, 3))
    before = x.copy(), w.copy()
    check_op("conv2d", {"x": x, "w": w, "b": np.zeros(3)})
    assert np.array_equal(x, before[0]) and np.array_equal(w, before[1])


def test_reference_ops_keep_their_inputs_dtype(rng):
    # float64 in, float64 out: what makes the finite-difference checks meaningful
    ref = NumpyBackend()
    x = rng.standard_normal((2, 3, 4, 4))
    y, cache = ref.batchnorm_forward(x, np.ones(3), np.zeros(3), np.zeros(3), np.ones(3), True)
    assert y.dtype == np.float64 and all(g.dtype == np.float64 for g in ref.batchnorm_backward(y, cache))
    y, cache = ref.lrn_forward(x, 3, 1e-2)
    assert y.dtype == np.float64 and ref.lrn_backward(y, cache).dtype == np.float64
    y, cache = ref.maxpool_forward(x, 3, 2, 1)
    assert y.dtype == np.float64 and ref.maxpool_backward(y, cache).dtype == np.float64
    assert ref.softmax_cross_entropy(x.reshape(2, -1), np.array([0, 1]))[1].dtype == np.float64
    # and float32 stays float32
    y32, _ = ref.lrn_forward(x.astype(np.float32), 3, 1e-2)
    assert y32.dtype == np.float32


# ---------------------------------------------------------------- conv2d


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("padding", [0, 1, 2])
def test_conv2d_gradients(stride, padding, rng):
    n, c, h, w, f, k = 2, 3, 7, 9, 4, 3  # odd sizes: the last stride-2 window does not reach the edge
    inputs = {
        "x": rng.standard_normal((n, c, h, w)),
        "w": rng.standard_normal((f, c, k, k)),
        "b": rng.standard_normal(f),
    }
    assert_grads(check_op("conv2d", inputs, stride=stride, padding=padding))


def test_conv2d_rectangular_kernel_and_batch_one(rng):
    x, w = rng.standard_normal((1, 2, 6, 5)), rng.standard_normal((3, 2, 5, 3))
    inputs = {"x": x, "w": w, "b": np.zeros(3)}
    assert_grads(check_op("conv2d", inputs, stride=2, padding=1))


def test_conv2d_need_dx_false_returns_none_and_the_same_dw_db(rng):
    b = NumpyBackend()
    x = rng.standard_normal((2, 3, 7, 7)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    y, cache = b.conv2d_forward(x, w, np.zeros(4, np.float32), 2, 1)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx, dw, db = b.conv2d_backward(dy, cache, need_dx=False)
    assert dx is None
    dx_full, dw_full, db_full = b.conv2d_backward(dy, cache, need_dx=True)
    assert dx_full.shape == x.shape
    np.testing.assert_array_equal(dw, dw_full)
    np.testing.assert_array_equal(db, db_full)
    layer = Conv2D(b, 3, 4, 3, stride=2, padding=1, need_dx=False)
    layer.forward(x)
    assert layer.backward(dy) is None and layer.grads["w"].shape == w.shape
    assert "x" not in check_layer(layer, x)  # and its dw, db still get checked


# ---------------------------------------------------------------- relu


def test_relu_gradients(rng):
    x = rng.standard_normal((2, 3, 5, 5))
    x += np.sign(x) * 0.01  # keep every input away from the kink at 0
    assert_grads(check_op("relu", {"x": x}))


# ---------------------------------------------------------------- local response norm


def lrn_input(rng: np.random.Generator) -> np.ndarray:
    # with alpha = 1e-2 and |x| ~ 10, alpha/n * sum x^2 ~ k: the cross-channel term of
    # the backward is as large as the diagonal one, so dropping it cannot pass
    return rng.standard_normal((2, 7, 3, 4)) * 10


@pytest.mark.parametrize("size", [3, 4, 5])
def test_lrn_gradients(size, rng):
    x = lrn_input(rng)
    assert_grads(check_op("lrn", {"x": x}, size=size, alpha=1e-2, beta=0.75, k=1.0))
    assert_grads(check_op("lrn", {"x": x}, size=size, alpha=1e-2, beta=0.6, k=2.0))  # the pow path


@pytest.mark.parametrize("size", [3, 4, 5])
def test_lrn_check_rejects_the_classic_wrong_backwards(size, rng):
    """The check is sharp enough: diagonal-only fails, and for even sizes so does the
    un-mirrored window (the backward must sum over {i : j in window(i)}, not window(j))."""
    x = lrn_input(rng)
    alpha, beta = 1e-2, 0.75
    ref = NumpyBackend()
    y, (_, _, s, p, _, _, _, before, after) = ref.lrn_forward(x, size, alpha, beta, 1.0)
    dy = rng.standard_normal(y.shape)
    numeric = numeric_grad(lambda v: ref.lrn_forward(v, size, alpha, beta, 1.0)[0], x, dy)
    c = 2 * alpha * beta / size
    diagonal_only = dy * p - c * x * (dy * y / s)
    unmirrored = dy * p - c * x * _channel_window_sum(dy * y / s, before, after)
    assert rel_error(diagonal_only, numeric) > 1e-2
    if size % 2 == 0:
        assert rel_error(unmirrored, numeric) > 1e-2


# ---------------------------------------------------------------- batch norm


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_gradients(training, rng):
    c = 4
    inputs = {
        "x": rng.standard_normal((3, c, 3, 5)) * 2 + 1,
        "gamma": rng.standard_normal(c),
        "beta": rng.standard_normal(c),
        "running_mean": rng.standard_normal(c),
        "running_var": rng.random(c) + 0.5,
    }
    assert_grads(check_op("batchnorm", inputs, training=training))


def test_batchnorm_batch_one(rng):
    inputs = {
        "x": rng.standard_normal((1, 3, 4, 3)),
        "gamma": rng.standard_normal(3),
        "beta": rng.standard_normal(3),
        "running_mean": np.zeros(3),
        "running_var": np.ones(3),
    }
    assert_grads(check_op("batchnorm", inputs, training=True))


# ---------------------------------------------------------------- max pool


@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_maxpool_gradients(kernel, stride, padding, rng):
    x = spaced(rng, (2, 3, 7, 9))
    assert_grads(check_op("maxpool", {"x": x}, kernel=kernel, stride=stride, padding=padding))


def naive_maxpool(x: np.ndarray, k: int, s: int, p: int) -> tuple[np.ndarray, np.ndarray]:
    """Gold by loops: y and, for each output, the (row, col) of the first maximum in row-major order."""
    n, c, h, w = x.shape
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    y = np.empty((n, c, oh, ow))
    where = np.empty((n, c, oh, ow, 2), dtype=int)
    for i in np.ndindex(n, c, oh, ow):
        best = None
        for di in range(k):
            for dj in range(k):
                r, q = i[2] * s + di - p, i[3] * s + dj - p
                if 0 <= r < h and 0 <= q < w and (best is None or x[i[0], i[1], r, q] > best[0]):
                    best = (x[i[0], i[1], r, q], r, q)
        y[i], where[i] = best[0], best[1:]
    return y, where


def naive_maxpool_backward(dy: np.ndarray, where: np.ndarray, x_shape: tuple[int, ...]) -> np.ndarray:
    dx = np.zeros(x_shape)
    for i in np.ndindex(*dy.shape):
        dx[i[0], i[1], where[i][0], where[i][1]] += dy[i]
    return dx


@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_maxpool_exact_ties_go_to_the_first_maximum(kernel, stride, padding, rng):
    x = rng.integers(0, 3, size=(2, 2, 7, 8)).astype(np.float32)  # ties everywhere
    b = NumpyBackend()
    y, cache = b.maxpool_forward(x, kernel, stride, padding)
    dy = rng.integers(1, 9, size=y.shape).astype(np.float32)  # small ints: every sum is exact
    gold_y, where = naive_maxpool(x, kernel, stride, padding)
    np.testing.assert_array_equal(y, gold_y)
    np.testing.assert_array_equal(b.maxpool_backward(dy, cache), naive_maxpool_backward(dy, where, x.shape))


def test_maxpool_constant_input_routes_each_window_to_one_input():
    # 3x3 stride 2 pad 1 on 5x5: windows start at rows/cols -1, 1, 3, so their first real
    # input (row-major) is at rows/cols 0, 1, 3; every window's gradient goes there alone
    b = NumpyBackend()
    y, cache = b.maxpool_forward(np.ones((1, 1, 5, 5), np.float32), 3, 2, 1)
    dy = np.arange(1, 10, dtype=np.float32).reshape(1, 1, 3, 3)
    dx = b.maxpool_backward(dy, cache)[0, 0]
    expected = np.zeros((5, 5), np.float32)
    expected[np.ix_([0, 1, 3], [0, 1, 3])] = dy[0, 0]
    np.testing.assert_array_equal(dx, expected)
    assert dx.sum() == dy.sum()  # nothing duplicated, nothing lost


def test_maxpool_input_winning_overlapping_windows_gets_the_sum():
    # (1, 1) lies in the four 3x3 stride-2 pad-1 windows with top-left (-1|1, -1|1)
    x = np.zeros((1, 1, 5, 5), np.float32) - np.arange(25, dtype=np.float32).reshape(1, 1, 5, 5)
    x[0, 0, 1, 1] = 10.0
    b = NumpyBackend()
    y, cache = b.maxpool_forward(x, 3, 2, 1)
    assert (y[0, 0, :2, :2] == 10).all()
    dy = np.arange(1, 10, dtype=np.float32).reshape(1, 1, 3, 3)
    dx = b.maxpool_backward(dy, cache)
    assert dx[0, 0, 1, 1] == 1 + 2 + 4 + 5
    assert dx.sum() == dy.sum()


# ---------------------------------------------------------------- linear and loss


def test_linear_gradients_with_a_4d_input(rng):
    x, w, b = rng.standard_normal((3, 2, 3, 3)), rng.standard_normal((5, 18)), rng.standard_normal(5)
    inputs = {"x": x, "w": w, "b": b}
    assert_grads(check_op("linear", inputs))
    ref = NumpyBackend()
    y, cache = ref.linear_forward(**inputs)
    assert ref.linear_backward(np.ones_like(y), cache)[0].shape == (3, 2, 3, 3)


def test_softmax_cross_entropy_gradient(rng):
    logits = rng.standard_normal((5, 7)) * 3
    labels = rng.integers(0, 7, size=5)
    assert check_loss(logits, labels) < TOL
    loss, _ = NumpyBackend().softmax_cross_entropy(logits.astype(np.float32), labels)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    exact = -np.mean(np.log(p[np.arange(5), labels]))  # float64; the float32 logits are 1 rounding off
    assert_close(np.asarray(loss), Expected(np.asarray(exact), 1 + 7 + 5 + 3 + 2 * FN))  # k: softmax_ce's


def test_label_smoothing_is_the_cross_entropy_against_the_smoothed_target_and_its_gradient(rng):
    logits = rng.standard_normal((5, 7)) * 3
    labels = rng.integers(0, 7, size=5)
    eps = 0.1
    loss_fn = SoftmaxCrossEntropy(NumpyBackend(), smoothing=eps)  # float64 logits stay float64
    loss, d = loss_fn(logits, labels)
    # the gold: -sum_k q_k log p_k, q = (1 - eps) onehot + eps / K, averaged over the rows, written out
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    q = np.full((5, 7), eps / 7) + (1 - eps) * np.eye(7)[labels]
    assert loss == pytest.approx(-np.mean(np.sum(q * np.log(p), axis=1)), rel=1e-12)
    assert np.allclose(d, (p - q) / 5, rtol=0, atol=1e-15)
    numeric = numeric_grad(lambda _: loss_fn(logits, labels)[0], logits, None, 1e-5)
    assert rel_error(d, numeric) < TOL
    # eps 0 is the backend's op itself
    z32 = logits.astype(np.float32)
    plain = SoftmaxCrossEntropy(NumpyBackend())(z32, labels)
    assert plain[0] == NumpyBackend().softmax_cross_entropy(z32, labels)[0]
    with pytest.raises(ValueError, match=r"label smoothing must be in \[0, 1\)"):
        SoftmaxCrossEntropy(NumpyBackend(), smoothing=1.0)


# ---------------------------------------------------------------- layers and the whole network


@pytest.mark.parametrize(
    "make",
    [
        lambda b: Conv2D(b, 3, 4, 3, stride=2, padding=1),
        lambda b: ReLU(b),
        lambda b: LocalResponseNorm(b, size=4, alpha=1e-2, k=1.0),
        lambda b: BatchNorm2D(b, 3),
        lambda b: MaxPool2D(b, 3, 2, 1),
        lambda b: Linear(b, 3 * 7 * 7, 5),
    ],
    ids=["conv", "relu", "lrn", "batchnorm", "maxpool", "linear"],
)
def test_check_layer(make, rng):
    layer = make(NumpyBackend())
    for name, p in layer.params.items():
        layer.params[name] = rng.standard_normal(p.shape).astype(np.float32)
    x = spaced(rng, (2, 3, 7, 7), 0.1)  # no near-ties, nothing near 0
    errors = check_layer(layer, x)
    assert set(errors) == {"x", *layer.params}
    assert_grads(errors)
    assert all(p.dtype == np.float32 for p in layer.params.values())  # the layer itself is untouched


@pytest.mark.parametrize("norm", ["lrn", "batch"])
def test_paper_net_end_to_end(norm, rng):
    net = paper_net("4:6", NumpyBackend(), norm=norm, seed=0, image_size=12)
    x = rng.standard_normal((3, 3, 12, 12))
    errors = check_network(net, x, np.array([1, 5, 9]), per_param=3, seed=0)
    expected = {key for key, _, _ in net.named_params()}
    assert set(errors) == expected and len(expected) == (6 if norm == "lrn" else 10)
    assert_grads(errors, NET_TOL)


# ---------------------------------------------------------------- PyTorch as a second gold (float32)


def close(ours: Expected | np.ndarray, theirs, k: int | None = None) -> None:
    """torch's result within float32_tolerance of ours (backends.conformance.runner; summation orders differ):
    an Expected's own bound, or the scale form of an array's with k, the op's (0: exact)."""
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else np.asarray(theirs)
    assert_close(theirs, ours if k is None else Expected(ours, k))


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    return torch


def t(torch, a: np.ndarray):
    return torch.from_numpy(np.array(a, dtype=np.float32)).requires_grad_()


f32 = np.float32


@pytest.mark.parametrize("stride,padding", [(1, 0), (2, 1), (2, 2), (1, 2)])
def test_conv2d_matches_torch(stride, padding, torch, rng):
    x, w, b = (rng.standard_normal(s).astype(f32) for s in ((2, 3, 9, 7), (5, 3, 3, 3), (5,)))
    y, cache = NumpyBackend().conv2d_forward(x, w, b, stride, padding)
    dy = rng.standard_normal(y.shape).astype(f32)
    y, dx, dw, db = conv2d_expected(x, w, b, stride, padding, dy)  # with their rigorous bounds
    tx, tw, tb = t(torch, x), t(torch, w), t(torch, b)
    ty = torch.nn.functional.conv2d(tx, tw, tb, stride=stride, padding=padding)
    ty.backward(torch.from_numpy(dy))
    close(y, ty)
    close(dx, tx.grad)
    close(dw, tw.grad)
    close(db, tb.grad)


def test_relu_matches_torch(torch, rng):
    x = rng.standard_normal((2, 3, 4, 5)).astype(f32)
    y, cache = NumpyBackend().relu_forward(x)
    dy = rng.standard_normal(y.shape).astype(f32)
    tx = t(torch, x)
    ty = torch.relu(tx)
    ty.backward(torch.from_numpy(dy))
    close(y, ty, 0)
    close(NumpyBackend().relu_backward(dy, cache), tx.grad, 0)


@pytest.mark.parametrize("size", [3, 4, 5])
@pytest.mark.parametrize("alpha,beta,k", [(1e-2, 0.75, 1.0), (1e-4, 0.75, 2.0), (2e-2, 0.6, 2.0)])
def test_lrn_matches_torch(size, alpha, beta, k, torch, rng):
    x = (rng.standard_normal((2, 7, 3, 4)) * 10).astype(f32)
    b = NumpyBackend()
    y, cache = b.lrn_forward(x, size, alpha, beta, k)
    dy = rng.standard_normal(y.shape).astype(f32)
    tx = t(torch, x)
    ty = torch.nn.LocalResponseNorm(size, alpha, beta, k)(tx)
    ty.backward(torch.from_numpy(dy))
    close(y, ty, size + 3 + FN)
    close(b.lrn_backward(dy, cache), tx.grad, 2 * size + 7 + 2 * FN)


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_matches_torch(training, torch, rng):
    c = 4
    x = (rng.standard_normal((3, c, 5, 3)) * 2 + 1).astype(f32)
    gamma, beta = rng.standard_normal(c).astype(f32), rng.standard_normal(c).astype(f32)
    rm, rv = rng.standard_normal(c).astype(f32), (rng.random(c) + 0.5).astype(f32)
    trm, trv = torch.from_numpy(rm.copy()), torch.from_numpy(rv.copy())
    b = NumpyBackend()
    y, cache = b.batchnorm_forward(x, gamma, beta, rm, rv, training, 0.1, 1e-5)
    dy = rng.standard_normal(y.shape).astype(f32)
    dx, dgamma, dbeta = b.batchnorm_backward(dy, cache)
    tx, tg, tb = t(torch, x), t(torch, gamma), t(torch, beta)
    ty = torch.nn.functional.batch_norm(tx, trm, trv, tg, tb, training=training, momentum=0.1, eps=1e-5)
    ty.backward(torch.from_numpy(dy))
    m = 3 * 5 * 3  # N*H*W: the statistics' reduction; the ks of batchnorm (backends.conformance.runner)
    close(y, ty, 2 * m + 8 + 2 * FN)
    close(rm, trm, 2 * m + 8 + 2 * FN)
    close(rv, trv, 2 * m + 8 + 2 * FN)
    close(dx, tx.grad, 3 * m + 14 + 2 * FN)
    close(dgamma, tg.grad, 3 * m + 10 + 2 * FN)
    close(dbeta, tb.grad, m)


@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_maxpool_matches_torch(kernel, stride, padding, torch, rng):
    x = spaced(rng, (2, 3, 7, 9)).astype(f32)
    b = NumpyBackend()
    y, cache = b.maxpool_forward(x, kernel, stride, padding)
    dy = rng.standard_normal(y.shape).astype(f32)
    tx = t(torch, x)
    ty = torch.nn.functional.max_pool2d(tx, kernel, stride, padding)
    ty.backward(torch.from_numpy(dy))
    close(y, ty, 0)
    # k: the windows that overlap; terms: the same routing of |dy| in float64
    overlaps = ((kernel + stride - 1) // stride) ** 2
    terms = b.maxpool_backward(np.abs(dy).astype(np.float64), cache)
    close(Expected(b.maxpool_backward(dy, cache), overlaps, terms), tx.grad)


def with_nans(rng: np.random.Generator, kernel: int, stride: int, padding: int, ties: bool) -> tuple:
    """A (2, 3, 7, 9) input holding NaNs, and the (row, col) of two NaNs that share the window
    at output (1, 1) of plane (0, 0): the first and the last corner of that window."""
    shape = (2, 3, 7, 9)
    x = rng.integers(0, 3, size=shape).astype(f32) if ties else spaced(rng, shape).astype(f32)
    x[1][rng.random(shape[1:]) < 0.1] = np.nan  # a few at random, some in overlapping windows
    first = (stride - padding, stride - padding)
    last = (first[0] + kernel - 1, first[1] + kernel - 1)
    x[0, 0][first], x[0, 0][last] = np.nan, np.nan
    return x, first, last


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_maxpool_with_nans_matches_torch(kernel, stride, padding, ties, torch, rng):
    """A window holding a NaN outputs NaN and its gradient goes to its last NaN (row-major)."""
    x, first, last = with_nans(rng, kernel, stride, padding, ties)
    b = NumpyBackend()
    y, cache = b.maxpool_forward(x, kernel, stride, padding)
    dy = rng.standard_normal(y.shape).astype(f32)
    tx = t(torch, x)
    ty = torch.nn.functional.max_pool2d(tx, kernel, stride, padding)
    ty.backward(torch.from_numpy(dy))
    assert np.isnan(y).any() and not np.isnan(y).all()
    np.testing.assert_array_equal(y, ty.detach().numpy())  # NaN exactly where torch has it, values equal
    # k: the windows that overlap; terms: the same routing of |dy| in float64
    overlaps = ((kernel + stride - 1) // stride) ** 2
    terms = b.maxpool_backward(np.abs(dy).astype(np.float64), cache)
    close(Expected(b.maxpool_backward(dy, cache), overlaps, terms), tx.grad)
    one = np.zeros_like(dy)
    one[0, 0, 1, 1] = 1.0  # the gradient of the window holding both NaNs alone
    dx = b.maxpool_backward(one, cache)
    assert dx[0, 0][last] == 1.0 and dx.sum() == 1.0


def test_batchnorm_refuses_one_value_per_channel_in_training_as_torch_does(torch, rng):
    x = rng.standard_normal((1, 3, 1, 1)).astype(f32)
    gamma, beta = rng.standard_normal(3).astype(f32), rng.standard_normal(3).astype(f32)
    rm, rv = rng.standard_normal(3).astype(f32), (rng.random(3) + 0.5).astype(f32)
    args = (torch.from_numpy(x), torch.from_numpy(rm.copy()), torch.from_numpy(rv.copy()))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        torch.nn.functional.batch_norm(*args, training=True)
    b, before = NumpyBackend(), (rm.copy(), rv.copy())
    with pytest.raises(ValueError, match=r"more than 1 value per channel.*batch of 2 or more, or use eval mode"):
        b.batchnorm_forward(x, gamma, beta, rm, rv, True)
    assert np.array_equal(rm, before[0]) and np.array_equal(rv, before[1])  # refused before the update
    y, _ = b.batchnorm_forward(x, gamma, beta, rm, rv, False)  # eval mode takes it
    ty = torch.nn.functional.batch_norm(*args, torch.from_numpy(gamma), torch.from_numpy(beta), training=False)
    close(y, ty, 3 + 2 * FN)  # eval: (x - mean) / sqrt(var + eps) * gamma + beta, no reduction


def test_lrn_defaults_are_torchs(torch, rng):
    x = (rng.standard_normal((2, 7, 3, 4)) * 10).astype(f32)
    close(NumpyBackend().lrn_forward(x)[0], torch.nn.LocalResponseNorm(5)(torch.from_numpy(x)), 5 + 3 + FN)


def test_linear_matches_torch(torch, rng):
    x, w, bias = (rng.standard_normal(s).astype(f32) for s in ((3, 2, 3, 3), (5, 18), (5,)))
    b = NumpyBackend()
    y, cache = b.linear_forward(x, w, bias)
    dy = rng.standard_normal(y.shape).astype(f32)
    y, dx, dw, db = linear_expected(x, w, bias, dy)  # with their rigorous bounds
    tx, tw, tb = t(torch, x), t(torch, w), t(torch, bias)
    ty = torch.nn.functional.linear(tx.flatten(1), tw, tb)
    ty.backward(torch.from_numpy(dy))
    close(y, ty)
    close(dx, tx.grad)
    close(dw, tw.grad)
    close(db, tb.grad)


def test_softmax_cross_entropy_matches_torch(torch, rng):
    logits = (rng.standard_normal((6, 10)) * 4).astype(f32)
    labels = rng.integers(0, 10, size=6)
    loss, d = NumpyBackend().softmax_cross_entropy(logits, labels)
    tl = t(torch, logits)
    tloss = torch.nn.functional.cross_entropy(tl, torch.from_numpy(labels))
    tloss.backward()
    k = 10 + 6 + 3 + 2 * FN  # softmax_ce's: 10 classes, 6 rows
    close(np.asarray(loss), np.asarray(tloss.item()), k)
    close(d, tl.grad, k)


def test_label_smoothing_matches_torch(torch, rng):
    logits = (rng.standard_normal((6, 10)) * 4).astype(f32)
    labels = rng.integers(0, 10, size=6)
    loss, d = SoftmaxCrossEntropy(NumpyBackend(), smoothing=0.1)(logits, labels)
    tl = t(torch, logits)
    tloss = torch.nn.functional.cross_entropy(tl, torch.from_numpy(labels), label_smoothing=0.1)
    tloss.backward()
    k = 10 + 6 + 3 + 2 * FN + 10  # softmax_ce's, and the mean over the 10 classes
    close(np.asarray(loss), np.asarray(tloss.item()), k)
    close(d, tl.grad, k)


@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 5e-4), (0.0, 0.0), (0.5, 0.0)])
def test_sgd_update_matches_torch(momentum, weight_decay, torch, rng):
    param = rng.standard_normal((4, 3)).astype(f32)
    velocity = np.zeros_like(param)
    tp = torch.from_numpy(param.copy()).requires_grad_()
    opt = torch.optim.SGD([tp], lr=0.1, momentum=momentum, weight_decay=weight_decay)
    for _ in range(3):
        grad = rng.standard_normal(param.shape).astype(f32)
        NumpyBackend().sgd_update(param, grad, velocity, 0.1, momentum, weight_decay)
        tp.grad = torch.from_numpy(grad.copy())
        opt.step()
    close(param, tp, 3 * 6)  # sgd_update's k, 3 steps

"""The gradient checker that sits beside the layers (CS231n's gradient_check.py).

Every backward in tinyconv is written by hand, so every backward is checked against centred finite
differences (error O(h^2)); for an op with an array output y = f(x), that is the vector-Jacobian product
backward computes, with a random upstream gradient g (backward's dy):

    dx_i  =  sum_j g_j dy_j/dx_i  ~  sum_j g_j (f(x + h e_i)_j - f(x - h e_i)_j) / (2h)

Only in float64: in float32 the round-off in f, ~1e-7 |f|, divided by 2h = 2e-5 is an error of ~1e-2 |f|.
So the checks run the numpy reference ops, which compute in their inputs' dtype, on float64 arrays.
A correct backward agrees to a :func:`rel_error` of ~1e-8 or less, a wrong one is off by ~1e-2 or more.
How to use it in a notebook, and the mistakes to avoid: docs/teaching.md.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from backends.numpy_backend import NumpyBackend
from tinyconv.layers import Layer

F64 = np.float64

# op -> the inputs its backward returns gradients for, in order; the forward is
# ``backend.<op>_forward(**inputs, **options)``, the backward ``backend.<op>_backward(dy, cache)``.
OP_GRADS: dict[str, tuple[str, ...]] = {
    "conv2d": ("x", "w", "b"),
    "relu": ("x",),
    "lrn": ("x",),
    "batchnorm": ("x", "gamma", "beta"),
    "maxpool": ("x",),
    "linear": ("x", "w", "b"),
}


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    """max_i |a_i - b_i| / max(1e-8, max_i (|a_i| + |b_i|)): 0 if equal, 1 for opposite signs.

    Relative to the *scale of the gradient*, not entry by entry as CS231n's: a finite difference's
    absolute round-off of ~1e-10 would make a correct but tiny entry (a border pixel, a class with
    probability 1e-6) a "1e-4 error". Any wrong entry bigger than tol * scale still shows.
    """
    a, b = np.asarray(a, dtype=F64), np.asarray(b, dtype=F64)
    if a.shape != b.shape:
        raise ValueError(f"rel_error: shapes differ, {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(1e-8, float(np.max(np.abs(a) + np.abs(b)))))


def _plus_minus(x: np.ndarray, i: tuple[int, ...], h: float, g: Callable[[], Any]) -> tuple[Any, Any]:
    """(g() with x[i] + h, g() with x[i] - h); x[i] is restored afterwards."""
    old = x[i]
    x[i] = old + h
    plus = g()
    x[i] = old - h
    minus = g()
    x[i] = old
    return plus, minus


def numeric_grad(
    f: Callable[[np.ndarray], Any], x: np.ndarray, df: np.ndarray | None = None, h: float = 1e-5
) -> np.ndarray:
    """Centred finite-difference gradient of ``sum(f(x) * df)`` (or of a scalar ``f(x)`` if ``df`` is None),
    of x's shape. x (float64) is perturbed *in place* one element at a time and restored, so ``f`` may read
    it through a closure instead of its argument."""
    if not isinstance(x, np.ndarray) or x.dtype != F64:
        raise ValueError(
            f"numeric_grad needs a float64 numpy array to perturb, got {type(x).__name__} "
            f"{getattr(x, 'dtype', '')}: in float32 the round-off divided by 2h swamps the derivative"
        )

    grad = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        plus, minus = _plus_minus(x, i, h, lambda: np.array(f(x), dtype=F64))  # a copy: f may reuse its buffer
        # difference first, then weight: outputs that x_i does not reach cancel exactly,
        # so the round-off is that of the few outputs it does reach, not of the whole sum
        diff = plus - minus
        grad[i] = (diff if df is None else np.sum(diff * df)) / (2 * h)
    return grad


def check_gradients(
    forward: Callable[[], np.ndarray],
    backward: Callable[[np.ndarray], dict[str, np.ndarray | None]],
    wrt: dict[str, np.ndarray],
    dy: np.ndarray | None = None,
    h: float = 1e-5,
    seed: int = 0,
) -> dict[str, float]:
    """The general check: analytic backward vs. numeric gradient, one rel_error per array of ``wrt``.
    ``forward()`` runs the op reading the float64 arrays in ``wrt`` (perturbed in place) and returns y;
    ``backward(dy)``, called once right after an unperturbed forward, returns {name: analytic gradient}.
    ``dy``: the upstream gradient (random normal from ``(seed, 1)`` if None).
    """
    y = np.asarray(forward())
    if dy is None:
        # a stream of its own: with default_rng(seed), a caller whose x came from the same seed
        # would get dy == x, which for batch norm lies in the null space of the backward (dx ~ 0)
        dy = np.random.default_rng((seed, 1)).standard_normal(y.shape)
    analytic = backward(dy)
    return {name: rel_error(analytic[name], numeric_grad(lambda _: forward(), arr, dy, h)) for name, arr in wrt.items()}


def check_op(
    op: str,
    inputs: dict[str, np.ndarray],
    dy: np.ndarray | None = None,
    h: float = 1e-5,
    seed: int = 0,
    **options: Any,
) -> dict[str, float]:
    """Check the backward of one reference op (a key of OP_GRADS) in float64 -> {input name: rel_error}.

    ``inputs``: the forward's array arguments by name, e.g. {"x": .., "w": .., "b": ..} (float64 copies
    are made, and copied again per call, so batchnorm's in-place running statistics do not accumulate);
    ``options``: its other arguments (stride, padding, size, alpha, training, ...).
    """
    arrays = {k: np.array(v, dtype=F64) for k, v in inputs.items()}
    ref = NumpyBackend()  # float64 inputs stay float64 through every op
    fwd = getattr(ref, f"{op}_forward")
    bwd = getattr(ref, f"{op}_backward")
    state: dict[str, Any] = {}

    def forward() -> np.ndarray:
        y, state["cache"] = fwd(**{k: v.copy() for k, v in arrays.items()}, **options)
        return y

    def backward(d: np.ndarray) -> dict[str, np.ndarray]:
        grads = bwd(d, state["cache"])
        if not isinstance(grads, tuple):
            grads = (grads,)
        return dict(zip(OP_GRADS[op], grads, strict=True))

    return check_gradients(forward, backward, {n: arrays[n] for n in OP_GRADS[op]}, dy, h, seed)


def check_loss(logits: np.ndarray, labels: np.ndarray, h: float = 1e-5) -> float:
    """rel_error of the reference softmax_cross_entropy's dlogits vs. the numeric gradient of the loss."""
    z = np.array(logits, dtype=F64)
    ref = NumpyBackend()  # float64 inputs stay float64 through every op
    _, dlogits = ref.softmax_cross_entropy(z, labels)
    numeric = numeric_grad(lambda _: ref.softmax_cross_entropy(z, labels)[0], z, None, h)
    return rel_error(dlogits, numeric)


def _float64_copy(layer: Layer) -> Layer:
    """A shallow copy of ``layer`` on the float64 reference with float64 copies of its arrays."""
    if hasattr(layer, "cluster"):
        raise ValueError(f"{layer!r} is computed in shards: check its plain layers (its .layers) instead")
    twin = copy.copy(layer)
    twin.backend = NumpyBackend()
    twin.params = {k: np.array(layer.backend.to_numpy(v), dtype=F64) for k, v in layer.params.items()}
    twin.buffers = {k: np.array(layer.backend.to_numpy(v), dtype=F64) for k, v in layer.buffers.items()}
    twin.grads = {}
    return twin


def check_layer(layer: Layer, x: np.ndarray, training: bool = True, h: float = 1e-5, seed: int = 0) -> dict[str, float]:
    """Check a float64 copy of ``layer`` on the numpy reference -> {"x": rel_error of dx, "<param>": of its
    grad}; "x" is left out for a Conv2D built with need_dx=False, which has no dx."""
    twin = _float64_copy(layer)
    x64 = np.array(x, dtype=F64)
    buffers = {k: v.copy() for k, v in twin.buffers.items()}
    wrt = dict(twin.params)
    if getattr(twin, "need_dx", True):
        wrt = {"x": x64, **wrt}

    def forward() -> np.ndarray:
        twin.buffers = {k: v.copy() for k, v in buffers.items()}  # running stats start equal
        return twin.forward(x64, training)

    def backward(dy: np.ndarray) -> dict[str, np.ndarray | None]:
        dx = twin.backward(dy)
        return {"x": dx, **twin.grads}

    return check_gradients(forward, backward, wrt, None, h, seed)


def check_network(
    net: Any, x: np.ndarray, labels: np.ndarray, per_param: int = 3, h: float = 1e-5, seed: int = 0
) -> dict[str, float]:
    """End to end: d loss / d w for ``per_param`` random entries of every parameter -> {"<layer name>.<param>":
    rel_error over the sampled entries}. ``net`` (a Network) is converted to float64 *in place*."""
    if not isinstance(net.backend, NumpyBackend):
        raise ValueError(f"check_network runs on the numpy reference, got {type(net.backend).__name__}")
    net.layers = [_float64_copy(layer) for layer in net.layers]
    x64 = np.array(x, dtype=F64)
    rng = np.random.default_rng(seed)
    errors = {}
    net.backward(net.loss_fn(net.forward(x64, training=True), labels)[1])  # float64 throughout
    analytic = {key: np.array(layer.grads[name]) for key, layer, name in net.named_params()}

    def loss() -> float:
        return net.loss_fn(net.forward(x64, training=True), labels)[0]

    for key, layer, name in net.named_params():
        p = layer.params[name]
        picks = rng.choice(p.size, size=min(per_param, p.size), replace=False)
        a, n = [], []
        for flat in picks:
            i = np.unravel_index(flat, p.shape)
            plus, minus = _plus_minus(p, i, h, loss)
            n.append((plus - minus) / (2 * h))
            a.append(analytic[key][i])
        errors[key] = rel_error(np.array(a), np.array(n))
    return errors

"""The gradient checker that sits beside the layers (CS231n's gradient_check.py).

Every backward in tinyconv is written by hand, so every backward is checked
against the definition of a derivative, centred finite differences:

    df/dx_i  ~  (f(x + h e_i) - f(x - h e_i)) / (2h)          error O(h^2)

For an op with an array output y = f(x) we check the vector-Jacobian product
that backward computes: with a random upstream gradient g (the "dy" of backward),

    dx_i  =  sum_j g_j d y_j / d x_i  ~  sum_j g_j (f(x + h e_i)_j - f(x - h e_i)_j) / (2h).

This only works in float64. In float32 the round-off in f is ~1e-7 |f|, which
divided by 2h = 2e-5 is an error of ~1e-2 |f|: the check would be noise. So the
checks run the *numpy reference math* on float64 arrays: the reference ops
compute in their inputs' dtype, so float64 in gives float64 throughout.

Agreement is measured by :func:`rel_error`, relative to the gradient's scale: ~1e-8 or
smaller for a correct backward in float64 with h = 1e-5, ~1e-2 or larger for a wrong one.

Near a kink (ReLU at 0, a max with two nearly equal inputs) the finite
difference straddles the kink and is *not* the derivative: check on inputs kept
away from kinks, and test ties separately.

In a notebook::

    from tinyconv.gradcheck import check_op
    x = np.random.default_rng(0).standard_normal((2, 3, 7, 7))
    w = np.random.default_rng(1).standard_normal((4, 3, 3, 3))
    check_op("conv2d", {"x": x, "w": w, "b": np.zeros(4)}, stride=2, padding=1)
    # -> {'x': 1e-11, 'w': 8e-12, 'b': 3e-11}: anything below ~1e-7 is right

and likewise ``check_layer(layer, x)`` for a tinyconv.layers layer (dx and every
parameter), ``check_loss(logits, labels)`` for the softmax cross-entropy, and
``check_network(net, x, labels)`` for d loss / d w of a whole network.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from backends.numpy_backend import NumpyBackend
from tinyconv.layers import Layer

F64 = np.float64

# op name -> the names of the inputs its backward returns gradients for, in order.
# The forward is ``backend.<op>_forward(**inputs, **options)``, the backward
# ``backend.<op>_backward(dy, cache)``; see backends/base.py.
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

    The worst error relative to the *scale of the gradient*, not of each entry
    (CS231n divides entry by entry): a finite difference carries an absolute
    round-off of ~1e-10, which entry by entry turns a correct but tiny gradient
    entry (a border pixel, a class with probability 1e-6) into a "1e-4 error".
    Any wrong entry bigger than tol * scale still shows.
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
    """Centred finite-difference gradient of ``sum(f(x) * df)`` (or of ``f(x)`` if ``df`` is None).

    x: float64 array, perturbed *in place* one element at a time (and restored),
       so ``f`` may read it through a closure instead of its argument.
    f: x -> array of df's shape, or a scalar when df is None.
    Returns an array of x's shape: grad_i = (g(x + h e_i) - g(x - h e_i)) / (2h).
    """
    if not isinstance(x, np.ndarray) or x.dtype != F64:
        raise ValueError(
            f"numeric_grad needs a float64 numpy array to perturb, got {type(x).__name__} "
            f"{getattr(x, 'dtype', '')}: in float32 the round-off divided by 2h swamps the derivative"
        )

    def g() -> np.ndarray:
        out = np.array(f(x), dtype=F64)  # a copy: f may hand back a buffer it reuses
        if df is not None and out.shape != df.shape:
            raise ValueError(f"numeric_grad: f returned shape {out.shape}, df has shape {df.shape}")
        if df is None and out.ndim != 0:
            raise ValueError(f"numeric_grad: without df, f must return a scalar, got shape {out.shape}")
        return out

    grad = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        plus, minus = _plus_minus(x, i, h, g)
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
    """The general check: analytic backward vs. numeric gradient, one rel_error per array.

    forward():   runs the op reading the float64 arrays in ``wrt`` (which get
                 perturbed in place) and returns y.
    backward(dy): called once, right after an unperturbed forward; returns
                 {name: analytic gradient} for every name in ``wrt``.
    dy:          the upstream gradient (random normal from ``(seed, 1)`` if None).
    """
    y = np.asarray(forward())
    if dy is None:
        # a stream of its own: with default_rng(seed), a caller whose x came from the same seed
        # would get dy == x, which for batch norm lies in the null space of the backward (dx ~ 0)
        dy = np.random.default_rng((seed, 1)).standard_normal(y.shape)
    analytic = backward(dy)
    errors = {}
    for name, arr in wrt.items():
        if analytic.get(name) is None:
            raise ValueError(f"backward returned no gradient for {name!r}")
        numeric = numeric_grad(lambda _: forward(), arr, dy, h)
        errors[name] = rel_error(analytic[name], numeric)
    return errors


def check_op(
    op: str,
    inputs: dict[str, np.ndarray],
    dy: np.ndarray | None = None,
    h: float = 1e-5,
    seed: int = 0,
    **options: Any,
) -> dict[str, float]:
    """Check one reference op's backward in float64; returns {input name: rel_error}.

    op:      a key of OP_GRADS ("conv2d", "relu", "lrn", "batchnorm", "maxpool", "linear").
    inputs:  the forward's array arguments by name, e.g. {"x": .., "w": .., "b": ..};
             for batchnorm also "running_mean" and "running_var" (copied per call,
             so the in-place running-statistics update does not accumulate).
    options: the forward's other arguments (stride, padding, size, alpha, training, ...).
    Gradients are checked for every name of OP_GRADS[op] (and the float copies
    of ``inputs`` are made here, so the caller's arrays are left alone).
    """
    if op not in OP_GRADS:
        raise ValueError(f"unknown op {op!r}; checkable ops: {', '.join(OP_GRADS)} (and check_loss)")
    arrays = {k: np.array(v, dtype=F64) for k, v in inputs.items()}
    missing = [n for n in OP_GRADS[op] if n not in arrays]
    if missing:
        raise ValueError(f"check_op({op!r}): inputs lack {missing}")
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
    """Check a layer's backward (dx and every parameter gradient) in float64.

    The layer itself is left alone: a float64 copy on the numpy reference is
    checked. Returns {"x": rel_error of dx, "<param>": rel_error of its grad}.
    A Conv2D built with need_dx=False has no dx to check, so "x" is left out.
    """
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
    """End to end: d loss / d w for ``per_param`` random entries of every parameter.

    ``net`` is a tinyconv.model.Network on the numpy backend; it is converted to
    float64 *in place* (build a fresh one for the check). Returns
    {"<layer name>.<param>": rel_error over the sampled entries}.
    """
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

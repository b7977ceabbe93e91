"""The conformance cases: every op of ``backends/base.py`` on the shapes and values that catch bugs
(docs/writing-a-backend.md lists them). Each case runs the backend under test and the reference on the
same inputs and records one CheckResult per output (see checks.py).
"""

from __future__ import annotations

import numpy as np

from backends.base import Backend
from backends.conformance.checks import EXACT, F32, K_CASES, REF, Case, Trial


def _through(
    t: Trial,
    op: str,
    inputs: dict[str, np.ndarray],
    args: tuple = (),
    backward_args: tuple = (),
    y_k: int = K_CASES,
    grad_k: int = K_CASES,
) -> None:
    """``op``_forward(*inputs, *args), then ``op``_backward(dy, cache, *backward_args) with a random dy,
    on the backend and the reference: y and each gradient (dx, dw, db, as many as the op returns; a
    dx the reference leaves None must be None) compared, and no input modified."""
    dev = {name: t.dev(a) for name, a in inputs.items()}
    y_ref, cache_ref = getattr(REF, f"{op}_forward")(*inputs.values(), *args)
    y, cache = getattr(t.backend, f"{op}_forward")(*dev.values(), *args)
    t.compare("y", y, y_ref, y_k)
    inputs["dy"] = t.normal(*y_ref.shape)
    dev["dy"] = t.dev(inputs["dy"])
    refs = getattr(REF, f"{op}_backward")(inputs["dy"], cache_ref, *backward_args)
    grads = getattr(t.backend, f"{op}_backward")(dev["dy"], cache, *backward_args)
    if not isinstance(refs, tuple):
        refs, grads = (refs,), (grads,)
    for name, got, ref in zip(("dx", "dw", "db"), grads, refs, strict=False):
        if ref is None:
            t.check("dx is None", got is None, "need_dx=False must return dx=None")
        else:
            t.compare(name, got, ref, grad_k)
    t.unchanged(**{name: (dev[name], a) for name, a in inputs.items()})


def _conv(n: int, c: int, h: int, w: int, f: int, k: int, stride: int, padding: int, need_dx: bool = True) -> Case:
    def run(t: Trial) -> None:
        inputs = {"x": t.normal(n, c, h, w), "w": t.normal(f, c, k, k, scale=0.3), "b": t.normal(f)}
        _through(t, "conv2d", inputs, (stride, padding), (need_dx,))

    dx_note = "" if need_dx else " no-dx"
    return Case("conv2d", f"N{n} C{c} {h}x{w} F{f} k{k} s{stride} p{padding}{dx_note}", run)


def _conv_partial(n: int, c: int, h: int, w: int, f: int, k: int, stride: int, padding: int) -> Case:
    """conv2d_partial: conv2d_forward's y with no bias, kernel-major, on the host; its cache takes a
    kernel-major dy (a transposed view, as the channel split passes it) to conv2d_backward."""

    def run(t: Trial) -> None:
        x, wt = t.normal(n, c, h, w), t.normal(f, c, k, k, scale=0.3)
        xd, wd = t.dev(x), t.dev(wt)
        y_ref, cache_ref = REF.conv2d_forward(x, wt, np.zeros(f, F32), stride, padding)
        p, cache = t.backend.conv2d_partial(xd, wd, stride, padding)
        t.check("on the host", isinstance(p, np.ndarray), f"got a {type(p).__name__}, not a numpy array")
        t.compare("P", p, y_ref.transpose(1, 0, 2, 3))
        dy = t.normal(f, *y_ref.shape[:1], *y_ref.shape[2:]).transpose(1, 0, 2, 3)  # (N, F, OH, OW), F-major
        refs = REF.conv2d_backward(np.ascontiguousarray(dy), cache_ref, True)
        grads = t.backend.conv2d_backward(t.backend.asarray(dy), cache, True)
        for name, got, ref in zip(("dx", "dw", "db"), grads, refs, strict=True):
            t.compare(name, got, ref)
        t.unchanged(x=(xd, x), w=(wd, wt))

    return Case("conv2d_partial", f"N{n} C{c} {h}x{w} F{f} k{k} s{stride} p{padding}", run)


def _relu(*shape: int) -> Case:
    def run(t: Trial) -> None:
        _through(t, "relu", {"x": t.normal(*shape)}, y_k=EXACT, grad_k=EXACT)

    return Case("relu", "x".join(map(str, shape)), run)


def _lrn(
    op: str, n: int, c: int, h: int, w: int, size: int, alpha: float, beta: float, k: float, scale: float, values=""
) -> Case:
    """lrn, or relu_lrn: the fused ReLU + LRN against the reference's, the composition lrn(relu(x)).
    "zeros": a third of x is exactly 0, where the ReLU's mask is 0; "nan": NaNs, which spread over LRN windows."""

    def run(t: Trial) -> None:
        x = t.normal(n, c, h, w, scale=scale)
        if values == "zeros":
            x[t.rng.random(x.shape) < 0.3] = 0.0
        if values == "nan":
            x[t.rng.random(x.shape) < 0.05] = np.nan
        _through(t, op, {"x": x}, (size, alpha, beta, k))

    label = f"N{n} C{c} {h}x{w} size{size} alpha{alpha:g} beta{beta:g} k{k:g} |x|~{scale:g} {values}"
    return Case(op, label.rstrip(), run)


def _refuses(backend: Backend, *args: object) -> bool:
    try:
        backend.batchnorm_forward(*args, True, 0.1, 1e-5)
    except ValueError:
        return True
    return False


def _batchnorm(n: int, c: int, h: int, w: int, training: bool, momentum: float = 0.1) -> Case:
    """Training with one value per channel (N*H*W == 1) must raise ValueError, as in torch, and
    leave the running statistics alone; another exception fails as "raised"."""
    refused = training and n * h * w == 1

    def run(t: Trial) -> None:
        x = t.normal(n, c, h, w, scale=2.0) + F32(0.5)
        gamma, beta = t.normal(c), t.normal(c)
        rm, rv = t.normal(c), (t.rng.random(c) + 0.5).astype(F32)
        xd, gd, bd, rmd, rvd = t.dev(x), t.dev(gamma), t.dev(beta), t.dev(rm), t.dev(rv)
        rm_ref, rv_ref = rm.copy(), rv.copy()
        if refused:
            ok = _refuses(REF, x, gamma, beta, rm_ref, rv_ref)
            t.check("reference refuses", ok, "the reference returned instead of raising ValueError")
            t.check("refuses", _refuses(t.backend, xd, gd, bd, rmd, rvd), "returned instead of raising ValueError")
            t.compare("running_mean kept", rmd, rm, EXACT)
            t.compare("running_var kept", rvd, rv, EXACT)
            return t.unchanged(x=(xd, x), gamma=(gd, gamma), beta=(bd, beta))
        y_ref, cache_ref = REF.batchnorm_forward(x, gamma, beta, rm_ref, rv_ref, training, momentum, 1e-5)
        y, cache = t.backend.batchnorm_forward(xd, gd, bd, rmd, rvd, training, momentum, 1e-5)
        t.compare("y", y, y_ref)
        t.compare("running_mean", rmd, rm_ref)  # updated in place in training, untouched in eval
        t.compare("running_var", rvd, rv_ref)
        dy = t.normal(n, c, h, w)
        dyd = t.dev(dy)
        grads, refs = t.backend.batchnorm_backward(dyd, cache), REF.batchnorm_backward(dy, cache_ref)
        for name, got, ref in zip(("dx", "dgamma", "dbeta"), grads, refs, strict=True):
            t.compare(name, got, ref)
        return t.unchanged(x=(xd, x), gamma=(gd, gamma), beta=(bd, beta), dy=(dyd, dy))

    mode = "train refused" if refused else ("train" if training else "eval") + f" momentum{momentum:g}"
    return Case("batchnorm", f"N{n} C{c} {h}x{w} {mode}", run)


def _maxpool(n: int, c: int, h: int, w: int, kernel: int, stride: int, padding: int, values: str = "") -> Case:
    """Normal values; "ties": few distinct values, so many windows hold several equal maxima;
    "nan": normal values with NaNs -- two in the window at output (1, 1) of image 0, channel 0
    (its first and last corner: torch routes the gradient to the last), and about one in ten
    entries of the last channel, in windows that overlap when stride < kernel; "-inf": normal
    values with the first channel all -inf, so windows that start in the padding hold nothing
    else (the gradient goes to the window's first input)."""

    def run(t: Trial) -> None:
        x = t.rng.integers(0, 3, size=(n, c, h, w)).astype(F32) if values == "ties" else t.normal(n, c, h, w)
        if values == "-inf":
            x[:, 0] = -np.inf
        if values == "nan":
            top = stride - padding
            x[0, 0, top, top] = x[0, 0, top + kernel - 1, top + kernel - 1] = np.nan
            last = x[:, -1]
            last[t.rng.random(last.shape) < 0.1] = np.nan
        _through(t, "maxpool", {"x": x}, (kernel, stride, padding), y_k=EXACT)  # NaN exactly where the reference's

    return Case("maxpool", f"N{n} C{c} {h}x{w} k{kernel} s{stride} p{padding} {values}".rstrip(), run)


def _linear(x_shape: tuple[int, ...], m: int) -> Case:
    def run(t: Trial) -> None:
        d = int(np.prod(x_shape[1:]))
        _through(t, "linear", {"x": t.normal(*x_shape), "w": t.normal(m, d, scale=0.3), "b": t.normal(m)})

    return Case("linear", f"x{'x'.join(map(str, x_shape))} M{m}", run)


def _softmax_ce(n: int, k: int, scale: float) -> Case:
    def run(t: Trial) -> None:
        logits = t.normal(n, k, scale=scale)
        labels = t.rng.integers(0, k, size=n)
        ld = t.dev(logits)
        loss_ref, d_ref = REF.softmax_cross_entropy(logits, labels)
        loss, d = t.backend.softmax_cross_entropy(ld, labels)
        t.check("loss is a float", isinstance(loss, float), f"a {type(loss).__name__}, not a Python float")
        t.compare("loss", np.array([loss], np.float64), np.array([loss_ref]))
        t.compare("dlogits", d, d_ref)
        t.unchanged(logits=(ld, logits))

    return Case("softmax_cross_entropy", f"N{n} K{k} |z|~{scale:g}", run)


def _sgd(shape: tuple[int, ...], lr: float, momentum: float, weight_decay: float) -> Case:
    def run(t: Trial) -> None:
        p, v = t.normal(*shape), np.zeros(shape, F32)
        pd, vd = t.dev(p), t.dev(v)
        for _ in range(3):  # the second and third steps use the velocity
            g = t.normal(*shape)
            gd = t.dev(g)
            REF.sgd_update(p, g, v, lr, momentum, weight_decay)
            t.backend.sgd_update(pd, gd, vd, lr, momentum, weight_decay)
        t.compare("param", pd, p)
        t.compare("velocity", vd, v)
        t.unchanged(grad=(gd, g))

    label = f"{'x'.join(map(str, shape))} lr{lr:g} momentum{momentum:g} wd{weight_decay:g} 3 steps"
    return Case("sgd_update", label, run)


def _take_kernels(shape: tuple[int, ...], start: int, stop: int) -> Case:
    def run(t: Trial) -> None:
        w = t.normal(*shape)
        wd = t.dev(w)
        part = t.backend.take_kernels(wd, start, stop)
        t.compare("slice", part, w[start:stop], EXACT)
        if len(shape) == 4:  # the sharded conv computes the master's share with the slice as weights
            x, b = t.normal(2, shape[1], 6, 6), np.zeros(stop - start, F32)
            y, _ = t.backend.conv2d_forward(t.dev(x), part, t.dev(b), 1, shape[2] // 2)
            t.compare("conv with slice", y, REF.conv2d_forward(x, w[start:stop], b, 1, shape[2] // 2)[0])
        t.unchanged(w=(wd, w))

    return Case("take_kernels", f"{'x'.join(map(str, shape))} [{start}:{stop}]", run)


def _roundtrip(shape: tuple[int, ...], kind: str) -> Case:
    def run(t: Trial) -> None:
        if kind == "int":
            a = t.rng.integers(0, 10, size=shape)
            host = np.asarray(t.backend.to_numpy(t.backend.asarray(a)))
            ok = host.shape == a.shape and host.dtype.kind in "iu" and np.array_equal(host, a)
            t.check("values", ok, f"got {host.dtype} {host.shape}")
            return
        a = t.normal(*shape)
        if kind == "strided":  # a non-contiguous view must arrive with its logical layout
            a = t.normal(*reversed(shape)).T
        t.compare("values", t.backend.asarray(a), np.ascontiguousarray(a), EXACT)

    return Case("asarray", f"{'x'.join(map(str, shape))} {kind}", run)


def _zeros(shape: tuple[int, ...]) -> Case:
    def run(t: Trial) -> None:
        t.compare("zeros", t.backend.zeros(shape), np.zeros(shape, F32), EXACT)

    return Case("zeros", "x".join(map(str, shape)), run)


def _describe() -> Case:
    def run(t: Trial) -> None:
        d = t.backend.describe()
        want = {"backend": str, "device": str, "kind": str, "compute_units": int}
        for key, typ in want.items():
            ok = isinstance(d.get(key), typ) and not isinstance(d.get(key), bool)
            if ok and key == "compute_units":
                ok = d[key] >= 1
            t.check(key, ok, f"got {d.get(key)!r}, want a {typ.__name__}")
        t.check("backend == name", d.get("backend") == t.backend.name, f"{d.get('backend')!r}")

    return Case("describe", "keys", run)


CASES: list[Case] = [
    _roundtrip((2, 3, 4, 5), "float32"),
    _roundtrip((7,), "float32"),
    _roundtrip((3, 5), "strided"),
    _roundtrip((6,), "int"),
    _zeros((2, 3, 4, 5)),
    _zeros((7,)),
    _describe(),
    _conv(1, 3, 7, 9, 5, 3, 1, 0),
    _conv(2, 4, 8, 8, 6, 5, 1, 2),  # the paper's 5x5 "same" convolution
    _conv(3, 2, 9, 7, 4, 3, 2, 1),
    _conv(2, 3, 11, 10, 3, 5, 2, 2),
    _conv(2, 5, 6, 6, 4, 1, 1, 0),  # 1x1
    _conv(1, 1, 5, 5, 1, 5, 2, 0),  # a single output pixel
    _conv(2, 3, 7, 7, 4, 3, 2, 1, need_dx=False),  # the first layer
    _conv_partial(2, 4, 8, 8, 6, 5, 1, 2),
    _conv_partial(3, 2, 9, 7, 4, 3, 2, 1),
    _relu(1, 3, 5, 7),
    _relu(5, 7),
    _lrn("lrn", 2, 7, 5, 5, 5, 1e-4, 0.75, 2.0, 1.0),  # the paper's defaults
    _lrn("lrn", 2, 7, 3, 4, 3, 1e-2, 0.75, 1.0, 10.0),  # large alpha: the cross-channel term matters
    _lrn("lrn", 1, 6, 3, 3, 4, 1e-2, 0.75, 1.0, 10.0),  # even size: the window is asymmetric
    _lrn("lrn", 2, 3, 4, 4, 5, 2e-2, 0.6, 2.0, 5.0),  # fewer channels than the window, beta != 0.75
    _lrn("relu_lrn", 2, 7, 5, 5, 5, 1e-4, 0.75, 2.0, 1.0),  # the paper's network
    _lrn("relu_lrn", 2, 7, 3, 4, 3, 1e-2, 0.75, 2.0, 10.0, "zeros"),  # the cross-channel term matters; the mask at 0
    _lrn("relu_lrn", 1, 6, 3, 3, 4, 1e-2, 0.6, 2.0, 10.0),  # even size, beta != 0.75 (pow)
    _lrn("relu_lrn", 2, 3, 4, 4, 5, 2e-2, 0.75, 2.0, 5.0, "nan"),  # fewer channels than the window; NaNs
    _batchnorm(2, 4, 5, 5, training=True),
    _batchnorm(1, 3, 4, 3, training=True, momentum=0.2),  # batch 1
    _batchnorm(2, 6, 4, 4, training=True, momentum=1.0),  # a split's tail: the running statistics become the batch's
    _batchnorm(2, 4, 5, 5, training=False),
    _batchnorm(1, 3, 1, 1, training=True),  # one value per channel: no batch statistics to train with
    _batchnorm(1, 3, 1, 1, training=False),  # ... which eval mode does not need
    _maxpool(2, 3, 9, 7, 2, 2, 0),
    _maxpool(2, 3, 9, 7, 3, 2, 1),  # overlapping windows
    _maxpool(1, 2, 8, 8, 3, 1, 1),
    _maxpool(2, 2, 6, 7, 2, 2, 0, "ties"),
    _maxpool(2, 2, 7, 7, 3, 2, 1, "ties"),  # ties and overlap: first maximum, summed
    _maxpool(2, 3, 9, 7, 2, 2, 0, "nan"),  # a NaN window outputs NaN; its gradient goes to its last NaN
    _maxpool(2, 3, 9, 7, 3, 2, 1, "nan"),  # ... and a NaN shared by overlapping windows
    _maxpool(1, 2, 8, 8, 3, 1, 1, "nan"),
    _maxpool(2, 2, 5, 5, 3, 2, 1, "-inf"),  # windows of -inf alone, some starting in the padding
    _linear((2, 3, 4, 4), 5),  # a 4-D input, flattened
    _linear((1, 10), 3),
    _linear((4, 6, 3, 3), 7),
    _softmax_ce(4, 10, 1.0),
    _softmax_ce(1, 3, 1.0),
    _softmax_ce(5, 7, 8.0),  # peaked: needs the max subtracted
    _sgd((6, 3, 5, 5), 0.05, 0.9, 5e-4),
    _sgd((10,), 0.1, 0.0, 0.0),
    _take_kernels((7, 3, 5, 5), 0, 7),
    _take_kernels((7, 3, 5, 5), 2, 5),
    _take_kernels((7,), 6, 7),
]

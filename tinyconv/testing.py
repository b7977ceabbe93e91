"""The conformance suite: any Backend, op by op, against the numpy reference.

Every op of ``backends/base.py`` is run forward and backward on random inputs of
random-looking shapes (odd sizes, stride 2, padding 0/1/2, batch 1, ties in a max,
an LRN whose cross-channel term matters), on the backend under test and on the
reference, and the results are compared output by output. Also checked: the
running statistics batchnorm updates in place, ``sgd_update`` (in place, three
steps), ``take_kernels``, the ``asarray``/``to_numpy``/``zeros`` edges,
``describe()``'s keys, that outputs are float32 of the right shape, and that no op
modifies its inputs (other than those documented as in place).

Tolerances (per dtype of the reference output)
----------------------------------------------
A check passes when

    max |got - ref|  <=  tol  =  rtol * max|ref| + atol

float32: rtol = 1e-5, atol = 1e-7. The error is measured against the *scale* of
the reference output, not entry by entry, because that is how float32 errors
arise: a backend that sums the K terms of a dot product (a conv output, a dW
entry, a batchnorm mean) in another order -- tiled, in parallel, with fused
multiply-adds -- differs by ~sqrt(K) * 6e-8 * (sum of |terms|), which is
proportional to the size of the terms, not of their possibly cancelled sum. For
the sizes here that is below 1e-6 * max|ref|; rtol = 1e-5 leaves room for
fast-math exp/pow while a real bug (a dropped term, a misrouted gradient, an
off-by-one window) is off by 1e-2 * max|ref| or more. atol only makes an
all-zero reference comparable. Data movement (asarray/to_numpy, take_kernels,
relu, the max of maxpool forward) must be exact: tol = 0.

How to run it
-------------
* in a script or notebook: ``run_conformance(backend)`` returns the results,
  ``assert_conforms(backend)`` prints the table and raises if anything failed;
* from the shell: ``python -m tinyconv.testing --backend NAME`` prints the table
  and exits 0 if every check passed, 1 otherwise;
* in a third party's pytest suite, one line in a test file gives one test per case::

      from tinyconv.testing import conformance_tests
      test_mybackend = conformance_tests("mybackend")   # a registered name, a Backend,
                                                        # or a function returning one
"""

from __future__ import annotations

import argparse
import math
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Backend
from backends.numpy_backend import NumpyBackend
from tinyconv.plugins import get_backend

REF = NumpyBackend()
F32 = np.float32


@dataclass(frozen=True)
class Tolerance:
    """Pass iff max|got - ref| <= rtol * max|ref| + atol (see the module docstring)."""

    rtol: float
    atol: float

    def of(self, ref: np.ndarray) -> float:
        scale = float(np.max(np.abs(ref))) if np.size(ref) else 0.0
        return self.rtol * scale + self.atol


TOLERANCES: dict[str, Tolerance] = {"float32": Tolerance(rtol=1e-5, atol=1e-7)}
EXACT = Tolerance(rtol=0.0, atol=0.0)


@dataclass(frozen=True)
class CheckResult:
    """One compared output of one case: e.g. op "conv2d", case "N2 C4 8x8 F6 k5 s1 p2", output "dw"."""

    op: str
    case: str
    output: str
    max_abs_err: float
    tol: float
    passed: bool
    note: str = ""


class Trial:
    """What a case runs with: the backend, a seeded generator, and the results so far."""

    def __init__(self, backend: Backend, rng: np.random.Generator, op: str, case: str) -> None:
        self.backend, self.rng, self.op, self.case = backend, rng, op, case
        self.results: list[CheckResult] = []

    def normal(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(F32)

    def dev(self, a: np.ndarray) -> Any:
        """A host array -> the backend under test. A copy: a host backend's asarray may return
        its argument itself, and the reference and the "inputs kept" check need the original."""
        return self.backend.asarray(a.copy())

    def add(self, output: str, err: float, tol: float, passed: bool, note: str = "") -> None:
        self.results.append(CheckResult(self.op, self.case, output, err, tol, passed, note))

    def compare(self, output: str, got: Any, ref: np.ndarray, tolerance: Tolerance | None = None) -> None:
        """Check one backend output (still on the device) against the reference's."""
        ref = np.asarray(ref)
        if got is None:
            return self.add(output, math.nan, 0.0, False, "returned None")
        host = np.asarray(self.backend.to_numpy(got))
        if host.shape != ref.shape:
            return self.add(output, math.nan, 0.0, False, f"shape {host.shape}, expected {ref.shape}")
        if host.dtype != ref.dtype:
            return self.add(output, math.nan, 0.0, False, f"dtype {host.dtype}, expected {ref.dtype}")
        tol = (tolerance or TOLERANCES[ref.dtype.name]).of(ref)
        err = float(np.max(np.abs(host.astype(np.float64) - ref))) if ref.size else 0.0
        self.add(output, err, tol, err <= tol)  # a NaN err fails here too

    def unchanged(self, **pairs: tuple[Any, np.ndarray]) -> None:
        """The contract: ops do not modify their inputs. name=(device array, host original)."""
        worst, changed = 0.0, []
        for name, (dev, host) in pairs.items():
            d = float(np.max(np.abs(np.asarray(self.backend.to_numpy(dev), np.float64) - host)))
            if not d == 0.0:
                changed.append(name)
                worst = max(worst, d) if not math.isnan(d) else math.nan
        self.add("inputs kept", worst, 0.0, not changed, f"modified: {', '.join(changed)}" if changed else "")


@dataclass(frozen=True)
class Case:
    """One conformance case: ``run`` checks ``op`` on one configuration, recording into a Trial."""

    op: str
    label: str
    run: Callable[[Trial], None]

    @property
    def id(self) -> str:
        return f"{self.op}-{self.label.replace(' ', '-')}"


# ------------------------------------------------------------------------ the cases


def _conv(
    n: int, c: int, h: int, w: int, f: int, k: int, stride: int, padding: int, need_dx: bool = True
) -> Case:
    def run(t: Trial) -> None:
        x, wt, b = t.normal(n, c, h, w), t.normal(f, c, k, k, scale=0.3), t.normal(f)
        xd, wd, bd = t.dev(x), t.dev(wt), t.dev(b)
        y_ref, cache_ref = REF.conv2d_forward(x, wt, b, stride, padding)
        y, cache = t.backend.conv2d_forward(xd, wd, bd, stride, padding)
        t.compare("y", y, y_ref)
        dy = t.normal(*y_ref.shape)
        dyd = t.dev(dy)
        dx_ref, dw_ref, db_ref = REF.conv2d_backward(dy, cache_ref, need_dx)
        dx, dw, db = t.backend.conv2d_backward(dyd, cache, need_dx)
        if need_dx:
            t.compare("dx", dx, dx_ref)
        else:
            note = "" if dx is None else "need_dx=False must return dx=None"
            t.add("dx is None", 0.0, 0.0, dx is None, note)
        t.compare("dw", dw, dw_ref)
        t.compare("db", db, db_ref)
        t.unchanged(x=(xd, x), w=(wd, wt), b=(bd, b), dy=(dyd, dy))

    dx_note = "" if need_dx else " no-dx"
    return Case("conv2d", f"N{n} C{c} {h}x{w} F{f} k{k} s{stride} p{padding}{dx_note}", run)


def _relu(*shape: int) -> Case:
    def run(t: Trial) -> None:
        x = t.normal(*shape)
        xd = t.dev(x)
        y_ref, cache_ref = REF.relu_forward(x)
        y, cache = t.backend.relu_forward(xd)
        t.compare("y", y, y_ref, EXACT)
        dy = t.normal(*shape)
        dyd = t.dev(dy)
        t.compare("dx", t.backend.relu_backward(dyd, cache), REF.relu_backward(dy, cache_ref), EXACT)
        t.unchanged(x=(xd, x), dy=(dyd, dy))

    return Case("relu", "x".join(map(str, shape)), run)


def _lrn(
    n: int, c: int, h: int, w: int, size: int, alpha: float, beta: float, k: float, scale: float
) -> Case:
    def run(t: Trial) -> None:
        x = t.normal(n, c, h, w, scale=scale)
        xd = t.dev(x)
        y_ref, cache_ref = REF.lrn_forward(x, size, alpha, beta, k)
        y, cache = t.backend.lrn_forward(xd, size, alpha, beta, k)
        t.compare("y", y, y_ref)
        dy = t.normal(n, c, h, w)
        dyd = t.dev(dy)
        t.compare("dx", t.backend.lrn_backward(dyd, cache), REF.lrn_backward(dy, cache_ref))
        t.unchanged(x=(xd, x), dy=(dyd, dy))

    return Case("lrn", f"N{n} C{c} {h}x{w} size{size} alpha{alpha:g} beta{beta:g} k{k:g} |x|~{scale:g}", run)


def _batchnorm(n: int, c: int, h: int, w: int, training: bool, momentum: float = 0.1) -> Case:
    def run(t: Trial) -> None:
        x = t.normal(n, c, h, w, scale=2.0) + F32(0.5)
        gamma, beta = t.normal(c), t.normal(c)
        rm, rv = t.normal(c), (t.rng.random(c) + 0.5).astype(F32)
        xd, gd, bd, rmd, rvd = t.dev(x), t.dev(gamma), t.dev(beta), t.dev(rm), t.dev(rv)
        rm_ref, rv_ref = rm.copy(), rv.copy()
        y_ref, cache_ref = REF.batchnorm_forward(x, gamma, beta, rm_ref, rv_ref, training, momentum, 1e-5)
        y, cache = t.backend.batchnorm_forward(xd, gd, bd, rmd, rvd, training, momentum, 1e-5)
        t.compare("y", y, y_ref)
        t.compare("running_mean", rmd, rm_ref)  # updated in place in training, untouched in eval
        t.compare("running_var", rvd, rv_ref)
        dy = t.normal(n, c, h, w)
        dyd = t.dev(dy)
        dx_ref, dgamma_ref, dbeta_ref = REF.batchnorm_backward(dy, cache_ref)
        dx, dgamma, dbeta = t.backend.batchnorm_backward(dyd, cache)
        t.compare("dx", dx, dx_ref)
        t.compare("dgamma", dgamma, dgamma_ref)
        t.compare("dbeta", dbeta, dbeta_ref)
        t.unchanged(x=(xd, x), gamma=(gd, gamma), beta=(bd, beta), dy=(dyd, dy))

    mode = "train" if training else "eval"
    return Case("batchnorm", f"N{n} C{c} {h}x{w} {mode} momentum{momentum:g}", run)


def _maxpool(n: int, c: int, h: int, w: int, kernel: int, stride: int, padding: int, ties: bool) -> Case:
    def run(t: Trial) -> None:
        if ties:  # few distinct values: many windows hold several equal maxima
            x = t.rng.integers(0, 3, size=(n, c, h, w)).astype(F32)
        else:
            x = t.normal(n, c, h, w)
        xd = t.dev(x)
        y_ref, cache_ref = REF.maxpool_forward(x, kernel, stride, padding)
        y, cache = t.backend.maxpool_forward(xd, kernel, stride, padding)
        t.compare("y", y, y_ref, EXACT)
        dy = t.normal(*y_ref.shape)
        dyd = t.dev(dy)
        t.compare("dx", t.backend.maxpool_backward(dyd, cache), REF.maxpool_backward(dy, cache_ref))
        t.unchanged(x=(xd, x), dy=(dyd, dy))

    kind = " ties" if ties else ""
    return Case("maxpool", f"N{n} C{c} {h}x{w} k{kernel} s{stride} p{padding}{kind}", run)


def _linear(x_shape: tuple[int, ...], m: int) -> Case:
    def run(t: Trial) -> None:
        d = int(np.prod(x_shape[1:]))
        x, wt, b = t.normal(*x_shape), t.normal(m, d, scale=0.3), t.normal(m)
        xd, wd, bd = t.dev(x), t.dev(wt), t.dev(b)
        y_ref, cache_ref = REF.linear_forward(x, wt, b)
        y, cache = t.backend.linear_forward(xd, wd, bd)
        t.compare("y", y, y_ref)
        dy = t.normal(x_shape[0], m)
        dyd = t.dev(dy)
        dx_ref, dw_ref, db_ref = REF.linear_backward(dy, cache_ref)
        dx, dw, db = t.backend.linear_backward(dyd, cache)
        t.compare("dx", dx, dx_ref)  # in x's original shape
        t.compare("dw", dw, dw_ref)
        t.compare("db", db, db_ref)
        t.unchanged(x=(xd, x), w=(wd, wt), b=(bd, b), dy=(dyd, dy))

    return Case("linear", f"x{'x'.join(map(str, x_shape))} M{m}", run)


def _softmax_ce(n: int, k: int, scale: float) -> Case:
    def run(t: Trial) -> None:
        logits = t.normal(n, k, scale=scale)
        labels = t.rng.integers(0, k, size=n)
        ld = t.dev(logits)
        loss_ref, d_ref = REF.softmax_cross_entropy(logits, labels)
        loss, d = t.backend.softmax_cross_entropy(ld, labels)
        if isinstance(loss, float):
            tol = TOLERANCES["float32"].of(np.array(loss_ref))
            t.add("loss", abs(loss - loss_ref), tol, abs(loss - loss_ref) <= tol)
        else:
            t.add("loss", math.nan, 0.0, False, f"loss is a {type(loss).__name__}, expected a Python float")
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
            t.add("values", 0.0 if ok else math.nan, 0.0, ok, "" if ok else f"got {host.dtype} {host.shape}")
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
            note = "" if ok else f"got {d.get(key)!r}, want a {typ.__name__}"
            t.add(key, 0.0 if ok else math.nan, 0.0, ok, note)
        ok = d.get("backend") == t.backend.name
        t.add("backend == name", 0.0 if ok else math.nan, 0.0, ok, "" if ok else f"{d.get('backend')!r}")

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
    _relu(1, 3, 5, 7),
    _relu(5, 7),
    _lrn(2, 7, 5, 5, 5, 1e-4, 0.75, 2.0, 1.0),  # the paper's defaults
    _lrn(2, 7, 3, 4, 3, 1e-2, 0.75, 1.0, 10.0),  # large alpha: the cross-channel term matters
    _lrn(1, 6, 3, 3, 4, 1e-2, 0.75, 1.0, 10.0),  # even size: the window is asymmetric
    _lrn(2, 3, 4, 4, 5, 2e-2, 0.6, 2.0, 5.0),  # fewer channels than the window, beta != 0.75
    _batchnorm(2, 4, 5, 5, training=True),
    _batchnorm(1, 3, 4, 3, training=True, momentum=0.2),  # batch 1
    _batchnorm(2, 4, 5, 5, training=False),
    _maxpool(2, 3, 9, 7, 2, 2, 0, ties=False),
    _maxpool(2, 3, 9, 7, 3, 2, 1, ties=False),  # overlapping windows
    _maxpool(1, 2, 8, 8, 3, 1, 1, ties=False),
    _maxpool(2, 2, 6, 7, 2, 2, 0, ties=True),
    _maxpool(2, 2, 7, 7, 3, 2, 1, ties=True),  # ties and overlap: first maximum, summed
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


# ------------------------------------------------------------------------ running it


def _resolve(backend: str | Backend | Callable[[], Backend]) -> Backend:
    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, str):
        return get_backend(backend)
    if callable(backend):
        made = backend()
        if not isinstance(made, Backend):
            raise TypeError(f"the backend factory returned {type(made).__name__}, not a Backend")
        return made
    raise TypeError(f"expected a backend name, a Backend or a factory, got {type(backend).__name__}")


def run_case(backend: Backend, case: Case, seed: int = 0) -> list[CheckResult]:
    """Run one case; an exception becomes a failed result naming it (after any results so far)."""
    rng = np.random.default_rng([seed, zlib.crc32(case.id.encode())])  # independent of case order
    trial = Trial(backend, rng, case.op, case.label)
    try:
        case.run(trial)
    except Exception as e:  # noqa: BLE001 -- a conformance report must survive a broken op
        trial.add("raised", math.nan, 0.0, False, f"{type(e).__name__}: {e}")
    return trial.results


def run_conformance(backend: str | Backend | Callable[[], Backend], seed: int = 0) -> list[CheckResult]:
    """Every case on ``backend`` (a registered name, an instance or a factory); one result per output."""
    b = _resolve(backend)
    return [r for case in CASES for r in run_case(b, case, seed)]


def format_table(results: list[CheckResult]) -> str:
    """A plain-text table: op, case, output, max abs err, tol, ok; then a one-line summary."""
    rows = [("op", "case", "output", "max abs err", "tol", "ok")]
    for r in results:
        status = "ok" if r.passed else "FAIL" + (f" ({r.note})" if r.note else "")
        rows.append((r.op, r.case, r.output, f"{r.max_abs_err:.2e}", f"{r.tol:.2e}", status))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    widths[-1] = 0  # the last column is not padded
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    failed = sum(not r.passed for r in results)
    lines.append(f"{len(results)} checks, {len(results) - failed} passed, {failed} failed")
    return "\n".join(lines)


def assert_conforms(backend: str | Backend | Callable[[], Backend], seed: int = 0) -> None:
    """Print the table; raise AssertionError listing the failures, if any."""
    results = run_conformance(backend, seed)
    print(format_table(results))
    failed = [r for r in results if not r.passed]
    if failed:
        lines = [
            f"{r.op} [{r.case}] {r.output}: err {r.max_abs_err:.2e}, tol {r.tol:.2e} {r.note}"
            for r in failed
        ]
        raise AssertionError(f"{len(failed)} conformance check(s) failed:\n" + "\n".join(lines))


def conformance_tests(backend: str | Backend | Callable[[], Backend], seed: int = 0) -> Callable[..., None]:
    """A pytest test function parametrised over every case; bind it to a ``test_*`` name.

    The backend is made once, on the first case that runs (so a factory may call
    ``pytest.skip``), and shared by every case of the module.
    """
    import pytest

    made: dict[str, Any] = {}

    def instance() -> Backend:
        if "error" in made:
            raise made["error"]
        if "backend" not in made:
            try:
                made["backend"] = _resolve(backend)
            except BaseException as e:  # a skip, a missing device: the same outcome for every case
                made["error"] = e
                raise
        return made["backend"]

    @pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
    def test_conformance(case: Case) -> None:
        results = run_case(instance(), case, seed)
        assert results, f"case {case.id} checked nothing"
        if not all(r.passed for r in results):
            pytest.fail("\n" + format_table(results), pytrace=False)

    return test_conformance


def main(argv: list[str] | None = None) -> int:
    """``python -m tinyconv.testing --backend NAME``: print the table; 0 if all passed, else 1."""
    parser = argparse.ArgumentParser(
        prog="python -m tinyconv.testing",
        description="Check a tinyconv backend op by op against the numpy reference.",
    )
    parser.add_argument("--backend", required=True, help="a name registered as a tinyconv.backends entry")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    args = parser.parse_args(argv)
    try:
        backend = get_backend(args.backend)
    except Exception as e:  # noqa: BLE001 -- unknown name, no device, import error: report and fail
        print(f"cannot create backend {args.backend!r}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"conformance of {backend!r} against the numpy reference (seed {args.seed})")
    results = run_conformance(backend, args.seed)
    print(format_table(results))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

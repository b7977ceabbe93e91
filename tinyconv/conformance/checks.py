"""How the conformance suite compares a backend with the numpy reference: tolerances, results, trials.

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

NaN. Where the reference output is NaN (a max pool window holding a NaN), the
backend's must be NaN too, and nowhere else; the error and the scale are taken
over the other entries. Equal entries (infinities included) differ by 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Backend
from backends.numpy_backend import NumpyBackend

REF = NumpyBackend()
F32 = np.float32


@dataclass(frozen=True)
class Tolerance:
    """Pass iff max|got - ref| <= rtol * max|ref| + atol, over ref's finite entries (see above)."""

    rtol: float
    atol: float

    def of(self, ref: np.ndarray) -> float:
        finite = np.abs(ref[np.isfinite(ref)])
        scale = float(np.max(finite)) if finite.size else 0.0
        return self.rtol * scale + self.atol


TOLERANCES: dict[str, Tolerance] = {"float32": Tolerance(rtol=1e-5, atol=1e-7)}
EXACT = Tolerance(rtol=0.0, atol=0.0)


def max_error(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| over the entries where ref is not NaN (0 where they are equal, infinities
    included); NaN if got is NaN anywhere else or not NaN somewhere ref is. Same shapes."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    nan = np.isnan(ref)
    if not np.array_equal(nan, np.isnan(got)):
        return math.nan
    with np.errstate(invalid="ignore"):  # inf - inf where both are the same infinity: zeroed next
        diff = np.abs(got - ref)
    diff[nan | (got == ref)] = 0.0
    return float(np.max(diff)) if diff.size else 0.0


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

    def check(self, output: str, passed: bool, note: str) -> None:
        """A yes/no check (no error to measure): ``note`` says what went wrong if it failed."""
        self.add(output, 0.0 if passed else math.nan, 0.0, passed, "" if passed else note)

    def compare(self, output: str, got: Any, ref: np.ndarray, tolerance: Tolerance | None = None) -> None:
        """Check one backend output (still on the device) against the reference's, NaN-aware."""
        ref = np.asarray(ref)
        if got is None:
            return self.add(output, math.nan, 0.0, False, "returned None")
        host = np.asarray(self.backend.to_numpy(got))
        if host.shape != ref.shape:
            return self.add(output, math.nan, 0.0, False, f"shape {host.shape}, expected {ref.shape}")
        if host.dtype != ref.dtype:
            return self.add(output, math.nan, 0.0, False, f"dtype {host.dtype}, expected {ref.dtype}")
        tol = (tolerance or TOLERANCES[ref.dtype.name]).of(ref)
        wrong_nan = int(np.count_nonzero(np.isnan(host) != np.isnan(ref)))
        if wrong_nan:
            note = f"NaN differs from the reference at {wrong_nan} of {ref.size} entries"
            return self.add(output, math.nan, tol, False, note)
        err = max_error(host, ref)
        self.add(output, err, tol, err <= tol)

    def unchanged(self, **pairs: tuple[Any, np.ndarray]) -> None:
        """The contract: ops do not modify their inputs. name=(device array, host original)."""
        worst, changed = 0.0, []
        for name, (dev, host) in pairs.items():
            got = np.asarray(self.backend.to_numpy(dev))
            if not np.array_equal(got, host, equal_nan=True):
                changed.append(name)
                d = max_error(got, host)
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

"""How tinyconv compares float32 results: the one tolerance; the conformance suite's results and trials.

Every float32 comparison of tinyconv -- this suite, the tests, a third party's tests of a backend --
is ``float32_tolerance(k, terms)`` (its docstring has the math): k the number of roundings on the
way, terms the sum of the absolute values summed, entry by entry where it can be computed
(tests/float32_expected.py), else the scale of the values. docs/writing-a-backend.md tables each
op's k, and why the suite's scale form with K_CASES = 256 separates round-off from a real bug.
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

U = 2.0**-24  # float32's unit round-off: fl(a op b) = (a op b)(1 + d), |d| <= U, for + - * / and sqrt
TINY = 2.0**-149  # float32's smallest subnormal: a product that underflows is off by at most TINY / 2
FN = 32  # the k of one pow, exp, log, sqrt or division: OpenCL allows pow 16 ulp off, and 1 ulp <= 2 U
K_CASES = 256  # at least the k of every output of cases.py (docs/writing-a-backend.md tables them)


def gamma(k: int) -> float:
    """gamma_k = k u / (1 - k u), u = 2^-24: k factors (1 + d_i), |d_i| <= u, multiply to within
    gamma_k of 1 (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1)."""
    if not 0 <= k <= 2**22:  # k u <= 1/4: the lemma needs k u < 1
        raise ValueError(f"k must be in [0, 2^22], got {k}")
    return k * U / (1 - k * U)


def float32_tolerance(k: int, terms: Any) -> Any:
    """How far apart two float32 computations of the same value may be: 2 gamma_k * terms + 2 k TINY.

    The rigorous form. A value computed from float32 inputs by additions and multiplications,
    in any order -- a dot product in a BLAS kernel of any width, tiled, split into partial sums
    added up later (on other machines), with or without fused multiply-adds; a convolution
    through im2col and col2im -- equals its exact value's expansion into monomials (for a sum
    of K products: the K products) with each monomial multiplied by at most k factors (1 + d),
    |d| <= u, one per rounding on its way to the result; k <= K for a sum of K products, the
    bias's addition adding one. So it is within gamma_k * terms of the exact value, where terms
    = the sum of the monomials' absolute values = the same computation on |inputs| in float64
    with every subtraction made an addition (conv2d(|x|, |w|) + |b|), and two such computations
    are within 2 gamma_k * terms of each other, entry by entry (Higham, op. cit., eq. 3.5).
    Products that underflow lose up to TINY / 2 each: 2 k TINY for two computations.
    tests/float32_expected.py computes k and terms this way for the convolution and the linear layer.

    The scale form, where terms cannot be computed -- normalisations (batch norm divides by a
    computed standard deviation, LRN raises a sum to -beta, softmax exponentiates), several
    layers in a row, training steps: terms = max|ref|, the largest finite reference entry, and
    k = the ops' k added up along the longest path from an input to the output, an op that is
    not exact in IEEE arithmetic (pow, exp, log; OpenCL's sqrt and division too) counting FN =
    32 (OpenCL allows pow 16 ulp, the loosest it allows of these, and 1 ulp <= 2u). This is a
    stated bound, not a proved one. It rests on (a) the statistics a normalisation divides by
    being sums of positive terms (squares, exponentials), so within gamma_n relative, and a
    relative error e of them moving the output by about e times the output -- for data not far
    off-centre: batch norm of values whose mean dwarfs their spread cancels in x - mean, in any
    float32 implementation; (b) the errors of layers in a row adding up, gamma_a + gamma_b <=
    gamma_(a+b), ReLU and max pool not magnifying a perturbation (LRN does, where s = k + alpha
    / n * sum(x^2) varies, by up to (max s / min s)^beta relative to the output's scale, which (c)
    absorbs for the alphas here); (c) where the terms of a sum cancel, sum|terms| exceeding
    max|ref| by only about sqrt(K) / 4 for K terms of random signs, while their rounding errors
    add like a random walk, to about u sqrt(K) max|ref| (Higham and Mary, SIAM J. Sci. Comput.
    41(5), 2019), a factor of about 2 sqrt(K) below 2 gamma_K max|ref|. Where a long sum does not
    cancel (batch norm's statistics over N*H*W values) it is loose by about sqrt(K) instead.
    """
    return 2.0 * gamma(k) * np.asarray(terms, np.float64) + 2 * k * TINY


def scale(ref: np.ndarray) -> float:
    """max|ref| over its finite entries (0 if none): what the scale form measures errors against."""
    ref = np.asarray(ref)
    finite = np.abs(ref[np.isfinite(ref)])
    return float(np.max(finite)) if finite.size else 0.0


EXACT = 0  # the k of data movement: no rounding on the way, so the tolerance is 0


def max_error(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| over the entries where ref is not NaN (0 where they are equal, infinities
    included; NaN where got alone is NaN). Same shapes."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf where both are the same infinity: zeroed next
        diff = np.abs(got - ref)
    diff[np.isnan(ref) | (got == ref)] = 0.0
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

    def compare(self, output: str, got: Any, ref: np.ndarray, k: int = K_CASES) -> None:
        """Check one backend output (still on the device) against the reference's, NaN-aware, in
        float32_tolerance's scale form: max|got - ref| <= float32_tolerance(k, max|ref|)."""
        ref = np.asarray(ref)
        if got is None:
            return self.add(output, math.nan, 0.0, False, "returned None")
        host = np.asarray(self.backend.to_numpy(got))
        if host.shape != ref.shape:
            return self.add(output, math.nan, 0.0, False, f"shape {host.shape}, expected {ref.shape}")
        if host.dtype != ref.dtype:
            return self.add(output, math.nan, 0.0, False, f"dtype {host.dtype}, expected {ref.dtype}")
        tol = float(float32_tolerance(k, scale(ref)))
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

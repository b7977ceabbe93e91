"""Float32 reference values with their rigorous bounds, for the tests: ``Expected`` and ``assert_close``.

Every float32 comparison of the tests is ``float32_tolerance(k, terms)`` (backends/conformance/checks.py has
the math, docs/writing-a-backend.md the table of each op's k): terms the sum of the absolute values summed,
entry by entry where it can be computed (``conv2d_expected``, ``linear_expected``), else the scale of the
values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.conformance.checks import REF, float32_tolerance, scale


@dataclass(frozen=True)
class Expected:
    """A float32 reference value and its bound: another float32 computation of it must be within
    float32_tolerance(k, terms) of it, entry by entry; terms None is the scale form (max|value|)."""

    value: np.ndarray
    k: int
    terms: Any = None  # sum|terms| per entry (float64, value's shape), a scale, or None

    def tolerance(self) -> Any:
        return float32_tolerance(self.k, scale(self.value) if self.terms is None else self.terms)

    def __getitem__(self, index: Any) -> Expected:
        """The entries ``value[index]`` with their bounds (a scale-form slice keeps the whole's scale)."""
        terms = scale(self.value) if self.terms is None else self.terms
        return Expected(self.value[index], self.k, terms[index] if np.ndim(terms) else terms)


def assert_close(got: Any, expected: Expected, what: str = "") -> None:
    """got (a float32 array or a number) is within expected's tolerance of its value, entry by entry,
    with its shape and dtype; the message names the entry nearest to failing."""
    got, ref = np.asarray(got), np.asarray(expected.value)
    name = f"{what}: " if what else ""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (
        f"{name}got {got.dtype} {got.shape}, expected {ref.dtype} {ref.shape}"
    )
    tol = np.broadcast_to(expected.tolerance(), ref.shape)
    err = np.abs(got.astype(np.float64) - ref)
    bad = ~(err <= tol)  # NaN in either fails
    if bad.any():
        with np.errstate(divide="ignore", invalid="ignore"):
            worst = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(err / tol, nan=np.inf), -1.0)), ref.shape)
        raise AssertionError(
            f"{name}{np.count_nonzero(bad)} of {ref.size} entries differ by more than float32_tolerance(k="
            f"{expected.k}); the worst, at {tuple(int(i) for i in worst)}: got {float(got[worst]):.9g}, expected "
            f"{float(ref[worst]):.9g}, error {err[worst]:.3g} > tolerance {tol[worst]:.3g}"
        )


def _bounded(op: str, inputs: tuple, args: tuple, dy: Any, backward_args: tuple, ks: tuple) -> tuple[Any, ...]:
    """The reference ``op``'s y (and given dy, its gradients) as Expected values with the k of ``ks``,
    their terms the same op on |inputs| and |dy| in float64; a gradient the op leaves None stays None."""
    forward, backward = getattr(REF, f"{op}_forward"), getattr(REF, f"{op}_backward")
    y, cache = forward(*inputs, *args)
    y_terms, terms_cache = forward(*(np.abs(np.asarray(a, np.float64)) for a in inputs), *args)
    values, terms = [y], [y_terms]
    if dy is not None:
        values += backward(dy, cache, *backward_args)
        terms += backward(np.abs(np.asarray(dy, np.float64)), terms_cache, *backward_args)
    return tuple(None if v is None else Expected(v, k, t) for v, k, t in zip(values, ks, terms, strict=False))


def conv2d_expected(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray,
    stride: int,
    padding: int,
    dy: np.ndarray | None = None,
    need_dx: bool = True,
) -> tuple[Any, ...]:
    """The reference convolution with rigorous bounds: (y,) or, given dy, (y, dx or None, dw, db), each
    an Expected whose terms are the same op on |x|, |w|, |b|, |dy| in float64, k as in the table above."""
    f, c, kh, kw = w.shape
    n_sums = 0 if dy is None else dy.shape[0] * dy.shape[2] * dy.shape[3]  # N*OH*OW: dw's and db's reduction
    return _bounded(
        "conv2d", (x, w, b), (stride, padding), dy, (need_dx,), (c * kh * kw + 1, f * kh * kw, n_sums, n_sums)
    )


def linear_expected(x: np.ndarray, w: np.ndarray, b: np.ndarray, dy: np.ndarray | None = None) -> tuple[Expected, ...]:
    """The reference linear layer with rigorous bounds: (y,) or, given dy, (y, dx, dw, db), as
    ``conv2d_expected``: y's k is D + 1, dx's M, dw's and db's N."""
    (m, d), n = w.shape, x.shape[0]
    return _bounded("linear", (x, w, b), (), dy, (), (d + 1, m, n, n))

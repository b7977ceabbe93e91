"""Running the conformance suite: any Backend, op by op, against the numpy reference (cases.py, checks.py),
from Python, pytest or ``python -m backends.conformance.runner --backend NAME`` (docs/writing-a-backend.md).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import zlib
from collections.abc import Callable

import numpy as np

from backends import get_backend, has_devices
from backends.base import Backend
from backends.conformance.cases import CASES
from backends.conformance.checks import FN, Case, CheckResult, Trial, float32_tolerance, gamma

__all__ = ["FN", "float32_tolerance", "gamma"]  # re-exported for a backend's own tests


# ------------------------------------------------------------------------ running it


def _resolve(backend: str | Backend | Callable[[], Backend]) -> Backend:
    if isinstance(backend, str):
        return get_backend(backend)
    return backend if isinstance(backend, Backend) else backend()


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
        lines = [f"{r.op} [{r.case}] {r.output}: err {r.max_abs_err:.2e}, tol {r.tol:.2e} {r.note}" for r in failed]
        raise AssertionError(f"{len(failed)} conformance check(s) failed:\n" + "\n".join(lines))


def conformance_tests(backend: str | Backend | Callable[[], Backend], seed: int = 0) -> Callable[..., None]:
    """A pytest test function parametrised over every case; bind it to a ``test_*`` name.

    The backend is made on the first case that runs and shared by every case of the module; a factory
    may call ``pytest.skip`` (each case then skips).
    """
    import pytest

    instance = functools.cache(lambda: _resolve(backend))

    @pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
    def test_conformance(case: Case) -> None:
        results = run_case(instance(), case, seed)
        assert results, f"case {case.id} checked nothing"
        if not all(r.passed for r in results):
            pytest.fail("\n" + format_table(results), pytrace=False)

    return test_conformance


def main(argv: list[str] | None = None, prog: str = "python -m backends.conformance.runner") -> int:
    """Print the table; 0 if all passed, else 1. ``prog``: the name the usage shows (``tinyconv conformance``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Check a tinyconv backend op by op against the numpy reference.",
    )
    parser.add_argument("--backend", required=True, help="a name registered as a tinyconv.backends entry")
    parser.add_argument(
        "--device",
        default=None,
        help="the backend's device, for one that has several (opencl: P:D, gpu, cpu or a name "
        "substring, as `tinyconv devices` lists them)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    args = parser.parse_args(argv)
    try:
        if args.device and not has_devices(args.backend):
            raise ValueError(f"the {args.backend} backend has no devices to choose from; drop --device")
        backend = get_backend(args.backend, **({"device": args.device} if args.device else {}))
    except Exception as e:  # noqa: BLE001 -- unknown name, no device, import error: report and fail
        print(f"cannot create backend {args.backend!r}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"conformance of {backend!r} against the numpy reference (seed {args.seed})")
    results = run_conformance(backend, args.seed)
    print(format_table(results))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The conformance suite's checks and cases: any Backend, op by op, against the numpy reference.

    checks.py   how an output is compared (tolerances, NaN-aware), CheckResult, Trial, Case
    cases.py    what is compared: CASES, every op on the shapes and values that catch bugs

Running them -- ``run_conformance``, ``assert_conforms``, ``conformance_tests``, the command
line -- is ``backends.conformance.runner``, which re-exports these names.
"""

from backends.conformance.cases import CASES
from backends.conformance.checks import EXACT, REF, TOLERANCES, Case, CheckResult, Tolerance, Trial, max_error

__all__ = ["CASES", "Case", "CheckResult", "EXACT", "REF", "TOLERANCES", "Tolerance", "Trial", "max_error"]

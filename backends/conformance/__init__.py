"""The conformance suite: any Backend, op by op, against the numpy reference.

checks.py   how an output is compared (tolerances, NaN-aware), CheckResult, Trial, Case
cases.py    what is compared: CASES, every op on the shapes and values that catch bugs
runner.py   running them: run_conformance, assert_conforms, conformance_tests, the command line
"""

from backends.conformance.cases import CASES
from backends.conformance.checks import EXACT, REF, TOLERANCES, Case, CheckResult, Tolerance, Trial, max_error

__all__ = ["CASES", "Case", "CheckResult", "EXACT", "REF", "TOLERANCES", "Tolerance", "Trial", "max_error"]

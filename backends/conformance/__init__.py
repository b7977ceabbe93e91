"""The conformance suite: any Backend, op by op, against the numpy reference.

checks.py   how an output is compared (tolerances, NaN-aware), CheckResult, Trial, Case
cases.py    what is compared: CASES, every op on the shapes and values that catch bugs
runner.py   running them: run_conformance, assert_conforms, conformance_tests, the command line
"""

from backends.conformance.cases import CASES

__all__ = ["CASES"]

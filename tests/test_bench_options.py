"""The benchmarks' options: every script's --help parses, its options are the shared spellings
(tinyconv/options.py), and an old spelling is refused in one line with exit 2, before any work.

One Python runs every script's command line (runpy, as ``python benchmarks/X.py ARGS`` would), so the
imports are paid once; nothing is timed or run for real."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))
RUNNER = """
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    for argv in (["--help"], ["--batch", "8"]):
        sys.argv = [path, *argv]
        stdout, stderr, code = io.StringIO(), io.StringIO(), 0
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as e:
                code = e.code
        out.setdefault(path, {})[argv[0]] = [code, stdout.getvalue(), stderr.getvalue()]
print(json.dumps(out))
"""
OLD = re.compile(r"--(batch|batches|archs|participants|nodes|devices|quiet|timeout|warmup-steps)(?![-\w])")


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, list]]:
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, *map(str, SCRIPTS)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", [s.name for s in SCRIPTS])
def test_help_parses_and_speaks_the_shared_spellings(runs, script):
    code, out, err = runs[str(ROOT / "benchmarks" / script)]["--help"]
    assert code == 0 and out.startswith("usage:"), err[-2000:]
    options = out.split("\n\n")[:4]  # the usage and the options, not the docstring's prose after them
    assert not OLD.search("\n".join(options)), OLD.search("\n".join(options))


@pytest.mark.parametrize("script", [s.name for s in SCRIPTS])
def test_an_old_spelling_is_one_line_and_exit_2(runs, script):
    code, _, err = runs[str(ROOT / "benchmarks" / script)]["--batch"]
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--batch is now --batch-size" in err, err

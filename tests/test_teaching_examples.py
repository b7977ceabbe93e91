"""The short lecture demos in examples/ run and say what they claim."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from backends.conformance.runner import float32_tolerance

ROOT = Path(__file__).resolve().parent.parent


def run(script: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_backprop_by_hand_shows_right_gradients_and_the_trap():
    out = run("backprop_by_hand.py")
    head, trap = out.split("the trap:")
    errors = [float(e) for e in re.findall(r"d\w+: ([0-9.e+-]+)", head)]
    assert len(errors) >= 10 and max(errors) < 1e-7
    assert float(re.search(r"worst ([0-9.e+-]+)", head).group(1)) < 1e-7
    right = float(re.search(r"full Jacobian \(tinyconv\):\s+([0-9.e+-]+)", trap).group(1))
    wrong = float(re.search(r"diagonal term only \(wrong\):\s+([0-9.e+-]+)", trap).group(1))
    assert right < 1e-7 and wrong > 1e-3


def test_split_a_convolution_starts_from_eq1_and_keeps_the_slow_worker_in():
    out = run("split_a_convolution.py")
    assert "[18, 9, 5]" in out  # eq. 1 on 1 s, 2 s, 4 s
    diffs = dict(re.findall(r"(y|dx|dw)\s+([0-9.e+-]+)", out.split("round-off is ~1e-7):")[1]))
    # each is max|got - ref| / max|ref|: float32_tolerance's scale form allows 2 gamma_k, k the output's
    # reduction in the example's conv (32 channels in, 96 kernels of 5x5, 16 images of 16x16)
    k = {"y": 32 * 25 + 1, "dx": 96 * 25, "dw": 16 * 16 * 16}
    assert diffs.keys() == k.keys() and all(float(d) <= float32_tolerance(k[n], 1.0) for n, d in diffs.items()), diffs
    calibrated = [int(c) for c in re.search(r"eq\. 1 on them -> kernels \[([\d, ]+)\]", out).group(1).split(", ")]
    shares = [tuple(map(int, s)) for s in re.findall(r"step +\d+: kernels \[(\d+), (\d+), (\d+), (\d+)\]", out)]
    master, fast0, fast1, slow = calibrated
    assert sum(calibrated) == 96 and shares[0] == tuple(calibrated)  # the first step runs eq. 1's split
    assert 0 < slow < max(fast0, fast1)  # timed 3x slower, it gets a smaller share (from noisy timings: max)
    assert shares == [tuple(calibrated)] * 12  # and keeps it: the paper's fixed split, never 0 kernels

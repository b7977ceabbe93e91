"""The short lecture demos in examples/ run and say what they claim."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tinyconv.testing import float32_tolerance

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


def test_split_a_convolution_equals_the_unsplit_one_and_unloads_the_slow_worker():
    out = run("split_a_convolution.py")
    assert "[18, 9, 5]" in out  # eq. 1 on 1 s, 2 s, 4 s
    diffs = dict(re.findall(r"(y|dx|dw)\s+([0-9.e+-]+)", out.split("round-off is ~1e-7):")[1]))
    # each is max|got - ref| / max|ref|: float32_tolerance's scale form allows 2 gamma_k, k the output's
    # reduction in the example's conv (16 channels in, 32 kernels of 5x5, 32 images of 16x16)
    k = {"y": 16 * 25 + 1, "dx": 32 * 25, "dw": 32 * 16 * 16}
    assert diffs.keys() == k.keys() and all(float(d) <= float32_tolerance(k[n], 1.0) for n, d in diffs.items()), diffs
    shares = re.findall(r"kernels \[(\d+), (\d+), (\d+), (\d+)\]", out)
    assert shares[0] == ("8", "8", "8", "8")
    assert int(shares[-1][3]) < 8  # the 3x slower worker ends with fewer than an equal share

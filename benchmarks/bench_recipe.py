#!/usr/bin/env python3
"""Which learning rate (and classifier rate) a preset should train at: short whole runs, compared.

    python benchmarks/bench_recipe.py                                   # 64:128 batch norm, 2 epochs, the grid below
    python benchmarks/bench_recipe.py --lrs 0.05 0.1 --classifier-lrs 0.1 --epochs 3
    python benchmarks/bench_recipe.py --preset paper --lrs 0.01 0.02 --epochs 1
    python benchmarks/bench_recipe.py --lrs 0.05 --classifier-lrs 0.1 --label-smoothing 0 0.1

Each candidate is a whole run of the main job (``examples/cifar10_dist.py``) on real CIFAR-10:
the --preset's recipe (batch, schedule, warm-up fraction, weight decay, crop and flip, seed 0),
with --arch, --epochs and the candidate's --lr and --classifier-lr put beside it. A short run's
cosine schedule still warms up, peaks and decays to 0, so each candidate is judged on a run with
the same shape as the real one, only shorter. Runs are the master alone (``--workers 0``) on
--backend: the numbers are the same as distributed, to float32 round-off, and faster here.
The table: each epoch's test accuracy, the first epoch's mean training loss (where the spikes
of a rate too high show) and the last one's, and whether the run diverged (a non-finite loss,
or a last-epoch training loss above ln 10, chance). With label smoothing the training loss is the
smoothed one, which stays above the plain cross-entropy: compare test accuracies. Accuracies do not
depend on the machine's load; the minutes do. Not a test: no asserts.

Measured (``python benchmarks/bench_recipe.py``: 64:128, batch norm, batch 128, 2 epochs, cosine
after a 5 % warm-up, weight decay 5e-4, OpenCL master alone, 4 minutes a run on 2 cores)::

    lr     classifier  test acc by epoch  train loss first / last  diverged
    0.02   1           59.95, 66.77       2.241 / 1.099            no
    0.05   1           53.08, 63.10       2.397 / 1.208            no
    0.1    1           20.57, -           2.7e13 / -               yes (stopped by hand after epoch 1)
    0.02   0.1         61.75, 68.62       1.601 / 1.062            no
    0.05   0.1         62.68, 69.39       1.573 / 1.029            no

and ``--lrs 0.05 --classifier-lrs 0.1 --label-smoothing 0.1``: 62.62, 69.24 (train loss 1.787 /
1.346, the smoothed loss).

Read: the 8,192-wide classifier is what limits the rate (as the paper net's 32,000-wide one,
``bench_init.py``): at the full rate 0.05 trains worse than 0.02 and 0.1 diverges, while with
the classifier at a tenth of the rate 0.05 is the best of all. Hence ``--preset best``'s lr 0.05
with ``classifier_lr`` 0.1 (``tinyconv/presets.py``), and ``--preset quick``'s since. Label smoothing
at 0.1 changed the test accuracy by -0.15 points, less than two runs' spread: no preset sets it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyconv.options import POSITIVE, Parser, UsageError, add, count, number  # noqa: E402
from tinyconv.presets import PRESETS  # noqa: E402
from tinyconv.report import format_table  # noqa: E402

EXAMPLE = ROOT / "examples" / "cifar10_dist.py"


def run(args: argparse.Namespace, lr: float, classifier_lr: float, smoothing: float, metrics: Path) -> list[dict]:
    """One candidate's whole run; its epoch lines from the metrics file (those it finished)."""
    cmd = [sys.executable, str(EXAMPLE), "--preset", args.preset, "--workers", "0", "--backend", args.backend]
    cmd += ["--epochs", str(args.epochs), "--lr", str(lr), "--classifier-lr", str(classifier_lr)]
    cmd += ["--label-smoothing", str(smoothing), "--metrics-out", str(metrics), "--no-progress", "--seed", "0"]
    cmd += ["--arch", args.arch]
    cmd += ["--data-dir", args.data_dir] if args.data_dir else []
    cmd += ["--dataset", args.dataset]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if done.returncode != 0 and not lines:
        raise SystemExit(f"the run at lr {lr} failed before its first line: {done.stderr.strip()[-2000:]}")
    return [r for r in lines if r["event"] == "epoch"]


def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=PRESETS, default="quick", help="the recipe the candidates change (%(default)s)")
    add(p, "arch", defaults={"arch": "64:128"}, helps={"arch": "given beside the preset's"})
    p.add_argument("--epochs", type=count(1), default=2, metavar="N", help="(default 2)")
    rates = {"type": POSITIVE, "nargs": "+", "metavar": "LR"}
    p.add_argument("--lrs", **rates, default=[0.02, 0.05, 0.1], help="peak rates (default 0.02 0.05 0.1)")
    p.add_argument("--classifier-lrs", **rates, default=[1.0, 0.1], help="the classifier's factors (default 1 0.1)")
    p.add_argument(
        "--label-smoothing",
        type=number(0, 1, what="a fraction"),
        nargs="+",
        default=[0.0],
        metavar="EPS",
        help="label smoothing values to compare (default 0: none)",
    )
    add(p, "backend", defaults={"backend": "opencl"}, helps={"backend": "the master's"})
    p.add_argument("--data-dir", help="CIFAR-10's folder (default: the main job's)")
    p.add_argument("--dataset", choices=("cifar10", "synthetic"), default="cifar10", help="synthetic: a smoke run")
    return p


def main() -> None:
    args = build_parser().parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (c, lr, eps) in enumerate(itertools.product(args.classifier_lrs, args.lrs, args.label_smoothing)):
            t = time.perf_counter()
            epochs = run(args, lr, c, eps, Path(tmp) / f"run{i}.jsonl")
            minutes = (time.perf_counter() - t) / 60
            losses = [e["train_loss"] for e in epochs]
            diverged = len(epochs) < args.epochs or not all(map(math.isfinite, losses)) or losses[-1] > math.log(10)
            accs = ", ".join(f"{100 * e['test_acc']:.2f}" for e in epochs) or "-"
            loss = " / ".join(f"{v:.4g}" for v in (losses[:1] + losses[-1:])) or "-"
            rows.append((lr, c, eps, accs, loss, "yes" if diverged else "no", f"{minutes:.1f}"))
            print(f"lr {lr} classifier {c} label smoothing {eps}: test accuracy by epoch {accs}", flush=True)
    print(
        format_table(
            ("lr", "classifier", "smoothing", "test acc % by epoch", "train loss first / last", "diverged", "minutes"),
            rows,
            title=f"--preset {args.preset} --arch {args.arch}, {args.epochs} epochs, master alone, {args.backend}",
        )
    )


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"bench_recipe: error: {e}", file=sys.stderr)
        sys.exit(2)

# %% [markdown]
# # Lesson 3 — Training the paper's network, and reading what it wrote
#
# **Time:** about 30 minutes (the full-size run below takes a few minutes on 2 cores; with
# `COURSE_QUICK=1` seconds). **Needs:** one machine.
#
# The paper's network (Marques et al. 2017, after cuda-convnet's CIFAR-10 net):
#
#     conv 5x5 -> ReLU -> LRN -> max pool /2 -> conv 5x5 -> ReLU -> LRN -> max pool /2 -> FC -> softmax
#
# with `C1:C2` kernels in the two convolutions (`50:500` is the paper's smallest). You will train
# it on tinyconv's synthetic CIFAR-shaped data (offline, seeded; a small CNN learns it in a few
# dozen steps), write the metrics file every run can write (`--metrics-out`, `docs/metrics.md`),
# draw its curves with `tinyconv plot`, and in the exercises read the file yourself.
#
# The same run from the shell, on the real CIFAR-10 (downloaded once, 163 MB):
#
#     python examples/cifar10_dist.py --workers 0 --epochs 1 --metrics-out run.jsonl
#     tinyconv plot run.jsonl -o plots/

# %% tags=["setup"]
import json
import statistics
from pathlib import Path

from charts import FIGURES, QUICK, show  # noqa: E402 -- beside the lessons: their size, their charts

import tinyconv as tc
from tinyconv.lab.plot.bars import Bar, Group, stacked_bars  # noqa: E402
from tinyconv.lab.plot.run_charts import plot_runs  # noqa: E402

# %%
from tinyconv.metrics import MetricsWriter  # noqa: E402

# %% [markdown]
# ## 1. The network and the data
#
# `tc.paper_net(arch)` builds it, He-initialised from a seed; `print(net)` lists the layers.
# The quick version uses `8:16` kernels on 16x16 images, the full one the paper's `50:500` on 32x32.

# %%
arch, size, n_train, epochs = ("8:16", 16, 256, 2) if QUICK else ("50:500", 32, 2048, 2)
data = tc.synthetic_dataset(n_train=n_train, n_test=256, seed=0, image_size=size)
net = tc.paper_net(arch, backend="numpy", image_size=size, seed=0)
print(net)
print(f"{data.name}: {len(data.x_train)} training images {data.x_train.shape[1:]}, {data.num_classes} classes")

# %% [markdown]
# ## 2. Training, with a metrics file
#
# `tc.Trainer` is the loop `examples/cifar10_dist.py` runs: shuffle, augment (random crop and
# flip), normalise, forward, loss, backward, SGD with momentum and weight decay, a warm-up then a
# cosine learning rate, an evaluation on the test set after each epoch. Every step and every
# evaluation becomes one JSON line.

# %%
metrics_path = FIGURES / "lesson3_run.jsonl"
FIGURES.mkdir(parents=True, exist_ok=True)
writer = MetricsWriter(metrics_path)
config = tc.TrainConfig(epochs=epochs, batch_size=32, lr=0.02, progress=not QUICK)
summary = tc.Trainer(net, data, config, metrics=writer).fit()
writer.close()
print(
    f"test accuracy {summary['test_acc']:.1%} after {summary['steps']} steps "
    f"(chance is {1 / data.num_classes:.0%}); median step {summary['median_step_s'] * 1e3:.0f} ms"
)

# %% [markdown]
# ## 3. The file, and the charts
#
# One object per line, each with an `event`: `step` (loss, batch accuracy, learning rate, the
# step's time and its comm/conv/comp split), `epoch` (the evaluation), `summary` (last). Readers
# skip events they do not know: the format grows. `tinyconv plot FILE -o DIR` draws
# `curves.svg` (loss and accuracy against the step) from it; `plot_runs` is the same in Python.

# %%
lines = metrics_path.read_text().splitlines()
print(f"{len(lines)} lines; the first step and the last evaluation:")
print(next(line for line in lines if '"step"' in line)[:300])
print([line for line in lines if '"event": "epoch"' in line][-1][:300])
for path in plot_runs([metrics_path], FIGURES / "lesson3_plots"):
    show(path.read_text(), f"lesson3_{path.name}")

# %% [markdown]
# What to read in `curves.svg`: the training loss (per step, noisy: one batch each) should fall
# from about $\ln 10 \approx 2.3$; the test loss (one point per evaluation) should follow it. Test
# loss rising while the training loss falls is over-fitting; both flat near 2.3, a learning rate
# too small (or a bug); a jump to NaN, one too large.
#
# ## Exercises
#
# The metrics file is how you will compare runs for the rest of the course (lessons 5-7 read the
# same fields from distributed runs). Write:
#
# 1. `read_events(path)`: the list of event dicts in the file, in order; blank lines skipped.
# 2. `test_accuracy_curve(events)`: `[(steps, test_acc), ...]`, one per `epoch` event, where
#    `steps` is that event's `steps` field (the global step it was evaluated at).
# 3. `median_split(events, skip=1)`: the median `time_s`, `comm_s`, `conv_s`, `comp_s` over the
#    `step` events after the first `skip` ones (the first steps pay for warming up), as a dict.
# 4. `steps_to_reach(events, accuracy)`: the first evaluation's `steps` whose `test_acc` is at least
#    `accuracy`; `None` if none is.
#
# Grade: `pytest course/ --student-dir YOUR_FOLDER -k lesson3`.


# %% tags=["exercise"]
def read_events(path: str | Path) -> list[dict]:
    """Every event of a metrics file (JSON lines), in order; blank lines skipped."""
    # BEGIN SOLUTION
    # TODO: one json.loads per non-blank line
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    # END SOLUTION


def test_accuracy_curve(events: list[dict]) -> list[tuple[int, float]]:
    """(steps, test_acc) of each epoch event, in file order."""
    # BEGIN SOLUTION
    # TODO: keep the events whose "event" is "epoch"; pair their "steps" and "test_acc"
    return [(e["steps"], e["test_acc"]) for e in events if e.get("event") == "epoch"]
    # END SOLUTION


def median_split(events: list[dict], skip: int = 1) -> dict[str, float]:
    """Median time_s, comm_s, conv_s and comp_s of the step events after the first ``skip``."""
    # BEGIN SOLUTION
    # TODO: the step events, minus the first skip; statistics.median of each field
    steps = [e for e in events if e.get("event") == "step"][skip:]
    return {k: statistics.median(e[k] for e in steps) for k in ("time_s", "comm_s", "conv_s", "comp_s")}
    # END SOLUTION


def steps_to_reach(events: list[dict], accuracy: float) -> int | None:
    """The steps of the first evaluation with test_acc >= accuracy, or None."""
    # BEGIN SOLUTION
    # TODO: walk test_accuracy_curve(events); return the first steps at or above accuracy
    return next((steps for steps, acc in test_accuracy_curve(events) if acc >= accuracy), None)
    # END SOLUTION


# %% [markdown]
# ### Try them on your run
#
# With no workers, `comm_s` and `conv_s` are 0 and `comp_s` is the whole step: the bar is one
# colour. Lesson 5's distributed runs fill in the other two.

# %%
events = read_events(metrics_path)
print("test accuracy by step:", [(s, round(a, 3)) for s, a in test_accuracy_curve(events)])
split = median_split(events)
print("median step split (s):", {k: round(v, 4) for k, v in split.items()})
print("steps to reach 50 %:", steps_to_reach(events, 0.5))
show(
    stacked_bars(
        "Median training step, the master alone",
        "seconds",
        [Group(arch, [Bar("1 node", {k: split[k] for k in ("comm_s", "conv_s", "comp_s")})])],
        [("comm_s", "comm", "#d62728"), ("conv_s", "conv", "#1f77b4"), ("comp_s", "comp", "#2ca02c")],
    ),
    "lesson3_split.svg",
)

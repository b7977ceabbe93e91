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
# it on real CIFAR-10 images — a few hundred, so that it runs in seconds — and check on images it never
# saw that it learnt something, write the metrics file every run can write (`--metrics-out`,
# `docs/metrics.md`), draw its curves with `tinyconv plot`, and in the exercises read the file yourself.
#
# The same run from the shell, on the whole of CIFAR-10 (downloaded once, 163 MB):
#
#     python examples/cifar10_dist.py --workers 0 --epochs 1 --metrics-out run.jsonl
#     tinyconv plot run.jsonl -o plots/

# %% tags=["setup"]
import io
import json
import lzma
import statistics
from pathlib import Path

import numpy as np
from charts import FIGURES, QUICK, show  # noqa: E402 -- beside the lessons: their size, their charts
from tqdm.auto import tqdm  # a bar that Jupyter draws as a widget, a terminal as text

import tinyconv as tc
from tinyconv.cifar10 import LABEL_NAMES, default_data_dir, find_batches_dir, load_batch

# %%
from tinyconv.data import Dataset  # noqa: E402
from tinyconv.lab.plot.bars import Bar, Group, stacked_bars  # noqa: E402
from tinyconv.lab.plot.run_charts import plot_runs  # noqa: E402
from tinyconv.metrics import MetricsWriter  # noqa: E402

# %% [markdown]
# ## 1. The data and the network
#
# Real images: if CIFAR-10 is on this machine (tinyconv's data folder: `$TINYCONV_DATA`, else
# `~/.cache/tinyconv`, where `python examples/cifar10_dist.py` downloads it), a subset of it: the first
# images of each class of its first training batch, and of its test batch for testing. Otherwise the
# images that ship with the course (`data/cifar10_sample.npz.xz` beside the lessons): 20 training and 10
# test images of each class, halved to 16x16 pixels and their colours rounded to 16 levels, so that 300
# fit in 91 KB. The quick version trains on those 200 (or the real set's same 200, halved alike) with
# `8:16` kernels; the full one the paper's `50:500` on 2,000 of the real set at 32x32 (without the real
# set, on the course's 200).
#
# `tc.paper_net(arch)` builds the network, He-initialised from a seed; `print(net)` lists the layers.


# %%
def course_sample() -> dict[str, np.ndarray]:
    """The images that ship with the course, by name (x_train, y_train, ...): data/ beside the lessons."""
    here = Path(globals().get("__file__", "lesson")).resolve().parent  # a notebook has no __file__: its folder
    for path in (here / "data" / "cifar10_sample.npz.xz", Path("course/data/cifar10_sample.npz.xz")):
        if path.is_file():
            with np.load(io.BytesIO(lzma.decompress(path.read_bytes()))) as npz:
                return dict(npz)
    raise FileNotFoundError("data/cifar10_sample.npz.xz is not beside the lessons: copy the course's data/ folder")


def first_of_each_class(labels: np.ndarray, n: int) -> np.ndarray:
    """The indices of the first ``n`` images of each class, in file order."""
    return np.sort(np.concatenate([np.flatnonzero(labels == c)[:n] for c in range(len(LABEL_NAMES))]))


def halved(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 3, 32, 32) -> (N, 3, 16, 16): each pixel the mean of a 2x2 block."""
    return images.reshape(len(images), 3, 16, 2, 16, 2).mean(axis=(3, 5)).round().astype(np.uint8)


arch, per_class, batch = ("8:16", (20, 10), 20) if QUICK else ("50:500", (200, 100), 32)
batches = find_batches_dir(default_data_dir())  # the real CIFAR-10's folder, or None
if batches is not None:
    parts = []
    for name, n in (("data_batch_1", per_class[0]), ("test_batch", per_class[1])):
        images, labels = load_batch(batches / name)  # uint8 (10000, 3072): R, G, B planes of 32x32
        chosen = first_of_each_class(labels, n)
        parts += [images[chosen].reshape(-1, 3, 32, 32), labels[chosen]]
    if QUICK:
        parts[0], parts[2] = halved(parts[0]), halved(parts[2])
    data = Dataset(*parts, "cifar10 (a subset)", list(LABEL_NAMES))
else:
    sample = course_sample()
    train = sample["x_train"], sample["y_train"].astype(np.int64)
    test = sample["x_test"], sample["y_test"].astype(np.int64)
    data = Dataset(*train, *test, "cifar10 (the course's sample)", list(sample["classes"]))
size = data.x_train.shape[-1]
epochs = 30 if len(data.x_train) < 1000 else 4  # a few hundred images take many passes
net = tc.paper_net(arch, backend="numpy", image_size=size, seed=0)
print(net)
print(
    f"{data.name}: {len(data.x_train)} training images {data.x_train.shape[1:]}, {len(data.x_test)} test images, "
    f"{data.num_classes} classes: {', '.join(data.classes)}"
)

# %% [markdown]
# ## 2. Training, with a metrics file
#
# `tc.Trainer` is the loop `examples/cifar10_dist.py` runs: shuffle, augment (random crop and
# flip), normalise, forward, loss, backward, SGD with momentum and weight decay, a warm-up then a
# cosine learning rate, an evaluation on the test set after each epoch. Every step and every
# evaluation becomes one JSON line, written by a `MetricsWriter`. The one below also moves a progress
# bar at every step it writes (`tqdm.auto`: a widget in Jupyter, a line in a terminal, nothing in a log).


# %%
class MetricsWithBar(MetricsWriter):
    """A metrics file that also moves ``bar`` by one at each step it writes."""

    def __init__(self, path: Path, bar: tqdm) -> None:
        super().__init__(path)
        self.bar = bar

    def write(self, event: str, **fields) -> None:
        super().write(event, **fields)
        if event == "step":
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{fields['loss']:.3f}")


metrics_path = FIGURES / "lesson3_run.jsonl"
FIGURES.mkdir(parents=True, exist_ok=True)
config = tc.TrainConfig(epochs=epochs, batch_size=batch, lr=0.02, progress=False)  # the bar below instead
with tqdm(total=epochs * (len(data.x_train) // batch), desc="training", unit="step", disable=None) as bar:
    writer = MetricsWithBar(metrics_path, bar)
    summary = tc.Trainer(net, data, config, metrics=writer).fit()
    writer.close()
chance = 1 / data.num_classes
print(
    f"test accuracy {summary['test_acc']:.1%} on {len(data.x_test)} images it never trained on, after "
    f"{summary['steps']} steps (chance: {chance:.0%}); median step {summary['median_step_s'] * 1e3:.0f} ms"
)
print("it learnt: well above chance" if summary["test_acc"] > 1.5 * chance else "look again: no better than chance")

# %% [markdown]
# A few hundred images are a small part of CIFAR-10's 50,000: the network soon does better on the
# images it trains on (the epoch lines' "train") than on the others, and its test accuracy wanders by
# a few points from one evaluation to the next (of 100 test images, one more right is 1 %). Still, on
# images it never saw it does two to three times better than chance. On the whole set, the paper's
# `50:500` reaches 76.9 % in 10 epochs (`tinyconv train --preset paper`, docs/results.md).

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
print("steps to reach 20 %:", steps_to_reach(events, 0.2))
show(
    stacked_bars(
        "Median training step, the master alone",
        "seconds",
        [Group(arch, [Bar("1 node", {k: split[k] for k in ("comm_s", "conv_s", "comp_s")})])],
        [("comm_s", "comm", "#d62728"), ("conv_s", "conv", "#1f77b4"), ("comp_s", "comp", "#2ca02c")],
    ),
    "lesson3_split.svg",
)

"""The terminal tells the run's story (issue #39): a line as a worker is lost, joins or sits a layer out and as the
rebalancer moves kernels, each epoch's line with its time per step, share communicating and split, progress bars
only on a terminal, and a summary in words."""

from __future__ import annotations

import re
import sys
import time

import pytest

from tinyconv.data import synthetic_dataset
from tinyconv.metrics import MetricsWriter, read_metrics
from tinyconv.model import paper_net
from tinyconv.parallel import forward_backward
from tinyconv.report import duration, summary_table
from tinyconv.story import Story
from tinyconv.trainer import TrainConfig, Trainer

NAMES = ["master", "worker0", "worker1"]


class ScriptedRuntime:
    """A runtime whose steps run on the master and report the split, rebalances and events of a script: step ->
    (participants, shares, rebalanced, events after it). Its comm_s is the step's forward and backward, so the
    epoch's share communicating is a real fraction of the trainer's measured step times."""

    splits, channel_counts = "kernels", {}

    def __init__(self, script: dict[int, tuple]) -> None:
        self.script, self.step, self.last_step, self.events = script, 0, None, []
        self.counts = dict(script[1][1])

    @property
    def participants(self) -> list[str]:
        return self.script[min(self.step + 1, max(self.script))][0]

    def train_batch(self, net, x, y, smoothing=0.0):
        t0 = time.perf_counter()
        loss, logits = forward_backward(net, x, y, smoothing)
        self.step += 1
        names, shares, rebalanced, events = self.script[self.step]
        n = len(names)
        self.last_step = {
            "comm_s": time.perf_counter() - t0, "conv_s": 0.0, "bytes_sent": 10, "bytes_recv": 10, "shares": shares,
            "participants": names, "participant_bytes_sent": [0] + [10 // (n - 1)] * (n - 1),
            "participant_bytes_recv": [0] + [10 // (n - 1)] * (n - 1), "channel_shares": {}, "rebalanced": rebalanced,
        }  # fmt: skip
        self.events += [{"step": self.step, **e} for e in events]
        return loss, logits

    def set_plan(self, layer, counts, channels=None) -> None:
        self.counts[layer] = list(counts)

    def pop_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        pass


# worker1 is too slow for conv2: the rebalancer sits it out, it is lost, worker2 joins; 4 steps make the epoch
SCRIPT = {
    1: (NAMES, {"conv1": [2, 1, 1], "conv2": [4, 2, 2]}, {"conv2": [5, 3, 0]}, []),
    2: (NAMES, {"conv1": [2, 1, 1], "conv2": [5, 3, 0]}, {},
        [{"event": "worker_lost", "worker": "worker1", "reason": "silent for 10 s",
          "shares": {"conv1": [2, 2], "conv2": [5, 3]}}]),
    3: (["master", "worker0"], {"conv1": [2, 2], "conv2": [5, 3]}, {},
        [{"event": "worker_joined", "worker": "worker2", "backend": "opencl", "device": "gfx1030", "host": "b",
          "shares": {"conv1": [2, 1, 1], "conv2": [4, 2, 2]}}]),
    4: (["master", "worker0", "worker2"], {"conv1": [2, 1, 1], "conv2": [4, 2, 2]}, {}, []),
}  # fmt: skip


@pytest.fixture(scope="module")
def data():
    return synthetic_dataset(n_train=128, n_test=32, seed=3)


def _trainer(data, tmp_path, cluster=None, **cfg) -> Trainer:
    config = TrainConfig(**{"epochs": 1, "batch_size": 32, "augment": False, "progress": False, **cfg})
    metrics = MetricsWriter(tmp_path / "m.jsonl")
    return Trainer(paper_net("4:8", "numpy", "batch", seed=1), data, config, metrics, cluster)


def test_the_cluster_story_is_told_as_it_happens_from_what_the_metrics_file_gets(data, tmp_path, capsys):
    trainer = _trainer(data, tmp_path, ScriptedRuntime(SCRIPT))
    trainer.fit()
    trainer.metrics.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[:5] == [
        "step 1: conv2 rebalanced 4/2/2 -> 5/3/0 (master/worker0/worker1)",
        "step 2: worker1 sits out conv2: too slow for one kernel's worth",
        "step 2: worker1 lost: silent for 10 s; shares now conv1 2/2  conv2 5/3 (master/worker0)",
        "step 3: worker2 joined (opencl on gfx1030 at b); shares now conv1 2/1/1  conv2 4/2/2 (master/worker0/worker2)",
        lines[4],
    ]
    # the lost worker's sitting out ends with it, unannounced; the epoch's line comes next, and last
    assert len(lines) == 5 and lines[4].startswith("epoch 1/1  loss ")
    events = read_metrics(tmp_path / "m.jsonl")
    assert [e["event"] for e in events if e["event"] not in ("step", "epoch", "summary")] == [
        "worker_lost", "worker_joined",
    ]  # fmt: skip
    steps = [e for e in events if e["event"] == "step"]
    assert steps[0]["rebalanced"] == {"conv2": [5, 3, 0]}
    # the epoch line's figures are the metrics file's: the mean step time and the share of it communicating
    epoch = next(e for e in events if e["event"] == "epoch")
    step_s = sum(s["time_s"] for s in steps) / 4
    comm = 100 * sum(s["comm_s"] for s in steps) / sum(s["time_s"] for s in steps)
    assert lines[4] == (
        f"epoch 1/1  loss {epoch['train_loss']:.3f}  train {100 * epoch['train_acc']:.1f} %  "
        f"test {100 * epoch['test_acc']:.1f} %  {step_s:.3g} s/step  comm {comm:.0f} %  "
        "conv1 2/1/1  conv2 4/2/2 (master/worker0/worker2)"
    )
    assert 0 < comm <= 100


def test_an_epoch_line_counts_its_own_steps_and_names_a_partial_epoch():
    story = Story()
    rec = {"comm_s": 0.1, "conv_s": 0.2, "shares": {"conv2": [60, 68]}, "participants": ["master", "worker0"]}
    for t in (0.3, 0.5):
        story.step(1, {**rec, "time_s": t})
    record = {"epoch": 3, "complete": True, "train_loss": 0.9123, "train_acc": 0.6821, "test_acc": 0.66}
    assert story.epoch_line(record, 7, 10, 10) == (
        "epoch 3/7  loss 0.912  train 68.2 %  test 66.0 %  0.4 s/step  comm 25 %  conv2 60/68 (master/worker0)"
    )
    story.step(2, {**rec, "time_s": 0.2, "comm_s": 0.02})  # the next epoch's first step, alone
    partial = {**record, "epoch": 4, "complete": False}
    assert story.epoch_line(partial, 7, 10, 1) == (
        "epoch 4/7 (1/10 steps)  loss 0.912  train 68.2 %  test 66.0 %  0.2 s/step  comm 10 %  conv2 60/68 "
        "(master/worker0)"
    )


def test_the_master_alone_has_no_split_to_tell(data, tmp_path, capsys):
    _trainer(data, tmp_path, max_steps=2).fit()
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        r"epoch 1/1 \(2/4 steps\)  loss \d\.\d{3}  train \d+\.\d %  test \d+\.\d %  [\d.e-]+ s/step", line
    )


def test_progress_bars_are_off_when_stderr_is_not_a_terminal(data, tmp_path, capsys, monkeypatch):
    _trainer(data, tmp_path, progress=True, max_steps=1).fit()
    assert capsys.readouterr().err == ""  # captured: not a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    _trainer(data, tmp_path, progress=True, max_steps=1).fit()
    err = capsys.readouterr().err
    assert "epochs:" in err and "epoch 1/1:" in err and "evaluating:" in err
    _trainer(data, tmp_path, progress=False, max_steps=1).fit()  # --no-progress, on a terminal too
    assert capsys.readouterr().err == ""


def test_the_summary_reads_in_words_and_units():
    summary = {
        "epochs": 7, "steps": 5467, "train_loss": 0.61, "test_acc": 0.769, "best_test_acc": 0.7712,
        "time_per_epoch_s": 125.2, "median_step_s": 0.25, "median_comm_s": 0.03, "median_conv_s": 0.2,
        "median_comp_s": 0.02, "bytes_sent": 2_000_000, "participants": NAMES,
        "final_shares": {"conv2": [60, 68, 0]},
    }  # fmt: skip
    table = summary_table(summary)
    shown = ("| epochs  ", "| training loss ", "| test accuracy   ", "| 76.9 %", "| best test accuracy ", "| 77.1 %",
             "| time per epoch   ", "| 2 min 05 s", "| time per step (median) ", "| 0.25 s", "| communication ",
             "| 12 % of the step", "| convolutions ", "| 80 % of the step", "| sent to the workers ", "| 2.0 MB",
             "| final split ", "conv2: master 60, worker0 68, worker1 0")  # fmt: skip
    for row in shown:
        assert row in table, row
    assert not re.search(r"\w_\w", table), "a bare key in the table"


@pytest.mark.parametrize(
    ("seconds", "read"), [(0.3125, "0.312 s"), (45.24, "45.2 s"), (125.2, "2 min 05 s"), (3725, "1 h 02 min")]
)
def test_durations_read_as_a_person_says_them(seconds, read):
    assert duration(seconds) == read


def test_a_participant_given_kernels_again_is_told_so_and_too_few_kernels_is_said_so(capsys):
    story = Story()
    base = {"time_s": 0.1, "comm_s": 0.0, "participants": NAMES, "channel_shares": {}}
    story.step(1, {**base, "shares": {"conv1": [1, 1, 0]}})
    story.step(2, {**base, "shares": {"conv1": [1, 1, 0]}})  # still sitting out: not told again
    story.step(3, {**base, "shares": {"conv1": [2, 1, 1]}})
    # split by input channels: no kernels but channels is work, not sitting out
    story.step(4, {**base, "shares": {"conv1": [2, 2, 0]}, "channel_shares": {"conv1": [1, 1, 1]}})
    assert capsys.readouterr().out.splitlines() == [
        "step 1: worker1 sits out conv1: conv1 has 2 kernels for 3 participants",
        "step 3: worker1 takes part in conv1 again",
    ]


def test_a_log_without_bars_gets_a_progress_line_every_hundred_steps(monkeypatch, capsys):
    from tinyconv import trainer as trainer_module
    from tinyconv.data import synthetic_dataset
    from tinyconv.model import paper_net
    from tinyconv.trainer import TrainConfig, Trainer

    monkeypatch.setattr(trainer_module, "PROGRESS_EVERY", 2)
    data = synthetic_dataset(n_train=64, n_test=16, seed=0)
    net = paper_net((2, 4), "numpy", "lrn", seed=0)
    cfg = TrainConfig(epochs=1, batch_size=8, max_steps=5, progress=True)  # stderr is captured: no terminal
    Trainer(net, data, cfg).fit()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 2", "step 4"]
    assert all("training accuracy" in line and "%" in line for line in lines)
    Trainer(
        paper_net((2, 4), "numpy", "lrn", seed=0),
        data,
        TrainConfig(epochs=1, batch_size=8, max_steps=5, progress=False),
    ).fit()
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]  # --no-progress

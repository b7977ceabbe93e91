"""The network preset, SGD, schedules, checkpoints, metrics and the Trainer."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import sys

import numpy as np
import pytest

from backends import get_backend
from tinyconv.checkpoint import read_checkpoint, save_checkpoint
from tinyconv.data import synthetic_dataset
from tinyconv.memory import step_memory_bytes
from tinyconv.metrics import MetricsWriter, read_metrics
from tinyconv.model import PAPER_ARCHS, paper_net, parse_arch
from tinyconv.optim import SGD
from tinyconv.report import summary_table
from tinyconv.schedule import learning_rate
from tinyconv.stopping import Stopped
from tinyconv.trainer import TrainConfig, Trainer


@pytest.fixture(scope="module")
def numpy_backend():
    return get_backend("numpy")


@pytest.fixture(scope="module")
def tiny_data():
    return synthetic_dataset(n_train=128, n_test=64, seed=3)


# ---- the preset ------------------------------------------------------------------
def test_paper_archs_parse_and_build(numpy_backend):
    assert [parse_arch(a) for a in PAPER_ARCHS] == [(50, 500), (150, 800), (300, 1000), (500, 1500)]
    net = paper_net("50:500", numpy_backend, "lrn")
    shapes = [tuple(np.shape(p)) for _, layer, n in net.named_params() for p in [layer.params[n]]]
    assert shapes[:2] == [(50, 3, 5, 5), (50,)]
    assert shapes[2:4] == [(500, 50, 5, 5), (500,)]
    assert shapes[-2:] == [(10, 500 * 8 * 8), (10,)]


@pytest.mark.parametrize("bad", ["50", "50:", "a:b", "0:10", "50:500:3", ""])
def test_parse_arch_rejects_bad_names(bad):
    with pytest.raises(ValueError, match="C1:C2"):
        parse_arch(bad)


def test_same_seed_same_weights_different_seed_different(numpy_backend):
    a = paper_net("4:6", numpy_backend, "batch", seed=7).state_dict()
    b = paper_net("4:6", numpy_backend, "batch", seed=7).state_dict()
    c = paper_net("4:6", numpy_backend, "batch", seed=8).state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["conv1.w"], c["conv1.w"])
    # He initialisation: std of conv weights is sqrt(2 / fan_in)
    w = paper_net("64:64", numpy_backend, "lrn", seed=0).state_dict()["conv2.w"]
    assert w.std() == pytest.approx(np.sqrt(2 / (64 * 25)), rel=0.05)


def test_state_dict_rejects_other_architecture(numpy_backend):
    state = paper_net("4:6", numpy_backend, "lrn").state_dict()
    with pytest.raises(ValueError, match="another architecture"):
        paper_net("4:8", numpy_backend, "lrn").load_state_dict(state)


# ---- optimiser and schedule ------------------------------------------------------------
def test_sgd_matches_pytorch_semantics(numpy_backend):
    net = paper_net("2:3", numpy_backend, "none", seed=0, image_size=8)
    opt = SGD(net, lr=0.1, momentum=0.9, weight_decay=0.1)
    layer = net.layers[0]
    w0 = layer.params["w"].copy()
    g = np.full_like(w0, 0.5)
    for _, lay, name in net.named_params():
        lay.grads[name] = np.zeros_like(lay.params[name])
    layer.grads["w"] = g
    opt.step()
    v1 = g + 0.1 * w0
    np.testing.assert_allclose(layer.params["w"], w0 - 0.1 * v1, rtol=1e-6)
    w1 = layer.params["w"].copy()
    opt.step()
    v2 = 0.9 * v1 + g + 0.1 * w1
    np.testing.assert_allclose(layer.params["w"], w1 - 0.1 * v2, rtol=1e-6)
    # biases get no weight decay
    assert np.array_equal(layer.params["b"], np.zeros_like(layer.params["b"]))


def steps(opt: SGD, net, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    for _ in range(n):
        net.train_step(rng.standard_normal((4, 3, 8, 8)).astype(np.float32), rng.integers(0, 10, 4))
        opt.step()
    return net.state_dict()


def test_a_layers_rate_factor_scales_its_steps_and_no_other(numpy_backend):
    def net():
        return paper_net("2:3", numpy_backend, "lrn", seed=5, image_size=8)

    start = net().state_dict()
    plain = steps(SGD(a := net(), 0.05, 0.9, 5e-4), a, 3)
    ones = steps(SGD(b := net(), 0.05, 0.9, 5e-4, layer_lr={"fc1": 1.0}), b, 3)
    for key in plain:  # a factor of 1 is SGD, bit for bit
        np.testing.assert_array_equal(ones[key], plain[key], err_msg=key)
    one = steps(SGD(c := net(), 0.05, 0.9, 5e-4), c, 1)
    tenth = steps(SGD(d := net(), 0.05, 0.9, 5e-4, layer_lr={"fc1": 0.1}), d, 1)
    for key in one:  # one step: the convolutions as before, the classifier a tenth as far
        if key.startswith("fc1."):
            assert np.any(one[key] != start[key])
            np.testing.assert_allclose(tenth[key] - start[key], 0.1 * (one[key] - start[key]), rtol=1e-3, atol=1e-7)
        else:
            np.testing.assert_array_equal(tenth[key], one[key], err_msg=key)
    with pytest.raises(ValueError, match="'relu1', which has no parameters; the layers are conv1, conv2, fc1"):
        SGD(net(), 0.05, layer_lr={"relu1": 0.1})
    with pytest.raises(ValueError, match=r"layer_lr\['fc1'\] must be a number >= 0"):
        SGD(net(), 0.05, layer_lr={"fc1": -1})


def test_the_classifier_rate_reaches_the_optimiser(numpy_backend):
    net = paper_net("2:3", numpy_backend, "lrn", seed=5, image_size=8)
    data = synthetic_dataset(n_train=8, n_test=4, image_size=8, seed=0)
    assert Trainer(net, data, TrainConfig(batch_size=4, classifier_lr=0.1, progress=False)).opt.layer_lr == {"fc1": 0.1}
    assert Trainer(net, data, TrainConfig(batch_size=4, progress=False)).opt.layer_lr == {}


def test_label_smoothing_trains_against_the_smoothed_target_and_tests_against_the_label(numpy_backend, tiny_data):
    def first_step(eps: float) -> tuple[float, Trainer]:
        trainer = _trainer(numpy_backend, tiny_data, label_smoothing=eps, augment=False)
        return trainer.train_step(tiny_data.x_train[:32], tiny_data.y_train[:32])[0], trainer

    plain, _ = first_step(0.0)
    smoothed, trainer = first_step(0.2)
    # the same weights and batch: (1 - eps) CE + eps (the mean over the classes of -log p)
    net = paper_net("4:8", numpy_backend, "batch", seed=1)
    logits = net.forward(trainer.normalize(tiny_data.x_train[:32]), training=True).astype(np.float64)
    log_p = logits - logits.max(axis=1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
    assert smoothed == pytest.approx(0.8 * plain + 0.2 * float(np.mean(-log_p.mean(axis=1))), rel=1e-5)
    assert trainer.net.loss_fn.smoothing == 0.0  # evaluation's test loss: the plain cross-entropy


def test_learning_rate_schedules():
    assert learning_rate(0, 100, 0.1, "constant") == 0.1
    assert learning_rate(49, 100, 0.1, "step") == pytest.approx(0.1)
    assert learning_rate(50, 100, 0.1, "step") == pytest.approx(0.01)
    assert learning_rate(75, 100, 0.1, "step") == pytest.approx(0.001)
    assert learning_rate(0, 100, 0.1, "cosine") == pytest.approx(0.1)
    assert learning_rate(50, 100, 0.1, "cosine") == pytest.approx(0.05)
    assert learning_rate(100, 100, 0.1, "cosine") == pytest.approx(0.0)
    assert [learning_rate(s, 100, 0.1, "cosine", warmup_steps=4) for s in range(4)] == pytest.approx(
        [0.025, 0.05, 0.075, 0.1]
    )
    with pytest.raises(ValueError, match="unknown schedule"):
        learning_rate(0, 10, 0.1, "linear")


# ---- the trainer ----------------------------------------------------------------
def _trainer(backend, data, tmp_path=None, **cfg) -> Trainer:
    net = paper_net("4:8", backend, "batch", seed=1)
    config = TrainConfig(batch_size=32, lr=0.02, schedule="constant", progress=False, **cfg)
    return Trainer(net, data, config, MetricsWriter(tmp_path / "m.jsonl" if tmp_path else None))


def test_loss_decreases_on_synthetic_data(numpy_backend):
    data = synthetic_dataset(n_train=512, n_test=128, seed=0)
    net = paper_net("6:12", numpy_backend, "lrn", seed=0)
    trainer = Trainer(net, data, TrainConfig(epochs=3, batch_size=32, lr=0.01, progress=False))
    loss0, acc0 = trainer.evaluate(data.x_test, data.y_test)
    summary = trainer.fit()
    assert summary["steps"] == 3 * (512 // 32)
    assert summary["test_loss"] < 0.5 * loss0
    assert summary["test_acc"] > max(0.6, acc0 + 0.3)


def test_evaluation_shows_a_progress_bar_unless_asked_not_to(numpy_backend, tiny_data, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)  # bars draw only on a terminal
    quiet = _trainer(numpy_backend, tiny_data, eval_batch_size=16)
    expected = quiet.evaluate(tiny_data.x_test, tiny_data.y_test)
    assert capsys.readouterr().err == ""
    loud = _trainer(numpy_backend, tiny_data, eval_batch_size=16)
    loud.cfg.progress = True
    assert loud.evaluate(tiny_data.x_test, tiny_data.y_test) == expected
    batches = -(-len(tiny_data.x_test) // 16)
    assert f"evaluating:   0%|          | 0/{batches}" in capsys.readouterr().err


def test_resume_is_bit_identical(numpy_backend, tiny_data, tmp_path):
    straight = _trainer(numpy_backend, tiny_data, epochs=2)
    straight.fit()
    # stop in the middle of epoch 2 (4 steps per epoch), then resume in a fresh trainer
    first = _trainer(numpy_backend, tiny_data, epochs=2, max_steps=6, checkpoint=str(tmp_path / "c.npz"))
    first.fit()
    resumed = _trainer(numpy_backend, tiny_data, epochs=2)
    resumed.resume(tmp_path / "c.npz")
    assert (resumed.step, resumed.epoch, resumed.batch_in_epoch) == (6, 1, 2)
    resumed.fit()
    a, b = straight.net.state_dict(), resumed.net.state_dict()
    assert a.keys() == b.keys()
    for k in a:  # parameters and batch-norm running statistics
        assert np.array_equal(a[k], b[k]), k
    sa, sb = straight.opt.state_dict(), resumed.opt.state_dict()
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)


def test_a_checkpoint_from_before_the_warmup_fraction_resumes_only_with_its_warmup(numpy_backend, tiny_data, tmp_path):
    path = tmp_path / "c.npz"
    _trainer(numpy_backend, tiny_data, epochs=2, max_steps=3, checkpoint=str(path)).fit()
    ck = read_checkpoint(path)  # as written before --warmup: warmup_epochs (1 by default), no warmup
    old = {k: v for k, v in ck.meta["train_config"].items() if k != "warmup"} | {"warmup_epochs": 1.0}
    save_checkpoint(path, ck.model, ck.optim, {**ck.meta, "train_config": old})
    with pytest.raises(ValueError, match=r"1-epoch warm-up \(4 steps\).*resume it with --warmup-epochs 1"):
        _trainer(numpy_backend, tiny_data, epochs=2).resume(path)  # 5 % of 8 steps: no warm-up
    resumed = _trainer(numpy_backend, tiny_data, epochs=2, warmup_epochs=1.0)
    resumed.resume(path)
    assert (resumed.step, resumed.warmup_steps) == (3, 4)


def test_resume_refuses_another_architecture(numpy_backend, tiny_data, tmp_path):
    t = _trainer(numpy_backend, tiny_data, epochs=1, max_steps=1, checkpoint=str(tmp_path / "c.npz"))
    t.fit()
    other = Trainer(paper_net("4:8", numpy_backend, "lrn"), tiny_data, TrainConfig(batch_size=32, progress=False))
    with pytest.raises(ValueError, match="--norm batch there, lrn here"):
        other.resume(tmp_path / "c.npz")


def test_metrics_file_follows_the_schema(numpy_backend, tiny_data, tmp_path):
    t = _trainer(numpy_backend, tiny_data, tmp_path, epochs=1)
    t.metrics.write("run", seed=0)
    summary = t.fit()
    t.metrics.close()
    events = read_metrics(tmp_path / "m.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds == ["run"] + ["step"] * 4 + ["epoch", "summary"]
    step_keys = {"epoch", "step", "loss", "time_s", "comm_s", "conv_s", "comp_s", "bytes_sent", "bytes_recv", "shares"}
    for e in events[1:5]:
        assert step_keys <= e.keys()
        assert e["comm_s"] == 0 and e["conv_s"] == 0 and e["shares"] == {}  # nothing distributed
    assert [e["step"] for e in events[1:5]] == [1, 2, 3, 4]
    epoch = events[5]
    assert {"epoch", "train_loss", "test_loss", "test_acc", "time_s"} <= epoch.keys()
    assert 0.0 <= epoch["test_acc"] <= 1.0
    assert events[-1]["test_acc"] == summary["test_acc"]
    # every line is plain JSON (no NaN), and the table prints
    for line in (tmp_path / "m.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert re.search(rf"\| test accuracy +\| {100 * summary['test_acc']:.1f} %", summary_table(summary))


def test_batch_larger_than_dataset_is_a_clear_error(numpy_backend, tiny_data):
    net = paper_net("4:8", numpy_backend, "lrn")
    with pytest.raises(ValueError, match="larger than the 128 training images"):
        Trainer(net, tiny_data, TrainConfig(batch_size=1000, progress=False))


# ---- checkpoints while training, and on the way out ---------------------------------------------
def _saves(monkeypatch) -> list[int]:
    """The step of every checkpoint any Trainer writes from now on."""
    steps: list[int] = []
    save = Trainer.save

    def spy(self, path):
        steps.append(self.step)
        return save(self, path)

    monkeypatch.setattr(Trainer, "save", spy)
    return steps


def _same_state(a: Trainer, b: Trainer) -> None:
    sa, sb = a.net.state_dict(), b.net.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:  # parameters and batch-norm running statistics
        assert np.array_equal(sa[k], sb[k]), k
    oa, ob = a.opt.state_dict(), b.opt.state_dict()
    assert all(np.array_equal(oa[k], ob[k]) for k in oa)


def test_checkpoint_every_n_steps_and_at_each_epoch_end(numpy_backend, tiny_data, tmp_path, monkeypatch):
    saves = _saves(monkeypatch)
    _trainer(numpy_backend, tiny_data, epochs=3, checkpoint=str(tmp_path / "c.npz"), checkpoint_every=3).fit()
    # 4 steps per epoch: every 3 steps, and each epoch's end (step 12, the last, only once)
    assert saves == [3, 4, 6, 8, 9, 12]
    assert read_checkpoint(tmp_path / "c.npz").meta["step"] == 12


def test_a_checkpoint_that_cannot_be_written_is_reported_and_tried_again(
    numpy_backend, tiny_data, tmp_path, monkeypatch, capsys
):
    # a full disk at steps 4 and 6: the run goes on, the checkpoint of step 3 stays whole, step 8's is written
    path, savez, held = tmp_path / "c.npz", np.savez, []

    def full_disk(f, **arrays):
        step = json.loads(str(arrays["meta"]))["step"]
        if step in (4, 6):
            held.append(read_checkpoint(path).meta["step"])
            f.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        savez(f, **arrays)

    monkeypatch.setattr(np, "savez", full_disk)
    trainer = _trainer(numpy_backend, tiny_data, tmp_path, epochs=3, checkpoint=str(path), checkpoint_every=3)
    assert trainer.fit()["steps"] == 12
    assert held == [3, 3]  # what the failed writes found there: the last good checkpoint, whole
    failed = [e for e in read_metrics(tmp_path / "m.jsonl") if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [4, 6] and "No space left" in failed[0]["error"]
    assert "the checkpoint of step 4 could not be written" in capsys.readouterr().err
    assert read_checkpoint(path).meta["step"] == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz", "m.jsonl"]  # no half-written file left


def test_checkpoint_every_m_minutes(numpy_backend, tiny_data, tmp_path, monkeypatch):
    saves = _saves(monkeypatch)
    _trainer(numpy_backend, tiny_data, epochs=2, checkpoint=str(tmp_path / "c.npz"), checkpoint_minutes=1e-9).fit()
    assert saves == [1, 2, 3, 4, 5, 6, 7, 8]  # always late: after every step
    saves.clear()
    _trainer(numpy_backend, tiny_data, epochs=2, checkpoint=str(tmp_path / "d.npz"), checkpoint_minutes=60).fit()
    assert saves == [4, 8]  # never late: the epoch ends only


def _fail_in_step(trainer: Trainer, at: int, error: BaseException | None = None, signum: int | None = None) -> None:
    """Make step ``at + 1`` fail (or be signalled) after its forward and backward, before its update."""
    real = trainer._forward_backward

    def forward_backward(xb, yb):
        out = real(xb, yb)  # the augmentation's generator and batch-norm's statistics have moved
        if trainer.step == at:
            if signum is not None:
                os.kill(os.getpid(), signum)
            if error is not None:
                raise error
        return out

    trainer._forward_backward = forward_backward


def test_an_error_checkpoints_the_last_whole_step_and_resumes_bit_identically(numpy_backend, tiny_data, tmp_path):
    straight = _trainer(numpy_backend, tiny_data, epochs=2)
    straight.fit()
    path = tmp_path / "c.npz"
    failing = _trainer(numpy_backend, tiny_data, epochs=2, checkpoint=str(path))
    _fail_in_step(failing, 5, error=TimeoutError("worker 1 silent"))  # in epoch 2, after its first step
    with pytest.raises(TimeoutError, match="worker 1 silent"):
        failing.fit()
    assert failing.saved == (5, str(path))
    resumed = _trainer(numpy_backend, tiny_data, epochs=2)
    resumed.resume(path)
    assert (resumed.step, resumed.epoch, resumed.batch_in_epoch) == (5, 1, 1)
    resumed.fit()
    _same_state(straight, resumed)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_step_checkpoints_the_step_before(numpy_backend, tiny_data, tmp_path, signum):
    straight = _trainer(numpy_backend, tiny_data, epochs=2)
    straight.fit()
    path = tmp_path / "c.npz"
    signalled = _trainer(numpy_backend, tiny_data, epochs=2, checkpoint=str(path))
    _fail_in_step(signalled, 2, signum=signum)
    with pytest.raises(Stopped) as info:
        signalled.fit()
    assert info.value.signum == signum and isinstance(info.value, KeyboardInterrupt)
    assert signalled.saved == (2, str(path))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    resumed = _trainer(numpy_backend, tiny_data, epochs=2)
    resumed.resume(path)
    resumed.fit()
    _same_state(straight, resumed)


def test_a_signal_during_the_update_waits_for_its_end(numpy_backend, tiny_data, tmp_path):
    path = tmp_path / "c.npz"
    t = _trainer(numpy_backend, tiny_data, tmp_path, epochs=2, checkpoint=str(path))
    real = t._update

    def update():
        if t.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        real()

    t._update = update
    with pytest.raises(Stopped):
        t.fit()
    t.metrics.close()
    assert t.saved == (3, str(path))  # the update, its count and its metrics line made it
    assert [e["step"] for e in read_metrics(tmp_path / "m.jsonl") if e["event"] == "step"] == [1, 2, 3]


def test_an_update_cut_short_is_not_checkpointed(numpy_backend, tiny_data, tmp_path):
    path = tmp_path / "c.npz"
    t = _trainer(numpy_backend, tiny_data, epochs=2, checkpoint=str(path))
    real = t.opt.step

    def step():
        if t.step == 5:
            raise MemoryError("half the parameters updated")
        real()

    t.opt.step = step
    with pytest.raises(MemoryError):
        t.fit()
    assert t.saved == (4, str(path))  # the epoch's end; never the half-updated step 6
    assert read_checkpoint(path).meta["step"] == 4


def test_a_nan_loss_is_refused_before_the_update(numpy_backend, tiny_data, tmp_path):
    t = _trainer(numpy_backend, tiny_data, epochs=1, checkpoint=str(tmp_path / "c.npz"))
    t.net.loss_fn = lambda logits, y: (float("nan"), None)
    with pytest.raises(FloatingPointError, match="loss became nan at step 1"):
        t.fit()
    assert all(np.isfinite(v).all() for v in read_checkpoint(tmp_path / "c.npz").model.values())


# ---- the metrics file --------------------------------------------------------------------------------
def test_cluster_events_follow_their_step(numpy_backend, tiny_data, tmp_path):
    import tinyconv as tc

    t = _trainer(numpy_backend, tiny_data, tmp_path, epochs=1, max_steps=2)
    cluster = tc.distribute(t.net, "inproc", 1, calibrate=False, announce=lambda s: None)
    try:
        t.cluster = cluster
        lost = {"event": "worker_lost", "step": 0, "worker": "worker0", "reason": "test", "shares": {"conv1": [4]}}
        cluster.events.append(lost)
        t.fit()
    finally:
        cluster.close()
        t.metrics.close()
    events = read_metrics(tmp_path / "m.jsonl")
    assert [e["event"] for e in events[:3]] == ["step", "worker_lost", "step"]
    assert events[1] == lost


def test_metrics_file_is_untouched_until_the_first_step(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"event": "run"}\n{"event": "step", "step": 1}\n')
    before = path.read_bytes()
    m = MetricsWriter(path)
    m.write("run", seed=0)
    m.write("calibration", shares={})
    m.close()  # the run failed before training: the old file stays
    assert path.read_bytes() == before
    m = MetricsWriter(path)
    m.write("run", seed=1)
    m.write("step", step=1)
    m.close()
    assert [e["event"] for e in read_metrics(path)] == ["run", "step"] and read_metrics(path)[0]["seed"] == 1


class FullDisk:
    """A raw file that takes nothing while ``full``, then a few bytes a write (a disk freeing up slowly)."""

    def __init__(self, f) -> None:
        self.f, self.full = f, True

    def write(self, data) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(bytes(data[:7]))

    def close(self) -> None:
        self.f.close()


def test_metrics_lines_wait_out_a_full_disk_and_come_in_order(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    m = MetricsWriter(path)
    m.write("step", step=1)
    disk = m._f = FullDisk(m._f)
    m.write("step", step=2)
    m.write("step", step=3)  # the run goes on: nothing raised
    assert m.write_error is not None and capsys.readouterr().err.count("takes no more lines") == 1
    disk.full = False
    m.write("step", step=4)
    assert m.write_error is None
    m.close()
    assert [e["step"] for e in read_metrics(path)] == [1, 2, 3, 4]


def test_a_resume_drops_the_steps_after_its_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [{"event": "run"}, *({"event": "step", "step": s} for s in (1, 2, 3)), {"event": "epoch", "steps": 3}]
    lines += [{"event": "step", "step": 4}, {"event": "worker_lost", "step": 4}, {"event": "step", "step": 5}]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines) + '{"event": "step", "st')  # a crash mid-line
    before = path.read_bytes()
    m = MetricsWriter(path, append=True, resume_step=3)
    m.write("run", resumed=True)
    assert path.read_bytes() == before  # not touched before the first step
    m.write("step", step=4)
    m.close()
    assert m.dropped == 4
    events = read_metrics(path)
    assert [e["event"] for e in events] == ["run", "step", "step", "step", "epoch", "run", "step"]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4]


def test_step_memory_estimate():
    mib = step_memory_bytes(50, 500, 64) / 2**20
    assert 300 < mib < 700  # measured: 559 MiB of peak RSS for a numpy step
    assert step_memory_bytes(50, 500, 128) > 1.9 * step_memory_bytes(50, 500, 64) * 0.99
    assert step_memory_bytes(50, 500, 64, columns=False) < step_memory_bytes(50, 500, 64)


def test_a_failed_checkpoint_on_the_way_out_keeps_the_error_that_ended_training(numpy_backend, tiny_data, tmp_path):
    t = _trainer(numpy_backend, tiny_data, epochs=1, checkpoint=str(tmp_path / "c.npz"))
    _fail_in_step(t, 1, error=TimeoutError("worker 0 silent"))
    t.save = lambda path: (_ for _ in ()).throw(OSError("No space left on device"))
    with pytest.raises(TimeoutError, match="worker 0 silent"):
        t.fit()
    assert t.save_error == "OSError: No space left on device" and t.saved is None


def test_the_summary_table_reads_in_percent_seconds_and_megabytes():
    summary = {
        "steps": 20, "train_loss": 3.0317, "test_acc": 0.8966, "time_per_epoch_s": None, "median_step_s": 0.7119,
        "bytes_sent": 1_606_165_120, "participant_bytes_sent": {"master": 0, "worker0": 807_179_360},
        "final_shares": {"conv1": [17, 16, 17], "conv2": [168, 166, 166]},
    }  # fmt: skip
    table = summary_table(summary)
    for shown in ("| 20 ", "3.032", "89.7 %", "0.712 s", "1.6 GB", "| worker0: 807.2 MB ",
                  "conv1: [17, 16, 17]; conv2: [168, 166, 166]"):  # fmt: skip
        assert shown in table, shown
    assert "time_per_epoch_s" not in table  # None: not measured, not shown


# ---- the prefetch thread and evaluation (issue #17) -----------------------------------------
def _prefetch_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "tinyconv-prefetch"]


def _seen_batches(trainer: Trainer) -> list[np.ndarray]:
    seen = []
    real = trainer._forward_backward

    def forward_backward(x, y):
        seen.append(x.copy())
        return real(x, y)

    trainer._forward_backward = forward_backward
    return seen


def test_prefetched_batches_are_todays_bit_for_bit_and_the_wait_is_recorded(numpy_backend, tiny_data, tmp_path):
    """With the thread (prefetch=2) and without (0), every step sees the batch the plain recipe makes --
    the epoch's shuffle from seed [s, 1], crop and flip from seed [s, 2] in step order, normalised --
    and the runs end bit-identical; each step records data_wait_s within its time_s."""
    from tinyconv.data import Normalizer, augment, channel_stats

    runs = {}
    for depth in (2, 0):
        trainer = _trainer(numpy_backend, tiny_data, tmp_path / str(depth), epochs=2, prefetch=depth)
        seen = _seen_batches(trainer)
        trainer.fit()
        trainer.metrics.close()
        runs[depth] = (trainer, seen)
    shuffle, aug = np.random.default_rng([0, 1]), np.random.default_rng([0, 2])
    normalize = Normalizer(*channel_stats(tiny_data.x_train))
    expected = []
    for _ in range(2):
        order = shuffle.permutation(len(tiny_data.x_train))
        for b in range(len(order) // 32):
            expected.append(normalize(augment(tiny_data.x_train[order[b * 32 : (b + 1) * 32]], aug)))
    for depth, (trainer, seen) in runs.items():
        assert len(seen) == len(expected) == 8
        assert all(np.array_equal(s, e) for s, e in zip(seen, expected, strict=True)), depth
        assert trainer.augment_rng.bit_generator.state == aug.bit_generator.state
    a, b = (runs[d][0].net.state_dict() for d in (2, 0))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    steps = [e for e in read_metrics(tmp_path / "2" / "m.jsonl") if e["event"] == "step"]
    assert len(steps) == 8 and all(0 <= e["data_wait_s"] <= e["time_s"] for e in steps)
    assert not _prefetch_threads()


def test_an_error_or_ctrl_c_mid_epoch_leaves_no_prefetch_thread(numpy_backend, tiny_data):
    for error in (RuntimeError("worker lost"), KeyboardInterrupt()):
        trainer = _trainer(numpy_backend, tiny_data, epochs=2)
        _fail_in_step(trainer, 2, error=error)
        with pytest.raises(type(error)):
            trainer.fit()
        assert trainer.step == 2
        assert not _prefetch_threads()


def test_evaluation_gives_todays_loss_and_accuracy(numpy_backend):
    """Evaluate (batches of the training's size, Network.predict, the backend's optimised batch norm) against
    the way it was computed before: one forward in eval mode through batch norm written out
    (batchnorm_forward_plain), in batches of 500, from the same trained weights."""
    from backends.numpy_backend import NumpyBackend, batchnorm_backward_plain, batchnorm_forward_plain

    class Plain(NumpyBackend):
        def batchnorm_forward(self, *args, **kw):
            return batchnorm_forward_plain(*args, **kw)

        def batchnorm_backward(self, dy, cache):
            return batchnorm_backward_plain(dy, cache)

    data = synthetic_dataset(n_train=256, n_test=600, seed=5)
    trainer = _trainer(numpy_backend, data, epochs=1)  # batch 32: running statistics far from (0, 1)
    trainer.fit()
    loss, acc = trainer.evaluate(data.x_test, data.y_test)
    reference = paper_net("4:8", Plain(), "batch", seed=1)
    reference.load_state_dict(trainer.net.state_dict())
    total, correct = 0.0, 0
    for i in range(0, 600, 500):
        x, y = data.x_test[i : i + 500], data.y_test[i : i + 500]
        logits = reference.forward(trainer.normalize(x), training=False)
        total += reference.loss_fn(logits, y)[0] * len(x)
        correct += int(np.sum(logits.argmax(axis=1) == y))
    assert acc == correct / 600 and 0.2 < acc < 1.0  # learnt something, not everything: argmaxes matter
    assert loss == pytest.approx(total / 600, rel=1e-5)
    assert all(layer.cache is None for layer in trainer.net.layers)  # predict kept nothing for a backward

"""The network preset, SGD, schedules, checkpoints, metrics and the Trainer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tinyconv.checkpoint import load_checkpoint, save_checkpoint
from tinyconv.data import synthetic_dataset
from tinyconv.metrics import MetricsWriter, read_metrics
from tinyconv.model import PAPER_ARCHS, paper_net, parse_arch
from tinyconv.optim import SGD
from tinyconv.plugins import get_backend
from tinyconv.schedule import learning_rate
from tinyconv.trainer import TrainConfig, Trainer, summary_table


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


# ---- checkpoints ----------------------------------------------------------------
def test_checkpoint_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "c.npz"
    save_checkpoint(path, {"0.w": np.ones((2, 2), np.float32)}, {"0.w": np.zeros(3, np.float32)}, {"step": 5})
    model, optim, meta = load_checkpoint(path)
    assert np.array_equal(model["0.w"], np.ones((2, 2))) and optim["0.w"].shape == (3,) and meta["step"] == 5
    assert not (tmp_path / "c.npz.tmp").exists()
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable tinyconv checkpoint"):
        load_checkpoint(garbage)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.npz")


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


def test_resume_refuses_another_architecture(numpy_backend, tiny_data, tmp_path):
    t = _trainer(numpy_backend, tiny_data, epochs=1, max_steps=1, checkpoint=str(tmp_path / "c.npz"))
    t.fit()
    other = Trainer(paper_net("4:8", numpy_backend, "lrn"), tiny_data, TrainConfig(batch_size=32, progress=False))
    with pytest.raises(ValueError, match="same --arch/--norm"):
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
    assert "test_acc" in summary_table(summary)


def test_batch_larger_than_dataset_is_a_clear_error(numpy_backend, tiny_data):
    net = paper_net("4:8", numpy_backend, "lrn")
    with pytest.raises(ValueError, match="larger than the 128 training images"):
        Trainer(net, tiny_data, TrainConfig(batch_size=1000, progress=False))

"""The public API, as a lecturer types it in a shell: every name ``import tinyconv as tc`` exports."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from echo_worker import TIMEOUT, reap, spawn
from float32_expected import Expected, assert_close

import tinyconv as tc
from backends.base import Backend
from backends.conformance.runner import FN
from tinyconv.distributed.protocol import VERSION
from tinyconv.metrics import MetricsWriter, read_metrics
from tinyconv.parallel import forward_backward

RNG = np.random.default_rng(5)
X = RNG.standard_normal((4, 3, 16, 16)).astype(np.float32)
Y = RNG.integers(0, 10, 4)


def small_net(norm: str = "lrn") -> tc.Network:
    return tc.paper_net("4:6", backend="numpy", norm=norm, image_size=16)


# float32_tolerance's scale form for small_net on X (see backends.conformance.runner): the loss's path, conv1,
# LRN, conv2, LRN, fc, softmax; the gradients' adds the way back to conv1's dw (4*16*16 sums)
LOSS_K = (3 * 25 + 1) + (5 + 3 + FN) + (4 * 25 + 1) + (5 + 3 + FN) + (6 * 4 * 4 + 1) + (10 + 4 + 3 + 2 * FN)
GRAD_K = LOSS_K + 10 + 4 + (2 * 5 + 7 + 2 * FN) + 6 * 25 + 4 + (2 * 5 + 7 + 2 * FN) + 4 * 16 * 16


def test_the_lecturers_session_trains():
    net = tc.paper_net("50:500", backend="numpy")
    opt = tc.SGD(net, lr=0.01, momentum=0.9)
    x = RNG.standard_normal((2, 3, 32, 32)).astype(np.float32)
    losses = []
    for _ in range(4):
        losses.append(net.train_step(x, Y[:2]))
        opt.step()
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]  # it learns this batch


def test_distribute_shards_the_network_and_close_puts_it_back():
    net, ref = small_net(), small_net()
    layers = list(net.layers)
    loss_ref = ref.train_step(X, Y)
    with tc.distribute(net, transport="inproc", workers=2, batch_size=4, image_size=16) as cluster:
        assert isinstance(cluster, tc.Cluster) and cluster.participants == ["master", "worker0", "worker1"]
        assert [type(layer).__name__ for layer in net.layers] == ["ShardedBlock", "ShardedBlock", "Linear"]
        assert_close(net.train_step(X, Y), Expected(np.asarray(loss_ref), LOSS_K), "loss")
        assert cluster.calibration["shares"].keys() == {"conv1", "conv2"}
        assert sum(cluster.last_step["shares"]["conv2"]) == 6
        for key, layer, name in ref.named_params():
            got = dict((k, (lay, n)) for k, lay, n in net.named_params())[key]
            assert_close(got[0].grads[got[1]], Expected(layer.grads[name], GRAD_K), key)
    assert net.layers == layers


def test_distribute_over_zmq_starts_and_stops_worker_processes():
    net, ref = small_net(), small_net()
    with tc.distribute(net, transport="zmq", workers=2, batch_size=4, image_size=16, calibrate=False) as cluster:
        assert all(w.pid != os.getpid() for w in cluster.workers)  # two other processes said hello
        assert_close(net.train_step(X, Y), Expected(np.asarray(ref.train_step(X, Y)), LOSS_K), "loss")
    assert cluster.on_close is None  # stopped, once


def test_another_process_cannot_take_a_local_workers_place():
    # on loopback without keys, the master admits only the workers it started: they carry the run's secret
    net = small_net()
    with tc.distribute(net, transport="zmq", workers=1, batch_size=4, image_size=16, calibrate=False) as cluster:
        stranger = spawn(cluster.transport.bound_address, "--protocol", str(VERSION))  # no secret: another user
        try:
            _, err = stranger.communicate(timeout=TIMEOUT)
        finally:
            reap([stranger])
        assert stranger.returncode != 0 and "admits only the workers it started" in err, err
        assert [w.index for w in cluster.workers] == [0] and cluster.transport.joined() == []


def test_layers_built_by_hand_start_he_initialised():
    be = tc.get_backend("numpy")
    conv = tc.Conv2D(be, 8, 64, 5, rng=np.random.default_rng(0))
    fc = tc.Linear(be, 4000, 10, rng=np.random.default_rng(0))
    assert conv.params["w"].std() == pytest.approx(np.sqrt(2 / (8 * 25)), rel=0.05)
    assert fc.params["w"].std() == pytest.approx(np.sqrt(2 / 4000), rel=0.05)
    assert not conv.params["b"].any() and not fc.params["b"].any()
    other = tc.Conv2D(be, 8, 64, 5)  # without a generator: fresh weights, not zeros, not the same
    assert other.params["w"].std() > 0 and not np.array_equal(other.params["w"], conv.params["w"])


def test_inference_does_not_update_batch_norm_statistics_unless_asked():
    net = small_net("batch")
    bn = next(layer for layer in net.layers if isinstance(layer, tc.BatchNorm2D))
    before = bn.buffers["running_mean"].copy()
    net.forward(X)
    assert np.array_equal(bn.buffers["running_mean"], before)
    net.forward(X, training=True)
    assert not np.array_equal(bn.buffers["running_mean"], before)


def test_lrn_follows_torch_and_says_where_the_preset_differs():
    be = tc.get_backend("numpy")
    lrn = tc.LocalResponseNorm(be)
    assert (lrn.size, lrn.alpha, lrn.beta, lrn.k) == (5, 1e-4, 0.75, 1.0)  # torch's, with size 5
    preset = next(layer for layer in small_net().layers if isinstance(layer, tc.LocalResponseNorm))
    assert preset.k == 2.0


def test_importing_tinyconv_loads_no_numpy():
    code = "import sys, tinyconv; print('numpy' in sys.modules, tinyconv.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", tc.__version__]


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'ShardedConv'"):
        tc.ShardedConv  # noqa: B018


def _trainer() -> None:
    data = tc.synthetic_dataset(n_train=8, n_test=4, image_size=16, seed=0)
    config = tc.TrainConfig(epochs=1, batch_size=4, augment=False, eval_batch_size=4, progress=False)
    summary = tc.Trainer(small_net(), data, config).fit()
    assert summary["steps"] == 2 and 0 <= summary["test_acc"] <= 1


def _check_layer() -> None:
    errors = tc.check_layer(tc.ReLU(tc.get_backend("numpy")), RNG.standard_normal((2, 3, 4, 4)) + 0.1)
    assert errors["x"] < 1e-7


def _check_network() -> None:
    net = tc.paper_net("2:3", "numpy", image_size=8)
    errors = tc.check_network(net, RNG.standard_normal((2, 3, 8, 8)), np.array([1, 2]))
    assert set(errors) == {"conv1.w", "conv1.b", "conv2.w", "conv2.b", "fc1.w", "fc1.b"}
    assert max(errors.values()) < 1e-6


def _load_dataset() -> None:
    data = tc.load_dataset("synthetic", seed=0, progress=False)
    assert data.x_train.shape[1:] == (3, 32, 32) and data.x_train.dtype == np.uint8


def _network() -> None:
    be = tc.get_backend("numpy")
    net = tc.Network(be, [tc.Conv2D(be, 3, 4, 3, padding=1), tc.ReLU(be), tc.Linear(be, 4 * 5 * 5, 2)])
    assert [layer.name for layer in net.layers] == ["conv1", "relu1", "fc1"]
    assert net.forward(RNG.standard_normal((2, 3, 5, 5)).astype(np.float32)).shape == (2, 2)


def _distribute() -> None:
    net = small_net()
    cluster = tc.distribute(net, workers=1, calibrate=False)  # inproc by default: a thread
    try:
        net.train_step(X, Y)
        assert cluster.last_step["participants"] == ["master", "worker0"]
    finally:
        cluster.close()


def _layer(make, shape, out) -> None:
    be = tc.get_backend("numpy")
    layer = make(be)
    y = layer.forward(RNG.standard_normal(shape).astype(np.float32))
    assert y.shape == out == layer.output_shape(shape)
    assert layer.backward(np.ones_like(y)).shape == shape


# one check per exported name: a new export without a check here fails test_every_export_is_checked
CHECKS = {
    "__version__": lambda: tc.__version__.count(".") == 2,
    "paper_net": lambda: [layer.name for layer in small_net().layers][::4] == ["conv1", "conv2", "fc1"],
    "parse_arch": lambda: tc.parse_arch("150:800") == (150, 800),
    "PAPER_ARCHS": lambda: tc.PAPER_ARCHS == ("50:500", "150:800", "300:1000", "500:1500"),
    "Network": _network,
    "Conv2D": lambda: _layer(lambda be: tc.Conv2D(be, 3, 4, 3, padding=1), (2, 3, 5, 5), (2, 4, 5, 5)),
    "ReLU": lambda: _layer(tc.ReLU, (2, 3, 5, 5), (2, 3, 5, 5)),
    "LocalResponseNorm": lambda: _layer(tc.LocalResponseNorm, (2, 7, 3, 3), (2, 7, 3, 3)),
    "BatchNorm2D": lambda: _layer(lambda be: tc.BatchNorm2D(be, 3), (2, 3, 5, 5), (2, 3, 5, 5)),
    "MaxPool2D": lambda: _layer(tc.MaxPool2D, (2, 3, 6, 6), (2, 3, 3, 3)),
    "Linear": lambda: _layer(lambda be: tc.Linear(be, 12, 5), (2, 3, 2, 2), (2, 5)),
    "SoftmaxCrossEntropy": lambda: (
        tc.SoftmaxCrossEntropy(tc.get_backend("numpy"))(np.zeros((2, 10), np.float32), np.array([0, 1]))[0]
        == pytest.approx(np.log(10))
    ),
    "SGD": lambda: tc.SGD(small_net(), lr=0.1).lr == 0.1,
    "Trainer": _trainer,
    "TrainConfig": lambda: tc.TrainConfig().batch_size == 64,
    "load_dataset": _load_dataset,
    "synthetic_dataset": lambda: len(tc.synthetic_dataset(n_train=8, n_test=4, image_size=8).y_test) == 4,
    "check_layer": _check_layer,
    "check_network": _check_network,
    "get_backend": lambda: isinstance(tc.get_backend("numpy"), Backend),
    "available_backends": lambda: {"numpy", "opencl"} <= set(tc.available_backends()),
    "get_transport": lambda: tc.get_transport("inproc", handler_factory=lambda i: None, protocol=1).name == "inproc",
    "available_transports": lambda: {"inproc", "zmq"} <= set(tc.available_transports()),
    "distribute": _distribute,
    "Cluster": lambda: tc.Cluster.__name__ == "Cluster",
}


def test_every_export_is_checked():
    assert set(CHECKS) == set(tc.__all__)
    assert set(dir(tc)) >= set(tc.__all__)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_export(name):
    assert CHECKS[name]() is not False


# ---- one door for every parallelism ----------------------------------------------------------------------
class _Recorder:
    """A runtime as the trainer sees it (tinyconv.parallel.Parallel): the master's step, counted."""

    splits = "images"
    counts: dict = {}
    channel_counts: dict = {}
    participants = ["master"]

    def __init__(self) -> None:
        self.step, self.last_step, self.batches, self.events = 0, None, [], [{"event": "worker_joined", "step": 0}]

    def train_batch(self, net, x, y, smoothing=0.0):
        self.batches.append(len(x))
        self.step += 1
        self.last_step = {"comm_s": 0.5, "conv_s": 0.0, "bytes_sent": 7, "bytes_recv": 9, "shares": {"batch": [4]}}
        self.last_step |= {"participants": ["master"], "participant_bytes_sent": [7], "participant_bytes_recv": [9]}
        return forward_backward(net, x, y, smoothing)

    def set_plan(self, layer, counts, channels=None) -> None:
        raise AssertionError("not called: nothing to restore")

    def pop_events(self) -> list:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        pass


def test_the_trainer_hands_every_step_to_the_runtime_whatever_it_splits(tmp_path):
    data = tc.synthetic_dataset(n_train=8, n_test=4, image_size=16, seed=0)
    config = tc.TrainConfig(epochs=1, batch_size=4, augment=False, eval_batch_size=4, progress=False)
    runtime = _Recorder()
    metrics = MetricsWriter(tmp_path / "run.jsonl")
    tc.Trainer(small_net(), data, config, metrics, runtime).fit()
    metrics.close()
    assert runtime.batches == [4, 4]
    records = read_metrics(tmp_path / "run.jsonl")
    steps = [r for r in records if r["event"] == "step"]
    assert [(r["bytes_sent"], r["comm_s"], r["shares"]) for r in steps] == [(7, 0.5, {"batch": [4]})] * 2
    assert [r["event"] for r in records].count("worker_joined") == 1


def test_the_framework_never_imports_the_runtime_the_lab_or_a_transport():
    import ast
    from pathlib import Path

    framework = Path(tc.__file__).parent
    for path in sorted(framework.glob("*.py")):
        if path.name == "cli.py":  # the command line dispatches to every part (tinyconv worker, experiment, ...)
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [n for n in names if n.startswith(("tinyconv.distributed", "tinyconv.lab", "transports"))]
            assert not bad, f"{path.name} imports {bad}"


def test_distribute_takes_the_model_splits_options_for_the_model_split_alone():
    with pytest.raises(ValueError, match="split: for parallel='model' only, not 'data'"):
        tc.distribute(small_net(), "inproc", 1, parallel="data", split="kernels")
    with pytest.raises(ValueError, match="parallel must be one of model, data, hybrid"):
        tc.distribute(small_net(), "inproc", 1, parallel="pipeline")

"""The worker answers each task of the protocol exactly like a direct backend call, follows its
table of stages, refuses anything else with a reply that says why; its command line behaves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from float32_expected import Expected, assert_close, conv2d_expected

from backends.conformance.runner import FN
from backends.numpy_backend import NumpyBackend
from tinyconv.distributed.protocol import TASKS, VERSION, TaskError
from tinyconv.distributed.replica import probe
from tinyconv.distributed.shard.block import block_forward, halo_span, tail_backward
from tinyconv.distributed.worker.handler import Worker
from tinyconv.distributed.worker.main import THREAD_ENV_VARS, main
from tinyconv.distributed.worker.state import STAGES
from transports.base import Handler, Message
from transports.session.worker import call_handler
from transports.wire import check_message

RNG = np.random.default_rng(7)
X = RNG.standard_normal((2, 3, 8, 8), dtype=np.float32)
W = RNG.standard_normal((5, 3, 3, 3), dtype=np.float32)
B = RNG.standard_normal((5,), dtype=np.float32)
DY = np.ones((2, 5, 8, 8), np.float32)


def task(kind: str, arrays: dict | None = None, task=1, step=0, layer=0, **header) -> Message:
    """A task of ``kind`` with the layer fields and ``header``; the conv's fields default to forward()'s layer."""
    if kind in ("block_forward", "partial_forward"):
        header = {"stride": 1, "padding": 1, "tail": []} | header
    if kind == "block_forward":
        header = {"own": [0, 5]} | header
    if kind == "partial_forward":
        header = {"halo": [0, 5], "own": [0, 5], "give": [0, 5]} | header
    if kind in ("block_backward", "partial_backward"):
        header = {"need_dx": True} | header
    return Message(kind, {"task": task, "step": step, "layer": layer, **header}, arrays or {})


def forward(x=X, w=W, b=B, **kw) -> Message:
    return task("block_forward", {"x": x, "w": w, "b": b}, **kw)


def partial(x=X, w=W, **kw) -> Message:
    return task("partial_forward", {"x": x, "w": w}, **kw)


def tail(b=B, others=None, **kw) -> Message:
    return task("tail_forward", {"b": b} | ({"sum": others} if others is not None else {}), **kw)


def km(a: np.ndarray) -> np.ndarray:
    """(N, F, H, W) -> (F, N, H, W): kernel-major, as the channel split's conv outputs travel."""
    return np.ascontiguousarray(a.transpose(1, 0, 2, 3))


def error_text(reply: Message) -> str:
    assert reply.kind == "error", reply
    check_message(reply)
    return reply.header["message"]


def close(got: np.ndarray, ref: Expected) -> None:
    """Equal to float32 round-off: the same sums, in another order (backends.conformance.runner's float32_tolerance)."""
    assert_close(got, ref)


def reference(dy: np.ndarray) -> tuple[Expected, ...]:
    """The reference (y, dx, dw, db) of forward()'s layer from the numpy backend, for gradient dy,
    with their rigorous bounds."""
    return conv2d_expected(X, W, B, 1, 1, dy)


def ok(worker: Worker, msg: Message) -> dict[str, np.ndarray]:
    """The arrays of a result; the task and the reply both follow the wire's rules."""
    check_message(msg)
    r = worker.handle(msg)
    check_message(r)
    assert r.kind == "result", r.header
    assert r.header["task"] == msg.header["task"] and r.header["compute_s"] >= 0
    return r.arrays


def test_hello_describes_the_worker():
    worker = Worker(NumpyBackend(), slowdown=2.0)
    assert isinstance(worker, Handler)
    h = worker.hello()
    assert h["protocol"] == VERSION and h["backend"] == "numpy" and h["pid"] == os.getpid()
    assert h["device"]["kind"] == "cpu" and h["device"]["slowdown"] == 2.0 and h["hostname"]
    check_message(Message("hello", h))


def test_the_stage_table_covers_every_task_of_a_layer():
    standalone = {"calibrate", "replica_calibrate", "replica_step", "hybrid_calibrate"}  # each brings all it needs
    assert set(STAGES) | standalone == set(TASKS) and not set(STAGES) & standalone
    # a layer's step starts with a forward and ends with a backward, by kernels or by channels (or the hybrid's
    # whole conv part)
    assert [k for k, (needs, _) in STAGES.items() if needs is None] == ["block_forward", "partial_forward",
                                                                         "hybrid_forward"]  # fmt: skip
    assert [k for k, (_, leaves) in STAGES.items() if leaves is None] == ["block_backward", "partial_backward",
                                                                           "hybrid_backward"]  # fmt: skip


def test_block_forward_and_backward_equal_the_backend():
    dy = RNG.standard_normal((2, 5, 8, 8), dtype=np.float32)
    y_ref, dx_ref, dw_ref, db_ref = reference(dy)
    worker = Worker(NumpyBackend())
    np.testing.assert_array_equal(ok(worker, forward(task=11, step=3, layer=2))["y"], y_ref.value)
    grads = ok(worker, task("block_backward", {"dy": dy}, task=12, step=3, layer=2))
    assert set(grads) == {"dx", "dw", "db"}
    np.testing.assert_array_equal(grads["dx"], dx_ref.value)
    np.testing.assert_array_equal(grads["dw"], dw_ref.value)
    np.testing.assert_array_equal(grads["db"], db_ref.value)
    assert worker.state.open == {}  # one backward per forward: nothing kept after it


def test_a_tail_with_batch_norm_takes_its_arrays_and_gives_its_statistics_and_gradients():
    # training: gamma and beta in; y, the batch's mean and unbiased variance of the computed kernels out; backward
    # dgamma and dbeta of the owned ones. Evaluation: the running statistics in, nothing more out
    worker, bn = Worker(NumpyBackend()), {"op": "bn", "eps": 1e-5, "training": True}
    gamma, beta = RNG.standard_normal((2, 5), dtype=np.float32)
    got = ok(
        worker, task("block_forward", {"x": X, "w": W, "b": B, "gamma": gamma, "beta": beta}, tail=[bn], own=[1, 4])
    )
    conv = NumpyBackend().conv2d_forward(X, W, B, 1, 1)[0]
    mean, var = conv.mean(axis=(0, 2, 3)), conv.var(axis=(0, 2, 3), ddof=1)
    close(got["mean"], Expected(mean, 2 * 8 * 8 + 30))
    close(got["var"], Expected(var, 4 * 2 * 8 * 8 + 30))
    xhat = (conv - mean[None, :, None, None]) / np.sqrt(conv.var(axis=(0, 2, 3)) + 1e-5)[None, :, None, None]
    close(got["y"], Expected((gamma[None, :, None, None] * xhat + beta[None, :, None, None])[:, 1:4], 4 * 2 * 8 * 8))
    grads = ok(worker, task("block_backward", {"dy": DY}))
    assert grads["dgamma"].shape == grads["dbeta"].shape == (3,)
    close(grads["dbeta"], Expected(DY.sum(axis=(0, 2, 3))[1:4], 2 * 8 * 8))

    running = {"running_mean": mean, "running_var": var}
    evaluated = ok(worker, task("block_forward", {"x": X, "w": W, "b": B, "gamma": gamma, "beta": beta} | running,
                                tail=[bn | {"training": False}]))  # fmt: skip
    assert set(evaluated) == {"y"}
    for arrays, tail, complaint in [
        ({"gamma": gamma}, [bn], r"needs exactly \['beta', 'gamma'\] arrays \(5,\)"),
        (
            {"gamma": gamma, "beta": beta},
            [bn | {"training": False}],
            r"\['beta', 'gamma', 'running_mean', 'running_var'\]",
        ),
        ({"gamma": gamma[:4], "beta": beta}, [bn], r"got \{'gamma': \(4,\), 'beta': \(5,\)\}"),
        ({"gamma": gamma, "beta": beta}, [], r"needs exactly no arrays"),
    ]:
        reply = worker.handle(task("block_forward", {"x": X, "w": W, "b": B} | arrays, tail=tail))
        assert re.search(complaint, error_text(reply)), error_text(reply)


def test_need_dx_false_returns_no_dx_and_layers_keep_separate_state():
    worker = Worker(NumpyBackend())
    y0 = ok(worker, forward(layer=0))["y"]
    x1 = RNG.standard_normal((2, 5, 8, 8), dtype=np.float32)
    w1 = RNG.standard_normal((4, 5, 5, 5), dtype=np.float32)
    y1 = ok(worker, forward(layer=1, x=x1, w=w1, b=np.zeros(4, np.float32), padding=2, own=[0, 4]))["y"]
    r1 = ok(worker, task("block_backward", {"dy": np.ones_like(y1)}, layer=1))
    r0 = ok(worker, task("block_backward", {"dy": np.ones_like(y0)}, layer=0, need_dx=False))
    assert set(r1) == {"dx", "dw", "db"} and r1["dx"].shape == x1.shape
    assert set(r0) == {"dw", "db"} and r0["dw"].shape == W.shape


@pytest.mark.parametrize("need_dx", [True, False])
def test_one_participant_with_every_channel_computes_the_whole_layer_by_channels(need_dx):
    dy = RNG.standard_normal((2, 5, 8, 8), dtype=np.float32)
    y_ref, dx_ref, dw_ref, db_ref = reference(dy)
    worker = Worker(NumpyBackend())
    assert ok(worker, partial()) == {}  # nobody else needs any of its partial
    y = ok(worker, tail())["y"]  # nobody else's partial to add: no sum
    dyc = ok(worker, task("tail_backward", {"dy": dy}))["dyc"]
    grads = ok(worker, task("partial_backward", need_dx=need_dx))
    close(y, y_ref)
    np.testing.assert_array_equal(dyc, km(dy))  # no tail: the conv-output gradient is dy itself
    assert set(grads) == {"dw", "db"} | ({"dx"} if need_dx else set())
    close(grads["dw"], dw_ref)
    close(grads["db"], db_ref)
    if need_dx:
        close(grads["dx"], dx_ref)
    assert "nothing kept of this layer's forward" in error_text(worker.handle(task("partial_backward")))


def test_two_workers_splitting_the_input_channels_give_the_whole_block_on_their_kernels(rng):
    # 8 kernels with an LRN in the tail, so each computes a halo of 2 kernels beyond its own:
    # worker 0 owns kernels [0, 3) and input channels [0, 2), worker 1 kernels [3, 8) and channels [2, 5)
    be = NumpyBackend()
    spec = [{"op": "relu"}, {"op": "lrn", "size": 3, "alpha": 2.0, "beta": 0.75, "k": 1.0}]
    spec.append({"op": "maxpool", "kernel": 2, "stride": 2, "padding": 0})
    x = rng.standard_normal((2, 5, 8, 8), dtype=np.float32)
    w = rng.standard_normal((8, 5, 3, 3), dtype=np.float32)
    b = rng.standard_normal(8, dtype=np.float32)
    y_ref, cache = block_forward(be, x, w, b, 1, 1, spec)
    g = rng.standard_normal(y_ref.shape, dtype=np.float32)
    dyc_ref = tail_backward(be, g, cache)  # the conv-output gradient, all 8 kernels
    dx_ref, dw_ref, db_ref = be.conv2d_backward(dyc_ref, cache.conv, True)
    # float32_tolerance's scale form, k along the path: the conv (5x3x3 + the bias), the LRN forward;
    # back through it and the pool (no overlaps); then dx (8x3x3) or dw and db (2*8*8 sums)
    y_k = 5 * 9 + 1 + (3 + 3 + FN)
    dyc_k = y_k + (2 * 3 + 7 + 2 * FN) + 1
    y_ref, dyc_ref = Expected(y_ref, y_k), Expected(dyc_ref, dyc_k)
    dx_ref = Expected(dx_ref, dyc_k + 8 * 9)
    dw_ref, db_ref = Expected(dw_ref, dyc_k + 2 * 8 * 8), Expected(db_ref, dyc_k + 2 * 8 * 8)

    own, channels = [(0, 3), (3, 8)], [(0, 2), (2, 5)]
    halos = [halo_span(s, e, 8, spec) for s, e in own]
    assert halos == [slice(0, 5), slice(1, 8)]
    give = [[0, 1], [5, 8]]  # what the other's halo needs of each partial: worker 0's from kernel 1, 1's up to 5
    workers = [Worker(NumpyBackend()), Worker(NumpyBackend())]

    p = []
    for i, ((s, e), (c0, c1), h) in enumerate(zip(own, channels, halos, strict=True)):
        xc, wc = np.ascontiguousarray(x[:, c0:c1]), np.ascontiguousarray(w[:, c0:c1])
        header = {"halo": [h.start, h.stop], "own": [s - h.start, e - h.start], "give": give[i], "tail": spec}
        p.append(ok(workers[i], partial(x=xc, w=wc, **header)))
        (partial_ref,) = conv2d_expected(xc, wc, np.zeros(8, np.float32), 1, 1)  # no bias
        name, ref = ("p_hi", partial_ref[:, 1:]) if i == 0 else ("p_lo", partial_ref[:, :5])
        assert set(p[i]) == {name}
        close(p[i][name].transpose(1, 0, 2, 3), ref)  # kernel-major

    # each gets the other's partial on its halo and its halo's bias; y is the block on its own kernels
    sums = [p[1]["p_lo"][0:5], p[0]["p_hi"][0:7]]  # p_hi starts at kernel 1
    dyc = []
    for i, ((s, e), h) in enumerate(zip(own, halos, strict=True)):
        y = ok(workers[i], tail(b=np.ascontiguousarray(b[h]), others=np.ascontiguousarray(sums[i])))
        close(y["y"], y_ref[:, s:e])
        dyc.append(ok(workers[i], task("tail_backward", {"dy": np.ascontiguousarray(g[:, h])}))["dyc"])
        close(dyc[i].transpose(1, 0, 2, 3), dyc_ref[:, s:e])

    # with the other's conv-output gradient around its own: dx and dw of its channels, and all of db
    for i, (c0, c1) in enumerate(channels):
        around = {"dyc_hi": dyc[1]} if i == 0 else {"dyc_lo": dyc[0]}
        grads = ok(workers[i], task("partial_backward", around))
        close(grads["dx"], dx_ref[:, c0:c1])
        close(grads["dw"], dw_ref[:, c0:c1])
        close(grads["db"], db_ref)


def test_a_refused_task_leaves_the_layer_for_a_good_one():
    # as the middle one of three participants: kernels [1, 4) of 5, the others' gradients around them
    worker = Worker(NumpyBackend())
    dy = RNG.standard_normal((2, 5, 8, 8), dtype=np.float32)
    y_ref, dx_ref, dw_ref, db_ref = reference(dy)
    assert ok(worker, partial(own=[1, 4])) == {}
    assert "tail_forward takes b (5,)" in error_text(worker.handle(tail(b=B[:2])))
    close(ok(worker, tail())["y"], y_ref[:, 1:4])
    assert "does not fit the forward" in error_text(worker.handle(task("tail_backward", {"dy": dy[:, :2]})))
    np.testing.assert_array_equal(ok(worker, task("tail_backward", {"dy": dy}))["dyc"], km(dy[:, 1:4]))
    wrong = error_text(worker.handle(task("partial_backward", {"dyc_lo": km(dy)})))
    assert "kernels [1, 4) of 5" in wrong and "dyc_lo must be (1, 2, 8, 8), got (5, 2, 8, 8)" in wrong
    missing = error_text(worker.handle(task("partial_backward", {"dyc_lo": km(dy[:, :1])})))
    assert "dyc_hi must be (1, 2, 8, 8), got nothing" in missing
    grads = ok(worker, task("partial_backward", {"dyc_lo": km(dy[:, :1]), "dyc_hi": km(dy[:, 4:])}))
    close(grads["dx"], dx_ref)
    close(grads["dw"], dw_ref)
    close(grads["db"], db_ref)


def test_a_batch_in_chunks_gives_the_whole_batchs_numbers():
    # the middle one of three participants again, its batch of 2 in two chunks of one image
    worker = Worker(NumpyBackend())
    dy = RNG.standard_normal((2, 5, 8, 8), dtype=np.float32)
    y_ref, dx_ref, dw_ref, db_ref = reference(dy)
    assert ok(worker, partial(x=X[:1], own=[1, 4], images=[0, 1, 2])) == {}
    assert ok(worker, task("partial_forward", {"x": X[1:]}, own=[1, 4], images=[1, 2, 2])) == {}
    # its tail treats each image on its own, so it runs on each chunk as the chunk is summed (b with the first)
    close(ok(worker, tail(images=[0, 1, 2]))["y"], y_ref[:1, 1:4])
    close(ok(worker, task("tail_forward", {}, images=[1, 2, 2]))["y"], y_ref[1:, 1:4])
    for i in range(2):
        dyc = ok(worker, task("tail_backward", {"dy": dy[i : i + 1]}, images=[i, i + 1, 2]))["dyc"]
        np.testing.assert_array_equal(dyc, km(dy[i : i + 1, 1:4]))
    for i in range(2):
        around = {"dyc_lo": km(dy[i : i + 1, :1]), "dyc_hi": km(dy[i : i + 1, 4:])}
        grads = ok(worker, task("partial_backward", around, images=[i, i + 1, 2]))
        assert set(grads) == ({"dx"} if i == 0 else {"dx", "dw", "db"})  # dw and db summed, with the last
        close(grads["dx"], dx_ref[i : i + 1])
    close(grads["dw"], dw_ref)
    close(grads["db"], db_ref)


def test_a_probed_backward_returns_its_dws_sums_along_the_probe():
    """Asked a probe (u, v) with a backward, both splits (the second by chunks of one image), the worker returns s
    and a (replica/probe.py) with dw: s = u^T dw v within the probe's bound, on a's scale."""
    dy = RNG.standard_normal((2, 5, 8, 8), dtype=np.float32)
    u, v = RNG.standard_normal(5, dtype=np.float32), RNG.standard_normal(3 * 3 * 3, dtype=np.float32)
    by_kernels = Worker(NumpyBackend())
    ok(by_kernels, forward())
    kernels = ok(by_kernels, task("block_backward", {"dy": dy, "probe": np.concatenate([u, v])}))
    by_channels = Worker(NumpyBackend())
    ok(by_channels, partial(x=X[:1], images=[0, 1, 2]))
    ok(by_channels, task("partial_forward", {"x": X[1:]}, images=[1, 2, 2]))
    ok(by_channels, tail(images=[0, 1, 2]))
    ok(by_channels, task("tail_forward", {}, images=[1, 2, 2]))
    for i in range(2):
        ok(by_channels, task("tail_backward", {"dy": dy[i : i + 1]}, images=[i, i + 1, 2]))
    asked = {"probe": np.concatenate([u, v])}
    ok(by_channels, task("partial_backward", asked, images=[0, 1, 2]))
    channels = ok(by_channels, task("partial_backward", {}, images=[1, 2, 2]))
    for grads, chunks in ((kernels, 1), (channels, 2)):
        (s, a), dw = grads["probes"], grads["dw"].reshape(5, -1)
        one, _ = probe.compared(dw, u, v, float(s), float(a), probe.length(2 * 8 * 8, 5, 27) + chunks)
        assert abs(one[0] - one[1])[0] <= one[2] and a > abs(s) > 0


@pytest.mark.parametrize(
    "steps, complaint",
    [
        ([partial(x=X[:1], images=[1, 2, 2])], "continues the chunk that ends there; send the batch's chunks in order"),
        ([task("partial_forward", {"x": X[:1]}, images=[0, 1, 2])], "the first chunk of partial_forward .* brings w"),
        ([partial(x=X[:1], images=[0, 1, 2]), partial(x=X[1:], images=[1, 2, 2])], "w comes with the first chunk"),
        ([partial(images=[0, 1, 2])], r"expected x \(1, c, H, W\) for images \[0, 1\)"),
        ([partial(images=[0, 2])], r"images must be \[a, b, N\] with 0 <= a < b <= N, got \[0, 2\]"),
        (
            [partial(x=X[:1], images=[0, 1, 2]), task("partial_forward", {"x": X[1:]}, own=[1, 4], images=[1, 2, 2])],
            "must repeat its first chunk's settings",
        ),
        ([partial(x=X[:1], images=[0, 1, 2]), tail()], r"tail_forward goes by .* the next is images \[0, 1, 2\]"),
        (
            [partial(x=X[:1], images=[0, 1, 2]), task("tail_forward", {}, images=[0, 1, 2])],
            r"b \(and batch norm.s arrays\) come with the first chunk of tail_forward",
        ),
        (
            [partial(x=X[:1], images=[0, 1, 2]), task("partial_forward", {"x": X[1:]}, images=[1, 2, 2]),
             tail(images=[0, 1, 2]), tail(images=[1, 2, 2])],
            r"come with the first chunk of tail_forward \(images from 0\) only",
        ),
        (
            [partial(x=X[:1], images=[0, 1, 2]), task("partial_forward", {"x": X[1:]}, images=[1, 2, 2]),
             tail(images=[0, 1, 2]), task("tail_forward", {}, images=[1, 2, 2]), task("tail_backward", {"dy": DY})],
            r"tail_backward goes by the tail's chunks; the next is images \[0, 1, 2\]",
        ),
        (
            [partial(x=X[:1], images=[0, 1, 2]), task("partial_forward", {"x": X[1:]}, images=[1, 2, 2]), tail()],
            r"tail_forward goes by partial_forward's chunks; the next is images \[0, 1, 2\]",
        ),
        (
            [partial(x=X[:1], images=[0, 1, 2]), task("partial_forward", {"x": X[1:]}, images=[1, 2, 2]),
             task("tail_forward", {}, images=[1, 2, 2])],
            r"tail_forward goes by partial_forward's chunks; the next is images \[0, 1, 2\]",
        ),
        (
            [partial(x=X[:1], images=[0, 1, 2]), task("partial_forward", {"x": X[1:]}, images=[1, 2, 2]),
             tail(images=[0, 1, 2]), task("tail_forward", {}, images=[1, 2, 2]),
             task("tail_backward", {"dy": DY[:1]}, images=[0, 1, 2]),
             task("tail_backward", {"dy": DY[1:]}, images=[1, 2, 2])],
            None,
        ),
    ],
)  # fmt: skip
def test_chunks_out_of_order_or_inconsistent_are_refused(steps, complaint):
    worker = Worker(NumpyBackend())
    for msg in steps[:-1]:
        assert worker.handle(msg).kind == "result", worker.handle(msg)
    if complaint is None:  # the whole forward in chunks, then the backward by other chunks than its forward's
        assert worker.handle(steps[-1]).kind == "result"
        bad = task("partial_backward", {}, images=[0, 2, 2])
        expected = "partial_backward goes by the forward's chunks; the next is images [0, 1, 2]"
        assert expected in error_text(worker.handle(bad))
        return
    assert re.search(complaint, error_text(worker.handle(steps[-1])))


BY_CHANNELS = [partial(), tail()]  # one participant with all channels: the whole layer
CALIBRATE_0 = {"layer": 0, "x": [1, 3, 8, 8], "w": [1, 3, 3, 3], "stride": 1, "padding": 0, "need_dx": True, "tail": []}


@pytest.mark.parametrize(
    ("steps", "complaint"),
    [
        # the stage table: which task may follow which on one layer
        ([tail()], r"nothing kept of this layer's forward: send partial_forward first"),
        ([forward(), tail()], "tail_forward follows partial_forward, but this layer's last task was block_forward"),
        ([*BY_CHANNELS, tail()], "tail_forward follows partial_forward, but this layer's last task was tail_forward"),
        ([partial(), tail(step=1)], "this layer's kept forward is of step 0"),
        ([*BY_CHANNELS, task("block_backward", {"dy": DY})], "block_backward follows block_forward, but"),
        ([forward(), task("tail_backward", {"dy": DY})], "tail_backward follows tail_forward, but"),
        ([partial(), task("tail_backward", {"dy": DY})], "tail_backward follows tail_forward, but"),
        ([*BY_CHANNELS, task("partial_backward")], "partial_backward follows tail_backward, but"),
        (
            [*BY_CHANNELS, task("tail_backward", {"dy": DY}), task("tail_backward", {"dy": DY})],
            "tail_backward follows tail_forward, but this layer's last task was tail_backward",
        ),
        ([task("block_backward", {"dy": DY})], "send block_forward first"),
        ([forward(step=1), task("block_backward", {"dy": DY}, step=2)], "kept forward is of step 1"),
        # each kind's header and arrays (protocol.py)
        ([partial(halo=[2, 6])], r"halo must be \[a, b\] with 0 <= a < b <= 5, got \[2, 6\]"),
        ([partial(halo=[1, 3], own=[0, 3])], r"own must be \[a, b\] with 0 <= a < b <= 2"),
        ([partial(give=[0, 6])], r"give must be \[lo_end, hi_start\] within \[0, 5\], got \[0, 6\]"),
        ([task("partial_forward", {"x": X, "w": W, "b": B})], r"\['x'\] and optionally \['w'\], got \['b', 'w', 'x'\]"),
        ([forward(own=[0, 6])], r"own must be \[a, b\] with 0 <= a < b <= 5"),
        ([Message("block_forward", {"task": 1, "step": 0, "layer": 0}, {})], "missing"),
        ([partial(), tail(b=B[:3])], r"tail_forward takes b \(5,\) and sum \(5, 2, 8, 8\); got b \(3,\)"),
        ([partial(), tail(others=DY[:, :2])], r"got b \(5,\), sum \(2, 2, 8, 8\)"),
        (
            [partial(), task("tail_forward", {"b": B, "x": X})],
            r"optionally \['b', 'beta', 'gamma', 'running_mean', 'running_var', 'sum'\], got \['b', 'x'\]",
        ),
        ([*BY_CHANNELS, task("tail_backward", {"dy": DY}), task("partial_backward", {"dy": DY})], "optionally"),
        (
            [*BY_CHANNELS, task("tail_backward", {"dy": DY}), task("partial_backward", {"dyc_hi": DY[:, :1]})],
            r"around this worker's kernels \[0, 5\) of 5, dyc_lo those before and dyc_hi those after: "
            r"dyc_hi must be absent, got \(2, 1, 8, 8\)",
        ),
        (
            [forward(), task("block_backward")],
            r"block_backward takes the arrays \['dy'\] and optionally \['probe'\], got none",
        ),
        ([forward(), task("block_backward", {"dy": np.ones((2, 5, 7, 8), np.float32)})], r"dy \(2, 5, 7, 8\) does"),
        ([forward(), task("block_backward", {"dy": DY, "probe": np.ones(5, np.float32)})], r"probe must be u \(5,\)"),
        (
            [
                *BY_CHANNELS,
                task("tail_backward", {"dy": DY}),
                task("partial_backward", {"probe": np.ones(3, np.float32)}),
            ],
            r"a probe, u \(5,\) then v \(3, 3, 3\), comes with the first chunk",
        ),
        ([forward(), task("block_backward", {"dy": DY.astype(np.float64)})], "dy must be float32"),
        ([forward(x=X[:, :2])], "matching C and F"),
        ([forward(b=B[:3])], "matching C and F"),
        ([forward(x=X[0])], r"x \(N, C, H, W\)"),
        ([forward(w=W.astype(np.float64))], "w must be float32"),
        ([forward(stride=0)], "stride >= 1"),
        ([forward(padding=0, x=X[:, :, :2, :2])], "does not fit"),
        ([forward(tail=[{"op": "softmax"}])], r"tail\[0\] must be a map with op one of"),
        ([Message("result", {"task": 1, "compute_s": 0.0})], "does not handle 'result'"),
        ([Message("conv_forward", {"task": 1})], "does not handle 'conv_forward'"),
        # calibration
        ([Message("calibrate", {"task": 1, "layers": [], "repeats": 1})], "nothing to calibrate"),
        ([Message("calibrate", {"task": 1, "layers": [{"layer": 0}], "repeats": 1})], r"layers\[0\] must be"),
        (
            [Message("calibrate", {"task": 1, "layers": [CALIBRATE_0 | {"x": [1, 3, 8]}], "repeats": 1})],
            r"layers\[0\].x must be 4 positive ints",
        ),
        ([Message("calibrate", {"task": 1, "layers": [CALIBRATE_0], "repeats": 0})], "repeats must be in"),
    ],
)
def test_errors_are_replies_and_the_worker_keeps_serving(steps, complaint):
    worker = Worker(NumpyBackend())
    *setup, bad = steps
    for msg in setup:
        assert worker.handle(msg).kind == "result"
    reply = worker.handle(bad)
    assert re.search(complaint, error_text(reply)), reply.header["message"]
    assert reply.header.get("task") == bad.header["task"]
    assert worker.handle(forward(layer=9)).kind == "result"  # still serving


def test_a_backend_failure_is_a_reply_too():
    class Broken(NumpyBackend):
        def conv2d_forward(self, *args, **kw):
            raise MemoryError("out of device memory")

    reply = call_handler(Worker(Broken()), forward(task=5), lambda said: None)  # as every transport calls the worker
    assert "MemoryError: out of device memory" in error_text(reply) and reply.header["task"] == 5


def calibrate(*layers: dict, task: int = 1, repeats: int = 1) -> Message:
    return Message("calibrate", {"task": task, "layers": list(layers), "repeats": repeats})


def test_calibrate_times_each_layer():
    tail = [{"op": "relu"}, {"op": "maxpool", "kernel": 2, "stride": 2, "padding": 0}]
    first = {"layer": 0, "x": [2, 3, 8, 8], "w": [4, 3, 5, 5], "stride": 1, "padding": 2, "need_dx": False}
    second = {"layer": 1, "x": [2, 4, 4, 4], "w": [6, 4, 3, 3], "stride": 1, "padding": 1, "need_dx": True}
    r = Worker(NumpyBackend()).handle(calibrate(first | {"tail": tail}, second | {"tail": []}, task=7, repeats=2))
    check_message(r)
    assert r.kind == "result" and r.header["task"] == 7 and r.arrays == {}
    assert len(r.header["times"]) == 2 and all(t > 0 for t in r.header["times"])
    assert r.header["compute_s"] >= sum(r.header["times"])


def test_calibrate_refuses_shapes_over_its_memory_limit():
    big = CALIBRATE_0 | {"x": [64, 64, 64, 64], "w": [64, 64, 5, 5], "padding": 2}
    reply = Worker(NumpyBackend(), max_calibrate_bytes=1 << 20).handle(calibrate(big))
    assert "over this worker's limit" in error_text(reply)


class SlowBackend(NumpyBackend):
    """A convolution that takes at least 20 ms, so timings are predictable."""

    def conv2d_forward(self, *args, **kw):
        threading.Event().wait(0.02)  # a slow device, emulated: not a synchronisation
        return super().conv2d_forward(*args, **kw)


def test_slowdown_scales_the_reported_time_and_the_wall_time():
    worker = Worker(SlowBackend(), slowdown=3.0)
    t0 = time.perf_counter()
    reply = worker.handle(forward())
    wall = time.perf_counter() - t0
    compute_s = reply.header["compute_s"]
    assert compute_s >= 3 * 0.02  # F x the >= 20 ms the backend took
    assert wall >= compute_s - 1e-3  # and the worker really took that long
    times = worker.handle(calibrate(CALIBRATE_0)).header["times"]
    assert times[0] >= 3 * 0.02  # forward + backward, of which the forward is the slow op


def test_slowdown_below_one_is_refused():
    with pytest.raises(ValueError, match="slowdown must be"):
        Worker(NumpyBackend(), slowdown=0.5)


# ---- command line ------------------------------------------------------------------------


def test_cli_help_runs_without_numpy():
    code = (
        "import sys; from tinyconv.distributed.worker.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    print('numpy' in sys.modules, e.code)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert "--connect" in out.stdout and "--threads" in out.stdout
    assert out.stdout.strip().endswith("False 0")


def one_line_error(capsys) -> str:
    """What a refused command line said on stderr: one line, no traceback."""
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--slowdown", "0.5"], "argument --slowdown: must be a factor >= 1, got 0.5"),
        (["--backend", "abacus"], "--backend abacus: not one of numpy"),
        (["--device", "0:0"], "--device 0:0: the numpy backend has no devices to choose from; drop --device"),
        (["--timeout", "5"], "--timeout is now --peer-timeout"),
        (["--connect-timeout", "5"], "--connect-timeout is now --start-timeout"),
        (["--quiet"], "--quiet is now --no-progress"),
        (["--peer-timeout", "0"], "argument --peer-timeout: must be a number > 0, got 0"),
        (["--key", "me.key_secret"], "--key and --master-key go together"),
    ],
)
def test_cli_refuses_bad_arguments_in_one_line_and_exit_2(capsys, args, says):
    assert main(["--connect", "tcp://127.0.0.1:1", *args]) == 2
    err = one_line_error(capsys)
    assert err.startswith("tinyconv worker: error: ") and says in err, err


def test_cli_needs_connect(capsys):
    assert main([]) == 2
    assert "required: --connect" in one_line_error(capsys)


@pytest.mark.parametrize("content", [None, "not a key\n"])
def test_a_key_that_does_not_load_says_how_to_make_one(tmp_path, capsys, content):
    key = tmp_path / "me.key_secret"
    if content is not None:
        key.write_text(content)
    assert main(["--connect", "tcp://127.0.0.1:1", "--key", str(key), "--master-key", str(key)]) == 2
    err = one_line_error(capsys)
    assert str(key) in err and "`tinyconv keygen DIR --name NAME`" in err and "generate_keys" not in err


SPY = textwrap.dedent(
    """
    import json, os, sys
    VARS = {vars!r}
    seen = {{}}

    class Spy:  # records the thread variables at the moment numpy is first imported
        def find_spec(self, name, path=None, target=None):
            if name == "numpy" and not seen:
                seen.update({{v: os.environ.get(v) for v in VARS}})
            return None

    sys.meta_path.insert(0, Spy())
    from tinyconv.distributed.worker.main import main
    rc = main(["--connect", {connect!r}, "--threads", "3", "--start-timeout", "0.3"])
    print(json.dumps({{"rc": rc, "seen": seen}}))
    """
)


def test_threads_are_set_before_numpy_is_imported(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV_VARS}
    script = SPY.format(vars=THREAD_ENV_VARS, connect=f"ipc://{tmp_path}/nobody.sock")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["seen"] == {v: "3" for v in THREAD_ENV_VARS}
    # nobody listens there: the worker gives up after --start-timeout, with one line saying why
    assert result["rc"] == 1 and "no welcome from a master" in out.stderr


def test_python_dash_m_and_the_tinyconv_command_start_the_same_worker():
    out = subprocess.run(
        [sys.executable, "-m", "tinyconv.distributed.worker", "--help"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0 and "usage: tinyconv worker" in out.stdout


def test_calibrate_admits_what_a_batch_256_step_needs():
    # the default cap follows the machine (half its memory, at least 2 GiB), so that a master may time
    # what its real steps allocate anyway: 150:800's conv2 at batch 256 needs about 2.3 GB
    from tinyconv.distributed.calibrate import default_max_calibrate_bytes, parse_spec

    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert default_max_calibrate_bytes() == max(1 << 31, physical // 2)
    spec = {
        "layer": 1,
        "x": [256, 150, 16, 16],
        "w": [800, 150, 5, 5],
        "stride": 1,
        "padding": 2,
        "need_dx": True,
        "tail": [],
    }
    if physical // 2 >= 2_400_000_000:  # this machine can hold it: admitted
        assert parse_spec(1, spec, default_max_calibrate_bytes()).w == (800, 150, 5, 5)
    with pytest.raises(TaskError, match="half its physical memory"):  # a small worker says what to do
        parse_spec(1, spec, 1 << 31)

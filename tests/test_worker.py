"""ConvWorker answers tasks exactly like a direct backend call; its command line behaves."""

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

from backends.numpy_backend import NumpyBackend
from tinyconv.block import block_forward, extended, grad_span, tail_backward
from tinyconv.worker import THREAD_ENV_VARS, ConvWorker, main
from transports.base import PROTOCOL_VERSION, Handler, Message
from transports.wire import check_message

RNG = np.random.default_rng(7)
X = RNG.standard_normal((2, 3, 8, 8), dtype=np.float32)
W = RNG.standard_normal((5, 3, 3, 3), dtype=np.float32)
B = RNG.standard_normal((5,), dtype=np.float32)


def forward(
    task=1, step=0, layer=0, x=X, w=W, b=B, stride=1, padding=1, need_dx=True, part=None, arrays=None, **extra
) -> Message:
    """A conv_forward: the whole (x, w, b) by default, or ``part`` with ``arrays`` and ``extra`` header keys."""
    header = {
        "task": task,
        "step": step,
        "layer": layer,
        "stride": stride,
        "padding": padding,
        "need_dx": need_dx,
    }
    header |= ({"part": part} if part else {}) | extra
    return Message("conv_forward", header, {"x": x, "w": w, "b": b} if arrays is None else arrays)


def forward_conv(x=X, w=W, ext=(0, 5), **kw) -> Message:
    """Forward part "conv" of a layer split by input channels: x and w of some channels, all kernels."""
    extra = {"ext": list(ext)} if ext is not None else {}
    return forward(part="conv", arrays={"x": x, "w": w}, **extra, **kw)


def forward_tail(b=B, total=None, **kw) -> Message:
    """Forward part "tail": the bias of the computed kernels and the others' partials summed on them."""
    return forward(part="tail", arrays={"b": b} | ({"sum": total} if total is not None else {}), **kw)


def backward(dy, task=2, step=0, layer=0, part=None, arrays=None, **extra) -> Message:
    header = {"task": task, "step": step, "layer": layer} | ({"part": part} if part else {}) | extra
    return Message("conv_backward", header, (arrays or {}) if dy is None else {"dy": dy})


def error_text(reply: Message) -> str:
    assert reply.kind == "error", reply
    check_message(reply)
    return reply.header["message"]


def close(got: np.ndarray, ref: np.ndarray) -> None:
    """Equal to float32 round-off (sums in another order)."""
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def reference_backward(dy: np.ndarray) -> tuple[np.ndarray, ...]:
    """The reference (y, dx, dw, db) of forward()'s layer from the numpy backend, for gradient dy."""
    be = NumpyBackend()
    y, cache = be.conv2d_forward(X, W, B, 1, 1)
    return (y, *be.conv2d_backward(dy, cache, True))


def test_hello_describes_the_worker():
    worker = ConvWorker(NumpyBackend(), slowdown=2.0)
    assert isinstance(worker, Handler)
    h = worker.hello()
    assert h["protocol"] == PROTOCOL_VERSION and h["backend"] == "numpy" and h["pid"] == os.getpid()
    assert h["device"]["kind"] == "cpu" and h["device"]["slowdown"] == 2.0 and h["hostname"]
    check_message(Message("hello", h))


def test_forward_and_backward_equal_the_backend():
    be = NumpyBackend()
    worker = ConvWorker(NumpyBackend())
    y_ref, cache = be.conv2d_forward(X, W, B, 1, 1)
    dy = RNG.standard_normal(y_ref.shape, dtype=np.float32)
    dx_ref, dw_ref, db_ref = be.conv2d_backward(dy, cache, True)

    r = worker.handle(forward(task=11, step=3, layer=2, padding=1))
    check_message(r)
    assert r.kind == "result" and r.header["task"] == 11 and r.header["step"] == 3 and r.header["layer"] == 2
    assert r.header["compute_s"] > 0
    np.testing.assert_array_equal(r.arrays["y"], y_ref)

    r = worker.handle(backward(dy, task=12, step=3, layer=2))
    check_message(r)
    assert r.kind == "result" and r.header["task"] == 12 and set(r.arrays) == {"dx", "dw", "db"}
    np.testing.assert_array_equal(r.arrays["dx"], dx_ref)
    np.testing.assert_array_equal(r.arrays["dw"], dw_ref)
    np.testing.assert_array_equal(r.arrays["db"], db_ref)


def test_need_dx_false_returns_no_dx_and_layers_keep_separate_caches():
    worker = ConvWorker(NumpyBackend())
    y0 = worker.handle(forward(layer=0, need_dx=False)).arrays["y"]
    x1 = RNG.standard_normal((2, 5, 8, 8), dtype=np.float32)
    w1 = RNG.standard_normal((4, 5, 5, 5), dtype=np.float32)
    b1 = np.zeros(4, np.float32)
    y1 = worker.handle(forward(layer=1, x=x1, w=w1, b=b1, padding=2)).arrays["y"]
    r1 = worker.handle(backward(np.ones_like(y1), layer=1))
    r0 = worker.handle(backward(np.ones_like(y0), layer=0))
    assert set(r1.arrays) == {"dx", "dw", "db"} and r1.arrays["dx"].shape == x1.shape
    assert set(r0.arrays) == {"dw", "db"} and r0.arrays["dw"].shape == W.shape


@pytest.mark.parametrize("need_dx", [True, False])
def test_one_participant_with_every_channel_computes_the_whole_layer_in_parts(need_dx):
    dy = RNG.standard_normal((2, 5, 8, 8), dtype=np.float32)
    y_ref, dx_ref, dw_ref, db_ref = reference_backward(dy)
    worker = ConvWorker(NumpyBackend())
    steps = [
        (forward_conv(task=1, need_dx=need_dx), set()),  # gives nothing: nobody else needs its partial
        (forward_tail(task=2, need_dx=need_dx), {"y"}),  # nobody else's partial to add: no sum
        (backward(dy, task=3, part="tail"), {"dyc"}),
        (backward(None, task=4, part="conv"), {"dw", "db"} | ({"dx"} if need_dx else set())),
    ]
    replies = []
    for msg, arrays in steps:
        check_message(msg)
        r = worker.handle(msg)
        check_message(r)
        assert r.kind == "result" and r.header["task"] == msg.header["task"] and set(r.arrays) == arrays
        replies.append(r.arrays)
    close(replies[1]["y"], y_ref)
    np.testing.assert_array_equal(replies[2]["dyc"], dy)  # no tail: the conv-output gradient is dy itself
    close(replies[3]["dw"], dw_ref)
    close(replies[3]["db"], db_ref)
    if need_dx:
        close(replies[3]["dx"], dx_ref)
    assert "no conv_forward" in error_text(worker.handle(backward(None, part="conv")))  # the backward is done


def test_two_workers_splitting_the_input_channels_give_the_whole_block_on_their_kernels(rng):
    # 8 kernels with an LRN in the tail, so each computes a halo of 2 kernels beyond its own:
    # worker 0 owns kernels [0, 3) and input channels [0, 2), worker 1 kernels [3, 8) and channels [2, 5)
    be = NumpyBackend()
    tail = [{"op": "relu"}, {"op": "lrn", "size": 3, "alpha": 2.0, "beta": 0.75, "k": 1.0}]
    tail.append({"op": "maxpool", "kernel": 2, "stride": 2, "padding": 0})
    x = rng.standard_normal((2, 5, 8, 8), dtype=np.float32)
    w = rng.standard_normal((8, 5, 3, 3), dtype=np.float32)
    b = rng.standard_normal(8, dtype=np.float32)
    y_ref, cache = block_forward(be, x, w, b, 1, 1, tail)
    g = rng.standard_normal(y_ref.shape, dtype=np.float32)
    dyc_ref = tail_backward(be, g, cache)  # the conv-output gradient, all 8 kernels
    dx_ref, dw_ref, db_ref = be.conv2d_backward(dyc_ref, cache.conv, True)

    own, channels = [(0, 3), (3, 8)], [(0, 2), (2, 5)]
    ext = [extended(s, e, 8, tail) for s, e in own]
    assert ext == [(0, 5), (1, 8)]
    # what the other one's ext needs of each partial: worker 0's from kernel 1 on, worker 1's up to kernel 5
    give = [[0, 1], [5, 8]]
    workers = [ConvWorker(NumpyBackend()), ConvWorker(NumpyBackend())]

    def ask(i: int, msg: Message) -> dict[str, np.ndarray]:
        check_message(msg)
        r = workers[i].handle(msg)
        check_message(r)
        assert r.kind == "result" and r.header["compute_s"] > 0, r.header
        return r.arrays

    p = []
    for i, ((s, e), (c0, c1), (cs, ce)) in enumerate(zip(own, channels, ext, strict=True)):
        xc, wc = np.ascontiguousarray(x[:, c0:c1]), np.ascontiguousarray(w[:, c0:c1])
        header = {"ext": (cs, ce), "own": [s - cs, e - cs], "give": give[i], "tail": tail}
        p.append(ask(i, forward_conv(x=xc, w=wc, **header)))
        partial_ref, _ = be.conv2d_forward(xc, wc, np.zeros(8, np.float32), 1, 1)  # no bias
        name, ref = ("p_hi", partial_ref[:, 1:]) if i == 0 else ("p_lo", partial_ref[:, :5])
        assert set(p[i]) == {name}
        close(p[i][name], ref)

    # each gets the other's partial on its ext and its ext's bias; y is the block on its own kernels
    sums = [p[1]["p_lo"][:, 0:5], p[0]["p_hi"][:, 0:7]]  # p_hi starts at kernel 1
    dyc = []
    for i, ((s, e), (cs, ce)) in enumerate(zip(own, ext, strict=True)):
        y = ask(i, forward_tail(b=np.ascontiguousarray(b[cs:ce]), total=np.ascontiguousarray(sums[i])))
        assert set(y) == {"y"}
        close(y["y"], y_ref[:, s:e])
        gs, ge = grad_span(s, e, 8, tail)
        dyc.append(ask(i, backward(np.ascontiguousarray(g[:, gs:ge]), part="tail", dy_from=gs - cs)))
        assert set(dyc[i]) == {"dyc"}
        close(dyc[i]["dyc"], dyc_ref[:, s:e])

    # with the other's conv-output gradient around its own: dx and dw of its channels, and all of db
    for i, (c0, c1) in enumerate(channels):
        around = {"dyc_hi": dyc[1]["dyc"]} if i == 0 else {"dyc_lo": dyc[0]["dyc"]}
        grads = ask(i, backward(None, part="conv", arrays=around))
        assert set(grads) == {"dx", "dw", "db"}
        close(grads["dx"], dx_ref[:, c0:c1])
        close(grads["dw"], dw_ref[:, c0:c1])
        close(grads["db"], db_ref)


def test_a_refused_part_leaves_the_layer_for_a_good_one():
    # as the middle one of three participants: kernels [1, 4) of 5, the others' gradients around them
    worker = ConvWorker(NumpyBackend())
    dy = RNG.standard_normal((2, 5, 8, 8), dtype=np.float32)
    y_ref, dx_ref, dw_ref, db_ref = reference_backward(dy)
    assert worker.handle(forward_conv(own=[1, 4])).kind == "result"
    assert "part 'tail' takes b (5,)" in error_text(worker.handle(forward_tail(b=B[:2])))
    close(worker.handle(forward_tail()).arrays["y"], y_ref[:, 1:4])
    assert "does not fit" in error_text(worker.handle(backward(dy[:, :2], part="tail")))
    np.testing.assert_array_equal(worker.handle(backward(dy[:, 1:4], part="tail", dy_from=1)).arrays["dyc"], dy[:, 1:4])
    assert "must make (2, 5, 8, 8)" in error_text(worker.handle(backward(None, part="conv", arrays={"dyc_lo": dy})))
    r = worker.handle(backward(None, part="conv", arrays={"dyc_lo": dy[:, :1], "dyc_hi": dy[:, 4:]}))
    assert set(r.arrays) == {"dx", "dw", "db"}
    close(r.arrays["dx"], dx_ref)
    close(r.arrays["dw"], dw_ref)
    close(r.arrays["db"], db_ref)


DY = np.ones((2, 5, 8, 8), np.float32)
SPLIT_BY_CHANNELS = [forward_conv(), forward_tail()]  # one participant with all channels: the whole layer


@pytest.mark.parametrize(
    ("steps", "complaint"),
    [
        # forward: whole (split by kernels) or in parts "conv" then "tail" (split by input channels)
        ([forward(part="all")], r"forward part must be 'conv' or 'tail' \(or absent for the whole\)"),
        (
            [forward(arrays={"x": X, "w": W})],
            r"forward part whole takes the arrays \['b', 'w', 'x'\], got \['w', 'x'\]",
        ),
        ([forward(part="conv", ext=[0, 5])], r"forward part conv takes the arrays \['w', 'x'\], got \['b', 'w', 'x'\]"),
        ([forward_conv(ext=None)], r"part 'conv' needs ext \[cs, ce\] with 0 <= cs < ce <= 5 kernels, got None"),
        ([forward_conv(ext=(2, 6))], r"part 'conv' needs ext \[cs, ce\] .* got \[2, 6\]"),
        ([forward_conv(ext=(1, 3), own=[0, 3])], r"own must be \[lo, hi\] with 0 <= lo < hi <= 2 kernels"),
        ([forward_conv(give=[0, 6])], r"give must be \[lo_end, hi_start\] within \[0, 5\], got \[0, 6\]"),
        ([forward_tail()], "no conv_forward of this layer"),
        ([forward(), forward_tail()], "part 'tail' needs this worker's partial convolution: send part 'conv' first"),
        ([*SPLIT_BY_CHANNELS, forward_tail()], "send part 'conv' first"),  # the tail ran already
        ([forward_conv(), forward_tail(step=1)], "a task of step 1, but the last forward was step 0"),
        ([forward_conv(), forward_tail(b=B[:3])], r"part 'tail' takes b \(5,\) and sum \(2, 5, 8, 8\); got b \(3,\)"),
        ([forward_conv(), forward_tail(total=DY[:, :2])], r"got b \(5,\), sum \(2, 2, 8, 8\)"),
        (
            [forward_conv(), forward(part="tail", arrays={"b": B, "x": X})],
            r"forward part tail takes the arrays \['b'\] and optionally \['sum'\], got \['b', 'x'\]",
        ),
        # backward: whole after a forward by kernels, parts "tail" then "conv" after one by input channels
        ([forward(), backward(DY, part="all")], r"backward part must be 'tail' or 'conv' \(or absent for the whole\)"),
        (
            [forward(), backward(DY, part="tail")],
            r"split by kernels: its backward goes whole \(no part\), got part 'tail'",
        ),
        (
            [*SPLIT_BY_CHANNELS, backward(DY)],
            "split by input channels: its backward goes in parts tail, conv, got part None",
        ),
        (
            [forward_conv(), backward(DY, part="tail")],
            "forward of this layer is not finished: send its part 'tail' first",
        ),
        ([*SPLIT_BY_CHANNELS, backward(None, part="conv")], "conv-output gradient: send part 'tail' first"),
        (
            [*SPLIT_BY_CHANNELS, backward(None, part="conv", arrays={"dy": DY})],
            r"backward part conv takes the arrays \[\] and optionally \['dyc_hi', 'dyc_lo'\], got \['dy'\]",
        ),
        (
            [*SPLIT_BY_CHANNELS, backward(DY, part="tail"), backward(DY, part="tail")],
            "part 'tail' of this backward already ran; send part 'conv'",
        ),
        (
            [*SPLIT_BY_CHANNELS, backward(DY, part="tail"), backward(None, part="conv", arrays={"dyc_hi": DY[:, :1]})],
            r"dyc_lo, this worker's 5 kernels' gradient and dyc_hi must make \(2, 5, 8, 8\); "
            r"got \[\(2, 5, 8, 8\), \(2, 1, 8, 8\)\]",
        ),
        ([forward(), backward(None)], r"backward part whole takes the arrays \['dy'\], got none"),
        ([backward(DY)], "no conv_forward of this layer"),
        ([forward(step=1), backward(DY, step=2)], "a task of step 2, but the last forward was step 1"),
        ([forward(), backward(np.ones((2, 5, 7, 8), np.float32))], r"dy \(2, 5, 7, 8\) from channel 0 does not fit"),
        ([forward(), backward(DY.astype(np.float64))], "dy must be float32"),
        ([forward(x=X[:, :2])], "matching C and F"),
        ([forward(b=B[:3])], "matching C and F"),
        ([forward(x=X[0])], r"x \(N, C, H, W\)"),
        ([forward(w=W.astype(np.float64))], "w must be float32"),
        ([forward(stride=0)], "stride >= 1"),
        ([forward(padding=0, x=X[:, :, :2, :2])], "does not fit"),
        ([Message("result", {"task": 1, "compute_s": 0.0})], "does not handle 'result'"),
        ([Message("calibrate", {"task": 1, "layers": [], "repeats": 1})], "nothing to calibrate"),
        ([Message("calibrate", {"task": 1, "layers": [{"layer": 0}], "repeats": 1})], r"layers\[0\] must be"),
        (
            [
                Message(
                    "calibrate",
                    {
                        "task": 1,
                        "layers": [{"layer": 0, "x": [1, 3, 8], "w": [1, 3, 3, 3], "stride": 1, "padding": 0}],
                        "repeats": 1,
                    },
                )
            ],
            r"layers\[0\].x must be 4 positive ints",
        ),
        ([Message("calibrate", {"task": 1, "layers": [{}], "repeats": 0})], "repeats must be in"),
    ],
)
def test_errors_are_replies_and_the_worker_keeps_serving(steps, complaint):
    worker = ConvWorker(NumpyBackend())
    *setup, bad = steps
    for msg in setup:
        assert worker.handle(msg).kind == "result"
    reply = worker.handle(bad)
    assert re.search(complaint, error_text(reply)), reply.header["message"]
    if bad.kind != "result":
        assert reply.header.get("task") == bad.header["task"]
    assert worker.handle(forward(layer=9)).kind == "result"  # still serving


def test_a_backend_failure_is_a_reply_too():
    class Broken(NumpyBackend):
        def conv2d_forward(self, *args, **kw):
            raise MemoryError("out of device memory")

    reply = ConvWorker(Broken()).handle(forward(task=5))
    assert "MemoryError: out of device memory" in error_text(reply) and reply.header["task"] == 5


def test_calibrate_times_each_layer():
    layers = [
        {"layer": 0, "x": [2, 3, 8, 8], "w": [4, 3, 5, 5], "stride": 1, "padding": 2, "need_dx": False},
        {"layer": 1, "x": [2, 4, 4, 4], "w": [6, 4, 3, 3], "stride": 1, "padding": 1},
    ]
    r = ConvWorker(NumpyBackend()).handle(Message("calibrate", {"task": 7, "layers": layers, "repeats": 2}))
    check_message(r)
    assert r.kind == "result" and r.header["task"] == 7
    assert len(r.header["times"]) == 2 and all(t > 0 for t in r.header["times"])
    assert r.header["compute_s"] >= sum(r.header["times"])
    assert "forward_times" not in r.header  # forward + backward only: every split is balanced on both


def test_calibrate_refuses_shapes_over_its_memory_limit():
    layers = [{"layer": 0, "x": [64, 64, 64, 64], "w": [64, 64, 5, 5], "stride": 1, "padding": 2}]
    worker = ConvWorker(NumpyBackend(), max_calibrate_bytes=1 << 20)
    reply = worker.handle(Message("calibrate", {"task": 1, "layers": layers, "repeats": 1}))
    assert "over this worker's limit" in error_text(reply)


class SlowBackend(NumpyBackend):
    """A convolution that takes at least 20 ms, so timings are predictable."""

    def conv2d_forward(self, *args, **kw):
        threading.Event().wait(0.02)
        return super().conv2d_forward(*args, **kw)


def test_slowdown_scales_the_reported_time_and_the_wall_time():
    worker = ConvWorker(SlowBackend(), slowdown=3.0)
    t0 = time.perf_counter()
    reply = worker.handle(forward())
    wall = time.perf_counter() - t0
    compute_s = reply.header["compute_s"]
    assert compute_s >= 3 * 0.02  # F x the >= 20 ms the backend took
    assert wall >= compute_s - 1e-3  # and the worker really took that long
    times = worker.handle(
        Message(
            "calibrate",
            {
                "task": 1,
                "layers": [{"layer": 0, "x": [1, 3, 8, 8], "w": [2, 3, 3, 3], "stride": 1, "padding": 1}],
                "repeats": 1,
            },
        )
    ).header
    assert times["times"][0] >= 3 * 0.02  # forward + backward, of which the forward is the slow op


def test_slowdown_below_one_is_refused():
    with pytest.raises(ValueError, match="slowdown must be"):
        ConvWorker(NumpyBackend(), slowdown=0.5)


# ---- command line ------------------------------------------------------------------------


def test_cli_help_runs_without_numpy():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tinyconv.worker import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    print('numpy' in sys.modules, e.code)",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "--connect" in out.stdout and "--threads" in out.stdout
    assert out.stdout.strip().endswith("False 0")


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--connect", "tcp://127.0.0.1:1", "--slowdown", "0.5"])
    assert info.value.code == 2 and "must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])  # --connect is required
    assert "--connect" in capsys.readouterr().err


def test_cli_unknown_backend_is_one_line(capsys):
    assert main(["--connect", "tcp://127.0.0.1:1", "--backend", "abacus"]) == 1
    err = capsys.readouterr().err
    assert "cannot start backend 'abacus'" in err and "available: " in err


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
    from tinyconv.worker import main
    rc = main(["--connect", {connect!r}, "--threads", "3", "--connect-timeout", "0.3"])
    print(json.dumps({{"rc": rc, "seen": seen}}))
    """
)


def test_threads_are_set_before_numpy_is_imported(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV_VARS}
    script = SPY.format(vars=THREAD_ENV_VARS, connect=f"ipc://{tmp_path}/nobody.sock")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["seen"] == {v: "3" for v in THREAD_ENV_VARS}
    # nobody listens there: the worker gives up after --connect-timeout, with one line saying why
    assert result["rc"] == 1 and "no welcome from a master" in out.stderr

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
from tinyconv.worker import THREAD_ENV_VARS, ConvWorker, main
from transports.base import PROTOCOL_VERSION, Handler, Message
from transports.wire import check_message

RNG = np.random.default_rng(7)
X = RNG.standard_normal((2, 3, 8, 8), dtype=np.float32)
W = RNG.standard_normal((5, 3, 3, 3), dtype=np.float32)
B = RNG.standard_normal((5,), dtype=np.float32)


def forward(task=1, step=0, layer=0, x=X, w=W, b=B, stride=1, padding=1, need_dx=True) -> Message:
    header = {
        "task": task,
        "step": step,
        "layer": layer,
        "stride": stride,
        "padding": padding,
        "need_dx": need_dx,
    }
    return Message("conv_forward", header, {"x": x, "w": w, "b": b})


def backward(dy, task=2, step=0, layer=0, part=None, arrays=None) -> Message:
    header = {"task": task, "step": step, "layer": layer} | ({"part": part} if part else {})
    return Message("conv_backward", header, (arrays or {}) if dy is None else {"dy": dy})


def error_text(reply: Message) -> str:
    assert reply.kind == "error", reply
    check_message(reply)
    return reply.header["message"]


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


def reference_backward() -> tuple[np.ndarray, ...]:
    """A random dy for forward()'s output and the reference (dy, dx, dw, db) from the numpy backend."""
    be = NumpyBackend()
    _, cache = be.conv2d_forward(X, W, B, 1, 1)
    dy = RNG.standard_normal((2, 5, 8, 8), dtype=np.float32)
    return (dy, *be.conv2d_backward(dy, cache, True))


def test_a_backward_in_three_parts_gives_the_conv_gradient_then_the_weights_then_dx_of_some_channels():
    worker = ConvWorker(NumpyBackend())
    dy, dx_ref, dw_ref, db_ref = reference_backward()
    worker.handle(forward())
    r = worker.handle(backward(dy, part="dyc"))
    check_message(r)
    assert set(r.arrays) == {"dyc"}
    np.testing.assert_array_equal(r.arrays["dyc"], dy)  # no tail: the conv-output gradient is dy itself
    r = worker.handle(backward(None, part="dw"))
    check_message(r)
    assert set(r.arrays) == {"dw", "db"}
    np.testing.assert_array_equal(r.arrays["dw"], dw_ref)
    np.testing.assert_array_equal(r.arrays["db"], db_ref)
    # as if this worker owned kernels [2, 4) of 5: the others' gradients come around its own;
    # dx before dw works too (dx needs only the kept gradient)
    msg = backward(None, task=3, part="dx")
    msg.header["dx_channels"] = [1, 3]
    msg.arrays.update(w=np.ascontiguousarray(W[:, 1:3]), dyc_lo=dy[:, :2], dyc_hi=dy[:, 4:])
    worker.handle(forward(w=W[2:4], b=B[2:4]))
    r = worker.handle(backward(np.ascontiguousarray(dy[:, 2:4]), part="dyc"))
    np.testing.assert_array_equal(r.arrays["dyc"], dy[:, 2:4])
    r = worker.handle(msg)
    check_message(r)
    assert set(r.arrays) == {"dx"}
    np.testing.assert_allclose(r.arrays["dx"], dx_ref[:, 1:3], rtol=1e-5, atol=1e-5)
    r = worker.handle(backward(None, part="dw"))
    np.testing.assert_allclose(r.arrays["dw"], dw_ref[2:4], rtol=1e-5, atol=1e-5)
    assert "no conv_forward" in error_text(worker.handle(msg))  # the backward is complete


def test_the_dx_part_refuses_gradients_that_do_not_add_up_to_the_weights():
    worker = ConvWorker(NumpyBackend())
    dy, *_ = reference_backward()
    worker.handle(forward())
    worker.handle(backward(dy, part="dyc"))
    msg = backward(None, task=3, part="dx")
    msg.header["dx_channels"] = [1, 3]
    msg.arrays.update(w=np.ascontiguousarray(W[:, :1]))  # one channel of weights for two channels of dx
    assert "needs w (5, 2, 3, 3)" in error_text(worker.handle(msg))
    msg.arrays.update(w=np.ascontiguousarray(W[:, 1:3]), dyc_hi=dy[:, :1])  # 6 kernels' gradients for 5
    assert "from 6 kernels' gradients" in error_text(worker.handle(msg))
    msg.arrays.update(dyc_hi=dy[:1, :1])
    assert "dyc_lo and dyc_hi must be (2, kernels, 8, 8)" in error_text(worker.handle(msg))
    del msg.header["dx_channels"]
    assert "needs dx_channels" in error_text(worker.handle(msg))
    assert "part 'dyc' of this forward already ran" in error_text(worker.handle(backward(dy, part="dyc")))
    assert "running in parts" in error_text(worker.handle(backward(dy)))
    worker.handle(backward(None, part="dw"))
    assert "part 'dw' of this forward already ran" in error_text(worker.handle(backward(None, part="dw")))


@pytest.mark.parametrize(
    ("steps", "complaint"),
    [
        ([forward(), backward(None, part="dx", arrays={"w": W})], "send part 'dyc' first"),
        ([forward(), backward(None, part="dw")], "send part 'dyc' first"),
        ([forward(), backward(None, part="dw", arrays={"dy": np.ones((2, 5, 8, 8), np.float32)})], "takes the arrays"),
        ([forward(), backward(None)], r"part whole takes the arrays \['dy'\], got none"),
        ([forward(), backward(np.ones((2, 5, 8, 8), np.float32), part="all")], "part must be 'dyc', 'dw' or 'dx'"),
        ([backward(np.ones((2, 5, 8, 8), np.float32))], "no conv_forward of this layer"),
        ([forward(step=1), backward(np.ones((2, 5, 8, 8), np.float32), step=2)], "last forward was step 1"),
        ([forward(), backward(np.ones((2, 5, 7, 8), np.float32))], r"dy \(2, 5, 7, 8\) from channel 0 does not fit"),
        ([forward(), backward(np.ones((2, 5, 8, 8), np.float64))], "dy must be float32"),
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
    # the forward alone, timed inside each of the same runs: more than nothing, less than the whole
    forward_times = r.header["forward_times"]
    assert len(forward_times) == 2 and all(0 < f < t for f, t in zip(forward_times, r.header["times"], strict=True))


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
    assert times["times"][0] >= 3 * 0.02 and times["forward_times"][0] >= 3 * 0.02  # the forward is the slow op


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

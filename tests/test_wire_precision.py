"""Reduced-precision shards on the wire (issue #15): the formats' round trips, the fallback on
overflow, AWP's controller, the codec's checks of declared formats, exact bytes, and training."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest

import tinyconv as tc
from backends.numpy_backend import NumpyBackend
from tinyconv.distributed import wire_codec
from tinyconv.distributed import wire_precision as wp
from tinyconv.distributed.accounting import OpStats
from tinyconv.distributed.adaptive_precision import AdaptivePrecision, formats_of, policy
from tinyconv.distributed.protocol import TaskError, check_result, check_task
from tinyconv.distributed.rpc import Lost, Rpc
from tinyconv.distributed.wire_codec import Narrowing, decode_task, narrowed
from tinyconv.distributed.worker.handler import Worker
from tinyconv.lab.eq2 import block_bytes, conv_shapes, equal_counts, measure, split_bytes, wire_words
from tinyconv.lab.eq2 import main as comm_main
from tinyconv.metrics import read_metrics
from tinyconv.model import paper_net
from tinyconv.optim import SGD
from transports.base import Message, Transport, WorkerInfo
from transports.wire import decode, encode

ROOT = Path(__file__).resolve().parent.parent
NARROW = ("adt24", "bf16", "fp16")
U_BF16 = 2.0**-8


def round_trip(x: np.ndarray, fmt: str) -> np.ndarray:
    n = wp.narrow(x, fmt)
    assert n.fmt == fmt and not n.fell_back
    wp.check_carried(fmt, n.carried)
    assert n.carried.nbytes == x.size * wp.WORD_BYTES[fmt]
    return wp.widen(n.carried, fmt)


# ---- the formats --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp32", *NARROW])
def test_each_format_meets_its_relative_error_bound_on_normal_numbers(fmt):
    rng = np.random.default_rng(0)
    top = 60000.0 if fmt == "fp16" else 1e38  # fp16's normal range ends at 65504
    low = 2.0**-14 if fmt == "fp16" else 2.0**-126
    mags = np.exp(rng.uniform(np.log(low), np.log(top), 200_000))
    x = (mags * rng.choice([-1.0, 1.0], mags.size)).astype(np.float32).reshape(2, 100, 1000)
    y = round_trip(x, fmt)
    assert y.dtype == np.float32 and y.shape == x.shape
    rel = np.abs(y.astype(np.float64) - x) / np.abs(x.astype(np.float64))
    assert rel.max() <= wp.RELATIVE_ERROR[fmt]
    if fmt != "fp32":  # rounded, not truncated: the worst case comes close to the bound, the mean error is 0
        assert rel.max() > 0.9 * wp.RELATIVE_ERROR[fmt]
        assert abs(np.mean((y.astype(np.float64) - x) / np.abs(x))) < wp.RELATIVE_ERROR[fmt] / 50


def test_bf16_and_adt24_round_ties_to_even():
    one = np.float32(1.0)
    # halfway between 1 and the next bf16 (1 + 2^-7): to 1, the even one; 1 + 3 * 2^-8: up to 1 + 2^-6
    x = np.array([one + 2.0**-8, one + 3 * 2.0**-8, one + 2.0**-8 + 2.0**-20], np.float32)
    assert round_trip(x, "bf16").tolist() == [1.0, 1.0 + 2.0**-6, 1.0 + 2.0**-7]
    x = np.array([one + 2.0**-16, one + 3 * 2.0**-16], np.float32)
    assert round_trip(x, "adt24").tolist() == [1.0, 1.0 + 2.0**-14]


@pytest.mark.parametrize("fmt, bound", [("adt24", 2.0**-142), ("bf16", 2.0**-134), ("fp16", 2.0**-25)])
def test_subnormals_and_tiny_numbers_meet_the_absolute_bound(fmt, bound):
    rng = np.random.default_rng(1)
    top = 2.0**-14 if fmt == "fp16" else 2.0**-126  # below the format's normal range
    x = (rng.uniform(-top, top, 100_000)).astype(np.float32)
    x[:3] = [np.float32(1.4e-45), -np.float32(1.4e-45), np.float32(2.0**-30)]  # float32's smallest subnormal
    assert np.abs(round_trip(x, fmt).astype(np.float64) - x).max() <= bound


@pytest.mark.parametrize("fmt", NARROW)
def test_zeros_infinities_and_nans_travel_as_themselves(fmt):
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0], np.float32)
    x[5] = np.uint32(0x7F800001).view(np.float32)  # a NaN whose payload is only in the dropped bits
    y = round_trip(x, fmt)
    assert y[0] == 0 and not np.signbit(y[0]) and y[1] == 0 and np.signbit(y[1])
    assert y[2] == np.inf and y[3] == -np.inf and np.isnan(y[4]) and np.isnan(y[5]) and y[6] == 1.0


def test_the_largest_numbers_fall_back_to_fp32_where_the_format_would_overflow():
    big = np.finfo(np.float32).max
    # fp16: 65504 is its largest; 65519 still rounds down to it, 65520 would be infinity
    assert round_trip(np.array([65504.0, 65519.0, -65504.0], np.float32), "fp16").tolist() == [65504, 65504, -65504]
    for fmt, x in (("fp16", [1.0, 65520.0]), ("fp16", [-1e30, 0.5]), ("bf16", [big, 1.0]), ("adt24", [-big, 0.0])):
        a = np.array(x, np.float32)
        n = wp.narrow(a, fmt)
        assert n.fell_back and n.fmt == "fp32" and n.carried.dtype == np.float32
        assert np.array_equal(wp.widen(n.carried, n.fmt), a)  # exactly as it was
    # a value that rounds up but stays finite is fine in bf16: float32's largest rounded down is finite
    assert np.isfinite(round_trip(np.array([np.float32(3.0e38)], np.float32), "bf16")).all()


def test_a_nan_or_inf_already_in_the_data_is_not_a_fallback():
    for fmt in NARROW:
        n = wp.narrow(np.array([np.nan, np.inf, 1e30 if fmt != "fp16" else 1.0], np.float32), fmt)
        assert not n.fell_back and n.fmt == fmt


def test_unknown_formats_and_empty_arrays():
    with pytest.raises(ValueError, match="unknown wire format 'bf8'.*fp32, bf16, fp16, adt24"):
        wp.narrow(np.zeros(3, np.float32), "bf8")
    for fmt in NARROW:
        assert wp.widen(wp.narrow(np.zeros((0, 4), np.float32), fmt).carried, fmt).shape == (0, 4)


def s8_round_trip(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x through s8 and back, checked on the way: (x', each number's plane scale s, broadcast to x)."""
    n = wp.narrow(x, "s8")
    assert n.fmt == "s8" and not n.fell_back and n.carried.dtype == np.uint8
    assert n.carried.shape == wp.carried_shape(x.shape, "s8") and n.carried.nbytes == wp.nbytes_of(x.shape, "s8")
    wp.check_carried(n.declared, n.carried)
    y = wp.widen(decode(encode(Message("t", {"narrow": n.declared}, {"x": n.carried}))).arrays["x"], n.declared)
    scales = np.ascontiguousarray(n.carried[..., :4]).view("<f4")  # the carrier's first 4 bytes a plane
    lead = x.shape[:-2] if x.ndim >= 3 else ()
    s = np.broadcast_to(scales.reshape(*lead, *([1] * min(x.ndim, 2))), x.shape)
    assert y.dtype == np.float32 and y.shape == x.shape
    return y, s


def s8_bound(y: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The module docstring's bound on |x' - x|: half a step s / 2, plus the float32 rounding of q s."""
    return s.astype(np.float64) / 2 + 2.0**-24 * np.abs(y.astype(np.float64))


@pytest.mark.parametrize("shape", [(3, 4, 8, 8), (2, 5, 1, 1), (6, 3, 5, 5), (1, 7, 3), (17,), (4, 9), (1,)])
def test_s8_meets_its_bound_half_a_step_of_each_planes_largest_over_127(shape):
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-40, 40, shape[:-2] + (1, 1) if len(shape) >= 3 else ()))
    x = x.astype(np.float32)
    x.reshape(-1)[0] = -np.abs(x).max()  # a plane whose largest magnitude is negative: q = -127
    y, s = s8_round_trip(x)
    err = np.abs(y.astype(np.float64) - x)
    assert np.all(err <= s8_bound(y, s))
    m = np.abs(x).reshape(*(x.shape[:-2] if x.ndim >= 3 else ()), -1).max(axis=-1)
    m = np.broadcast_to(m.reshape(*m.shape, *([1] * min(x.ndim, 2))), x.shape)
    assert np.all(s >= m / 127) and np.all(s <= m / 127 * (1 + 2.0**-23))  # s = max|plane| / 127, rounded up
    assert np.all(err <= m / 254 * (1 + 2.0**-15))  # i.e. 1/254 of the plane's largest
    if x.size >= 64:  # rounded, not truncated: the error comes close to the bound, and it is unbiased
        assert (err / (s / 2)).max() > 0.9 and abs(np.mean((y.astype(np.float64) - x) / s)) < 0.05


def test_s8_zero_planes_single_numbers_signed_zeros_and_subnormals():
    x = np.zeros((2, 3, 2, 2), np.float32)
    x[0, 1] = [[-0.0, 1.0], [-2.0, 0.5]]  # -0 beside others: 0 (+0: int8 has no -0)
    x[1, 0] = -0.0  # a plane of -0 only: s = 0, q = 0
    x[1, 2] = [[1e-45, -3e-45], [2.0**-140, 0.0]]  # subnormals: m / 127 is below float32's smallest step
    y, s = s8_round_trip(x)
    assert s[0, 0, 0, 0] == 0 and s[1, 0, 0, 0] == 0 and np.all(y[0, 0] == 0) and np.all(y[1, 0] == 0)
    assert not np.signbit(y[0, 1, 0, 0]) and not np.signbit(y[1, 0]).any()
    assert y[0, 1, 1, 0] == -127 * s[0, 1, 0, 0] and abs(y[0, 1, 1, 0] + 2.0) <= 2.0**-22  # the largest: q = -127
    assert np.all(np.abs(y.astype(np.float64) - x) <= s8_bound(y, s)) and s[1, 2, 0, 0] > 0
    q = wp.narrow(x, "s8").carried[1, 2, 4:].view(np.int8)  # s rounded up to a subnormal step: |q| <= 127
    assert q.size == 4 and np.abs(q.astype(int)).max() <= 127
    for one in ([3.5], [-3.5]):  # a single number is its own plane's largest: exact up to s's rounding
        y, s = s8_round_trip(np.array(one, np.float32))
        assert abs(y[0] - one[0]) <= s8_bound(y, s)[0] and abs(y[0] - one[0]) < 1e-6


def test_s8_a_plane_with_nan_or_inf_sends_the_whole_array_fp32_and_says_so():
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones((2, 2, 3, 3), np.float32)
        x[1, 0, 2, 1] = bad
        n = wp.narrow(x, "s8")
        assert n.fell_back and n.fmt == "fp32" and n.declared == "fp32" and n.carried.dtype == np.float32
        assert np.array_equal(wp.widen(n.carried, n.declared), x, equal_nan=True)
    arrays, narrow, fell = narrowed({"y": x, "w": np.ones((2, 2, 3, 3), np.float32)}, {"y": "s8", "w": "s8"})
    assert fell == 1 and narrow == {"w": ["s8", 3, 3]} and arrays["y"].dtype == np.float32


# ---- the protocol: declared formats are checked before anything is widened ------------------------


def block_forward(narrow=None, reply=None, **arrays):
    a = {"x": np.ones((1, 1, 3, 3), np.float32), "w": np.ones((1, 1, 3, 3), np.float32), "b": np.zeros(1, np.float32)}
    header = {"task": 1, "step": 0, "layer": 0, "stride": 1, "padding": 1, "tail": [], "own": [0, 1]}
    header |= ({"narrow": narrow} if narrow is not None else {}) | ({"reply": reply} if reply is not None else {})
    return Message("block_forward", header, a | arrays)


@pytest.mark.parametrize(
    "narrow, reply, arrays, error",
    [
        ({"x": "bf16"}, None, {}, "x: declared bf16, which travels as uint16, but the array is float32"),
        ({"x": "fp16"}, None, {"x": np.ones((1, 1, 3, 3), np.uint16)}, "declared fp16.*float16.*uint16"),
        ({"x": "adt24"}, None, {"x": np.ones((1, 1, 3, 4), np.uint8)}, "last axis of 3 bytes.*\\(1, 1, 3, 4\\)"),
        ({"x": "bf8"}, None, {}, "x: unknown wire format 'bf8'; the formats are fp32, bf16, fp16, adt24"),
        ({"dy": "bf16"}, None, {}, "names 'dy', which is not one of its float32 arrays"),
        (None, {"y": 16}, {}, "reply: y: unknown wire format 16"),
        (None, {"dw": "bf16"}, {}, "reply names 'dw'"),
        (None, None, {"x": np.ones((1, 1, 3, 3), np.uint16)}, "x must be float32, got uint16"),
        ("bf16", None, {}, "header 'narrow' must be map, got str"),
        ({"x": ["s8", 3, 3]}, None, {}, "x: declared s8, which travels as uint8, but the array is float32"),
        ({"x": ["s8", 3, 3]}, None, {"x": np.ones((1, 1, 13), np.int8)}, "travels as uint8, but the array is int8"),
        ({"x": ["s8", 3, 3]}, None, {"x": np.zeros((1, 1, 12), np.uint8)}, "uint8 \\(lead..., 13\\).*\\(1, 1, 12\\)"),
        ({"x": ["s8", 9]}, None, {"x": np.zeros((1, 1, 13), np.uint8)}, "uint8 \\(lead..., 13\\).*\\(1, 1, 13\\)"),
        ({"x": ["s8", 3, 3]}, None, {"x": np.full((1, 1, 13), 255, np.uint8)}, "scale is not a finite number >= 0"),
        ({"x": "s8"}, None, {"x": np.zeros((1, 1, 13), np.uint8)}, "declared with its plane, \\['s8', H, W\\]"),
        ({"x": ["s8", 3, -1]}, None, {"x": np.zeros((1, 1, 1), np.uint8)}, "up to 2 sizes >= 0"),
        ({"x": ["s8", 3.0, 3]}, None, {"x": np.zeros((1, 1, 13), np.uint8)}, "up to 2 sizes >= 0"),
        (None, {"y": ["s8", 3, 3]}, {}, "reply: y: unknown wire format \\['s8', 3, 3\\]"),
    ],
)
def test_bad_declared_formats_are_refused_before_anything_is_widened(monkeypatch, narrow, reply, arrays, error):
    msg = block_forward(narrow, reply, **arrays)
    with pytest.raises(TaskError, match=error):
        check_task(decode_task(msg, NumpyBackend(), frozenset())[0])  # the worker's edge, then the protocol

    def never(*_):
        raise AssertionError("widened before it was checked")

    monkeypatch.setattr(wire_codec, "widened", never)
    answer = Worker(NumpyBackend()).handle(msg)
    assert answer.kind == "error" and "widened" not in answer.header["message"]


def test_calibrations_and_replicas_take_no_narrow_key_and_results_are_checked_too():
    calibrate = Message("calibrate", {"task": 1, "layers": [], "repeats": 1, "narrow": {}})
    assert decode_task(calibrate, NumpyBackend(), frozenset()) == (calibrate, {})  # not the codec's: as it came
    with pytest.raises(TaskError, match="unexpected header key"):
        check_task(calibrate)
    task = Message("block_forward", {"task": 1, "reply": {"y": "bf16"}})
    ok = Message("result", {"task": 1, "compute_s": 0.1, "narrow": {"y": "bf16"}}, {"y": np.zeros(3, np.uint16)})
    with pytest.raises(RuntimeError, match="unexpected header key"):  # the protocol proper speaks float32
        check_result(ok, "block_forward")
    decoded, fell_back = Narrowing({"y": "bf16"}).decode(ok, task)
    check_result(decoded, "block_forward")
    assert fell_back == 0 and decoded.arrays["y"].dtype == np.float32 and "narrow" not in decoded.header
    bad = Message("result", {"task": 1, "compute_s": 0.1, "narrow": {"y": "bf16"}}, {"y": np.zeros(3, np.float16)})
    with pytest.raises(RuntimeError, match="a result of block_forward.s narrow: y: declared bf16.*float16"):
        Narrowing({"y": "bf16"}).decode(bad, task)
    with pytest.raises(RuntimeError, match="a malformed result of block_forward: result: header 'narrow' must be map"):
        Narrowing({"y": "bf16"}).decode(Message("result", ok.header | {"narrow": "bf16"}, ok.arrays), task)
    with pytest.raises(RuntimeError, match="unexpected header key"):
        check_result(Message("result", {"task": 1, "compute_s": 0.1, "times": [1.0], "narrow": {}}), "calibrate")


def test_a_narrowed_task_crosses_the_wire_codec_and_the_worker_answers_in_the_asked_formats():
    x = np.random.default_rng(2).standard_normal((2, 3, 6, 6)).astype(np.float32)
    w = np.random.default_rng(3).standard_normal((4, 3, 3, 3)).astype(np.float32)
    arrays, narrow, fell = narrowed({"x": x, "w": w, "b": np.zeros(4, np.float32)}, {"x": "adt24", "w": "bf16"})
    assert fell == 0 and narrow == {"x": "adt24", "w": "bf16"}
    task = block_forward(narrow, {"y": "fp16"}, **arrays)
    task.header["own"] = [0, 4]
    msg = decode(encode(task))  # the frames every transport carries
    reply = decode(encode(Worker(NumpyBackend()).handle(msg)))
    assert reply.kind == "result" and reply.header["narrow"] == {"y": "fp16"} and reply.arrays["y"].dtype == np.float16
    be = NumpyBackend()
    expected, _ = be.conv2d_forward(wp.widen(arrays["x"], "adt24"), wp.widen(arrays["w"], "bf16"), np.zeros(4), 1, 1)
    assert np.array_equal(wp.widen(reply.arrays["y"], "fp16"), be.to_numpy(expected).astype(np.float16))


def test_an_s8_task_crosses_the_wire_codec_and_the_worker_answers_in_s8():
    x = np.random.default_rng(2).standard_normal((2, 3, 6, 5)).astype(np.float32)
    w = np.random.default_rng(3).standard_normal((4, 3, 3, 3)).astype(np.float32)
    arrays, narrow, fell = narrowed({"x": x, "w": w, "b": np.zeros(4, np.float32)}, {"x": "s8", "w": "s8", "b": "s8"})
    assert fell == 0 and narrow == {"x": ["s8", 6, 5], "w": ["s8", 3, 3], "b": ["s8", 4]}
    assert arrays["x"].shape == (2, 3, 34) and arrays["b"].shape == (8,)
    task = block_forward(narrow, {"y": "s8"}, **arrays)
    task.header["own"] = [0, 4]
    reply = decode(encode(Worker(NumpyBackend()).handle(decode(encode(task)))))
    assert reply.kind == "result" and reply.header["narrow"] == {"y": ["s8", 6, 5]}, reply.header
    check_result(Narrowing({"y": "s8"}).decode(reply, task)[0], "block_forward")  # the master's edge, then the protocol
    be = NumpyBackend()
    expected, _ = be.conv2d_forward(wp.widen(arrays["x"], narrow["x"]), wp.widen(arrays["w"], narrow["w"]),
                                    np.zeros(4), 1, 1)  # fmt: skip
    again = wp.narrow(be.to_numpy(expected), "s8").carried
    assert np.array_equal(reply.arrays["y"], again)  # the worker computed on the widened arrays, then narrowed


# ---- the master's side: fallbacks counted, NaN still loses a worker -------------------------------


class Loopback(Transport):
    """Workers in this thread: each task goes through the wire codec to ``make()``'s handler."""

    name = "loopback"

    def __init__(self, handlers) -> None:
        self.handlers, self.inbox = handlers, deque()

    def start(self, n_workers, timeout=60.0):
        return [WorkerInfo(i, "numpy", {"device": "cpu"}) for i in range(n_workers)]

    def send(self, worker, msg):
        reply = self.handlers[worker](decode(encode(msg)))
        self.inbox.append((worker, decode(encode(reply))))

    def recv(self, timeout):
        if not self.inbox:
            raise TimeoutError("nothing")
        return self.inbox.popleft()

    def close(self):
        pass


def test_an_overflowing_array_goes_fp32_both_ways_and_is_counted():
    worker = Worker(NumpyBackend())
    rpc = Rpc(Loopback([worker.handle]), Loopback([]).start(1), timeout=5.0)
    formats = formats_of(policy("fp16").roles("conv1"))
    x = np.ones((1, 1, 4, 4), np.float32)
    for x_max, w, fallbacks in ((1e5, 1e-6, 1), (1.0, 1e5, 2), (1.0, 1.0, 0)):  # x alone; w and the maps y
        x[0, 0, 0, 0] = x_max
        op = rpc.op("forward of conv1", NumpyBackend(), {"step": 0, "layer": 0}, codec=Narrowing(formats))
        arrays = {"x": x, "w": np.full((2, 1, 3, 3), w, np.float32), "b": np.zeros(2, np.float32)}
        task = op.send(0, Message("block_forward", {"stride": 1, "padding": 1, "tail": [], "own": [0, 2]}, arrays))
        y = op.gather([task])[0].arrays["y"]
        assert y.dtype == np.float32 and op.fallbacks == fallbacks == OpStats.from_op(op, [("worker0", 0)]).fallbacks
        expected = 0.0 if w < 1 else 9 * w  # the centre of a 3x3 of ones
        assert y[0, 0, 2, 2] == pytest.approx(expected, rel=2**-11, abs=1e-3)


class NanWorker:
    """Answers every block_forward with a NaN in y, narrowed as asked."""

    def handle(self, msg):
        y = np.array([[[[np.nan, 1.0]]]], np.float32)
        arrays, narrow, _ = narrowed({"y": y}, msg.header.get("reply", {}))
        return Message("result", {"task": msg.header["task"], "compute_s": 0.0, "narrow": narrow}, arrays)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "adt24", "s8"])
def test_a_worker_answering_finite_inputs_with_a_narrowed_nan_is_still_lost(fmt):
    rpc = Rpc(Loopback([NanWorker().handle]), Loopback([]).start(1), timeout=5.0)
    op = rpc.op("forward of conv2", NumpyBackend(), {"step": 0, "layer": 1}, codec=Narrowing({"x": fmt, "y": fmt}))
    task = op.send(0, Message("block_forward", {}, {"x": np.ones((1, 1, 2, 2), np.float32)}))
    with pytest.raises(Lost, match="non-finite values in y"):
        op.gather([task])
    assert op.fallbacks == (fmt == "s8")  # s8 cannot scale a NaN: y came back fp32, counted


# ---- AWP's controller --------------------------------------------------------------------------


def trajectory(rates: list[tuple[int, float]]) -> list[float]:
    """The norm after each step 1..: ``rates`` = [(until step, relative growth per step), ...]."""
    norms, norm, step = [], 10.0, 1
    for until, g in rates:
        while step <= until:
            norm *= 1 + g
            norms.append(norm)
            step += 1
    return norms


def test_awp_widens_each_layer_as_its_weight_norm_settles_and_never_narrows_again():
    awp = AdaptivePrecision()  # checks every 20 steps: widen below 2^-7, then below 2^-15 per interval
    w0 = np.random.default_rng(4).standard_normal(500)
    w0 /= np.linalg.norm(w0)
    # conv1: ~5 % per interval for 100 steps, then 0.1 %, then 1e-6, then a burst of 20 %
    conv1 = trajectory([(100, 2.5e-3), (200, 5e-5), (300, 5e-8), (340, 1e-2)])
    conv2 = trajectory([(340, 2.5e-3)])  # keeps moving: stays bf16
    seen = {}
    for step, (n1, n2) in enumerate(zip(conv1, conv2, strict=True), start=1):
        seen.setdefault(awp.roles("conv1")["weights"], step)
        assert awp.roles("conv2") == {"weights": "bf16", "maps": "s8", "grads": "bf16"}
        awp.observe(step, "conv1", w0 * n1)
        awp.observe(step, "conv2", w0 * n2)
    # checks at 1, 21, ..., 121: 102..121 all at 0.1 % < 2^-7 -> adt24 from step 122; 202..221 at 1e-6 -> fp32
    assert seen == {"bf16": 1, "adt24": 122, "fp32": 222}
    assert awp.roles("conv1") == {"weights": "fp32", "maps": "s8", "grads": "bf16"}


def test_policies_are_checked():
    assert isinstance(policy("adaptive"), AdaptivePrecision) and policy("bf16").roles("x")["maps"] == "bf16"
    with pytest.raises(ValueError, match="--wire-precision must be one of fp32, bf16, fp16, adt24, s8, adaptive"):
        policy("int8")
    with pytest.raises(ValueError, match="--wire-precision must be one of"):
        tc.distribute(paper_net("2:4", "numpy"), "inproc", 1, wire_precision="fp8", calibrate=False)


# ---- bytes: the model and a real step agree exactly -----------------------------------------------


@pytest.mark.parametrize(
    "setting, fuse, split, participants",
    [("bf16", False, "kernels", 2), ("bf16", False, "kernels", 3), ("fp16", False, "kernels", 2),
     ("adt24", False, "kernels", 3), ("bf16", True, "kernels", 3), ("bf16", True, "channels", 3),
     ("s8", False, "kernels", 2), ("s8", True, "kernels", 3), ("s8", True, "channels", 3),
     ("adaptive", False, "kernels", 2), ("adaptive", True, "channels", 3)],
)  # fmt: skip
def test_modelled_and_measured_bytes_agree_exactly(setting, fuse, split, participants):
    convs = conv_shapes(paper_net("4:8", "numpy"), 2)
    counts = equal_counts(convs, participants)
    words = wire_words(setting)[0][1]  # adaptive: AWP's start, where one real step runs
    model = split_bytes(convs, counts, fuse, split, words)
    assert measure("4:8", 2, participants, fuse=fuse, split=split, wire_precision=setting) == model
    fp32 = split_bytes(convs, counts, fuse, split)
    if setting in ("s8", "adaptive"):  # a byte a number and 4 per plane: more than a quarter of float32's
        assert all(f / 4 < m < f / 2 for m, f in zip(model, fp32, strict=True))
        return
    per = wp.WORD_BYTES[setting]
    assert [m * 4 for m in model] == [f * per for f in fp32]  # every array narrowed: exactly per/4 of float32's


def test_s8_bytes_are_a_byte_a_number_and_a_scale_a_plane():
    assert wp.nbytes_of((64, 50, 16, 16), "s8") == 64 * 50 * (4 + 256)  # conv2's x: a plane per image and channel
    assert wp.nbytes_of((500, 50, 5, 5), "s8") == 500 * 50 * (4 + 25)  # its weights: a plane per kernel and channel
    assert wp.nbytes_of((500,), "s8") == 4 + 500 and wp.nbytes_of((3, 4), "s8") == 4 + 12  # one scale for all
    assert wp.nbytes_of((64, 50, 16, 16), "bf16") == 64 * 50 * 256 * 2
    # the paper's split of one layer, one worker with k of F kernels: x out, k kernels and biases out, k maps back
    conv = conv_shapes(paper_net("4:8", "numpy"), 2)[1]  # x (2, 4, 16, 16), w (8, 4, 5, 5), y (2, 8, 16, 16)
    (n, c, h, w), k = conv.x, 3
    assert block_bytes(conv, k, k, (), dict.fromkeys(("weights", "maps", "grads"), "s8")) == (
        n * c * (4 + h * w) + k * c * (4 + 25) + 4 + k, n * k * (4 + h * w),
        n * k * (4 + h * w), k * c * (4 + 25) + 4 + k + n * c * (4 + h * w))  # fmt: skip


def test_tinyconv_comm_prints_each_setting_with_its_ratios_to_eq2(capsys):
    argv = ["--arch", "4:8", "--batch-size", "2", "--workers", "1", "--wire-precision", "fp32", "bf16", "adaptive"]
    assert comm_main([*argv, "--run-step"]) == 0
    out = capsys.readouterr().out
    assert "forward / eq. 2" in out and "adaptive (settled)" in out and "differs" not in out
    paper_bf16 = next(line for line in out.splitlines() if "paper" in line and "| bf16" in line)
    forward = float(paper_bf16.split("|")[7].strip(" %"))
    assert 25.0 <= forward < 25.5  # x, w and y in 2 bytes instead of 8: a quarter of eq. 2, and the biases


# ---- training --------------------------------------------------------------------------------


def train(setting: str, transport: str = "inproc", steps: int = 4, split: str = "kernels", fuse: bool = False,
          awp: AdaptivePrecision | None = None):  # fmt: skip
    """``steps`` SGD steps of paper_net 6:10 on 16x16 random images, batch 8, one worker and the master
    on an equal split: the losses and each step's record."""
    net = paper_net("6:10", "numpy", seed=0, image_size=16)
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((steps, 8, 3, 16, 16), dtype=np.float32)
    ys = rng.integers(0, 10, (steps, 8))
    opt = SGD(net, 0.05, momentum=0.9)
    losses, records = [], []
    with tc.distribute(net, transport, 1, split=split, fuse=fuse, calibrate=False, rebalance=False, batch_size=8,
                       image_size=16, announce=lambda _: None, wire_precision=setting) as cluster:  # fmt: skip
        if awp is not None:
            cluster.wire = awp
        for x, y in zip(xs, ys, strict=True):
            losses.append(net.train_step(x, y))
            opt.step()
            records.append(cluster.last_step)
    return np.array(losses), records


def bf16_tolerance(losses: np.ndarray) -> np.ndarray:
    """How far a bf16 run's losses may be from the fp32 run's ``losses``. bf16 rounds every number it
    carries by at most u = 2^-8 relative. Step t's loss comes from a forward whose operands (x, w, y of
    two layers) were each rounded once -- to first order a few u of the loss -- and from weights that
    t - 1 updates with rounded gradients moved: we allow 4u per step, |d loss_t| <= 4u t |loss_t|.
    (Measured: at most 1.1u by step 5, in either split; a broken narrowing is off by far more.)"""
    return 4 * U_BF16 * np.arange(1, losses.size + 1) * np.abs(losses)


@pytest.mark.parametrize("split, fuse", [("kernels", False), ("channels", True)])
def test_training_at_bf16_stays_within_bf16s_round_off_of_fp32(split, fuse):
    exact, _ = train("fp32", split=split, fuse=fuse)
    losses, records = train("bf16", split=split, fuse=fuse)
    assert np.all(np.abs(losses - exact) <= bf16_tolerance(exact)) and not np.array_equal(losses, exact)
    assert all(r["wire_fallbacks"] == 0 for r in records)
    assert records[0]["wire_precision"]["conv2"] == {"weights": "bf16", "maps": "bf16", "grads": "bf16"}


U_S8 = 1 / 254  # s8's bound: half a step, a step being 1/127 of the plane's largest magnitude


def s8_tolerance(losses: np.ndarray) -> np.ndarray:
    """How far an s8 (or adaptive: maps s8, the rest bf16 or wider) run's losses may be from fp32's.
    s8 moves each number by at most U_S8 = 1/254 of its plane's largest magnitude (the bound tested
    above), where bf16 moves it by 2^-8 of itself: against the plane, the same size of error (1/254 =
    2^-7.99), so the argument of :func:`bf16_tolerance` holds with u = U_S8 if the loss is as sensitive
    to a plane's small numbers as to its large ones -- 4u per step, |d loss_t| <= 4u t |loss_t|.
    (Measured: at most 0.46u t |loss_t| by step 5, s8 or adaptive, in either split.)"""
    return 4 * U_S8 * np.arange(1, losses.size + 1) * np.abs(losses)


@pytest.mark.parametrize(
    "setting, split, fuse",
    [("s8", "kernels", False), ("adaptive", "kernels", False), ("s8", "channels", True),
     ("adaptive", "channels", True)],
)  # fmt: skip
def test_training_at_s8_and_adaptive_stays_within_s8s_round_off_of_fp32(setting, split, fuse):
    exact, _ = train("fp32", split=split, fuse=fuse)
    losses, records = train(setting, split=split, fuse=fuse)
    assert np.all(np.abs(losses - exact) <= s8_tolerance(exact)) and not np.array_equal(losses, exact)
    assert all(r["wire_fallbacks"] == 0 for r in records)
    weights = "s8" if setting == "s8" else "bf16"  # adaptive: AWP's start; its first check is at step 1
    grads = "s8" if setting == "s8" else "bf16"
    assert records[0]["wire_precision"]["conv2"] == {"weights": weights, "maps": "s8", "grads": grads}
    fixed = [r["bytes_sent"] + r["bytes_recv"] for r in train("bf16", split=split, fuse=fuse, steps=1)[1]]
    assert records[0]["bytes_sent"] + records[0]["bytes_recv"] < fixed[0]  # fewer bytes than bf16's


def test_adaptive_training_records_each_steps_precision_and_moves_more_bytes_as_it_widens():
    awp = AdaptivePrecision(interval=1, thresholds=(1.0, 1.0))  # widens at every check: one rung a step
    _, records = train("adaptive", awp=awp)
    weights = [r["wire_precision"]["conv1"]["weights"] for r in records]
    assert weights == ["bf16", "bf16", "adt24", "fp32"]  # the first check only records the norm
    sent = [r["bytes_sent"] for r in records]
    assert sent[0] == sent[1] < sent[2] < sent[3]


def test_training_at_bf16_over_zmq():
    exact, _ = train("fp32", steps=2)
    losses, records = train("bf16", "zmq", steps=2)
    assert np.all(np.abs(losses - exact) <= bf16_tolerance(exact))
    inproc, _ = train("bf16", steps=2)
    assert np.array_equal(losses, inproc)  # the same narrowed bytes, whichever transport carries them
    assert records[-1]["bytes_sent"] > 0


# ---- the main job ----------------------------------------------------------------------------


def run_main_job(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "examples" / "cifar10_dist.py"), "--no-progress", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)


def test_the_main_job_trains_adaptive_over_zmq_and_refuses_narrow_replicas(tmp_path):
    metrics = tmp_path / "run.jsonl"
    out = run_main_job("--dataset", "synthetic", "--arch", "4:8", "--batch-size", "32", "--steps", "2",
                       "--transport", "zmq", "--workers", "1", "--wire-precision", "adaptive",
                       "--metrics-out", str(metrics))  # fmt: skip
    assert out.returncode == 0, out.stderr
    steps = [e for e in read_metrics(metrics) if e["event"] == "step"]
    assert len(steps) == 2 and all(s["wire_fallbacks"] == 0 and s["bytes_sent"] > 0 for s in steps)
    assert all(s["wire_precision"]["conv2"] == {"weights": "bf16", "maps": "s8", "grads": "bf16"} for s in steps)
    out = run_main_job("--dataset", "synthetic", "--parallel", "data", "--workers", "1", "--wire-precision", "bf16")
    assert out.returncode != 0 and "--parallel data send their weights and gradients in float32" in out.stderr

"""bf16 wire words converted on the OpenCL device (backends/opencl/wire.cl) are the host's words
(tinyconv/distributed/wire_precision.py) bit for bit, and a worker that converts there sends the same
bytes as one that converts on the host.

Every kernel runs both ways: per element (GPUs) and its rows twin (CPUs), so tests/test_oclgrind.py
checks both on the simulated GPU. Arrays stay small for it (a few thousand numbers, 2^16 words).
Skipped, but for the numpy backend's test, when the machine has no OpenCL device.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.base import WireConversion
from backends.numpy_backend import NumpyBackend
from tinyconv.distributed import wire_precision as wp
from tinyconv.distributed.wire_codec import narrowed
from tinyconv.distributed.worker.handler import ON_BACKEND, Worker
from transports.base import Message
from transports.wire import check_message, encode

U32 = np.uint32
# float32 bit patterns at every edge of bf16's rounding: zeros, infinities, NaNs of both signs and
# several payloads (quiet, signalling, payload only in the dropped bits), subnormals (the smallest,
# ties, the largest), the smallest normal, ties to even both ways at 1.0, the largest floats that
# stay finite when rounded; each with its sign flipped too (below)
EDGES = [
    0x00000000, 0x7F800000, 0x7FC00000, 0x7F800001, 0x7F808000, 0x7FBFFFFF, 0x7FFFFFFF, 0x7F80FFFF,
    0x00000001, 0x00007FFF, 0x00008000, 0x00008001, 0x00018000, 0x0000FFFF, 0x007FFFFF, 0x00800000,
    0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x3F80FFFF, 0x7F7E8000, 0x7F7F7FFF,
    0x7F7F0000, 0x7F7E7FFF, 0x7F000000, 0x7F7EFFFF,
]  # fmt: skip
# the largest floats, within half a unit of 2^128: bf16 rounds them to inf (a fallback to fp32)
OVERFLOW = [0x7F7F8000, 0x7F7FFFFF, 0x7F7FC000, 0xFF7F8000, 0xFF7FFFFF]


def patterns(n: int, seed: int) -> np.ndarray:
    """The EDGES with both signs, then ``n`` random float32 bit patterns (any exponent, NaNs
    included) that bf16 carries finite, then as many N(0, 1) numbers: (2 len(EDGES) + 2n,) float32."""
    rng = np.random.default_rng(seed)
    edges = np.array(EDGES, U32)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(U32)
    magnitude = bits & U32(0x7FFFFFFF)
    bits = bits[(magnitude < U32(0x7F7F8000)) | (magnitude > U32(0x7F7FFFFF))]  # not an overflow
    normal = rng.standard_normal(n).astype(np.float32).view(U32)
    return np.concatenate([edges, edges | U32(0x80000000), bits, normal]).view(np.float32)


def test_the_patterns_cover_what_they_claim():
    # the fixture's own check: without it, a generator gone wrong would leave the edges untested
    x = patterns(1000, 0)
    assert np.isnan(x).sum() >= 12 and np.isinf(x).sum() >= 2 and (x == 0).sum() >= 2
    assert np.signbit(x[x == 0]).any() and (np.abs(x[x != 0]) < np.finfo(np.float32).tiny).sum() >= 14
    assert not wp.narrow(x, "bf16").fell_back
    for bits in OVERFLOW:  # and the OVERFLOW values do make the host fall back
        assert wp.narrow(np.array([bits], U32).view(np.float32), "bf16").fell_back


def test_the_numpy_backend_leaves_the_words_to_the_host():
    assert not isinstance(NumpyBackend(), WireConversion)  # an optional capability it does not have


# ---- the OpenCL kernels ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def be(tmp_path_factory):
    """One OpenCL backend for the file, converting on the device; no autotuning, no user cache writes."""
    pytest.importorskip("pyopencl")
    from backends.opencl import NoOpenCLDevice, OpenCLBackend

    try:
        backend = OpenCLBackend(autotune=False, tune_file=tmp_path_factory.mktemp("tune") / "gemm.json")
    except NoOpenCLDevice as e:
        pytest.skip(f"no OpenCL device on this machine: {e}")
    backend.wire_on_device = True
    assert isinstance(backend, WireConversion)
    return backend


@pytest.fixture(params=[False, True], ids=["per-element", "rows"])
def kernels(request, be):
    """The backend running the per-element kernels, then the rows kernels; restored after."""
    before = be.rows
    be.rows = request.param
    yield be
    be.rows = before


@pytest.mark.parametrize("shape", [(4133,), (3, 5, 7, 11)])
def test_narrowing_on_the_device_gives_the_hosts_words_bit_for_bit(kernels, shape):
    be = kernels
    n = int(np.prod(shape))
    x = patterns(n, seed=n)[:n].reshape(shape)  # (3, 5, 7, 11): 1155 numbers, the edges among them
    carried, overflow = be.narrow_wire(be.asarray(x), "bf16")
    host = wp.narrow(x, "bf16")
    assert not overflow and not host.fell_back
    assert carried.dtype == host.carried.dtype == np.dtype("<u2") and carried.shape == shape
    assert np.array_equal(carried, host.carried)  # the words, every bit: NaNs kept NaN, -0 kept -0


def test_narrowing_a_slice_of_a_device_array_reads_only_the_slice(be):
    x = patterns(300, seed=3).reshape(-1, 4)
    part = be.take_kernels(be.asarray(x), 5, 40)  # rows at an offset into the buffer
    carried, overflow = be.narrow_wire(part, "bf16")
    assert not overflow and np.array_equal(carried, wp.narrow(x[5:40], "bf16").carried)


@pytest.mark.parametrize("where", [0, 1, 2047, 2048, 4132])  # each end, and both sides of a rows chunk's edge
def test_a_finite_number_rounded_to_inf_is_signalled_so_the_array_goes_fp32(kernels, where):
    x = patterns(2100, seed=where)[:4133].copy()
    assert x.size == 4133
    x.view(U32)[where] = OVERFLOW[where % len(OVERFLOW)]
    _, overflow = kernels.narrow_wire(kernels.asarray(x), "bf16")
    assert overflow and wp.narrow(x, "bf16").fell_back  # the host falls back on the same array


def test_inf_and_nan_already_there_are_no_overflow(kernels):
    x = np.array([np.inf, -np.inf, np.nan, -np.nan, 1.0], np.float32)
    carried, overflow = kernels.narrow_wire(kernels.asarray(x), "bf16")
    assert not overflow and np.array_equal(carried, wp.narrow(x, "bf16").carried)


def test_widening_on_the_device_gives_the_hosts_floats_bit_for_bit(kernels):
    words = np.arange(2**16, dtype=np.uint16).reshape(16, 64, 64)  # every bf16 word, NaNs included
    got = kernels.widen_wire(words, "bf16")
    assert got.dtype == np.float32 and got.shape == (16, 64, 64)
    assert np.array_equal(kernels.to_numpy(got).view(U32), wp.widen(words, "bf16").view(U32))


def test_only_bf16_and_only_when_chosen(be):
    x = be.asarray(np.ones((2, 3), np.float32))
    for fmt in ("fp32", "fp16", "adt24", "s8"):
        assert be.narrow_wire(x, fmt) is None and be.widen_wire(np.ones(3, np.uint16), fmt) is None
    be.wire_on_device = False
    try:
        assert be.narrow_wire(x, "bf16") is None and be.widen_wire(np.ones(3, np.uint16), "bf16") is None
    finally:
        be.wire_on_device = True
    with pytest.raises(TypeError, match="uint16"):
        be.widen_wire(np.ones(3, np.float16), "bf16")


# ---- the worker: the same bytes on the wire either way --------------------------------------------


def with_edges(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """N(0, 1) numbers with a -0, a subnormal and a number that rounds to a tie scattered in."""
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[rng.integers(0, flat.size, 3)] = np.array([0x80000000, 0x00008000, 0x3F818000], U32).view(np.float32)
    return x


def wire_bytes(msg: Message) -> list[bytes]:
    """The frames ``msg`` goes as, its measured compute time set to 0 (the only field that may differ)."""
    check_message(msg)
    assert msg.kind == "result", msg.header
    header = msg.header | {"compute_s": 0.0}
    return [bytes(f) for f in encode(Message(msg.kind, header, msg.arrays))]


def task(kind: str, arrays: dict, narrow: dict, reply: dict, **header) -> Message:
    out, declared, fell = narrowed(arrays, narrow)
    assert fell == 0
    head = {"task": 1, "step": 0, "layer": 0, **header, "narrow": declared, "reply": reply}
    return Message(kind, head, out)


def block_step(w_fmt: str = "bf16", x=None, w=None) -> list[Message]:
    """A layer's block_forward then block_backward, every array bf16 (w in ``w_fmt``) both ways."""
    rng = np.random.default_rng(5)
    x = with_edges(rng, 2, 3, 8, 8) if x is None else x
    w = with_edges(rng, 5, 3, 3, 3) if w is None else w
    lrn = {"op": "lrn", "size": 5, "alpha": 1e-4, "beta": 0.75, "k": 1.0}
    conv = {"stride": 1, "padding": 1, "tail": [{"op": "relu"}, lrn]}
    fwd = task("block_forward", {"x": x, "w": w, "b": with_edges(rng, 5)}, {"x": "bf16", "w": w_fmt, "b": "bf16"},
               {"y": "bf16"}, own=[0, 5], **conv)  # fmt: skip
    bwd = task("block_backward", {"dy": with_edges(rng, 2, 5, 8, 8)}, {"dy": "bf16"},
               {"dx": "bf16", "dw": "bf16", "db": "bf16"}, need_dx=True)  # fmt: skip
    return [fwd, bwd]


def channel_step() -> list[Message]:
    """One participant with every input channel: partial_forward, tail_forward (b and sum narrowed,
    both widened on the host: they meet numpy), tail_backward, partial_backward; bf16 both ways."""
    rng = np.random.default_rng(6)
    conv = {"stride": 1, "padding": 1, "tail": [{"op": "relu"}]}
    return [
        task("partial_forward", {"x": with_edges(rng, 2, 3, 8, 8), "w": with_edges(rng, 4, 3, 3, 3)},
             {"x": "bf16", "w": "bf16"}, {"p_lo": "bf16"}, halo=[0, 4], own=[0, 4], give=[2, 4], **conv),
        task("tail_forward", {"b": with_edges(rng, 4), "sum": with_edges(rng, 4, 2, 8, 8)},
             {"b": "bf16", "sum": "bf16"}, {"y": "bf16"}),
        task("tail_backward", {"dy": with_edges(rng, 2, 4, 8, 8)}, {"dy": "bf16"}, {"dyc": "bf16"}),
        task("partial_backward", {}, {}, {"dx": "bf16", "dw": "bf16", "db": "bf16"}, need_dx=True),
    ]  # fmt: skip


def replies(be, on_device: bool, messages: list[Message], calls: list[str] | None = None) -> list[list[bytes]]:
    """Each task's result as wire frames, from a new worker on ``be`` converting on the device or not;
    ``calls`` collects which conversions the backend did ("narrow (shape)", "widen (shape)")."""
    be.wire_on_device = on_device
    narrow_wire, widen_wire = be.narrow_wire, be.widen_wire

    def narrow_spy(x, fmt):
        got = narrow_wire(x, fmt)
        if calls is not None and got is not None:
            calls.append(f"narrow {tuple(x.shape)}")
        return got

    def widen_spy(c, fmt):
        got = widen_wire(c, fmt)
        if calls is not None and got is not None:
            calls.append(f"widen {tuple(c.shape)}")
        return got

    be.narrow_wire, be.widen_wire = narrow_spy, widen_spy
    try:
        worker = Worker(be)
        return [wire_bytes(worker.handle(m)) for m in messages]
    finally:
        del be.narrow_wire, be.widen_wire
        be.wire_on_device = True


def test_a_worker_converting_on_the_device_sends_the_same_bytes_as_on_the_host(be):
    calls: list[str] = []
    assert replies(be, True, block_step(), calls) == replies(be, False, block_step())
    # x, w, b widened there; y narrowed there; then dy widened, dw, db, dx narrowed
    assert calls == ["widen (2, 3, 8, 8)", "widen (5, 3, 3, 3)", "widen (5,)", "narrow (2, 5, 8, 8)",
                     "widen (2, 5, 8, 8)", "narrow (5, 3, 3, 3)", "narrow (5,)", "narrow (2, 3, 8, 8)"]  # fmt: skip


def test_the_split_by_channels_converts_on_the_device_only_what_goes_straight_to_it(be):
    calls: list[str] = []
    assert replies(be, True, channel_step(), calls) == replies(be, False, channel_step())
    assert set(ON_BACKEND) == {"block_forward", "block_backward", "partial_forward", "tail_backward"}
    # partial_forward's x, w; tail_forward's y (its b and sum are widened on the host, its p_lo was
    # read back whole: the worker keeps P on the host); tail_backward's dy; partial_backward's dw, db, dx
    assert calls == ["widen (2, 3, 8, 8)", "widen (4, 3, 3, 3)", "narrow (2, 4, 8, 8)", "widen (2, 4, 8, 8)",
                     "narrow (4, 3, 3, 3)", "narrow (4,)", "narrow (2, 3, 8, 8)"]  # fmt: skip


def test_a_result_that_would_overflow_goes_fp32_from_the_device_too(be):
    # y = x * w at one pixel is the largest float32s bf16 rounds to inf: y must come back float32
    x = np.zeros((1, 1, 4, 4), np.float32)
    x[0, 0, 1, 1] = 1.0
    w = np.zeros((2, 1, 3, 3), np.float32)
    w[1, 0, 1, 1] = np.array(OVERFLOW[0], U32).view(np.float32)
    msgs = block_step("fp32", x, w)[:1]
    msgs[0].header.update(tail=[], own=[0, 2])
    msgs[0].arrays["b"] = np.zeros(2, np.uint16)  # b = 0 in bf16
    got = replies(be, True, msgs)
    assert got == replies(be, False, msgs)
    reply = Worker(be).handle(msgs[0])
    assert "y" not in reply.header.get("narrow", {}) and reply.arrays["y"].dtype == np.float32
    assert reply.arrays["y"].view(U32)[0, 1, 1, 1] == OVERFLOW[0]


def test_a_numpy_worker_answers_the_same_bytes(be):
    # the reference: the same tasks on the numpy backend, which converts on the host. The maps'
    # arithmetic differs in the last bits between the backends, so only the forward of a layer whose
    # sums are exact (small integers) is compared byte for byte
    rng = np.random.default_rng(8)
    x = rng.integers(1, 5, (2, 3, 8, 8)).astype(np.float32)  # no 0 in x nor w: no -0 that a sum's order could keep
    w = (rng.integers(1, 3, (5, 3, 3, 3)) * rng.choice([-1, 1], (5, 3, 3, 3))).astype(np.float32)
    msgs = block_step("bf16", x, w)[:1]
    msgs[0].header["tail"] = []
    msgs[0].arrays["b"] = np.zeros(5, np.uint16)
    assert [wire_bytes(Worker(NumpyBackend()).handle(m)) for m in msgs] == replies(be, True, msgs)

"""The wire protocol: every kind round-trips, zero-copy; every malformed input is a ProtocolError."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from transports.base import KINDS, PROTOCOL_VERSION, Message
from transports.wire import (
    MAX_HEADER_BYTES,
    ProtocolError,
    VersionMismatch,
    decode,
    encode,
    frames_nbytes,
    message_nbytes,
)

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 5, 5), dtype=np.float32)
W = RNG.standard_normal((4, 3, 3, 3), dtype=np.float32)
B = RNG.standard_normal((4,), dtype=np.float32)

SAMPLES = {
    "hello": Message(
        "hello",
        {
            "protocol": PROTOCOL_VERSION,
            "backend": "numpy",
            "device": {"kind": "cpu"},
            "pid": 7,
            "hostname": "h",
        },
    ),
    "welcome": Message("welcome", {"index": 3, "heartbeat_s": 0.5}),
    "calibrate": Message(
        "calibrate",
        {
            "task": 1,
            "layers": [{"layer": 0, "x": [2, 3, 5, 5], "w": [4, 3, 3, 3], "stride": 1, "padding": 1}],
            "repeats": 3,
        },
    ),
    "conv_forward": Message(
        "conv_forward",
        {"task": 2, "step": 5, "layer": 1, "stride": 1, "padding": 2, "need_dx": False},
        {"x": X, "w": W, "b": B},
    ),
    "conv_backward": Message("conv_backward", {"task": 3, "step": 5, "layer": 1}, {"dy": X}),
    "result": Message(
        "result",
        {"task": 3, "step": 5, "layer": 1, "compute_s": 0.25},
        {
            "y": X,
            "dw": np.arange(6, dtype=np.int64).reshape(2, 3),  # another dtype
            "db": np.zeros((0, 4), dtype=np.int32),  # empty
            "dx": np.array(7, dtype=np.uint8),  # 0-d
        },
    ),
    "error": Message("error", {"task": 4, "message": "boom"}),
    "heartbeat": Message("heartbeat"),
    "shutdown": Message("shutdown", {"reason": "train over"}),
}


def envelope(**overrides) -> dict:
    env = {"v": PROTOCOL_VERSION, "kind": "heartbeat", "header": {}, "arrays": []}
    env.update(overrides)
    return env


def raw(env: object, *arrays: bytes) -> list[bytes]:
    return [msgpack.packb(env, use_bin_type=True), *arrays]


def test_every_kind_has_a_sample():
    assert set(SAMPLES) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(kind):
    msg = SAMPLES[kind]
    got = decode(encode(msg))
    assert got.kind == msg.kind and got.header == msg.header
    assert list(got.arrays) == list(msg.arrays)
    for name, a in msg.arrays.items():
        assert got.arrays[name].dtype == a.dtype and got.arrays[name].shape == a.shape
        np.testing.assert_array_equal(got.arrays[name], a)


def test_zero_copy_both_ways():
    msg = SAMPLES["conv_forward"]
    frames = encode(msg)
    # sending: the frame is the array's own memory
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), X)
    # receiving: copy the frames as a socket would hand them over, then decode
    received = [bytearray(f) for f in frames]
    got = decode(received)
    for name, frame in zip(("x", "w", "b"), received[1:], strict=True):
        assert np.shares_memory(got.arrays[name], np.frombuffer(frame, np.uint8))
        assert not got.arrays[name].flags.writeable


def test_misaligned_frame_is_copied_to_an_aligned_array():
    frames = encode(Message("conv_backward", {"task": 1, "step": 0, "layer": 0}, {"dy": X}))
    misaligned = memoryview(bytearray(len(frames[1]) + 1))[1:]
    misaligned[:] = frames[1]
    got = decode([frames[0], misaligned])
    assert got.arrays["dy"].flags.aligned
    np.testing.assert_array_equal(got.arrays["dy"], X)


def test_non_contiguous_arrays_are_sent_contiguously():
    xt = X.transpose(0, 1, 3, 2)
    got = decode(encode(Message("conv_backward", {"task": 1, "step": 0, "layer": 0}, {"dy": xt})))
    np.testing.assert_array_equal(got.arrays["dy"], xt)


def test_byte_counting():
    msg = SAMPLES["conv_forward"]
    frames = encode(msg)
    assert frames_nbytes(frames) == len(frames[0]) + X.nbytes + W.nbytes + B.nbytes
    assert message_nbytes(msg) == frames_nbytes(frames)


FORWARD = {"task": 2, "step": 5, "layer": 1, "stride": 1, "padding": 2, "need_dx": True}


def test_the_parts_of_a_layer_split_by_input_channels_round_trip():
    messages = [
        Message(
            "conv_forward", FORWARD | {"part": "conv", "ext": [0, 3], "own": [0, 2], "give": [0, 2]}, {"x": X, "w": W}
        ),
        Message("result", {"task": 2, "compute_s": 0.1}, {"p_hi": X}),
        Message("conv_forward", FORWARD | {"part": "tail"}, {"b": B, "sum": X}),
        Message("result", {"task": 3, "compute_s": 0.1}, {"y": X}),
        Message("conv_backward", {"task": 4, "step": 5, "layer": 1, "part": "tail", "dy_from": 1}, {"dy": X}),
        Message("result", {"task": 4, "compute_s": 0.1}, {"dyc": X}),
        Message("conv_backward", {"task": 5, "step": 5, "layer": 1, "part": "conv"}, {"dyc_lo": X, "dyc_hi": X}),
        Message("result", {"task": 5, "compute_s": 0.1}, {"dx": X, "dw": W, "db": B}),
    ]
    for msg in messages:
        got = decode(encode(msg))
        assert got.kind == msg.kind and got.header == msg.header and list(got.arrays) == list(msg.arrays)


@pytest.mark.parametrize(
    ("msg", "complaint"),
    [
        (
            Message("conv_backward", {"task": 1, "step": 0, "layer": 0, "part": "dx", "dx_channels": [0, 1]}),
            r"unexpected header key\(s\) dx_channels",
        ),
        (
            Message("conv_backward", {"task": 1, "step": 0, "layer": 0, "part": "conv"}, {"w": W}),
            r"unexpected array\(s\) w; allowed: dy, dyc_hi, dyc_lo",
        ),
        (
            Message("result", {"task": 1, "compute_s": 0.1, "times": [1.0], "forward_times": [0.5]}),
            r"unexpected header key\(s\) forward_times",
        ),
        (Message("result", {"task": 1, "compute_s": 0.1}, {"partial": X}), r"unexpected array\(s\) partial"),
        (Message("conv_forward", FORWARD | {"part": "conv", "ext": "0:3"}, {"x": X, "w": W}), "'ext' must be list"),
        (Message("conv_forward", FORWARD | {"give": [0, None]}, {"x": X, "w": W}), "'give' must be list of numbers"),
    ],
)
def test_the_wire_refuses_fields_the_parts_do_not_have(msg, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        encode(msg)


# ---- what the decoder refuses -----------------------------------------------------------


def test_version_mismatch_names_both_versions():
    with pytest.raises(VersionMismatch, match=f"version 99.*version {PROTOCOL_VERSION}") as info:
        decode(raw(envelope(v=99)))
    assert info.value.theirs == 99 and info.value.ours == PROTOCOL_VERSION
    # a future version may change the layout: the version is checked before anything else
    with pytest.raises(VersionMismatch):
        decode(raw({"v": PROTOCOL_VERSION + 1, "something": "else"}))
    with pytest.raises(VersionMismatch):
        decode(raw(envelope(v=True)))


@pytest.mark.parametrize(
    ("frames", "complaint"),
    [
        ([], "empty message"),
        ([b""], "not valid msgpack"),
        ([b"\xc1"], "not valid msgpack"),
        ([msgpack.packb([1, 2])], "must be a msgpack map"),
        (raw({"kind": "heartbeat"}), "no protocol version"),
        (raw(envelope(extra=1)), "header keys must be exactly"),
        (raw({"v": PROTOCOL_VERSION, "kind": "heartbeat", "header": {}}), "header keys must be exactly"),
        (raw(envelope(kind="launch_missiles")), "unknown message kind"),
        (raw(envelope(kind=7)), "'kind' must be a str"),
        (raw(envelope(header=[])), "header must be a map"),
        (raw(envelope(kind="shutdown", header={})), "missing reason"),
        (raw(envelope(kind="shutdown", header={"reason": "x", "why": 1})), "unexpected header key"),
        (raw(envelope(kind="shutdown", header={"reason": 5})), "'reason' must be str"),
        (raw(envelope(kind="welcome", header={"index": True, "heartbeat_s": 1.0})), "'index' must be int"),
        (raw(envelope(kind="welcome", header={"index": "0", "heartbeat_s": 1.0})), "'index' must be int"),
        (raw(envelope(kind="welcome", header={"index": 0, "heartbeat_s": "1"})), "must be number"),
        (raw(envelope(arrays={})), "'arrays' must be a list"),
        (raw(envelope(arrays=[{"name": "y"}] * 17)), "at most 16"),
        (raw(envelope(header={1: 2})), "not valid msgpack"),  # strict_map_key
        (raw(envelope(header={"x": b"bytes"})), "not valid msgpack"),  # bin values are refused
        ([msgpack.packb(envelope(header={"t": msgpack.ExtType(1, b"x")}))], "not valid msgpack"),
        ([b"\xdd\xff\xff\xff\xff"], "not valid msgpack"),  # a 4G-element list, refused before allocating
        ([b"\x91" * 100_000 + b"\xc0"], "not valid msgpack"),  # nested 100k deep
        ([b"\x80" * (MAX_HEADER_BYTES + 1)], "over the"),
    ],
)
def test_malformed_envelopes(frames, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        decode(frames)


def conv_backward(desc: dict, *frames: bytes) -> list[bytes]:
    return raw(envelope(kind="conv_backward", header={"task": 1, "step": 0, "layer": 0}, arrays=[desc]), *frames)


DY = {"name": "dy", "dtype": "float32", "shape": [2, 3]}


@pytest.mark.parametrize(
    ("frames", "complaint"),
    [
        (conv_backward(DY, bytes(24), bytes(4)), "1 array\\(s\\) but 2 array frame"),  # extra frame
        (conv_backward(DY), "1 array\\(s\\) but 0 array frame"),  # missing frame
        (conv_backward(DY, bytes(23)), "= 24 bytes, but its frame has 23"),  # truncated
        (conv_backward(DY, bytes(28)), "= 24 bytes, but its frame has 28"),
        (conv_backward({**DY, "shape": [10**12]}, bytes(8)), "over the limit"),  # before allocating
        (conv_backward({**DY, "shape": [2**40, 2**40, 2**40]}, bytes(8)), "over the limit"),
        (conv_backward({**DY, "dtype": "object"}, bytes(24)), "dtype 'object'"),
        (conv_backward({**DY, "dtype": "<U10"}, bytes(24)), "dtype '<U10'"),
        (conv_backward({**DY, "dtype": "float64"}, bytes(48)), "dtype 'float64'"),
        (conv_backward({**DY, "dtype": 5}, bytes(24)), "dtype 5"),
        (conv_backward({**DY, "shape": [-2, -3]}, bytes(24)), "non-negative ints"),
        (conv_backward({**DY, "shape": [2.0, 3]}, bytes(24)), "non-negative ints"),
        (conv_backward({**DY, "shape": [True, 6]}, bytes(24)), "non-negative ints"),
        (conv_backward({**DY, "shape": [1] * 7}, bytes(4)), "at most 6"),
        (conv_backward({**DY, "shape": "2,3"}, bytes(24)), "at most 6"),
        (conv_backward({**DY, "name": ""}, bytes(24)), "non-empty str name"),
        (conv_backward({**DY, "name": "dz"}, bytes(24)), "unexpected array\\(s\\) dz; allowed: dy"),
        (conv_backward({"name": "dy", "dtype": "float32"}, bytes(24)), "keys name, dtype, shape"),
        (conv_backward(["dy", "float32", [2, 3]], bytes(24)), "keys name, dtype, shape"),
        (raw(envelope(kind="error", header={"message": "x"}, arrays=[DY]), bytes(24)), "carries no arrays"),
        (
            raw(
                envelope(kind="conv_backward", header={"task": 1, "step": 0, "layer": 0}, arrays=[DY, DY]),
                bytes(24),
                bytes(24),
            ),
            "duplicate array names",
        ),
    ],
)
def test_malformed_arrays(frames, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        decode(frames)


def test_max_bytes_is_configurable():
    frames = encode(SAMPLES["conv_backward"])
    with pytest.raises(ProtocolError, match="over the limit of 100 bytes"):
        decode(frames, max_bytes=100)
    assert decode(frames, max_bytes=X.nbytes).arrays["dy"].shape == X.shape


def test_non_bytes_frames_are_refused():
    with pytest.raises(ProtocolError, match="bytes-like"):
        decode([encode(SAMPLES["conv_backward"])[0], 12345])


def test_fuzz_random_frames_only_raise_protocol_error():
    rng = np.random.default_rng(1234)
    for _ in range(300):
        n = int(rng.integers(1, 4))
        frames = [rng.bytes(int(rng.integers(0, 64))) for _ in range(n)]
        with pytest.raises(ProtocolError):
            decode(frames)


def test_fuzz_mutated_messages_decode_or_raise_protocol_error():
    """Flip bytes of real headers: each result is a valid message or a ProtocolError, nothing else."""
    rng = np.random.default_rng(99)
    refused = 0
    for i in range(400):
        frames = [bytes(f) for f in encode(SAMPLES[KINDS[i % len(KINDS)]])]
        head = bytearray(frames[0])
        for _ in range(int(rng.integers(1, 4))):
            head[int(rng.integers(len(head)))] = int(rng.integers(256))
        try:
            decode([bytes(head), *frames[1:]])
        except ProtocolError:
            refused += 1
    assert refused > 200  # most mutations break something, and each one was reported as a ProtocolError


# ---- what the encoder refuses -------------------------------------------------------------


def test_encode_refuses_what_decode_would():
    header = {"task": 1, "step": 0, "layer": 0}
    with pytest.raises(ProtocolError, match="dtype float64.*astype"):
        encode(Message("conv_backward", header, {"dy": X.astype(np.float64)}))
    with pytest.raises(ProtocolError, match="not a numpy array"):
        encode(Message("conv_backward", header, {"dy": [1.0, 2.0]}))
    with pytest.raises(ProtocolError, match="not plain data"):
        encode(Message("calibrate", {"task": 1, "layers": [np.float32(1)], "repeats": 1}))
    with pytest.raises(ProtocolError, match="'task' must be int"):
        encode(Message("conv_backward", {"task": np.int64(1), "step": 0, "layer": 0}, {"dy": X}))
    with pytest.raises(ProtocolError, match="unexpected array"):
        encode(Message("heartbeat", {}, {"x": X}))
    with pytest.raises(ProtocolError, match="unknown message kind"):
        encode(Message("nonsense"))


def test_big_endian_arrays_are_refused_with_a_hint():
    with pytest.raises(ProtocolError, match="dtype >f4.*cast it"):
        encode(Message("conv_backward", {"task": 1, "step": 0, "layer": 0}, {"dy": X.astype(">f4")}))

"""The wire on its own: any kind round-trips, zero-copy; every malformed input is a ProtocolError.

The transport knows its session kinds only; every other kind here (``echo``,
``launch_missiles``, ...) is a task it has never heard of, and must carry all the same.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from transports.base import Message
from transports.header import MAX_DEPTH
from transports.session.worker import call_handler
from transports.wire import (
    MAX_ARRAYS,
    MAX_HEADER_BYTES,
    MAX_LIST_LEN,
    MAX_MAP_LEN,
    SESSION_KINDS,
    WIRE_VERSION,
    Int,
    Num,
    ProtocolError,
    VersionMismatch,
    check_fields,
    check_message,
    decode,
    encode,
    error_reply,
    frames_nbytes,
)

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 5, 5), dtype=np.float32)
W = RNG.standard_normal((4, 3, 3, 3), dtype=np.float32)
B = RNG.standard_normal((4,), dtype=np.float32)

SAMPLES = {
    "hello": Message(
        "hello",
        {"protocol": 7, "backend": "numpy", "device": {"kind": "cpu", "cores": [0, 1]}, "pid": 7, "hostname": "h"},
    ),
    "welcome": Message("welcome", {"index": 3, "heartbeat_s": 0.5}),
    "heartbeat": Message("heartbeat"),
    "shutdown": Message("shutdown", {"reason": "train over"}),
    "error": Message("error", {"task": 4, "message": "boom"}),
    "error_without_task": Message("error", {"message": "boom"}),
    "started": Message("started", {"task": 4}),
    "computed": Message("computed", {"task": 4}),
    "echo": Message(
        "echo", {"task": 2, "step": 5, "flag": False, "scale": 0.5, "note": None}, {"x": X, "w": W, "b": B}
    ),
    "echoed": Message(
        "echoed",
        {"task": 3},
        {
            "y": X,
            "ints": np.arange(6, dtype=np.int64).reshape(2, 3),  # another dtype
            "empty": np.zeros((0, 4), dtype=np.int32),
            "scalar": np.array(7, dtype=np.uint8),  # 0-d
        },
    ),
    "launch_missiles": Message(
        "launch_missiles", {"targets": [{"name": "moon", "at": [1.5, -2, 2**63]}], "big": 2**64 - 1, "small": -(2**63)}
    ),
    "a": Message("a"),  # the shortest kind
    "z" * 32: Message("z" * 32, {}, {"z": B}),  # the longest
}


def envelope(**overrides) -> dict:
    env = {"v": WIRE_VERSION, "kind": "heartbeat", "header": {}, "arrays": []}
    env.update(overrides)
    return env


def raw(env: object, *arrays: bytes) -> list[bytes]:
    return [msgpack.packb(env, use_bin_type=True), *arrays]


def nested(depth: int) -> dict:
    header: dict = {}
    for _ in range(depth - 1):
        header = {"n": header}
    return header


def test_every_session_kind_has_a_sample():
    assert SESSION_KINDS == {"hello", "welcome", "heartbeat", "shutdown", "error", "started", "computed"}
    assert SESSION_KINDS <= {msg.kind for msg in SAMPLES.values()}


@pytest.mark.parametrize("name", SAMPLES)
def test_round_trip(name):
    msg = SAMPLES[name]
    check_message(msg)
    got = decode(encode(msg))
    assert got.kind == msg.kind and got.header == msg.header
    assert list(got.arrays) == list(msg.arrays)
    for name, a in msg.arrays.items():
        assert got.arrays[name].dtype == a.dtype and got.arrays[name].shape == a.shape
        np.testing.assert_array_equal(got.arrays[name], a)


def test_a_kind_the_wire_never_heard_of_round_trips():
    msg = Message("never_heard_of_9", {"task": 1, "anything": {"at": ["all"]}}, {"whatever_name": X})
    assert msg.kind not in SESSION_KINDS
    got = decode(encode(msg))
    assert (got.kind, got.header, list(got.arrays)) == (msg.kind, msg.header, ["whatever_name"])


def test_zero_copy_both_ways():
    msg = SAMPLES["echo"]
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
    frames = encode(Message("echo", {"task": 1}, {"x": X}))
    misaligned = memoryview(bytearray(len(frames[1]) + 1))[1:]
    misaligned[:] = frames[1]
    got = decode([frames[0], misaligned])
    assert got.arrays["x"].flags.aligned
    np.testing.assert_array_equal(got.arrays["x"], X)


def test_non_contiguous_arrays_are_sent_contiguously():
    xt = X.transpose(0, 1, 3, 2)
    got = decode(encode(Message("echo", {"task": 1}, {"x": xt})))
    np.testing.assert_array_equal(got.arrays["x"], xt)


def test_byte_counting():
    frames = encode(SAMPLES["echo"])
    assert frames_nbytes(frames) == len(frames[0]) + X.nbytes + W.nbytes + B.nbytes


# ---- versions -----------------------------------------------------------------------------------


def test_wire_version_mismatch_names_both_versions():
    with pytest.raises(
        VersionMismatch, match=f"wire version mismatch: the peer speaks version 99, this side version {WIRE_VERSION}"
    ) as info:
        decode(raw(envelope(v=99)))
    assert (info.value.what, info.value.theirs, info.value.ours) == ("wire", 99, WIRE_VERSION)
    # a future version may change the layout: the version is checked before anything else
    with pytest.raises(VersionMismatch):
        decode(raw({"v": WIRE_VERSION + 1, "something": "else"}))
    with pytest.raises(VersionMismatch):
        decode(raw(envelope(v=True)))


def test_version_mismatch_says_what_is_versioned_and_who_speaks_which():
    e = VersionMismatch("task protocol", 4, 5, peer="the worker", here="the master")
    assert isinstance(e, ProtocolError) and (e.what, e.theirs, e.ours) == ("task protocol", 4, 5)
    assert str(e).startswith("task protocol version mismatch: the worker speaks version 4, the master version 5")


# ---- what the decoder refuses -----------------------------------------------------------


@pytest.mark.parametrize(
    ("frames", "complaint"),
    [
        ([], "empty message"),
        ([b""], "not valid msgpack"),
        ([b"\xc1"], "not valid msgpack"),
        ([msgpack.packb([1, 2])], "must be a msgpack map"),
        (raw({"kind": "heartbeat"}), "no wire version"),
        (raw(envelope(extra=1)), "header keys must be exactly"),
        (raw({"v": WIRE_VERSION, "kind": "heartbeat", "header": {}}), "header keys must be exactly"),
        (raw(envelope(kind=7)), "'kind' must be a str"),
        (raw(envelope(kind="")), "not a short identifier"),
        (raw(envelope(kind="Echo")), "not a short identifier"),
        (raw(envelope(kind="9lives")), "not a short identifier"),
        (raw(envelope(kind="launch-missiles")), "not a short identifier"),
        (raw(envelope(kind="echo\n")), "not a short identifier"),
        (raw(envelope(kind="z" * 33)), "not a short identifier"),
        (raw(envelope(header=[])), "header must be a map"),
        (raw(envelope(kind="echo", header=None)), "header must be a map"),
        (raw(envelope(kind="echo", header={"n": nested(MAX_DEPTH)})), f"nest deeper than {MAX_DEPTH}"),
        (raw(envelope(arrays={})), "'arrays' must be a list"),
        (raw(envelope(kind="echo", arrays=[{"name": "y"}] * (MAX_ARRAYS + 1))), f"at most {MAX_ARRAYS}"),
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


@pytest.mark.parametrize(
    ("kind", "header", "complaint"),
    [
        ("shutdown", {}, "shutdown: header is missing 'reason' \\(str\\)"),
        ("shutdown", {"reason": "x", "why": 1}, "unexpected header key\\(s\\) why; allowed: reason"),
        ("shutdown", {"reason": 5}, "'reason' must be str, got int"),
        ("heartbeat", {"task": 1}, "unexpected header key\\(s\\) task; it takes none"),
        ("welcome", {"index": True, "heartbeat_s": 1.0}, "'index' must be int, got bool"),
        ("welcome", {"index": "0", "heartbeat_s": 1.0}, "'index' must be int, got str"),
        ("welcome", {"index": 0, "heartbeat_s": "1"}, "'heartbeat_s' must be number"),
        ("error", {"message": "x", "task": "7"}, "'task' must be int"),
        ("error", {"message": "x", "task": 7, "step": 1}, "unexpected header key\\(s\\) step"),
        ("started", {}, "started: header is missing 'task' \\(int\\)"),
        ("started", {"task": "7"}, "'task' must be int, got str"),
        ("started", {"task": True}, "'task' must be int, got bool"),
        ("started", {"task": 7, "step": 1}, "unexpected header key\\(s\\) step"),
        ("computed", {"task": 7.0}, "'task' must be int, got float"),
        ("hello", {**SAMPLES["hello"].header, "protocol": 7.0}, "'protocol' must be int, got float"),
        ("hello", {**SAMPLES["hello"].header, "device": "cpu"}, "'device' must be map"),
    ],
)
def test_session_headers_follow_their_schema(kind, header, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        decode(raw(envelope(kind=kind, header=header)))
    with pytest.raises(ProtocolError, match=complaint):
        check_message(Message(kind, header))


class MyDict(dict):
    pass


@pytest.mark.parametrize(
    ("header", "complaint"),
    [
        ({"task": np.int64(1)}, r"header\['task'\] is not plain data: a numpy.int64 \(a numpy scalar"),
        ({"t": np.float64(1.0)}, r"header\['t'\] is not plain data: a numpy.float64"),  # a float subclass
        ({"t": [0, np.float32(1.0)]}, r"header\['t'\]\[1\] is not plain data: a numpy.float32"),
        ({"t": {"deep": np.bool_(True)}}, r"header\['t'\]\['deep'\] is not plain data: a numpy.bool"),
        ({"t": np.str_("a")}, "a numpy.str_"),
        ({"t": (1, 2)}, r"a tuple \(use a list\)"),
        ({"t": b"bytes"}, "a bytes"),
        ({"t": {1, 2}}, "a set"),
        ({"t": {1: "x"}}, r"header\['t'\] is not plain data: the key 1 is not a str"),
        ({"t": 2**64}, "does not fit in 64 bits"),
        ({"t": -(2**63) - 1}, "does not fit in 64 bits"),
        ({"t": nested(MAX_DEPTH)}, f"nest deeper than {MAX_DEPTH} levels"),
        ({"t": [0] * (MAX_LIST_LEN + 1)}, f"over the {MAX_LIST_LEN} limit"),
        ({"t": {str(i): i for i in range(MAX_MAP_LEN + 1)}}, f"over the {MAX_MAP_LEN} limit"),
        ({"t": "\ud800"}, "cannot be packed"),  # not valid unicode
        ({"t": "x" * MAX_HEADER_BYTES}, "over the"),
        (MyDict(t=1), "header must be a map, got MyDict"),
        ([("t", 1)], "header must be a map, got list"),
    ],
)
def test_task_headers_are_any_plain_data_and_nothing_else(header, complaint):
    """What msgpack would send changed (a numpy float64 as a float) or not at all is refused before sending,
    so the in-process transport, which calls check_message, refuses it too."""
    with pytest.raises(ProtocolError, match=complaint):
        check_message(Message("echo", header))
    with pytest.raises(ProtocolError, match=complaint):
        encode(Message("echo", header))


def test_the_nesting_limit_is_the_same_both_ways():
    deepest = {"n": nested(MAX_DEPTH - 1)}
    assert decode(encode(Message("echo", deepest))).header == deepest


DY = {"name": "dy", "dtype": "float32", "shape": [2, 3]}


def task(desc: dict, *frames: bytes) -> list[bytes]:
    return raw(envelope(kind="echo", header={"task": 1}, arrays=[desc]), *frames)


@pytest.mark.parametrize(
    ("frames", "complaint"),
    [
        (task(DY, bytes(24), bytes(4)), "1 array\\(s\\) but 2 array frame"),  # extra frame
        (task(DY), "1 array\\(s\\) but 0 array frame"),  # missing frame
        (task(DY, bytes(23)), "= 24 bytes, but its frame has 23"),  # truncated
        (task(DY, bytes(28)), "= 24 bytes, but its frame has 28"),
        (task({**DY, "shape": [10**12]}, bytes(8)), "over the limit"),  # before allocating
        (task({**DY, "shape": [2**40, 2**40, 2**40]}, bytes(8)), "over the limit"),
        (task({**DY, "dtype": "object"}, bytes(24)), "dtype 'object'"),
        (task({**DY, "dtype": "<U10"}, bytes(24)), "dtype '<U10'"),
        (task({**DY, "dtype": "float64"}, bytes(48)), "dtype 'float64'"),
        (task({**DY, "dtype": 5}, bytes(24)), "dtype 5"),
        (task({**DY, "shape": [-2, -3]}, bytes(24)), "non-negative ints"),
        (task({**DY, "shape": [2.0, 3]}, bytes(24)), "non-negative ints"),
        (task({**DY, "shape": [True, 6]}, bytes(24)), "non-negative ints"),
        (task({**DY, "shape": [1] * 7}, bytes(4)), "at most 6"),
        (task({**DY, "shape": "2,3"}, bytes(24)), "at most 6"),
        (task({**DY, "name": ""}, bytes(24)), "array names must be non-empty str"),
        (task({**DY, "name": 3}, bytes(24)), "array names must be non-empty str"),
        (task({"name": "dy", "dtype": "float32"}, bytes(24)), "keys name, dtype, shape"),
        (task(["dy", "float32", [2, 3]], bytes(24)), "keys name, dtype, shape"),
        (raw(envelope(kind="error", header={"message": "x"}, arrays=[DY]), bytes(24)), "carries no arrays"),
        (raw(envelope(kind="heartbeat", arrays=[DY]), bytes(24)), "carries no arrays"),
        (raw(envelope(kind="echo", header={}, arrays=[DY, DY]), bytes(24), bytes(24)), "duplicate array names"),
    ],
)
def test_malformed_arrays(frames, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        decode(frames)


def test_max_bytes_is_configurable():
    frames = encode(Message("echo", {}, {"x": X}))
    with pytest.raises(ProtocolError, match="over the limit of 100 bytes"):
        decode(frames, max_bytes=100)
    assert decode(frames, max_bytes=X.nbytes).arrays["x"].shape == X.shape


def test_non_bytes_frames_are_refused():
    with pytest.raises(ProtocolError, match="bytes-like"):
        decode([encode(Message("echo", {}, {"x": X}))[0], 12345])


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
    samples = list(SAMPLES.values())
    refused = 0
    for i in range(400):
        frames = [bytes(f) for f in encode(samples[i % len(samples)])]
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
    with pytest.raises(ProtocolError, match="dtype float64.*astype"):
        encode(Message("echo", {}, {"x": X.astype(np.float64)}))
    with pytest.raises(ProtocolError, match="not a numpy array"):
        encode(Message("echo", {}, {"x": [1.0, 2.0]}))
    with pytest.raises(ProtocolError, match="rank 7 > 6"):
        encode(Message("echo", {}, {"x": np.zeros((1,) * 7, np.float32)}))
    with pytest.raises(ProtocolError, match=f"at most {MAX_ARRAYS}"):
        encode(Message("echo", {}, {f"a{i}": B for i in range(MAX_ARRAYS + 1)}))
    with pytest.raises(ProtocolError, match="array names must be non-empty str"):
        encode(Message("echo", {}, {"": B}))
    with pytest.raises(ProtocolError, match="carries no arrays"):
        encode(Message("heartbeat", {}, {"x": X}))
    with pytest.raises(ProtocolError, match="not a short identifier"):
        encode(Message("Nonsense"))
    with pytest.raises(ProtocolError, match="expected a Message"):
        encode({"kind": "echo"})


def test_big_endian_arrays_are_refused_with_a_hint():
    with pytest.raises(ProtocolError, match="dtype >f4.*cast it"):
        encode(Message("echo", {}, {"x": X.astype(">f4")}))


# ---- the schema helper, for the application's task headers -----------------------------------


def test_int_and_num_refuse_bools():
    assert isinstance(3, Int) and not isinstance(True, Int) and not isinstance(3.0, Int)
    assert isinstance(3, Num) and isinstance(2.5, Num) and not isinstance(False, Num) and not isinstance("1", Num)


def test_check_fields_names_the_kind_the_key_and_what_was_expected():
    required, optional = {"task": Int, "rate": Num, "names": list}, {"flag": bool, "meta": dict}
    check_fields("train", {"task": 1, "rate": 0.5, "names": []}, required, optional)
    check_fields("train", {"task": 1, "rate": 2, "names": ["a"], "flag": True, "meta": {}}, required, optional)
    cases = [
        ({"rate": 0.5, "names": []}, "train: header is missing 'task' \\(int\\)"),
        ({"task": 1}, "train: header is missing 'rate' \\(number\\), 'names' \\(list\\)"),
        ({"task": True, "rate": 0.5, "names": []}, "train: header 'task' must be int, got bool"),
        ({"task": 1, "rate": "fast", "names": []}, "train: header 'rate' must be number, got str"),
        ({"task": 1, "rate": 1, "names": [], "meta": []}, "train: header 'meta' must be map, got list"),
        ({"task": 1, "rate": 1, "names": [], "size": 3}, "unexpected header key\\(s\\) size; allowed: flag, meta"),
        ([], "train: header must be a map, got list"),
    ]
    for header, complaint in cases:
        with pytest.raises(ProtocolError, match=complaint):
            check_fields("train", header, required, optional)


# ---- serving helpers -------------------------------------------------------------------------


def test_error_reply_echoes_only_an_int_task():
    assert error_reply(Message("echo", {"task": 5, "step": 2, "layer": 1}), "no").header == {"message": "no", "task": 5}
    for header in ({"task": True}, {"task": "5"}, {"task": 1.0}, {}):
        assert error_reply(Message("echo", header), "no").header == {"message": "no"}
    assert error_reply(None, "no") == Message("error", {"message": "no"})
    check_message(error_reply(Message("echo", {"task": 5}), "no"))


def test_call_handler_turns_exceptions_and_invalid_replies_into_error_replies():
    class Handler:
        def hello(self):
            return {}

        def handle(self, msg):
            if msg.kind == "boom":
                raise KeyError("k")
            if msg.kind == "bad":
                return Message("echoed", {"n": np.float32(1)})
            return None if msg.kind == "quiet" else Message("echoed", {"task": msg.header["task"]})

    h, told = Handler(), []
    assert call_handler(h, Message("echo", {"task": 1}), told.append) == Message("echoed", {"task": 1})
    assert told == [Message("started", {"task": 1}), Message("computed", {"task": 1})]  # around the handler
    assert call_handler(h, Message("quiet", {"task": 2}), told.append) is None
    reply = call_handler(h, Message("boom", {"task": 3}), told.append)
    assert reply.header == {"message": "boom failed: KeyError: 'k'", "task": 3}
    assert told[-2:] == [Message("started", {"task": 3}), Message("computed", {"task": 3})]
    told.clear()
    assert call_handler(h, Message("quiet"), told.append) is None and told == []  # no task id: nothing to say of it
    reply = call_handler(h, Message("bad", {"task": 4}), told.append)
    assert reply.kind == "error" and reply.header["task"] == 4
    assert reply.header["message"].startswith("bad: the worker produced an invalid reply: echoed: header['n']")

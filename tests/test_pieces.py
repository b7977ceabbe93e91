"""A large message in pieces (transports/pieces.py): put together again byte for byte, each piece a sign of
life on the way, and whatever is out of place refused before it is kept."""

from __future__ import annotations

import numpy as np
import pytest
from echo_worker import PROTOCOL, TIMEOUT, answer, reap, spawn

from transports.base import Message
from transports.pieces import PIECE_BYTES, Reassembly, is_piece, pieces
from transports.wire import ProtocolError, decode, encode
from transports.zmq_master import ZmqTransport

RNG = np.random.default_rng(5)


def big_message() -> list:
    arrays = {"x": RNG.standard_normal(PIECE_BYTES // 2, dtype=np.float32), "e": np.zeros(0, np.float32),
              "y": RNG.standard_normal((3, PIECE_BYTES // 8), dtype=np.float32)}  # fmt: skip
    return encode(Message("result", {"task": 7, "compute_s": 0.5}, arrays))


def test_a_large_message_comes_back_whole_and_each_piece_before_the_last_is_only_a_sign_of_life():
    frames = big_message()
    parts = pieces(frames)
    assert parts is not None and len(parts) > 3 and all(is_piece(p) for p in parts)
    assert all(len(p[2]) <= PIECE_BYTES for p in parts)
    again = Reassembly(max_bytes=1 << 30)
    got = [again.add(p) for p in parts]
    assert got[:-1] == [None] * (len(parts) - 1)
    whole = decode(got[-1])
    sent = decode(frames)
    assert whole.header == sent.header and whole.arrays.keys() == sent.arrays.keys()
    for name in sent.arrays:
        np.testing.assert_array_equal(whole.arrays[name], sent.arrays[name])


def test_a_small_message_goes_whole():
    assert pieces(encode(Message("heartbeat"))) is None


def test_a_message_cut_short_is_dropped_when_the_next_begins():
    parts = pieces(big_message())
    again = Reassembly(max_bytes=1 << 30)
    assert again.add(parts[0]) is None and again.add(parts[1]) is None  # the sender's pipe filled: the rest never came
    assert [again.add(p) for p in parts][-1] is not None


@pytest.mark.parametrize(
    "tamper, why",
    [
        (lambda parts: parts[1:], "out of place"),  # no first piece
        (lambda parts: [parts[0], parts[2]], "out of place"),  # a piece skipped
        (lambda parts: [[parts[0][0], b"\x01\x00\x00\xff\xff" + bytes(8), b""]], "65535 frames"),
        (lambda parts: [[parts[0][0], b"\x01", b""]], "place is 1 bytes"),
    ],
)
def test_a_piece_out_of_place_is_refused(tamper, why):
    again = Reassembly(max_bytes=1 << 30)
    with pytest.raises(ProtocolError, match=why):
        for p in tamper(pieces(big_message())):
            again.add(p)


def test_a_message_in_pieces_over_the_cap_is_refused_before_it_is_kept():
    again = Reassembly(max_bytes=PIECE_BYTES)
    with pytest.raises(ProtocolError, match="over its cap"):
        for p in pieces(big_message()):
            again.add(p)


def test_large_tasks_and_results_cross_a_zmq_link_in_pieces():
    x = RNG.standard_normal(3 * PIECE_BYTES // 4, dtype=np.float32)  # 3 pieces each way
    with ZmqTransport(bind="tcp://127.0.0.1:0", protocol=PROTOCOL) as t:
        worker = spawn(t.bound_address)
        try:
            t.start(1, timeout=TIMEOUT)
            t.send(0, Message("echo", {"task": 1}, {"x": x}))
            _, reply = answer(t)
            np.testing.assert_array_equal(reply.arrays["y"], x * 2 + 1)
        finally:
            t.close()
            reap([worker])

"""The master's memory under a flood from peers that hold no authorised key.

The master runs in a process of its own (``MASTER`` below), so that its resident set is
its own; the flooding peers run here. Without CURVE, one peer sends 10,000 random
messages (1 to 4 frames of up to 1 KiB) and 10 oversized ones (5 single frames of
6 MiB, 5 messages of 3 frames of 3 MiB), and a second peer says hello, is admitted (no
key is needed without CURVE) and sends 10 messages whose frames add up to 9 MiB, over
the 8 MiB cap; all of it three times, so that a leak would add up. With CURVE, ten
such pairs of peers (the first without keys, the second with a key the master does not
know) try the same once; they never get past the handshake.
The test waits until the master has counted every message (or, with CURVE, until each
peer's handshake failed), and asserts a generous bound on the growth
of the master's RSS; ``-s`` prints the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import zmq
from echo_worker import HERE, PROTOCOL, TIMEOUT, EchoHandler, wait_for
from zmq.utils.monitor import recv_monitor_message

from transports.base import Message
from transports.curve import CurveClient, generate_keys, local_keys
from transports.wire import encode

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")

MIB = 1 << 20
MAX_MESSAGE_BYTES = 8 * MIB
RANDOM_MESSAGES = 10_000
ROUNDS = 3

MASTER = f"""
import json, os, sys, threading
from transports.curve import CurveServer
from transports.wire import ProtocolError
from transports.zmq_master import ZmqTransport

def rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

curve = CurveServer(sys.argv[1], sys.argv[2]) if len(sys.argv) > 2 else None
t = ZmqTransport(bind="tcp://127.0.0.1:0", protocol={PROTOCOL}, max_message_bytes={MAX_MESSAGE_BYTES}, curve=curve)
refused = [0]

def serve():  # what a master's training loop does: read what its workers send
    try:
        t.start(1, timeout=600)
        while True:
            try:
                t.recv(0.5)
            except ProtocolError:
                refused[0] += 1
            except TimeoutError:
                pass
    except RuntimeError:  # closed
        pass

threading.Thread(target=serve, daemon=True).start()
print(t.bound_address, flush=True)
for line in sys.stdin:
    print(json.dumps({{"rss_kib": rss_kib(), "dropped": t.dropped(), "refused": refused[0]}}), flush=True)
t.close()
"""


class Master:
    def __init__(self, *curve_files: str) -> None:
        path = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", MASTER, *curve_files],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": path},
        )
        self.address = self.proc.stdout.readline().strip()
        assert self.address.startswith("tcp://"), "the master did not start"

    def stats(self) -> dict:
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=TIMEOUT)


def dealer(ctx: zmq.Context, address: str, curve: CurveClient | None = None) -> tuple[zmq.Socket, zmq.Socket]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(TIMEOUT * 1000))
    if curve is not None:
        curve.apply(sock)
    failed = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    monitor = sock.get_monitor_socket(failed | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    sock.connect(address)
    return sock, monitor


def flood(noisy: zmq.Socket, admitted: zmq.Socket, block: bool) -> int:
    """Every message of the flood; returns how many zmq took (without a handshake, it queues few)."""
    rng = np.random.default_rng(11)
    flags = 0 if block else zmq.NOBLOCK
    taken = 0
    messages = [[rng.bytes(int(rng.integers(0, 1024))) for _ in range(int(rng.integers(1, 5)))] for _ in range(500)]
    oversized = [[bytes(6 * MIB)]] * 5 + [[bytes(3 * MIB)] * 3] * 5
    arrays = {f"a{i}": np.zeros(3 * MIB // 4, np.float32) for i in range(3)}
    over_the_cap = encode(Message("result", {"task": 1}, arrays))
    batches = [(noisy, messages * (RANDOM_MESSAGES // 500)), (noisy, oversized), (admitted, [over_the_cap] * 10)]
    for sock, batch in batches:
        for frames in batch:
            try:
                sock.send_multipart(frames, flags=flags)
                taken += 1
            except zmq.Again:
                pass
    return taken


def handshake_failed(monitor: zmq.Socket) -> None:
    assert monitor.poll(int(TIMEOUT * 1000)), "no failed handshake"
    recv_monitor_message(monitor)


def report(name: str, before: dict, after: dict) -> int:
    growth = after["rss_kib"] - before["rss_kib"]
    print(
        f"\n{name}: master RSS {before['rss_kib'] / 1024:.1f} MiB -> {after['rss_kib'] / 1024:.1f} MiB "
        f"(+{growth / 1024:.1f} MiB); dropped {after['dropped']}, refused from the admitted peer {after['refused']}"
    )
    return growth


def test_master_memory_under_a_flood_without_curve():
    master, ctx = Master(), zmq.Context()
    try:
        before = master.stats()
        noisy, _ = dealer(ctx, master.address)
        admitted, _ = dealer(ctx, master.address)
        admitted.send_multipart(encode(Message("hello", EchoHandler().hello())))
        assert admitted.poll(int(TIMEOUT * 1000)) and admitted.recv_multipart()  # welcome: a worker now
        growth = []
        for n in range(1, ROUNDS + 1):  # the same flood again and again: what a leak would add up
            flood(noisy, admitted, block=True)

            def counted(n: int = n) -> dict | None:
                s = master.stats()
                done = sum(s["dropped"].values()) >= n * (RANDOM_MESSAGES + 10) and s["refused"] >= n * 10
                return s if done else None

            after = wait_for(counted, what="the master counting every message")
            assert sum(after["dropped"].values()) == n * (RANDOM_MESSAGES + 10) and after["refused"] == n * 10
            growth.append(report(f"without CURVE, flood {n}", before, after))
        assert max(growth) < 64 * 1024  # KiB; each flood moves about 5 MiB of random messages, 75 + 90 MiB oversized
    finally:
        ctx.destroy(linger=0)
        master.close()


def test_master_memory_under_a_flood_with_curve(tmp_path):
    server, _, files = local_keys(tmp_path / "master")
    stranger = CurveClient(generate_keys(tmp_path / "stranger", "rogue")[1], files.server_public)
    master, ctx = Master(server.secret_key_file, server.authorized_keys_dir), zmq.Context()
    try:
        before = master.stats()
        taken = 0
        for _ in range(10):  # zmq does not retry a refused handshake, so ten pairs of peers try once each
            noisy, noisy_monitor = dealer(ctx, master.address)
            admitted, admitted_monitor = dealer(ctx, master.address, stranger)
            taken += flood(noisy, admitted, block=False)
            handshake_failed(noisy_monitor)
            handshake_failed(admitted_monitor)
        after = master.stats()
        # nothing of theirs reached the transport: their knocks were counted, as refused keys, and no more
        assert set(after["dropped"]) <= {"key"} and after["refused"] == 0
        print(f"\n(with CURVE, zmq queued {taken} of the flood's messages in the peers, to send after a handshake)")
        assert report("with CURVE", before, after) < 16 * 1024
    finally:
        ctx.destroy(linger=0)
        master.close()

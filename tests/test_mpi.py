"""The MPI transport (transports/mpi_*.py) in real ``mpiexec`` jobs.

Each test runs this file as an MPI program, ``mpiexec -n N python tests/test_mpi.py SCENARIO``,
in a subprocess with a time limit: rank 0 plays the master (or a fake one that sends exactly
the frames a check wants), the other ranks serve :class:`echo_worker.EchoHandler` (or play a
fake worker). Rank 0 runs the same conformance checks as the inproc and zmq transports
(``transport_conformance.py``); every rank prints one ``rank R exit N;`` line at the end, so the
test sees each worker's exit code whatever ``mpiexec`` makes of them. A failed check on rank 0
prints its traceback and exits 1.

Skipped, with the reason, where mpi4py or ``mpiexec`` is missing (``make setup`` installs both).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
from echo_worker import PROTOCOL, TIMEOUT, EchoHandler, answer
from transport_conformance import (
    check_bad_messages_fail_at_send,
    check_echoes,
    check_error_replies,
    check_exact_arrays,
    echo,
)

from transports import Message, ProtocolError, VersionMismatch, WorkerLost, wire

HERE = Path(__file__).resolve().parent
JOB_TIMEOUT = 60.0  # one mpiexec job; a passing one takes a few seconds
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")

# ---- the pytest side: one mpiexec job per scenario --------------------------------------------


# Run first in a process: from then on ``import zmq`` (and any zmq.*) raises ImportError, as where pyzmq is missing.
FORBID_ZMQ = "import sys; sys.modules['zmq'] = None"


def run_job(scenario: str, ranks: int, without_zmq: bool = False) -> tuple[str, dict[int, int]]:
    """Run SCENARIO on ``ranks`` ranks (every rank unable to import zmq if ``without_zmq``); (stderr,
    {rank: its exit code}). Fails on rank 0's failure."""
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install -e '.[mpi]' or make setup)")
    if MPIEXEC is None:
        pytest.skip("no mpiexec beside this python nor on PATH (pip install -e '.[mpi]' installs MPICH's)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    program = [str(Path(__file__))]
    if without_zmq:
        run = f"runpy.run_path({str(Path(__file__))!r}, run_name='__main__')"
        program = ["-c", f"{FORBID_ZMQ}; sys.path.insert(0, {str(HERE)!r}); import runpy; {run}"]
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, *program, scenario]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and every rank it started
        out, err = proc.communicate()
        pytest.fail(f"mpiexec job {scenario!r} did not end within {JOB_TIMEOUT:g} s\n{out}\n{err}")
    # mpiexec forwards each rank's writes as they come, so one rank's line may run into another's
    codes = {int(rank): int(code) for rank, code in re.findall(r"rank (\d+) exit (-?\d+);", out)}
    assert codes.get(0) == 0 and proc.returncode == 0, f"{scenario}: mpiexec {proc.returncode}\n{out}\n{err}"
    assert sorted(codes) == list(range(ranks)), f"{scenario}: not every rank reported\n{out}\n{err}"
    return err, codes


def test_mpi_conformance_echo_errors_bad_messages_and_clean_shutdown():
    err, codes = run_job("conformance", 3)
    assert codes == {0: 0, 1: 0, 2: 0}  # shutdown reached both workers: each exited 0
    for rank in (1, 2):
        assert f"MPI rank {rank}: shutdown: train over" in err
    assert "Traceback" not in err


def test_the_mpi_transport_imports_nothing_of_zmq():
    code = (
        f"{FORBID_ZMQ}\n"
        "import transports.mpi_master, transports.mpi_worker, transports.mpi_link, transports.session.welcome\n"
        "from transports import load_transport\n"
        "assert load_transport('mpi') is transports.mpi_master.MpiTransport\n"
        "assert not [m for m in sys.modules if m.startswith('zmq.')], sorted(sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=JOB_TIMEOUT)
    assert done.returncode == 0, done.stderr


def test_mpi_conformance_without_pyzmq():
    err, codes = run_job("conformance", 3, without_zmq=True)  # masters and workers alike
    assert codes == {0: 0, 1: 0, 2: 0} and "Traceback" not in err


def test_mpi_heartbeats_flow_while_a_long_task_computes():
    err, codes = run_job("long_task", 2)
    assert codes == {0: 0, 1: 0} and "lost" not in err


def test_mpi_master_refuses_a_rank_of_another_protocol_and_the_others_are_shut_down():
    err, codes = run_job("refused", 3)
    assert codes == {0: 0, 1: 0, 2: 1}
    both = f"task protocol version mismatch: the worker speaks version {PROTOCOL + 1}, the master version {PROTOCOL}"
    assert f"MPI rank 2: the master refused this worker: {both}" in err
    assert "MPI rank 1: shutdown: train over" in err


def test_mpi_rank_that_cannot_build_its_handler_ends_start_with_its_message():
    err, codes = run_job("start_failure", 2)
    assert codes == {0: 0, 1: 1}
    assert "MPI rank 1: cannot start: RuntimeError: no such GPU" in err


def test_mpi_stopped_worker_is_lost_and_the_other_keeps_serving():
    err, codes = run_job("lost", 3)
    assert codes[0] == 0 and codes[2] == 0
    # Once continued, rank 1 ends either way, whichever it notices first: the shutdown the master sent it
    # anyway at close, or its own clock, which ran on while it was stopped and says the master was silent.
    assert (codes[1], "MPI rank 1: shutdown: train over" in err) == (0, True) or (
        codes[1] == 1 and "MPI rank 1: lost the master" in err
    ), err


def test_mpi_worker_answers_bad_messages_refuses_another_wire_and_stops_on_broken_framing():
    err, codes = run_job("fake_master", 4)
    assert codes == {0: 0, 1: 1, 2: 0, 3: 1}
    theirs, ours = wire.WIRE_VERSION + 1, wire.WIRE_VERSION
    assert f"MPI rank 1: cannot talk to the master: wire version mismatch: the master speaks version {theirs}, " \
           f"this worker version {ours}" in err  # fmt: skip
    assert "MPI rank 2: bad message from the master" in err and "over the limit" in err
    assert "MPI rank 3: cannot read the master any more: a prefix of 3 bytes" in err


def test_mpi_master_reports_malformed_messages_and_loses_a_worker_whose_framing_breaks():
    _, codes = run_job("fake_worker", 2)
    assert codes == {0: 0, 1: 0}


def test_mpi_transport_without_mpi4py_names_what_to_install(monkeypatch):
    from transports import mpi_link
    from transports.mpi_master import MpiTransport

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as if it were not installed: import fails
    with pytest.raises(mpi_link.MpiUnavailable, match=r"pip install -e '\.\[mpi\]' \(or make setup\)"):
        MpiTransport(protocol=PROTOCOL)
    assert issubclass(mpi_link.MpiUnavailable, RuntimeError)  # a one-line failure in the main job


def test_mpi_transport_is_registered():
    from transports import available_transports, load_transport
    from transports.mpi_master import MpiTransport

    assert "mpi" in available_transports() and load_transport("mpi") is MpiTransport


def test_prefix_is_checked_before_anything_is_allocated():
    from transports.mpi_link import MAGIC, PREFIX_LEN, LinkBroken, check_prefix, make_prefix

    frames = wire.encode(echo(1, np.ones((3, 4), np.float32)))
    prefix = make_prefix(frames)
    assert check_prefix(prefix, 1000) == [len(frames[0]), 48]
    assert check_prefix(make_prefix([]), 0) == []  # a bye: nothing more comes from that peer
    with pytest.raises(LinkBroken, match="over the limit of 47 bytes"):
        check_prefix(prefix, 47)

    def bad(**at: int) -> np.ndarray:
        p = prefix.copy()
        for i, v in at.items():
            p[int(i.removeprefix("i"))] = v
        return p

    cases = [
        ("MAGIC", bad(i0=MAGIC + 1)),
        ("announcing -1 frames", bad(i1=-1)),
        (f"announcing {PREFIX_LEN - 1} frames", bad(i1=PREFIX_LEN - 1)),
        ("lengths after its last frame", bad(i4=1)),
        ("lengths after its last frame", bad(i1=0)),  # a bye announces no lengths at all
        ("a header frame of 0 bytes", bad(i2=0)),
        (f"a header frame of {wire.MAX_HEADER_BYTES + 1} bytes", bad(i2=wire.MAX_HEADER_BYTES + 1)),
        ("negative frame lengths", bad(i3=-8)),
    ]
    for text, p in cases:
        with pytest.raises(LinkBroken, match=text):
            check_prefix(p, 10**9)


# ---- the MPI side: what each rank does ----------------------------------------------------------


def _pause(seconds: float) -> None:
    """Paces a fake peer's polling of MPI, which cannot wake it; never a substitute for a condition."""
    time.sleep(seconds)


def _serve(handler_factory=EchoHandler, **options) -> int:
    from transports.mpi_worker import serve_if_worker

    code = serve_if_worker(handler_factory, **options)
    assert code is not None, "serve_if_worker returned None on a worker rank"
    return code


def conformance(rank: int) -> int:
    from transports.mpi_master import MpiTransport

    if rank:
        return _serve(heartbeat_s=0.2)
    with MpiTransport(protocol=PROTOCOL, heartbeat_s=0.2) as t:
        with pytest.raises(ValueError, match=r"3 worker\(s\) asked for, but mpiexec started 3 ranks.*mpiexec -n 4"):
            t.start(3, timeout=TIMEOUT)
        infos = t.start(2, timeout=TIMEOUT)
        assert [w.index for w in infos] == [0, 1] and [w.address for w in infos] == ["MPI rank 1", "MPI rank 2"]
        assert all(w.backend == "echo" and w.device == {"name": "test device", "hellos": 1} for w in infos)
        assert len({w.pid for w in infos} | {os.getpid()}) == 3  # three processes
        assert t.joined() == []  # the ranks of an MPI job are fixed when it starts
        check_echoes(t, 2)
        check_exact_arrays(t, 1)
        check_error_replies(t, 0)
        check_bad_messages_fail_at_send(t)
        sent, received = t.traffic()[1]
        assert sent > 4 << 20 and received > 4 << 20  # the large array went out and came back
        t.close()
        t.close()  # idempotent
        with pytest.raises(RuntimeError, match="needs a started, open transport"):
            t.send(0, echo(1))
    return 0


def long_task(rank: int) -> int:
    from transports.mpi_master import MpiTransport

    if rank:
        return _serve(heartbeat_s=0.1, peer_timeout_s=1.0, quiet=True)
    with MpiTransport(protocol=PROTOCOL, heartbeat_s=0.1, peer_timeout_s=1.0) as t:
        t.start(1, timeout=TIMEOUT)
        t.send(0, Message("slow", {"task": 1, "seconds": 2.0}))  # longer than either side's patience, 0.4 s
        _, reply = answer(t)  # no WorkerLost: the worker's loop kept heartbeating
        assert reply.kind == "echoed" and reply.header["took"] >= 2.0
    return 0


def refused(rank: int) -> int:
    from transports.mpi_master import MpiTransport

    if rank:
        return _serve(lambda: EchoHandler(PROTOCOL + 1 if rank == 2 else PROTOCOL))
    with MpiTransport(protocol=PROTOCOL) as t, pytest.raises(VersionMismatch) as info:
        t.start(2, timeout=TIMEOUT)  # raises at once: no other rank could take rank 2's place
    assert str(info.value).startswith(
        f"task protocol version mismatch: MPI rank 2 speaks version {PROTOCOL + 1}, the master version {PROTOCOL}"
    )
    return 0


def start_failure(rank: int) -> int:
    from transports.mpi_master import MpiTransport

    def no_gpu() -> EchoHandler:
        raise RuntimeError("no such GPU")

    if rank:
        return _serve(no_gpu)
    with (
        MpiTransport(protocol=PROTOCOL) as t,
        pytest.raises(RuntimeError, match="MPI rank 1 could not start: RuntimeError: no such GPU"),
    ):
        t.start(1, timeout=TIMEOUT)
    return 0


def lost(rank: int) -> int:
    from transports.mpi_master import MpiTransport

    if rank:
        return _serve(heartbeat_s=0.1, peer_timeout_s=2.0)
    with MpiTransport(protocol=PROTOCOL, heartbeat_s=0.1, peer_timeout_s=2.0) as t:
        infos = t.start(2, timeout=TIMEOUT)
        os.kill(infos[0].pid, signal.SIGSTOP)  # rank 1 stops answering, heartbeats included
        try:
            with pytest.raises(
                WorkerLost, match=r"worker 0 lost: silent for .* \(patience 0\.4 s: 4 heartbeats; at most 2 s\)"
            ):
                t.recv(TIMEOUT)
            with pytest.raises(WorkerLost, match="worker 0 lost"):
                t.send(0, echo(1))
            t.send(1, echo(2))  # the other one serves on
            assert answer(t)[1].header["task"] == 2
        finally:
            os.kill(infos[0].pid, signal.SIGCONT)
    return 0


def fake_master(rank: int) -> int:
    """Rank 0 sends raw frames: rank 1 a welcome of a future wire, rank 2 bad messages, rank 3 a broken prefix."""
    from mpi4py import MPI

    from transports.mpi_link import TAG_PREFIX, MpiChannel

    if rank:
        return _serve(heartbeat_s=0.2)
    link = MpiChannel(MPI.COMM_WORLD, [1, 2, 3])
    inbox: dict[int, list[Message]] = {1: [], 2: [], 3: []}

    def next_from(peer: int) -> Message:
        """The next message from ``peer`` but a heartbeat or a task's progress (the others' are kept for later)."""
        deadline = time.monotonic() + TIMEOUT
        while not inbox[peer]:
            assert time.monotonic() < deadline, f"nothing from rank {peer} within {TIMEOUT:g} s"
            for got in link.poll():
                msg = None if got.frames is None else wire.decode(got.frames)
                if msg is not None and msg.kind not in {"heartbeat", *wire.PROGRESS}:
                    inbox[got.peer].append(msg)
            _pause(0.001)
        return inbox[peer].pop(0)

    for peer in (1, 2, 3):
        assert next_from(peer).kind == "hello"
    import msgpack

    future = {"v": wire.WIRE_VERSION + 1, "kind": "welcome", "header": {"index": 0}, "arrays": []}
    link.send(1, [msgpack.packb(future)])
    link.send(3, wire.encode(Message("welcome", {"index": 2, "heartbeat_s": 0.2})))
    MPI.COMM_WORLD.Send([b"abc", MPI.BYTE], 3, TAG_PREFIX)  # 3 bytes where a prefix belongs
    link.send(2, wire.encode(Message("welcome", {"index": 1, "heartbeat_s": 0.2})))
    declared = {"name": "x", "dtype": "float32", "shape": [10**12]}
    bogus = {"v": wire.WIRE_VERSION, "kind": "echo", "header": {"task": 1}, "arrays": [declared]}
    link.send(2, [msgpack.packb(bogus), b"tiny"])
    reply = next_from(2)
    assert reply.kind == "error" and "over the limit" in reply.header["message"]
    link.send(2, wire.encode(Message("hello", EchoHandler().hello())))  # a session kind no worker takes
    reply = next_from(2)
    assert reply.kind == "error" and "does not accept 'hello'" in reply.header["message"]
    link.send(2, wire.encode(echo(4)))  # still serving
    reply = next_from(2)
    assert reply.kind == "echoed" and reply.header["task"] == 4
    link.send(2, wire.encode(Message("shutdown", {"reason": "train over"})))
    assert link.finish([1, 2, 3], TIMEOUT) == []  # every rank said bye: nothing is left unread anywhere
    return 0


def fake_worker(rank: int) -> int:
    """Rank 1 speaks raw frames to a real master: a malformed message, a reply, then a broken prefix."""
    from mpi4py import MPI

    from transports.mpi_link import TAG_PREFIX, MpiChannel
    from transports.mpi_master import MpiTransport

    comm = MPI.COMM_WORLD
    if rank:
        link = MpiChannel(comm, [0])

        def wait_for(kind: str) -> Message:
            deadline = time.monotonic() + TIMEOUT
            while True:
                assert time.monotonic() < deadline, f"no {kind} from the master"
                for got in link.poll():
                    msg = None if got.frames is None else wire.decode(got.frames)
                    if msg is not None and msg.kind == kind:
                        return msg
                _pause(0.001)

        link.send(0, wire.encode(Message("hello", EchoHandler().hello())))
        wait_for("welcome")
        link.send(0, [b"\x92garbage"])
        assert "the master could not read your message" in wait_for("error").header["message"]
        link.send(0, wire.encode(Message("made_up_reply", {"task": 9, "anything": [1, "two"]})))
        comm.Send([b"abc", MPI.BYTE], 0, TAG_PREFIX)  # the master can read nothing after this
        assert link.finish([0], TIMEOUT) == []  # but it still understands a bye, and answers it
        return 0
    with MpiTransport(protocol=PROTOCOL, heartbeat_s=0.2) as t:
        t.start(1, timeout=TIMEOUT)
        with pytest.raises(ProtocolError, match="worker 0 sent a malformed message"):
            t.recv(TIMEOUT)
        k, msg = t.recv(TIMEOUT)  # the link goes on after a message that does not decode
        assert (k, msg.kind, msg.header) == (0, "made_up_reply", {"task": 9, "anything": [1, "two"]})
        with pytest.raises(WorkerLost, match="worker 0 lost: its messages cannot be read: a prefix of 3 bytes"):
            t.recv(TIMEOUT)
    return 0


SCENARIOS = {f.__name__: f for f in (conformance, long_task, refused, start_failure, lost, fake_master, fake_worker)}


def main(scenario: str) -> int:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    try:
        code = SCENARIOS[scenario](rank)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.write(f"rank {rank} exit {code};\n")  # one write: see run_job
    sys.stdout.flush()
    return 0 if rank else code  # a worker's own code is in the line above; mpiexec sees rank 0's


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

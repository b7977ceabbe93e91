"""What the terminal shows while a run goes: a line as each thing happens to the cluster (a worker lost or
joined, one sitting a layer out, a rebalance and its new shares), a line per epoch, and progress bars only where
a person watches them. The lines come from what the metrics file gets -- each step's record and the runtime's
events -- so the terminal and the file tell the same story."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tinyconv.report import idle, whole, why_idle


def hide_bars(progress: bool) -> bool | None:
    """tqdm's ``disable``: True without ``progress``, else None, with which tqdm draws only on a terminal (in a
    log, each redraw of a bar would be a line of its own)."""
    return None if progress else True


def say(line: str) -> None:
    """One line of the story on stdout, above the bars, flushed: piped to a log, it shows as it happens."""
    tqdm.write(line)
    sys.stdout.flush()


def ratio(counts: Sequence[object]) -> str:
    return "/".join(map(str, counts))  # [60, 68] as "60/68"


def split(shares: dict[str, Sequence[int]], names: Sequence[str] | None = None) -> str:
    """{"conv1": [25, 25], "conv2": [60, 68]} as "conv1 25/25  conv2 60/68 (master/worker0)"."""
    text = "  ".join(f"{unit} {ratio(counts)}" for unit, counts in shares.items())
    return f"{text} ({ratio(names)})" if names else text


class Story:
    """Tells the run as it goes, fed what the metrics file gets: each step's record (:meth:`step`) and each
    cluster event (:meth:`event`); :meth:`epoch_line` sums up the steps since the last epoch's line."""

    def __init__(self) -> None:
        self.idle: set[tuple[str, str]] = set()  # (participant, unit) it computed nothing of in the last step
        self.shares: dict[str, list[int]] = {}  # the split in force
        self.names: list[str] = []  # the participants, in the order of the shares' lists ([]: not known)
        self.steps, self.time_s, self.comm_s = 0, 0.0, 0.0  # the epoch's, so far

    def step(self, step: int, rec: dict[str, Any]) -> None:
        """Step ``step``'s metrics record: who starts or stops sitting a unit out, and what the rebalancer moved
        (its ``rebalanced``: the shares from the next step)."""
        self.steps, self.time_s, self.comm_s = self.steps + 1, self.time_s + rec["time_s"], self.comm_s + rec["comm_s"]
        if "participants" not in rec:  # the master alone: nothing shared
            return
        names, rebalanced = rec["participants"], rec.get("rebalanced") or {}
        now = {(name, unit): few for name, unit, few in idle(rec)}
        for name, unit in sorted(now.keys() - self.idle):
            why = why_idle(unit, now[name, unit], sum(rec["shares"][unit]), len(names), short=True)
            say(f"step {step}: {name} sits out {whole(unit)}: {why}")
        for name, unit in sorted(self.idle - now.keys()):
            if name in names:  # not a worker lost since
                say(f"step {step}: {name} takes part in {whole(unit)} again")
        for unit, counts in rebalanced.items():
            say(f"step {step}: {unit} rebalanced {ratio(rec['shares'][unit])} -> {ratio(counts)} ({ratio(names)})")
        self.idle, self.shares, self.names = set(now), {**rec["shares"], **rebalanced}, list(names)

    def event(self, e: dict[str, Any]) -> None:
        """A cluster event (:meth:`~tinyconv.parallel.Parallel.pop_events`'s), with the shares it left."""
        worker, shares = e.get("worker", "a worker"), e.get("shares") or {}
        if e["event"] == "worker_lost":  # the fields a runtime may leave out, left out of the line too
            what, self.names = f"{worker} lost: {e.get('reason', '?')}", [n for n in self.names if n != worker]
        elif e["event"] == "worker_joined":
            where = f" at {e['host']}" if e.get("host") else ""
            on = f" ({e['backend']} on {e.get('device', '?')}{where})" if "backend" in e else ""
            what, self.names = f"{worker} joined{on}", [*self.names, worker]
        else:
            what = e["event"].replace("_", " ")
        if shares:
            self.shares = shares
            if any(len(counts) != len(self.names) for counts in shares.values()):
                self.names = []  # the runtime's order cannot be told from here
        say(f"step {e['step']}: {what}" + (f"; shares now {split(shares, self.names)}" if shares else ""))

    def epoch_line(self, record: dict[str, Any], of: int, steps_per_epoch: int, done: int) -> str:
        """The epoch's line from its metrics record (``of``: the run's epochs; ``done``: its steps run, of
        ``steps_per_epoch``): losses, accuracies, time per step, the share of it spent communicating, the split."""
        parts = [f"epoch {record['epoch']}/{of}" + ("" if record["complete"] else f" ({done}/{steps_per_epoch} steps)")]
        if record["train_loss"] is not None:
            parts += [f"loss {record['train_loss']:.3f}", f"train {100 * record['train_acc']:.1f} %"]
        parts.append(f"test {100 * record['test_acc']:.1f} %")
        if self.steps:
            parts.append(f"{self.time_s / self.steps:.3g} s/step")
        if self.shares:
            parts += [f"comm {100 * self.comm_s / max(self.time_s, 1e-12):.0f} %", split(self.shares, self.names)]
        self.steps, self.time_s, self.comm_s = 0, 0.0, 0.0
        return "  ".join(parts)

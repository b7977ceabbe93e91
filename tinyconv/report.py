"""A run's results: the summary the metrics file ends with, and the table printed at the end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> str:
    """A plain-text table for terminals and logs: numeric columns right-aligned, others left."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(headers))]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = []
    if title:
        out.append(title)
    out += [line, "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |", line]
    for r in cells:
        padded = (c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric, strict=True))
        out.append("| " + " | ".join(padded) + " |")
    out.append(line)
    return "\n".join(out)


LABELS = {  # the summary's keys in words (the others read with spaces for "_"); the metrics file keeps the keys
    "train_loss": "training loss", "test_acc": "test accuracy", "best_test_acc": "best test accuracy",
    "time_per_epoch_s": "time per epoch", "median_step_s": "time per step (median)", "median_comm_s": "communication",
    "median_conv_s": "convolutions", "median_comp_s": "everything else", "bytes_sent": "sent to the workers",
    "bytes_recv": "received from the workers", "participant_bytes_sent": "sent to each",
    "participant_bytes_recv": "received from each", "final_shares": "final split",
    "final_channel_shares": "final split of input channels",
}  # fmt: skip


def summary_table(summary: dict[str, Any], steps_per_epoch: int | None = None) -> str:
    """The end-of-run table for the terminal, in words and units a person reads (%, min and s, MB); the metrics
    file keeps the raw numbers. ``steps_per_epoch``: a run with no whole epoch gets a time per epoch projected
    from its steps."""
    names, step_s, rows = summary.get("participants"), summary.get("median_step_s"), []
    for key, value in summary.items():
        label = LABELS.get(key, key.replace("_", " "))
        if key == "sat_out":
            rows += [("sat out" if i == 0 else "", sentence(s)) for i, s in enumerate(value)]
        elif key == "time_per_epoch_s" and value is None:  # no whole epoch: its median step times an epoch's
            steps = summary.get("steps")
            if step_s and steps and steps_per_epoch:
                rows.append((f"{label} (projected from {steps} steps)", duration(step_s * steps_per_epoch)))
        elif key in ("median_comm_s", "median_conv_s", "median_comp_s") and value is not None and step_s:
            rows.append((label, f"{100 * value / step_s:.0f} % of the step"))  # the medians' ratio
        elif value is not None:
            rows.append((label, _readable(key, value, names)))
    return format_table(("result", "value"), rows, title="Summary")


def duration(seconds: float) -> str:
    """Seconds as a person reads them: "0.312 s", "45.2 s", "2 min 05 s", "1 h 02 min"."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def whole(unit: str) -> str:
    """What a unit of the shares is in words: a layer by its name, or data parallelism's "the batch"."""
    return "the batch" if unit == "batch" else unit


def why_idle(unit: str, few: bool, count: int, participants: int, short: bool = False) -> str:
    """Why a participant computes nothing of ``unit`` (``count`` kernels, or the batch's images): ``few``, too
    few to go round, else too slow for even one (``short``: without saying how that was told)."""
    # data parallelism shares out a batch's images (the unit "batch"), model parallelism a layer's kernels
    thing, part = ("image", "slice") if unit == "batch" else ("kernel", "layer")
    if few:
        return f"{whole(unit)} has {count} {thing}s for {participants} participants"
    slow = f"too slow for one {thing}'s worth"
    return slow if short else f"{slow} (its one {thing} outlasted the others' whole {part})"


def sentence(sat: dict[str, Any]) -> str:
    """One entry of the summary's ``sat_out`` in words: who, which layer, how often, why."""
    who, layer, steps, of = sat["participant"], sat["layer"], sat["steps"], sat["of"]
    when = "in every step" if steps == of else f"in {steps} of {of} steps"
    why = why_idle(layer, sat["reason"] == "too few kernels", sat["kernels"], sat["participants"])
    return f"{who} sat out {whole(layer)} {when}: {why}"


def idle(rec: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(participant, unit, too few to go round) for each that computes nothing of a unit in the step ``rec``:
    none of its kernels (or images), nor of its input channels where it is split by them (they are work too)."""
    channels = rec.get("channel_shares") or {}
    return [
        (name, unit, sum(counts) < len(counts))
        for unit, counts in rec["shares"].items()
        for i, (name, k) in enumerate(zip(rec["participants"], counts, strict=True))
        if k == 0 and (unit not in channels or channels[unit][i] == 0)
    ]


def _megabytes(n: float) -> str:
    """Bytes in decimal units a person reads: 0.4 MB, 65.8 MB, 53.2 GB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _readable(key: str, value: Any, names: Sequence[str] | None = None) -> Any:
    if key in ("test_acc", "best_test_acc"):
        return f"{100 * value:.1f} %"
    if "bytes" in key:  # a total, or each worker's by name (the master sends itself nothing)
        if isinstance(value, dict):
            return "; ".join(f"{name}: {_megabytes(b)}" for name, b in value.items() if name != "master")
        return _megabytes(value)
    if key.endswith("_s"):
        return duration(value)
    if isinstance(value, dict):  # shares: kernels (or input channels) per participant, by layer
        return "; ".join(f"{layer}: {_by_name(counts, names)}" for layer, counts in value.items())
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return value


def _by_name(counts: Sequence[int], names: Sequence[str] | None) -> str:
    """[0, 3, 1] as "master 0, worker0 3, worker1 1" when the participants' names are known."""
    if names is None or len(names) != len(counts):
        return str(list(counts))
    return ", ".join(f"{name} {c}" for name, c in zip(names, counts, strict=True))


class Tally:
    """Each step's metrics record, aggregated as it comes, so a run of any length holds the same memory:
    the medians are over the last ``window`` steps, the bytes and who sat out over all of them."""

    TIMES = ("time_s", "comm_s", "conv_s", "comp_s")

    def __init__(self, window: int = 8192) -> None:
        self.steps = 0
        self._times = np.zeros((window, len(self.TIMES)))  # a ring: step i's row is i % window
        self.bytes = {"bytes_sent": 0, "bytes_recv": 0}  # in all, and each participant's by name
        self.per: dict[str, dict[str, int]] = {"bytes_sent": {}, "bytes_recv": {}}
        self.last: dict[str, Any] = {}  # the last distributed step's record: its participants and shares
        self.split_steps = 0
        self._idle: dict[tuple[str, str], dict[str, Any]] = {}  # (participant, layer) -> its steps without work

    def add(self, rec: dict[str, Any]) -> None:
        self._times[self.steps % len(self._times)] = [rec.get(k, 0.0) for k in self.TIMES]
        self.steps += 1
        if "participants" not in rec:  # the master alone: no split to add up
            return
        self.last, self.split_steps = rec, self.split_steps + 1
        for key, per in self.per.items():
            self.bytes[key] += int(rec[key])
            for name, b in zip(rec["participants"], rec[f"participant_{key}"], strict=True):
                per[name] = per.get(name, 0) + int(b)
        for name, layer, few in idle(rec):
            kernels = rec["shares"][layer]
            e = self._idle.setdefault((name, layer), {"steps": 0, "few": 0, "kernels": sum(kernels)})
            e["steps"], e["few"], e["participants"] = e["steps"] + 1, e["few"] + few, len(kernels)

    def median(self, key: str) -> float | None:
        n = min(self.steps, len(self._times))
        return float(np.median(self._times[:n, self.TIMES.index(key)])) if n else None

    def sat_out(self) -> list[dict[str, Any]]:
        """Who computed nothing of a layer (no kernels, nor input channels where it is split by them), in
        how many of the steps, and why (``sentence`` says it in words)."""
        return [
            {"participant": name, "layer": layer, "steps": e["steps"], "of": self.split_steps,
             "reason": "too few kernels" if e["few"] == e["steps"] else "too slow", "kernels": e["kernels"],
             "participants": e["participants"]}
            for (name, layer), e in self._idle.items()
        ]  # fmt: skip


def summarize(history: list[dict[str, Any]], tally: Tally, epoch: int, step: int) -> dict[str, Any]:
    """The run's summary (docs/metrics.md's ``summary`` event) from its epochs' records and its steps' tally."""
    last = history[-1] if history else {}
    full = [h["time_s"] for h in history if h["complete"]]
    out: dict[str, Any] = {
        "epochs": epoch + (0 if not history or last.get("complete") else 1),
        "steps": step,
        "train_loss": last.get("train_loss"),
        "test_loss": last.get("test_loss"),
        "test_acc": last.get("test_acc"),
        "best_test_acc": max((h["test_acc"] for h in history), default=None),
        "time_per_epoch_s": float(np.mean(full)) if full else None,
        "median_step_s": tally.median("time_s"),
    }
    if not tally.last:
        return out
    for k in ("comm_s", "conv_s", "comp_s"):
        out[f"median_{k}"] = tally.median(k)
    names = tally.last["participants"]
    for key, per in tally.per.items():  # the master's are 0: it keeps its share
        out[key] = tally.bytes[key]
        out[f"participant_{key}"] = {**{name: per.get(name, 0) for name in names}, **per}  # the last step's first
    out["participants"] = list(names)  # the order of the shares' lists
    out["final_shares"] = tally.last["shares"]
    if tally.last.get("channel_shares"):  # input channels, for layers split by them
        out["final_channel_shares"] = tally.last["channel_shares"]
    out["sat_out"] = tally.sat_out()
    return out

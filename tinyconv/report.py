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


def summary_table(summary: dict[str, Any]) -> str:
    """The end-of-run table for the terminal, in units a person reads (%, s, MB); the metrics file
    keeps the raw numbers."""
    rows = [(key, _readable(key, value)) for key, value in summary.items() if value is not None]
    return format_table(("result", "value"), rows, title="Summary")


def _readable(key: str, value: Any) -> Any:
    if key in ("test_acc", "best_test_acc"):
        return f"{value:.2%}"
    if "bytes" in key:  # a total, or each participant's by name
        if isinstance(value, dict):
            return "; ".join(f"{name}: {_mb(b)}" for name, b in value.items())
        return _mb(value)
    if key.endswith("_s"):
        return f"{value:.3g} s"
    if isinstance(value, dict):  # shares: kernels (or input channels) per participant, by layer
        return "; ".join(f"{layer}: {counts}" for layer, counts in value.items())
    return value


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def summarize(
    history: list[dict[str, Any]], step_times: list[float], step_splits: list[dict[str, Any]], epoch: int,
    step: int, distributed: bool,
) -> dict[str, Any]:  # fmt: skip
    """The run's summary from its epochs' records (``history``), each step's time and split: the last
    epoch's losses and accuracy, the best accuracy, times per epoch and step; when distributed, the
    median comm/conv/comp split, the bytes (in all and each participant's) and the last shares."""
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
        "median_step_s": float(np.median(step_times)) if step_times else None,
    }
    if not (distributed and step_splits):
        return out
    for k in ("comm_s", "conv_s", "comp_s"):
        out[f"median_{k}"] = float(np.median([s[k] for s in step_splits]))
    out["bytes_sent"] = int(sum(s["bytes_sent"] for s in step_splits))
    out["bytes_recv"] = int(sum(s["bytes_recv"] for s in step_splits))
    # each participant's, by name (the master's are 0: it keeps its share), over the steps that had them
    names = step_splits[-1]["participants"]
    for key in ("bytes_sent", "bytes_recv"):
        per = {name: 0 for name in names}
        for s in step_splits:
            for name, b in zip(s["participants"], s[f"participant_{key}"], strict=True):
                per[name] = per.get(name, 0) + int(b)
        out[f"participant_{key}"] = per
    out["final_shares"] = step_splits[-1]["shares"]
    if step_splits[-1].get("channel_shares"):  # input channels, for layers split by them
        out["final_channel_shares"] = step_splits[-1]["channel_shares"]
    return out

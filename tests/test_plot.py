"""Charts from metrics files: valid SVG with one bar per run and the speedup of each."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from tinyconv.plot import main, plot_runs

SVG = "{http://www.w3.org/2000/svg}"


def _write_run(path, workers: int, step_s: float, split: tuple[float, float, float]) -> None:
    events = [{"event": "run", "workers": [{"index": i} for i in range(workers)]}]
    for s in range(1, 5):
        comm, conv, comp = split
        events.append({"event": "step", "step": s, "time_s": step_s, "comm_s": comm, "conv_s": conv, "comp_s": comp})
    for e in (1, 2):
        events.append({"event": "epoch", "epoch": e, "train_loss": 2.0 / e, "test_loss": 2.1 / e, "test_acc": 0.3 * e})
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n")


def test_plots_are_svg_with_the_runs_in_them(tmp_path):
    _write_run(tmp_path / "solo.jsonl", 0, 2.0, (0.0, 0.0, 2.0))
    _write_run(tmp_path / "two.jsonl", 2, 1.0, (0.2, 0.5, 0.3))
    files = plot_runs([tmp_path / "solo.jsonl", tmp_path / "two.jsonl"], tmp_path / "out")
    assert sorted(f.name for f in files) == ["curves.svg", "speedup.svg", "split.svg"]
    split = ET.parse(tmp_path / "out" / "split.svg").getroot()
    labels = [t.text for t in split.iter(SVG + "text")]
    assert "solo (0 workers)" in labels and "two (2 workers)" in labels
    assert {"comm_s", "conv_s", "comp_s"} <= set(labels)
    speedup = ET.parse(tmp_path / "out" / "speedup.svg").getroot()
    line = next(speedup.iter(SVG + "polyline")).get("points").split()
    assert len(line) == 2  # (0 workers, 1.0) and (2 workers, 2.0)


def test_unreadable_metrics_is_a_message_not_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main([str(bad), "-o", str(tmp_path / "out")]) == 2
    assert "cannot read the metrics" in capsys.readouterr().out

"""``tinyconv experiment grid``: the CSV's columns, resuming, the cells' order, the workers' command
lines, bad input. Tiny networks (4:8) on 4 images, one step, in-process workers; nothing is timed."""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tinyconv.lab.experiment import main
from tinyconv.lab.experiment.cpu_quota import find_controller, unavailable
from tinyconv.lab.experiment.grid import cells
from tinyconv.lab.experiment.grid_checks import BadInput, check_devices
from tinyconv.lab.experiment.grid_command import build_parser
from tinyconv.lab.experiment.run import speeds_text
from tinyconv.lab.experiment.table import COLUMNS, summary
from tinyconv.lab.experiment.workers import cores, place, split_prefix, worker_command

CONTRACT = (
    "arch norm batch participants fuse split backend transport repeat steps step_s step_s_min step_s_max "
    "comm_s conv_s comp_s bytes_sent bytes_recv solo_step_s speedup shares link host timestamp"
).split()
FAST = ["--timed-steps", "1", "--untimed-steps", "0", "--settle", "0", "--no-progress"]


def grid(out: Path, *more: str, transport: str = "inproc") -> int:
    cells = ["--arch", "4:8", "--batch-size", "4", "--workers", "0", "1"]
    return main(["grid", *cells, "--transport", transport, "--out", str(out), *FAST, *more])


def rows(out: Path) -> list[dict[str, str]]:
    with open(out, newline="") as f:
        return list(csv.DictReader(f))


def test_the_csv_and_json_hold_every_contract_column_typed(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "grid.csv"
    assert grid(out, "--link-label", "test link") == 0
    with open(out, newline="") as f:
        header = next(csv.reader(f))
    assert header[: len(CONTRACT)] == CONTRACT and header == list(COLUMNS)
    got = json.loads(out.with_suffix(".json").read_text())
    assert [r["participants"] for r in got] == [1, 2] and [r["arch"] for r in got] == ["4:8", "4:8"]
    for r in got:
        assert list(r) == list(COLUMNS) and r["link"] == "test link" and r["steps"] == 1
        for name, kind in COLUMNS.items():
            assert isinstance(r[name], kind), name
        assert r["step_s_min"] <= r["step_s"] <= r["step_s_max"]
    alone, two = got
    assert (alone["fuse"], alone["split"], alone["speedup"]) == ("-", "-", 1.0)
    assert alone["comm_s"] == 0 and alone["bytes_sent"] == alone["bytes_recv"] == 0
    assert alone["conv_s"] + alone["comp_s"] == pytest.approx(alone["step_s"]) and alone["shares"] == "conv1=4 conv2=8"
    assert two["speedup"] == pytest.approx(two["solo_step_s"] / two["step_s"])
    assert two["bytes_sent"] > 0 and two["bytes_recv"] > 0 and two["shares"].count("/") == 2  # 2 layers, 2 each
    assert rows(out) == [{k: str(v) if not isinstance(v, float) else repr(v) for k, v in r.items()} for r in got]


def test_a_rerun_runs_nothing_new_and_one_more_batch_runs_only_its_cells(tmp_path: Path, capsys) -> None:
    out = tmp_path / "grid.csv"
    assert grid(out) == 0
    first = rows(out)
    capsys.readouterr()
    assert grid(out) == 0
    assert "2 already in" in capsys.readouterr().out and rows(out) == first
    assert grid(out, "--batch-size", "4", "6") == 0
    said = capsys.readouterr().out
    assert "4 cells, 2 already in" in said and "2 to run" in said
    now = rows(out)
    assert now[:2] == first and [(r["batch"], r["participants"]) for r in now[2:]] == [("6", "1"), ("6", "2")]
    assert len(json.loads(out.with_suffix(".json").read_text())) == 4


def test_a_half_written_last_line_is_dropped_and_its_cell_runs_again(tmp_path: Path, capsys) -> None:
    out = tmp_path / "grid.csv"
    assert grid(out) == 0
    text = out.read_text()
    out.write_text(text[: len(text) - 40])  # the last row cut mid-way, no newline
    assert grid(out) == 0
    assert "half-written" in capsys.readouterr().out
    again = rows(out)
    assert [r["participants"] for r in again] == ["1", "2"] and all(r["timestamp"] for r in again)


def test_other_steps_on_the_same_file_are_refused(tmp_path: Path, capsys) -> None:
    out = tmp_path / "grid.csv"
    assert grid(out) == 0
    capsys.readouterr()
    assert grid(out, "--timed-steps", "2") == 2
    err = capsys.readouterr().err
    assert "measured with --timed-steps 1, not --timed-steps 2" in err and len(err.strip().splitlines()) == 1


def test_cells_alternate_architectures_and_repeats_are_rounds() -> None:
    got = cells(["a:1", "b:1", "c:1"], [64, 128], [1, 2], repeats=2, fuses=["on", "off"])
    assert len(got) == 2 * 2 * 3 * 3  # per round and batch: 3 archs alone, 3 x 2 fuses with a worker
    for before, after in zip(got, got[1:], strict=False):
        assert before.arch != after.arch  # never the same architecture twice in a row
    half = len(got) // 2
    assert {c.repeat for c in got[:half]} == {0} and {c.repeat for c in got[half:]} == {1}
    assert [c.key("x")[:-2] for c in got[:half]] == [c.key("x")[:-2] for c in got[half:]]  # the same order
    alone = [c for c in got if c.participants == 1]
    assert {(c.fuse, c.split) for c in alone} == {("-", "-")} and len(alone) == 2 * 2 * 3


def test_data_parallel_cells_split_nothing_and_run_beside_the_model_parallel_ones(tmp_path: Path) -> None:
    got = cells(["a:1"], [64], [1, 2], repeats=1, parallels=["model", "data"])
    assert [(c.participants, c.parallel, c.fuse, c.split) for c in got] == [
        (1, "model", "-", "-"), (2, "model", "on", "auto"), (2, "data", "-", "-")]  # fmt: skip
    out = tmp_path / "grid.csv"
    assert grid(out, "--workers", "1", "--parallel", "model", "data") == 0
    model, data = json.loads(out.with_suffix(".json").read_text())
    assert (model["parallel"], data["parallel"]) == ("model", "data")
    assert data["shares"].startswith("batch=") and sum(map(int, data["shares"][6:].split("/"))) == 4
    assert data["bytes_sent"] > 0 and data["speedup"] == pytest.approx(data["solo_step_s"] / data["step_s"])
    assert "data-parallel" in summary(json.loads(out.with_suffix(".json").read_text()))


def test_a_csv_written_before_the_parallel_column_resumes_as_model(tmp_path: Path, capsys) -> None:
    out = tmp_path / "grid.csv"
    assert grid(out) == 0
    old = [{k: v for k, v in r.items() if k != "parallel"} for r in rows(out)]
    with open(out, "w", newline="") as f:  # as a grid before the column wrote it
        writer = csv.DictWriter(f, fieldnames=[c for c in COLUMNS if c != "parallel"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(old)
    capsys.readouterr()
    assert grid(out, "--parallel", "model", "data") == 0
    assert "3 cells, 2 already in" in capsys.readouterr().out  # only the data-parallel cell is new
    now = rows(out)
    assert [r["parallel"] for r in now] == ["model", "model", "data"]
    assert [{k: v for k, v in r.items() if k != "parallel"} for r in now[:2]] == old


def test_a_local_workers_command_line_is_the_prefix_then_taskset_then_the_worker() -> None:
    prefix = split_prefix("ip netns exec 'tinyconv w'")
    extra = ["--peer-timeout", "60"]
    cmd = worker_command("tcp://10.0.0.1:5555", "numpy", 3, prefix, extra, taskset="/usr/bin/taskset")
    assert cmd[:4] == ["ip", "netns", "exec", "tinyconv w"]
    assert cmd[4:7] == ["/usr/bin/taskset", "-c", "3"]
    assert cmd[7:10] == [sys.executable, "-m", "tinyconv.distributed.worker"]
    assert cmd[cmd.index("--connect") + 1] == "tcp://10.0.0.1:5555" and cmd[-2:] == extra
    assert {"--serve", "--no-progress"} <= set(cmd) and cmd[cmd.index("--threads") + 1] == "1"
    assert worker_command("tcp://a:1", "numpy", 1)[:3] == [
        sys.executable,
        "-m",
        "tinyconv.distributed.worker",
    ]  # no taskset


@pytest.mark.skipif(len(cores()) < 2, reason="a pinned local worker needs a second core")
def test_a_pinned_local_worker_over_zmq_behind_a_prefix(tmp_path: Path) -> None:
    out, before = tmp_path / "grid.csv", cores()
    assert grid(out, "--workers", "1", "--worker-prefix", "env TINYCONV_TEST=1", transport="zmq") == 0
    (row,) = rows(out)
    assert (row["transport"], row["participants"]) == ("zmq", "2") and int(row["bytes_sent"]) > 0
    assert cores() == before  # the master was pinned for the grid only: this process has its cores back


@pytest.mark.parametrize(
    "args, says",
    [
        (["--arch", "300-1000"], "argument --arch: '300-1000' is not C1:C2"),
        (["--backend", "numpy", "nope"], "--backend nope: not one of numpy"),
        (["--workers", "0", "98"], "--workers 98 needs 99 cores"),
        (["--worker-prefix", "env", "--transport", "inproc"], "--worker-prefix is for local"),
        (["--external-workers", "--transport", "inproc"], "--external-workers needs --transport zmq"),
        (["--transport", "mpi"], "--transport mpi: the grid runs over zmq or inproc"),
        (["--timed-steps", "0"], "argument --timed-steps: must be 1 or more, got 0"),
        # the old spellings, each refused with today's
        (["--archs", "4:8"], "--archs is now --arch"),
        (["--batches", "4"], "--batches is now --batch-size"),
        (["--participants", "1", "2"], "--participants is now --workers (workers beside the master"),
        (["--steps", "1"], "--steps is now --timed-steps"),
        (["--warmup", "0"], "--warmup is now --untimed-steps"),
        (["--devices", "0.5"], "--devices is now --cpu-quota"),
        (["--timeout", "60"], "--timeout is now --peer-timeout (a silent peer) or --start-timeout"),
        (["--external-workers", "2"], "--external-workers takes no number now"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys, args: list[str], says: str) -> None:
    code = main(["grid", "--out", str(tmp_path / "g.csv"), *args])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("tinyconv experiment grid: error: ")


def test_an_unwritable_out_exits_2(tmp_path: Path, capsys) -> None:
    assert main(["grid", "--arch", "4:8", "--out", str(tmp_path), "--transport", "inproc"]) == 2  # a folder
    err = capsys.readouterr().err
    assert "cannot write --out" in err and len(err.strip().splitlines()) == 1


def test_workers_beyond_the_cores_need_external_workers() -> None:
    args = build_parser().parse_args(["--workers", "0", "2"])
    with pytest.raises(BadInput, match="--workers 2 needs 3 cores"):
        check_devices(args, [0, 1])
    args.external_workers = True
    check_devices(args, [0, 1])  # workers from elsewhere: no core needed here


def test_print_config_round_trips_through_config(tmp_path: Path, capsys) -> None:
    given = ["--arch", "4:8", "16:32", "--batch-size", "4", "--workers", "0", "1", "--rebalance", "on", "off"]
    given += ["--cpu-quota", "1", "0.5", "--external-workers", "--start-timeout", "30"]
    given += ["--link-label", "5MB/s wifi", "--out", str(tmp_path / "g.csv")]
    assert main(["grid", *given, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert 'arch = ["4:8", "16:32"]' in printed and "workers = [0, 1]" in printed
    assert "external-workers = true" in printed and 'link-label = "5MB/s wifi"' in printed
    config = tmp_path / "grid.toml"
    config.write_text(printed)
    assert main(["grid", "--config", str(config), "--print-config"]) == 0
    assert capsys.readouterr().out == printed
    from_file = vars(build_parser().parse_args(["--config", str(config)]))
    assert from_file == vars(build_parser().parse_args(given)) | {"config": str(config)}


def test_a_grid_runs_from_its_config_and_the_command_line_wins(tmp_path: Path, capsys) -> None:
    out, config = tmp_path / "grid.csv", tmp_path / "grid.toml"
    assert grid(out, "--print-config") == 0
    config.write_text(capsys.readouterr().out)
    assert main(["grid", "--config", str(config), "--workers", "1"]) == 0
    assert [r["participants"] for r in rows(out)] == ["2"]  # --workers 1 on the command line, not the file's 0 1
    assert main(["grid", "--config", str(tmp_path / "none.toml")]) == 2
    assert "--config" in capsys.readouterr().err


def test_the_summary_puts_the_papers_value_beside_ours() -> None:
    base = {"norm": "lrn", "batch": 64, "backend": "numpy", "fuse": "on", "split": "auto"}
    got = summary([{**base, "arch": "300:1000", "participants": 1, "fuse": "-", "split": "-", "speedup": 1.0},
                   {**base, "arch": "300:1000", "participants": 2, "speedup": 1.8},
                   {**base, "arch": "300:1000", "participants": 2, "speedup": 1.6},
                   {**base, "arch": "4:8", "participants": 2, "speedup": 0.5}])  # fmt: skip
    assert "1.70x" in got and "1.69x" in got and "not known" in got and "2 participants" in got


def test_the_summary_reads_by_batch_then_network_size_whatever_order_the_cells_ran() -> None:
    base = {"norm": "lrn", "backend": "numpy", "fuse": "on", "split": "auto", "participants": 2, "speedup": 1.5}
    ran = [("500:1500", 64), ("50:500", 256), ("300:1000", 64), ("50:500", 128), ("50:500", 64)]
    got = summary([{**base, "arch": a, "batch": b} for a, b in ran])
    lines = [line for line in got.splitlines() if line.startswith("| ") and "x" in line.split("|")[3]]
    cells = [tuple(c.strip() for c in line.split("|")[1:3]) for line in lines]
    assert cells == [("50:500", "64"), ("300:1000", "64"), ("500:1500", "64"), ("50:500", "128"), ("50:500", "256")]


# ---- the rebalance and wire-precision axes ---------------------------------------------------------------------------
def test_rebalance_and_wire_are_axes_the_master_alone_and_data_parallel_cells_skip() -> None:
    got = cells(["a:1", "b:1"], [64], [1, 2], repeats=1, parallels=["model", "data"], rebalances=["on", "off"],
                wires=["fp32", "bf16"])  # fmt: skip
    alone = [c for c in got if c.participants == 1]
    assert [(c.arch, c.rebalance, c.wire) for c in alone] == [("a:1", "-", "-"), ("b:1", "-", "-")]  # once each
    model = [(c.rebalance, c.wire) for c in got if c.parallel == "model" and c.participants == 2]
    assert model == [(r, w) for r in ("on", "off") for w in ("fp32", "bf16") for _ in "ab"]
    data = [(c.rebalance, c.wire, c.fuse, c.split) for c in got if c.parallel == "data"]
    assert data == [("on", "fp32", "-", "-")] * 2 + [("off", "fp32", "-", "-")] * 2  # no data cell at bf16
    for before, after in zip(got, got[1:], strict=False):
        assert before.arch != after.arch
    assert len({c.key("x") for c in got}) == len(got)  # rebalance and wire tell cells apart in the key
    (fixed,) = [c for c in got if (c.arch, c.rebalance, c.wire, c.parallel) == ("a:1", "off", "bf16", "model")]
    assert "rebalance off" in fixed.label() and "wire bf16" in fixed.label()


def test_a_fixed_split_and_a_narrowed_wire_reach_the_cluster(tmp_path: Path, monkeypatch) -> None:
    from tinyconv.lab.experiment import run

    made = []

    class Recorded(run.Cluster):
        """The grid's cluster, kept for a look, and split evenly whatever the calibration measured, so
        that every cell moves the same arrays."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

        def calibrate(self, net, batch_size, image_size=32):
            got = super().calibrate(net, batch_size, image_size)
            for b in self.blocks:
                self.set_plan(b.name, [b.conv.out_channels // 2] * 2)
            return got

    monkeypatch.setattr(run, "Cluster", Recorded)
    out = tmp_path / "grid.csv"
    assert grid(out, "--workers", "1", "--split", "kernels", "--rebalance", "on", "off",
                "--wire-precision", "fp32", "bf16") == 0  # fmt: skip
    assert [(c.rebalancer is not None, c.wire_precision) for c in made] == [
        (True, "fp32"), (True, "bf16"), (False, "fp32"), (False, "bf16")]  # fmt: skip
    got = json.loads(out.with_suffix(".json").read_text())
    assert [(r["rebalance"], r["wire"], r["shares"]) for r in got] == [
        (on, wire, "conv1=2/2 conv2=4/4") for on in ("on", "off") for wire in ("fp32", "bf16")]  # fmt: skip
    on32, on16, off32, off16 = got
    for wide, narrow in ((on32, on16), (off32, off16)):  # the same arrays in 2 bytes a number instead of 4
        assert narrow["bytes_recv"] * 2 == wide["bytes_recv"] and narrow["bytes_sent"] * 2 == wide["bytes_sent"]
        assert wide["wire_formats"] == "" and narrow["wire_formats"] == "conv1=bf16/bf16/bf16 conv2=bf16/bf16/bf16"
        assert narrow["wire_fallbacks"] == 0
    assert "rebalance off wire bf16" in summary(got)


def test_data_parallel_and_hybrid_run_at_fp32_only(tmp_path: Path, capsys) -> None:
    out = tmp_path / "grid.csv"
    assert grid(out, "--workers", "1", "--parallel", "data", "--wire-precision", "bf16") == 2
    assert "no cells" in capsys.readouterr().err
    assert grid(out, "--workers", "1", "--parallel", "model", "data", "hybrid", "--wire-precision", "fp32",
                "adt24") == 0  # fmt: skip
    assert "--parallel data and hybrid: their cells at --wire-precision adt24 are left out" in capsys.readouterr().out
    got = json.loads(out.with_suffix(".json").read_text())
    assert [(r["parallel"], r["wire"], r["fuse"], r["split"]) for r in got] == [
        ("model", "fp32", "on", "auto"), ("model", "adt24", "on", "auto"), ("data", "fp32", "-", "-"),
        ("hybrid", "fp32", "-", "-")]  # fmt: skip
    hybrid = got[-1]  # the images shared out, the classifier on the master
    assert hybrid["shares"].startswith("batch=") and sum(map(int, hybrid["shares"][6:].split("/"))) == 4
    assert hybrid["bytes_sent"] > 0 and "2 hybrid-parallel" in summary(got)


@pytest.mark.parametrize("newer", [["rebalance", "wire", "wire_fallbacks", "wire_formats"],
                                   ["parallel", "rebalance", "wire", "wire_fallbacks", "wire_formats"]])  # fmt: skip
def test_a_csv_written_before_the_rebalance_and_wire_columns_resumes_as_on_and_fp32(
    tmp_path: Path, capsys, newer: list[str]
) -> None:
    out = tmp_path / "grid.csv"
    assert grid(out) == 0
    old = [{k: v for k, v in r.items() if k not in newer} for r in rows(out)]
    with open(out, "w", newline="") as f:  # as a grid before those columns wrote it
        writer = csv.DictWriter(f, fieldnames=[c for c in COLUMNS if c not in newer], lineterminator="\n")
        writer.writeheader()
        writer.writerows(old)
    capsys.readouterr()
    assert grid(out, "--rebalance", "on", "off") == 0
    assert "3 cells, 2 already in" in capsys.readouterr().out  # only the cell with the split kept is new
    now = rows(out)
    assert [(r["participants"], r["rebalance"], r["wire"], r["wire_fallbacks"]) for r in now] == [
        ("1", "-", "-", "0"), ("2", "on", "fp32", "0"), ("2", "off", "fp32", "0")]  # fmt: skip
    assert [{k: v for k, v in r.items() if k not in newer} for r in now[:2]] == old


def test_a_csv_with_columns_this_grid_does_not_know_is_refused(tmp_path: Path, capsys) -> None:
    out = tmp_path / "grid.csv"
    out.write_text(",".join([*COLUMNS, "mystery"]) + "\n")
    assert grid(out) == 2
    err = capsys.readouterr().err
    assert "unknown mystery" in err and "another --out" in err and len(err.strip().splitlines()) == 1


# ---- the pipeline axis -----------------------------------------------------------------------------------------------
def test_the_grids_default_pipeline_is_the_clusters() -> None:
    from tinyconv.distributed.shard.by_channels import PIPELINE
    from tinyconv.lab.experiment import grid as grid_module

    assert grid_module.PIPELINE == PIPELINE  # grid.py keeps its own copy so as not to load numpy early


def test_pipeline_varies_the_model_parallel_cells_and_reaches_the_cluster(tmp_path: Path, monkeypatch) -> None:
    from tinyconv.lab.experiment import run
    from tinyconv.lab.plot.grid_charts import speedup_chart

    got = cells(["a:1", "b:1"], [64], [1, 2], repeats=1, parallels=["model", "data"], pipelines=[0, 2])
    assert [(c.participants, c.parallel, c.pipeline) for c in got if c.arch == "a:1"] == [
        (1, "model", "-"), (2, "model", "0"), (2, "model", "2"), (2, "data", "-")]  # fmt: skip
    assert len({c.key("x") for c in got}) == len(got) and "pipeline 2" in got[4].label()
    made = []

    class Recorded(run.Cluster):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(run, "Cluster", Recorded)
    out = tmp_path / "grid.csv"
    # batch 4 in chunks of 2 images: the split by input channels (auto, one local worker) goes in two chunks
    assert grid(out, "--parallel", "model", "data", "--pipeline", "0", "2") == 0
    assert [c.pipeline for c in made] == [0, 2] and all(c.split_by_channels for c in made)
    rows_ = json.loads(out.with_suffix(".json").read_text())
    assert [(r["participants"], r["parallel"], r["pipeline"]) for r in rows_] == [
        (1, "model", "-"), (2, "model", "0"), (2, "model", "2"), (2, "data", "-")]  # fmt: skip
    assert all(r["channel_shares"] for r in rows_[1:3]) and "pipeline 2" in summary(rows_)
    chart = speedup_chart(rows_)  # two pipelines are two series, not the repeats of one
    assert "pipeline 0" in chart and "pipeline 2" in chart


def test_a_csv_written_before_the_pipeline_column_resumes_as_0_and_a_new_value_is_a_new_cell(
    tmp_path: Path, capsys
) -> None:
    out = tmp_path / "grid.csv"
    assert grid(out, "--parallel", "model", "data") == 0
    old = [{k: v for k, v in r.items() if k != "pipeline"} for r in rows(out)]
    with open(out, "w", newline="") as f:  # as a grid before the column wrote it
        writer = csv.DictWriter(f, fieldnames=[c for c in COLUMNS if c != "pipeline"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(old)
    capsys.readouterr()
    assert grid(out, "--parallel", "model", "data", "--pipeline", "0") == 0
    assert "3 cells, 3 already in" in capsys.readouterr().out  # the model-parallel row ran the whole batch at once
    assert [(r["participants"], r["parallel"], r["pipeline"]) for r in rows(out)] == [
        ("1", "model", "-"), ("2", "model", "0"), ("2", "data", "-")]  # fmt: skip
    assert [{k: v for k, v in r.items() if k != "pipeline"} for r in rows(out)] == old
    assert grid(out, "--parallel", "model", "data", "--pipeline", "0", "2") == 0
    assert "4 cells, 3 already in" in capsys.readouterr().out  # only the model-parallel cell in chunks of 2 is new
    now = rows(out)
    assert [(r["participants"], r["parallel"], r["pipeline"]) for r in now[3:]] == [("2", "model", "2")]
    assert len(json.loads(out.with_suffix(".json").read_text())) == 4


def test_settle_solo_runs_more_steps_while_they_fault_memory_in() -> None:
    """After the settling steps, more run while the last spent over KERNEL_FRACTION of its time in the
    kernel, up to SETTLE_MORE; --settle 0 runs none."""
    from tinyconv.lab.experiment import run

    def steps(kernel: list[float]) -> tuple[list[int], Callable[[], dict[str, float]]]:
        done: list[int] = []

        def step() -> dict[str, float]:
            done.append(len(done))
            return {"time_s": 10.0, "kernel_s": kernel[len(done) - 1]}

        return done, step

    done, step = steps([5.9, 1.3, 0.0, 0.0, 0.0, 0.0])  # 150:800 at 256's first switch, as measured
    run.settle_solo(step, 1)
    assert len(done) == 3  # the first clean one ends it
    done, step = steps([0.0, 3.0, 0.0, 0.0])
    run.settle_solo(step, 2)
    assert len(done) == 3  # the settling steps all run, clean or not; the second faulted, so one more
    done, step = steps([5.0] * 10)
    run.settle_solo(step, 1)
    assert len(done) == 1 + run.SETTLE_MORE  # bounded
    done, step = steps([5.0] * 10)
    run.settle_solo(step, 0)
    assert done == []


def test_devices_are_placed_where_a_core_has_the_most_time_free() -> None:
    assert place([0.5] * 4, [0, 1]) == [0, 1, 0, 1]  # a cell of two has a core each, four share two
    assert place([1, 0.5, 0.25], [2, 3]) == [2, 3, 3]
    with pytest.raises(ValueError, match="do not fit 2 cores"):
        place([1, 1, 0.5], [0, 1])


def test_a_cell_runs_on_the_first_devices_and_they_are_part_of_its_key() -> None:
    got = cells(["4:8"], [4], [1, 2, 3], 1, devices=[1, 0.5, 0.25])
    assert [c.devices for c in got] == ["1", "1/0.5", "1/0.5/0.25"]
    plain = cells(["4:8"], [4], [2], 1)[0]
    assert plain.devices == "-" and plain.key("loopback") != got[1].key("loopback")


@pytest.mark.parametrize(
    "args, says",
    [
        (["--cpu-quota", "0.5", "--workers", "0", "1"], "--workers 1 needs 2 --cpu-quota devices"),
        (["--cpu-quota", *["1"] * (len(cores()) + 1)], "do not fit"),
        (["--cpu-quota", "0.5", "0.5", "--transport", "inproc"], "local worker processes"),
        (["--cpu-quota", "1.5"], "argument --cpu-quota: must be a share of one core"),
        (["--cpu-quota", "half"], "argument --cpu-quota: 'half' is not a number"),
    ],
)
def test_bad_devices_exit_2_with_one_line(tmp_path: Path, capsys, args: list[str], says: str) -> None:
    code = main(["grid", "--arch", "4:8", "--out", str(tmp_path / "g.csv"), "--transport", "zmq", *args])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_speeds_are_each_participants_beside_the_masters_over_every_unit() -> None:
    calibration = {"times": {"conv1": [1.0, 2.0, 4.0], "conv2": [3.0, 6.0, 12.0]}}
    assert speeds_text(calibration) == "1/0.5/0.25"
    assert speeds_text(None) == "" and speeds_text({"times": {"conv1": [1.0, None]}}) == ""


def test_the_summary_gives_the_papers_value_for_each_count_and_the_devices() -> None:
    base = {"arch": "500:1500", "norm": "lrn", "batch": 64, "backend": "numpy", "fuse": "on", "split": "auto"}
    got = summary([{**base, "participants": 1, "fuse": "-", "split": "-", "speedup": 1.0, "devices": "0.5"},
                   {**base, "participants": 4, "speedup": 3.5, "devices": "0.5/0.5/0.5/0.5"}])  # fmt: skip
    assert "1.98x (2), 3.28x (4)" in got and "devices of 0.5/0.5/0.5/0.5 cores" in got


@pytest.mark.skipif(unavailable() is not None or len(cores()) < 2, reason=f"CPU quotas: {unavailable()}")
def test_a_grid_on_half_core_devices_records_them_and_leaves_no_group(tmp_path: Path) -> None:
    out = tmp_path / "grid.csv"
    home = (Path("/proc/self/cgroup").read_text(), cores())
    assert grid(out, "--cpu-quota", "0.5", "0.5", transport="zmq") == 0
    alone, two = rows(out)
    assert (alone["devices"], alone["speeds"], two["devices"]) == ("0.5", "1", "0.5/0.5")
    assert len(two["speeds"].split("/")) == 2 and float(two["speeds"].split("/")[1]) > 0
    controller = find_controller(Path("/proc/mounts").read_text())
    assert not list(controller.root.glob("tinyconv-grid-*"))  # every group removed
    assert (Path("/proc/self/cgroup").read_text(), cores()) == home  # this process back where it was

"""tinyconv simulate's command line: the CSV's columns, a row per wire format, --measure, bad input and old
spellings in one line and exit 2, and --print-config read back by --config. No timing is asserted."""

from __future__ import annotations

import csv
import json

import pytest
from test_simulate import entry

from tinyconv.lab.eq2 import conv_shapes, split_bytes
from tinyconv.lab.simulate import main
from tinyconv.lab.simulate.devices import VERSION, load, save
from tinyconv.model import paper_net

CONTRACT = "arch batch split medium bandwidth_MBps latency_ms nodes step_s comm_s conv_s comp_s speedup".split()


@pytest.fixture
def devices_file(tmp_path):
    path = tmp_path / "devices.json"
    save(path, entry("dev"), {"loopback": {"bandwidth_MBps": 1000.0, "latency_ms": 0.02}})
    return path


def test_the_csv_has_the_contract_columns(tmp_path, devices_file, capsys):
    out = tmp_path / "sim.csv"
    argv = ["--device-file", str(devices_file), "--arch", "8:16", "--batch-size", "2", "--workers", "0", "1", "3"]
    argv += ["--bandwidth", "5", "125", "--out", str(out)]
    assert main(argv) == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[: len(CONTRACT)] == CONTRACT
    assert len(rows) == 4 * 2 * 2 * 3  # --fuse off on x --split kernels channels x media x bandwidths x nodes
    assert {r["wire"] for r in rows} == {"fp32"}  # the default
    assert {(r["fuse"], r["split"]) for r in rows} == {(f, s) for f in ("off", "on") for s in ("kernels", "channels")}
    assert {r["label"] for r in rows if r["fuse"] == "off" and r["split"] == "kernels"} == {"paper"}
    assert all(float(r["speedup"]) == 1.0 for r in rows if r["nodes"] == "1")
    assert "wifi, 5 MB/s" in capsys.readouterr().out
    argv += ["--worker-bandwidth", "125", "0.5", "--fuse", "on", "--split", "kernels", "--medium", "ethernet"]
    assert main(argv) == 0
    with open(out, newline="") as f:
        slowed = {(r["bandwidth_MBps"], r["nodes"]): r for r in csv.DictReader(f)}
    assert {r["worker_MBps"] for r in slowed.values()} == {"125 0.5"}
    same = {(r["bandwidth_MBps"], r["nodes"]): r for r in rows if r["split"] == "kernels" and r["fuse"] == "on"}
    same = {k: r for k, r in same.items() if r["medium"] == "ethernet"}
    assert float(slowed["125.0", "2"]["step_s"]) == pytest.approx(float(same["125.0", "2"]["step_s"]))  # worker 0
    assert float(slowed["125.0", "4"]["step_s"]) > float(same["125.0", "4"]["step_s"])  # worker 1 takes part


def test_the_csv_has_a_row_per_wire_format_and_adaptive_is_its_start(tmp_path, devices_file, capsys):
    out = tmp_path / "sim.csv"
    argv = ["--device-file", str(devices_file), "--arch", "8:16", "--batch-size", "2", "--workers", "0", "1"]
    argv += ["--bandwidth", "5", "--medium", "ethernet", "--fuse", "off", "--split", "kernels"]
    argv += ["--wire-precision", "fp32", "bf16", "adaptive", "--out", str(out)]
    assert main(argv) == 0
    with open(out, newline="") as f:
        rows = {(r["wire"], r["nodes"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == [(w, n) for w in ("adaptive", "bf16", "fp32") for n in ("1", "2")]
    assert int(rows["bf16", "2"]["bytes_sent"]) * 2 == int(rows["fp32", "2"]["bytes_sent"])
    convs, shares = conv_shapes(paper_net("8:16", "numpy"), 2), [[4, 4], [8, 8]]  # two equal devices: eq. 1 halves
    adaptive = split_bytes(convs, shares, False, "kernels", {"weights": "bf16", "maps": "s8", "grads": "bf16"})
    assert (int(rows["adaptive", "2"]["bytes_sent"]), int(rows["adaptive", "2"]["bytes_recv"])) == adaptive
    assert float(rows["adaptive", "2"]["comm_s"]) < float(rows["bf16", "2"]["comm_s"])  # AWP's start: maps in s8
    text = capsys.readouterr().out
    assert "speedup paper bf16" in text and "AWP's start" in text


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no device file
        ["--device-file", "DEV", "--arch", "3"],
        ["--device-file", "DEV", "--bandwidth", "0"],
        ["--device-file", "DEV", "--workers", "-1"],
        ["--device-file", "DEV", "--medium", "carrier-pigeon"],
        ["--device-file", "DEV", "--wire-precision", "fp8"],
        ["--device-file", "DEV", "--split", "paper"],  # the old name of --fuse off --split kernels
        ["--device-file", "DEV", "--slowdown", "0.5"],
        ["--device-file", "DEV", "--arch", "50:500"],  # not measured at that arch
        ["--device-file", "DEV", "--arch", "8:16", "--batch-size", "2", "--device-name", "nope"],
        ["--device-file", "MISSING"],
        ["--device-file", "DEV", "--against", "BADGRID"],
        ["--measure", "--device-file", "DEV", "--device-name", "a", "b"],  # one name to record
        ["--measure", "DEV"],  # a switch now
        ["--config", "MISSING"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, devices_file, capsys, argv):
    bad = tmp_path / "bad.csv"
    bad.write_text("arch,batch\n8:16,2\n")
    subs = {"DEV": str(devices_file), "MISSING": str(tmp_path / "nope.json"), "BADGRID": str(bad)}
    assert main([subs.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error" in err


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (["--devices", "DEV"], "--devices is now --cpu-quota (emulated devices) or --device-file"),
        (["--device-file", "DEV", "--nodes", "4"], "--nodes is now --workers (workers beside the master: --nodes 4"),
        (["--device-file", "DEV", "--batch", "2"], "--batch is now --batch-size"),
        (["--measure", "--device-file", "DEV", "--name", "x"], "--name is now --device-name"),
        (["--device-file", "DEV", "--device", "fast", "slow"], "--device is now --device-name"),
    ],
)
def test_an_old_spelling_is_refused_with_the_new_one(devices_file, capsys, old, new):
    assert main([str(devices_file) if a == "DEV" else a for a in old]) == 2
    assert new in capsys.readouterr().err


def test_print_config_is_a_config_file_that_gives_the_same_run(tmp_path, devices_file, capsys):
    from tinyconv.lab.simulate.parser import parse

    argv = ["--device-file", str(devices_file), "--arch", "8:16", "--batch-size", "2", "--workers", "0", "1", "3"]
    argv += ["--fuse", "on", "--wire-precision", "fp32", "bf16", "--loopback-MBps", "900", "--slowdown", "2"]
    assert main([*argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    assert 'device-file = "' in text and "workers = [0, 1, 3]" in text and "loopback-mbps = 900.0" in text
    config = tmp_path / "sim.toml"
    config.write_text(text)
    assert vars(parse(["--config", str(config)])) == vars(parse(argv)) | {"config": str(config)}
    given = parse(["--config", str(config), "--workers", "7"])  # the command line wins
    assert given.workers == [7] and given.arch == "8:16"


def test_measure_writes_a_device_file(tmp_path, capsys):
    """A toy network on this machine, to check the file's shape (the times are whatever they are)."""
    path = tmp_path / "d.json"
    argv = ["--measure", "--device-file", str(path), "--arch", "2:4", "--batch-size", "2", "--repeats", "1"]
    argv += ["--device-name", "here", "--workers", "0", "1", "--bandwidth", "5", "--medium", "wifi"]
    assert main([*argv, "--fuse", "off", "--split", "kernels"]) == 0
    (dev,), links = load(path)
    assert (dev.name, dev.arch, dev.batch) == ("here", "2:4", 2)
    assert [c.kernels for c in dev.fuse["on"].layers] == [2, 4]
    assert links["loopback"]["bandwidth_MBps"] > 0
    assert json.loads(path.read_text())["version"] == VERSION


def test_a_measure_inside_a_quota_records_it_and_keeps_the_files_loopback(tmp_path, devices_file, monkeypatch):
    from tinyconv.lab.experiment import cpu_quota

    monkeypatch.setattr(cpu_quota, "own_cores", lambda: 0.5)
    argv = ["--measure", "--device-file", str(devices_file), "--arch", "2:4", "--batch-size", "2", "--repeats", "1"]
    assert main([*argv, "--workers", "0", "--bandwidth", "5", "--medium", "wifi", "--split", "kernels"]) == 0
    devices, links = load(devices_file)
    assert devices[-1].cores == 0.5 and links["loopback"]["bandwidth_MBps"] == 1000.0  # the fixture's, kept

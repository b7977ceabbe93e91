"""tinyconv simulate: the link schedule and the step model by hand, eq. 1's shares, the bytes against
comm.py, the CSV's columns, --against's errors and bad input. No timing is asserted."""

from __future__ import annotations

import csv
import json

import pytest

from tinyconv.comm import ConvShape, conv_shapes, split_bytes
from tinyconv.model import paper_net
from tinyconv.simulate import main
from tinyconv.simulate.against import compare_rows, read_grid
from tinyconv.simulate.devices import FORMAT, VERSION, Device, LayerCost, SplitCost, fit_line, load, save
from tinyconv.simulate.link import Link, Task, op_wall, parse_rate
from tinyconv.simulate.model import predict

CONTRACT = ["arch", "batch", "split", "medium", "bandwidth_MBps", "latency_ms", "nodes", "step_s", "comm_s",
            "conv_s", "comp_s", "speedup"]  # fmt: skip
# one 1x1 convolution, no tail, no dX: x (2, 3, 4, 4), 4 kernels
TOY = ConvShape("conv1", (2, 3, 4, 4), (4, 3, 1, 1), (2, 4, 4, 4), need_dx=False)


def device(name: str, layers: list[tuple[int, float, float]], comp: float = 0.5, solo: float = 1.0) -> Device:
    """A device with layers (kernels, fixed_s, per_kernel_s), the same with the tails fused or not."""
    cost = SplitCost(comp, tuple(LayerCost(f"conv{i + 1}", *layer) for i, layer in enumerate(layers)))
    return Device(name, "8:16", "lrn", 2, solo, {"off": cost, "on": cost})


def entry(name: str, arch: str = "8:16", batch: int = 2, per_kernel: float = 0.01) -> dict:
    """A device file entry for ``arch`` at ``batch``, as --measure writes one."""
    convs = conv_shapes(paper_net(arch, "numpy"), batch)
    layers = [{"name": c.name, "kernels": c.w[0], "fixed_s": 0.01, "per_kernel_s": per_kernel} for c in convs]
    return {"name": name, "arch": arch, "norm": "lrn", "batch": batch, "solo_step_s": 1.0,
            "fuse": {k: {"comp_s": 0.2, "layers": layers} for k in ("off", "on")}}  # fmt: skip


@pytest.fixture
def devices_file(tmp_path):
    path = tmp_path / "devices.json"
    save(path, entry("dev"), {"loopback": {"bandwidth_MBps": 1000.0, "latency_ms": 0.02}})
    return path


def test_two_equal_devices_by_hand():
    """Master + 1 worker, 2 kernels each: t = 0.1 + 0.05 * 2 = 0.2 s, half forward (no dX).
    Worker bytes: forward out x 384 + 2 kernels * (12 + 4) = 416, back 2 maps * 128 = 256;
    backward out 256, back dw, db 32. At 1000 B/s and 10 ms a message:
    forward 0.01 + 0.416 + 0.1 + 0.256 + 0.01 = 0.792, backward 0.01 + 0.256 + 0.1 + 0.032 + 0.01 = 0.408."""
    dev = device("d", [(4, 0.1, 0.05)])
    for medium in ("wifi", "ethernet"):  # one worker: no difference
        p = predict([TOY], [dev], 2, "off", "kernels", Link(medium, 1000.0, 0.01))
        assert p.shares == ((2, 2),)
        assert (p.bytes_sent, p.bytes_recv) == (416 + 256, 256 + 32)
        assert p.step_s == pytest.approx(0.5 + 0.792 + 0.408)
        assert p.conv_s == pytest.approx(0.2) and p.comm_s == pytest.approx(1.0) and p.comp_s == 0.5
        assert p.speedup == pytest.approx((0.5 + 0.1 + 0.05 * 4) / 1.7)


def test_alone_is_the_solo_step():
    p = predict([TOY], [device("d", [(4, 0.1, 0.05)])], 1, "off", "kernels", Link("wifi", 1.0))
    assert (p.step_s, p.comm_s, p.speedup, p.bytes_sent) == (pytest.approx(0.8), 0.0, 1.0, 0)


def test_wifi_serialises_both_directions_ethernet_overlaps_them():
    """Two workers, 100 bytes each way, no compute, 100 B/s: wifi 1 + 1 out, then 1 + 1 back = 4 s;
    ethernet: tasks at 1 and 2 s, results on the other direction at 1-2 and 2-3 s = 3 s."""
    tasks = [Task(100, 0.0, 100), Task(100, 0.0, 100)]
    assert op_wall(Link("wifi", 100.0), 0.0, tasks) == pytest.approx(4.0)
    assert op_wall(Link("ethernet", 100.0), 0.0, tasks) == pytest.approx(3.0)
    # latency: a message's channel time on wifi (4 messages), a delay each way on ethernet
    assert op_wall(Link("wifi", 100.0, 0.5), 0.0, tasks) == pytest.approx(6.0)
    assert op_wall(Link("ethernet", 100.0, 0.5), 0.0, tasks) == pytest.approx(4.0)
    assert op_wall(Link("wifi", 100.0), 7.0, tasks) == 7.0  # the master's own share outlasts the link
    net = predict([TOY], [device("d", [(4, 0.1, 0.05)])], 4, "off", "kernels", Link("ethernet", 1000.0))
    air = predict([TOY], [device("d", [(4, 0.1, 0.05)])], 4, "off", "kernels", Link("wifi", 1000.0))
    assert air.step_s > net.step_s and air.conv_s == net.conv_s


def test_eq1_gives_a_twice_faster_device_twice_the_kernels():
    fast, slow = device("fast", [(300, 0.0, 0.001)]), device("slow", [(300, 0.0, 0.002)])
    toy = ConvShape("conv1", (2, 3, 4, 4), (300, 3, 1, 1), (2, 300, 4, 4), need_dx=False)
    p = predict([toy], [fast, slow], 2, "off", "kernels", Link("ethernet", 1e12))
    assert p.shares == ((200, 100),)
    assert p.conv_s == pytest.approx(0.2)  # both finish together: 200 * 1 ms = 100 * 2 ms
    assert predict([toy], [fast, slow], 4, "off", "kernels", Link("ethernet", 1e12)).shares == ((100, 50, 100, 50),)


@pytest.mark.parametrize(("fuse", "split"), [("off", "kernels"), ("on", "kernels"), ("on", "channels")])
def test_bytes_are_comm_py_s(fuse, split):
    """Per worker and op, the bytes add up to comm.split_bytes (exact against real steps in test_comm.py)."""
    convs = conv_shapes(paper_net("8:16", "numpy"), 2)
    devs = [device("a", [(8, 0.0, 0.001), (16, 0.0, 0.003)]), device("b", [(8, 0.0, 0.002), (16, 0.0, 0.001)])]
    p = predict(convs, devs, 3, fuse, split, Link("wifi", 1e6))
    assert (p.bytes_sent, p.bytes_recv) == split_bytes(convs, p.shares, fuse == "on", split)


def test_fit_line_and_rates():
    assert fit_line([(1, 1.5), (2, 2.0), (4, 3.0)]) == pytest.approx((1.0, 0.5))
    assert fit_line([(1, 0.1), (2, 1.0), (4, 2.0)])[0] == 0.0  # would be negative: through the origin
    assert parse_rate("5MB/s") == parse_rate("40mbit") == parse_rate("40 Mbit/s") == 5e6
    with pytest.raises(ValueError):
        parse_rate("5 furlongs")


def test_save_replaces_the_same_device_and_load_reads_it(tmp_path, devices_file):
    save(devices_file, entry("dev", per_kernel=0.02), {})
    save(devices_file, entry("other"), {})
    devices, links = load(devices_file)
    assert [d.name for d in devices] == ["dev", "other"]
    assert devices[0].fuse["on"].layers[1].per_kernel_s == 0.02 and links["loopback"]["bandwidth_MBps"] == 1000.0
    assert json.loads(devices_file.read_text())["format"] == FORMAT


def test_the_csv_has_the_contract_columns(tmp_path, devices_file, capsys):
    out = tmp_path / "sim.csv"
    argv = ["--devices", str(devices_file), "--arch", "8:16", "--batch", "2", "--nodes", "1", "2", "4",
            "--bandwidth", "5", "125", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[: len(CONTRACT)] == CONTRACT
    assert len(rows) == 3 * 2 * 2 * 3  # splits x media x bandwidths x nodes
    assert {(r["fuse"], r["split"]) for r in rows} == {("off", "kernels"), ("on", "kernels"), ("on", "channels")}
    assert all(float(r["speedup"]) == 1.0 for r in rows if r["nodes"] == "1")
    assert "wifi, 5 MB/s" in capsys.readouterr().out


def write_grid(path, rows: list[dict]) -> None:
    columns = ["arch", "norm", "batch", "participants", "fuse", "split", "backend", "transport", "repeat", "steps",
               "step_s", "step_s_min", "step_s_max", "comm_s", "conv_s", "comp_s", "bytes_sent", "bytes_recv",
               "solo_step_s", "speedup", "shares", "link", "host", "timestamp"]  # fmt: skip
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, restval="")
        w.writeheader()
        w.writerows(rows)


def test_against_reports_the_relative_error(tmp_path, devices_file, capsys):
    grid = tmp_path / "grid.csv"
    base = {"arch": "8:16", "norm": "lrn", "batch": "2", "participants": "2", "fuse": "off", "split": "kernels"}
    alone = {"step_s": "1", "comm_s": "0", "speedup": "1", "link": "loopback"}
    rows = [
        {**base, "step_s": "0.5", "comm_s": "0.1", "speedup": "1.5", "link": "loopback"},
        {**base, "fuse": "on", "step_s": "2.0", "comm_s": "1.0", "speedup": "0.5", "link": "5MB/s"},
        {**base, "arch": "50:500", "step_s": "1", "comm_s": "0", "speedup": "1", "link": "loopback"},  # no device
        {**base, "participants": "1", "fuse": "-", "split": "-", **alone},  # the master alone
    ]
    write_grid(grid, rows)
    devices, links = load(devices_file)
    done, skipped = compare_rows(read_grid(str(grid)), devices, links, latency_ms=1.0)
    assert len(done) == 3 and len(skipped) == 1 and "50:500" in skipped[0]
    assert done[2]["speedup"] == 1.0 and done[2]["step_err"] == pytest.approx(0.2 + 2 * 0.01 + 0.01 * (8 + 16) - 1)
    convs = conv_shapes(paper_net("8:16", "numpy"), 2)
    loop = predict(convs, devices, 2, "off", "kernels", Link("ethernet", 1000e6, 0.02e-3))
    shaped = predict(convs, devices, 2, "on", "kernels", Link("ethernet", 5e6, 1e-3))
    assert done[0]["step_err"] == pytest.approx(loop.step_s / 0.5 - 1)
    assert done[0]["speedup_err"] == pytest.approx(loop.speedup / 1.5 - 1)
    assert done[1]["step_err"] == pytest.approx(shaped.step_s / 2.0 - 1)
    assert main(["--devices", str(devices_file), "--against", str(grid)]) == 0
    assert "median |error|" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no device file
        ["--devices", "DEV", "--arch", "3"],
        ["--devices", "DEV", "--bandwidth", "0"],
        ["--devices", "DEV", "--nodes", "0"],
        ["--devices", "DEV", "--medium", "carrier-pigeon"],
        ["--devices", "DEV", "--arch", "50:500"],  # not measured at that arch
        ["--devices", "DEV", "--arch", "8:16", "--batch", "2", "--device", "nope"],
        ["--devices", "MISSING"],
        ["--devices", "DEV", "--against", "BADGRID"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, devices_file, capsys, argv):
    bad = tmp_path / "bad.csv"
    bad.write_text("arch,batch\n8:16,2\n")
    subs = {"DEV": str(devices_file), "MISSING": str(tmp_path / "nope.json"), "BADGRID": str(bad)}
    try:
        code = main([subs.get(a, a) for a in argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "error" in err


def test_measure_writes_a_device_file(tmp_path, capsys):
    """A toy network on this machine, to check the file's shape (the times are whatever they are)."""
    path = tmp_path / "d.json"
    assert main(["--measure", str(path), "--arch", "2:4", "--batch", "2", "--repeats", "1", "--nodes", "1", "2",
                 "--bandwidth", "5", "--medium", "wifi", "--split", "paper"]) == 0  # fmt: skip
    (dev,), links = load(path)
    assert (dev.arch, dev.batch) == ("2:4", 2) and [c.kernels for c in dev.fuse["on"].layers] == [2, 4]
    assert links["loopback"]["bandwidth_MBps"] > 0
    assert json.loads(path.read_text())["version"] == VERSION


def test_a_slower_device_takes_longer_on_the_same_link():
    from tinyconv.simulate.devices import slowed

    dev = device("d", [(4, 0.1, 0.05)])
    fast = predict([TOY], [dev], 2, "off", "kernels", Link("wifi", 1000.0))
    slow = predict([TOY], [slowed(dev, 3.0)], 2, "off", "kernels", Link("wifi", 1000.0))
    assert (slow.conv_s, slow.comp_s) == (pytest.approx(3 * fast.conv_s), pytest.approx(3 * fast.comp_s))
    assert slow.comm_s == pytest.approx(fast.comm_s) and slow.speedup > fast.speedup

"""tinyconv simulate: the link schedule and the step model by hand, eq. 1's shares, the bytes against
eq2.py, the device file and --against's errors (the command line: test_simulate_command.py). No timing is
asserted."""

from __future__ import annotations

import csv
import json

import pytest

from tinyconv.lab.eq2 import ConvShape, conv_shapes, split_bytes, wire_words
from tinyconv.lab.simulate import main
from tinyconv.lab.simulate.against import compare_rows, read_grid, row_devices
from tinyconv.lab.simulate.devices import FORMAT, Device, LayerCost, SplitCost, fit_line, load, save, slowed
from tinyconv.lab.simulate.link_model import LinkModel, Task, op_wall, parse_rate
from tinyconv.lab.simulate.predict import predict
from tinyconv.model import paper_net

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
    return {
        "name": name,
        "arch": arch,
        "norm": "lrn",
        "batch": batch,
        "solo_step_s": 1.0,
        "fuse": {k: {"comp_s": 0.2, "layers": layers} for k in ("off", "on")},
    }


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
        p = predict([TOY], [dev], 2, "off", "kernels", LinkModel(medium, 1000.0, 0.01))
        assert p.shares == ((2, 2),)
        assert (p.bytes_sent, p.bytes_recv) == (416 + 256, 256 + 32)
        assert p.step_s == pytest.approx(0.5 + 0.792 + 0.408)
        assert p.conv_s == pytest.approx(0.2) and p.comm_s == pytest.approx(1.0) and p.comp_s == 0.5
        assert p.speedup == pytest.approx((0.5 + 0.1 + 0.05 * 4) / 1.7)


def test_alone_is_the_solo_step():
    p = predict([TOY], [device("d", [(4, 0.1, 0.05)])], 1, "off", "kernels", LinkModel("wifi", 1.0))
    assert (p.step_s, p.comm_s, p.speedup, p.bytes_sent) == (pytest.approx(0.8), 0.0, 1.0, 0)


def test_wifi_serialises_both_directions_ethernet_overlaps_them():
    """Two workers, 100 bytes each way, no compute, 100 B/s: wifi 1 + 1 out, then 1 + 1 back = 4 s;
    ethernet: tasks at 1 and 2 s, results on the other direction at 1-2 and 2-3 s = 3 s."""
    tasks = [Task(100, 0.0, 100), Task(100, 0.0, 100)]
    assert op_wall(LinkModel("wifi", 100.0), 0.0, tasks) == pytest.approx(4.0)
    assert op_wall(LinkModel("ethernet", 100.0), 0.0, tasks) == pytest.approx(3.0)
    # latency: a message's channel time on wifi (4 messages), a delay each way on ethernet
    assert op_wall(LinkModel("wifi", 100.0, 0.5), 0.0, tasks) == pytest.approx(6.0)
    assert op_wall(LinkModel("ethernet", 100.0, 0.5), 0.0, tasks) == pytest.approx(4.0)
    assert op_wall(LinkModel("wifi", 100.0), 7.0, tasks) == 7.0  # the master's own share outlasts the link
    net = predict([TOY], [device("d", [(4, 0.1, 0.05)])], 4, "off", "kernels", LinkModel("ethernet", 1000.0))
    air = predict([TOY], [device("d", [(4, 0.1, 0.05)])], 4, "off", "kernels", LinkModel("wifi", 1000.0))
    assert air.step_s > net.step_s and air.conv_s == net.conv_s


def test_eq1_gives_a_twice_faster_device_twice_the_kernels():
    fast, slow = device("fast", [(300, 0.0, 0.001)]), device("slow", [(300, 0.0, 0.002)])
    toy = ConvShape("conv1", (2, 3, 4, 4), (300, 3, 1, 1), (2, 300, 4, 4), need_dx=False)
    p = predict([toy], [fast, slow], 2, "off", "kernels", LinkModel("ethernet", 1e12))
    assert p.shares == ((200, 100),)
    assert p.conv_s == pytest.approx(0.2)  # both finish together: 200 * 1 ms = 100 * 2 ms
    assert predict([toy], [fast, slow], 4, "off", "kernels", LinkModel("ethernet", 1e12)).shares == (
        (100, 50, 100, 50),
    )


@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp16", "adt24", "adaptive"])
@pytest.mark.parametrize(("fuse", "split"), [("off", "kernels"), ("on", "kernels"), ("on", "channels")])
def test_bytes_are_comm_py_s(fuse, split, wire):
    """Per worker and op, the bytes add up to comm.split_bytes in each role's word of the wire format
    (exact against real steps in test_comm.py, test_wire_precision.py); adaptive at AWP's start."""
    convs = conv_shapes(paper_net("8:16", "numpy"), 2)
    devs = [device("a", [(8, 0.0, 0.001), (16, 0.0, 0.003)]), device("b", [(8, 0.0, 0.002), (16, 0.0, 0.001)])]
    p = predict(convs, devs, 3, fuse, split, LinkModel("wifi", 1e6), wire)
    words = wire_words(wire)[0][1]
    assert (p.bytes_sent, p.bytes_recv) == split_bytes(convs, p.shares, fuse == "on", split, words)


def test_bf16_halves_the_papers_comm_exactly():
    """Two equal devices, the paper's split: both compute alike, so comm is the bytes / B, and bf16's
    2-byte words make it fp32's / 2 exactly; the compute does not change. adt24: 3/4."""
    convs = conv_shapes(paper_net("8:16", "numpy"), 2)
    dev = device("d", [(8, 0.01, 0.001), (16, 0.02, 0.003)])
    link = LinkModel("ethernet", 1e4)  # no latency: nothing but bytes on the link
    fp32, bf16, adt24 = (predict(convs, [dev], 2, "off", "kernels", link, w) for w in ("fp32", "bf16", "adt24"))
    assert (bf16.bytes_sent * 2, bf16.bytes_recv * 2) == (fp32.bytes_sent, fp32.bytes_recv)
    assert (adt24.bytes_sent * 4, adt24.bytes_recv * 4) == (fp32.bytes_sent * 3, fp32.bytes_recv * 3)
    assert fp32.comm_s == pytest.approx((fp32.bytes_sent + fp32.bytes_recv) / 1e4)
    assert bf16.comm_s == pytest.approx(fp32.comm_s / 2) and adt24.comm_s == pytest.approx(fp32.comm_s * 3 / 4)
    assert bf16.conv_s == fp32.conv_s and bf16.shares == fp32.shares and bf16.speedup > fp32.speedup
    with pytest.raises(ValueError, match="fp32, bf16"):
        predict(convs, [dev], 2, "off", "kernels", link, "fp8")


def test_a_given_split_is_taken_and_checked():
    convs = conv_shapes(paper_net("8:16", "numpy"), 2)
    dev = device("d", [(8, 0.01, 0.001), (16, 0.02, 0.003)])
    p = predict(convs, [dev], 2, "off", "kernels", LinkModel("wifi", 1e6), shares=[[3, 5], [10, 6]])
    assert p.shares == ((3, 5), (10, 6))
    assert (p.bytes_sent, p.bytes_recv) == split_bytes(convs, [[3, 5], [10, 6]], False, "kernels")
    with pytest.raises(ValueError, match="a split of 8 kernels among 2"):
        predict(convs, [dev], 2, "off", "kernels", LinkModel("wifi", 1e6), shares=[[3, 4], [10, 6]])


def test_a_worker_behind_a_slower_link_of_its_own_is_held_to_its_rate_and_the_others_are_not():
    """100 kB each way and 0.1 s of compute per worker, the master's link 1 MB/s, worker 1's own 100 kB/s.
    Ethernet: worker 0 has its task at 0.1 s and its result in at 0.3 s; worker 1 its task at 1.0 s (the master's
    NIC was done at 0.2 s), ready at 1.1 s, its result in 1 s later: 2.1 s. Wi-Fi: worker 1's transfers hold the
    one channel 1 s each: tasks out at 0.1 and 1.1 s, results in at 1.2 and 2.2 s."""
    tasks = [Task(100_000, 0.1, 100_000, worker=0), Task(100_000, 0.1, 100_000, worker=1)]
    assert op_wall(LinkModel("ethernet", 1e6, 0.0, (1e6, 1e5)), 0.0, tasks) == pytest.approx(2.1)
    assert op_wall(LinkModel("wifi", 1e6, 0.0, (1e6, 1e5)), 0.0, tasks) == pytest.approx(2.2)
    assert op_wall(LinkModel("ethernet", 1e6, 0.0, (1e6,)), 0.0, tasks) == pytest.approx(0.4)  # both at 1 MB/s
    assert LinkModel("ethernet", 1e6, 0.0, (1e7,)).rate(0) == 1e6  # no faster than the master's own link
    dev, fast = device("d", [(4, 0.1, 0.05)]), LinkModel("ethernet", 1000.0)
    slow = predict([TOY], [dev], 3, "off", "kernels", LinkModel("ethernet", 1000.0, 0.0, (1000.0, 100.0)))
    assert slow.step_s > predict([TOY], [dev], 3, "off", "kernels", fast).step_s and slow.lag > 0.5


def test_the_rebalancers_lag_grows_as_the_link_slows():
    """Eq. 1 balances compute: equal devices finish together on a free link (lag 0), and a worker's
    transfers put it behind on a slow one -- with 2, lag = (r_w - r_m) / (r_w + r_m)."""
    dev = device("d", [(4, 0.1, 0.05)])
    assert predict([TOY], [dev], 2, "off", "kernels", LinkModel("ethernet", 1e15)).lag < 1e-9
    p = predict([TOY], [dev], 2, "off", "kernels", LinkModel("ethernet", 1000.0))
    worker = 0.2 + (p.bytes_sent + p.bytes_recv) / 1000.0  # compute 0.2 s, bytes 928 at 1000 B/s
    assert p.lag == pytest.approx((worker - 0.2) / (worker + 0.2))


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


def write_grid(path, rows: list[dict]) -> None:
    columns = [
        "arch",
        "norm",
        "batch",
        "participants",
        "fuse",
        "split",
        "backend",
        "transport",
        "repeat",
        "steps",
        "step_s",
        "step_s_min",
        "step_s_max",
        "comm_s",
        "conv_s",
        "comp_s",
        "bytes_sent",
        "bytes_recv",
        "solo_step_s",
        "speedup",
        "shares",
        "link",
        "host",
        "timestamp",
    ]
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
    loop = predict(convs, devices, 2, "off", "kernels", LinkModel("ethernet", 1000e6, 0.02e-3))
    shaped = predict(convs, devices, 2, "on", "kernels", LinkModel("ethernet", 5e6, 1e-3))
    assert done[0]["step_err"] == pytest.approx(loop.step_s / 0.5 - 1)
    assert done[0]["speedup_err"] == pytest.approx(loop.speedup / 1.5 - 1)
    assert done[1]["step_err"] == pytest.approx(shaped.step_s / 2.0 - 1)
    assert main(["--device-file", str(devices_file), "--against", str(grid)]) == 0
    assert "median |error|" in capsys.readouterr().out


def grid_row(**kw) -> dict:
    """A grid row of 8:16 at batch 2 on 2 participants, the paper's split, as the grid writes it."""
    return {
        "arch": "8:16",
        "norm": "lrn",
        "batch": "2",
        "participants": "2",
        "fuse": "off",
        "split": "kernels",
        "step_s": "1.0",
        "comm_s": "0.5",
        "speedup": "1.2",
        "link": "5MB/s",
        "parallel": "model",
        "rebalance": "off",
        "wire": "fp32",
        "shares": "conv1=3/5 conv2=10/6",
        **kw,
    }


def test_against_predicts_each_row_in_its_wire_format_at_its_split(tmp_path, devices_file):
    """A bf16 row is held against a bf16 prediction (fp32's comm / 2 at the same split, not fp32's),
    with --rebalance off at the split the row kept (its shares), so the bytes are the ones that moved."""
    devices, links = load(devices_file)
    rows = [grid_row(), grid_row(wire="bf16"), grid_row(wire="adt24", shares="garbled")]
    done, skipped = compare_rows(rows, devices, links)
    assert skipped == [] and [(d["wire"], d["split_from"]) for d in done] == [
        ("fp32", "row"),
        ("bf16", "row"),
        ("adt24", "eq. 1"),
    ]
    convs = conv_shapes(paper_net("8:16", "numpy"), 2)
    for d in done:
        counts = [[3, 5], [10, 6]] if d["split_from"] == "row" else [[4, 4], [8, 8]]
        assert (d["bytes_sent"], d["bytes_recv"]) == split_bytes(
            convs, counts, False, "kernels", wire_words(d["wire"])[0][1]
        )
        p = predict(convs, devices, 2, "off", "kernels", LinkModel("ethernet", 5e6), d["wire"], counts)
        assert (d["comm_s"], d["step_s"]) == (p.comm_s, p.step_s)
        assert d["comm_err"] == pytest.approx(p.comm_s / 0.5 - 1)
    assert done[1]["bytes_sent"] * 2 == done[0]["bytes_sent"]
    assert done[1]["comm_s"] == pytest.approx(done[0]["comm_s"] / 2)  # no latency: bytes / B, half of them


def test_against_says_which_rows_it_cannot_predict(tmp_path, devices_file):
    """Rebalance on at 5 MB/s: the model's split leaves the worker far behind, the rebalancer moved kernels
    during the steps -- left out, said why; on loopback it is predicted. The batch split, an unknown
    format: left out, said why."""
    devices, links = load(devices_file)
    rows = [
        grid_row(rebalance="on"),
        grid_row(rebalance="on", link="loopback"),
        grid_row(parallel="data", fuse="-", split="-"),
        grid_row(wire="fp8"),
    ]
    done, skipped = compare_rows(rows, devices, links, latency_ms=1.0)
    assert [(d["link"], d["rebalance"], d["split_from"]) for d in done] == [("loopback", "on", "eq. 1")]
    assert len(skipped) == 3
    assert skipped[0].startswith("line 2:") and "rebalance on at 5MB/s" in skipped[0]
    assert "past the rebalancer" in skipped[0]
    assert skipped[1].startswith("line 4:") and "--parallel data" in skipped[1]
    assert skipped[2].startswith("line 5:") and "fp8" in skipped[2]


def test_against_reads_a_grid_older_than_wire_and_rebalance_as_fp32_and_on(tmp_path, devices_file):
    """Rows written before the columns: fp32 and rebalance on (eq. 1's split); the master alone "-"."""
    grid = tmp_path / "old.csv"
    newer = ("parallel", "rebalance", "wire")
    rows = [
        grid_row(link="loopback"),
        grid_row(participants="1", fuse="-", split="-", link="loopback", shares="conv1=8 conv2=16"),
    ]
    write_grid(grid, [{k: v for k, v in r.items() if k not in newer} for r in rows])
    devices, links = load(devices_file)
    old = read_grid(str(grid))
    assert "wire" not in old[0]
    done, skipped = compare_rows(old, devices, links)
    assert skipped == [] and [(d["wire"], d["rebalance"], d["split_from"]) for d in done] == [
        ("fp32", "on", "eq. 1"),
        ("fp32", "-", "-"),
    ]


def test_a_slower_device_takes_longer_on_the_same_link():
    from tinyconv.lab.simulate.devices import slowed

    dev = device("d", [(4, 0.1, 0.05)])
    fast = predict([TOY], [dev], 2, "off", "kernels", LinkModel("wifi", 1000.0))
    slow = predict([TOY], [slowed(dev, 3.0)], 2, "off", "kernels", LinkModel("wifi", 1000.0))
    assert (slow.conv_s, slow.comp_s) == (pytest.approx(3 * fast.conv_s), pytest.approx(3 * fast.comp_s))
    assert slow.comm_s == pytest.approx(fast.comm_s) and slow.speedup > fast.speedup


def test_a_row_of_emulated_devices_takes_each_quotas_device_or_the_whole_one_slowed(tmp_path, devices_file):
    """ "0.5/0.25": a device measured inside 0.5 of a core is taken as it is; none measured at 0.25, so the
    one measured without a quota is slowed 4x. The prediction is the model's on exactly those two."""
    save(devices_file, {**entry("dev", per_kernel=0.03), "cores": 0.5}, {})
    devices, links = load(devices_file)
    assert [d.cores for d in devices] == [None, 0.5]  # same name, another quota: kept beside it
    row = grid_row(participants="2", devices="0.5/0.25", link="loopback")
    (done,), _ = compare_rows([row], devices, links)
    assert (done["devices"], done["devices_from"]) == ("0.5/0.25", "scaled")
    convs = conv_shapes(paper_net("8:16", "numpy"), 2)
    both = [devices[1], slowed(devices[0], 4.0)]
    want = predict(convs, both, 2, "off", "kernels", LinkModel("ethernet", 1000e6, 0.02e-3), "fp32", [[3, 5], [10, 6]])
    assert done["step_s"] == pytest.approx(want.step_s)
    assert row_devices(grid_row(devices="0.5"), devices) == ([devices[1]], "measured")
    assert row_devices(grid_row(devices="-"), devices) == ([devices[0]], "-")
    only = [devices[1]]  # nothing without a quota: a 0.25 device cannot be had, and the row says why
    assert "no device measured at 0.25 cores" in row_devices(grid_row(devices="0.25"), only)
    assert "without a CPU quota" in row_devices(grid_row(), only)


def test_a_devices_quota_must_be_a_positive_number(tmp_path, devices_file):
    doc = json.loads(devices_file.read_text())
    doc["devices"][0]["cores"] = "half"
    devices_file.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="cores must be a CPU quota"):
        load(devices_file)

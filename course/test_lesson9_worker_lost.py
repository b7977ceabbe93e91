"""Grades lesson 9 on the metrics of real runs made here -- in-process workers that die in a chosen step, a master
stopped after a chosen step and resumed from its checkpoint -- and on hand-made records and state dicts with the
bits that == misses. The expected splits come from tinyconv's own apportionment (an equal split among those left)."""

from __future__ import annotations

import numpy as np
import pytest

import tinyconv as tc
from tinyconv.distributed.protocol import VERSION
from tinyconv.distributed.shard.balance import apportion
from tinyconv.distributed.worker.handler import Worker
from tinyconv.metrics import MetricsWriter, read_metrics

LESSON = "09_a_worker_dies"
# a worker that dies ends its thread on purpose; pytest would report the death as a warning
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
SIZE, BATCH, STEPS_PER_EPOCH = 8, 8, 8


class Dying(Worker):
    """A worker whose thread ends in the backward of step ``dies_in`` (None: never)."""

    def __init__(self, backend, dies_in: int | None) -> None:
        super().__init__(backend)
        self.dies_in = dies_in

    def handle(self, msg):
        if self.dies_in is not None and msg.kind == "block_backward" and msg.header["step"] + 1 >= self.dies_in:
            raise SystemExit(f"dies in step {self.dies_in}")
        return super().handle(msg)


class Stopped(Exception):
    pass


class StopAfter(MetricsWriter):
    """A metrics file whose writer raises as it gets the record of step ``step`` (None: never)."""

    def __init__(self, path, step: int | None) -> None:
        super().__init__(path)
        self.step = step

    def write(self, event: str, **fields) -> None:
        super().write(event, **fields)
        if event == "step" and fields["step"] == self.step:
            raise Stopped


def run(path, arch: str, workers: int, deaths: dict[int, int], stop_after=None, checkpoint=None, resume=None):
    """Two epochs of ``arch`` with the master and ``workers`` in-process workers, an equal split, worker i dying in
    step deaths[i] -> (the metrics records, the network's state dict)."""
    data = tc.synthetic_dataset(n_train=BATCH * STEPS_PER_EPOCH, n_test=16, seed=len(arch), image_size=SIZE)
    net = tc.paper_net(arch, backend="numpy", image_size=SIZE, seed=workers)
    writer = StopAfter(path, stop_after)
    make = lambda i: Dying(tc.get_backend("numpy"), deaths.get(i))  # noqa: E731
    with tc.get_transport("inproc", handler_factory=make, protocol=VERSION) as transport:
        cluster = tc.Cluster(transport, transport.start(workers, timeout=30), net.backend, split="kernels",
                             fuse=False, rebalance=False)  # fmt: skip
        cluster.attach(net)
        config = tc.TrainConfig(epochs=2, batch_size=BATCH, lr=0.02, progress=False, checkpoint=checkpoint)
        trainer = tc.Trainer(net, data, config, metrics=writer, cluster=cluster)
        if resume is not None:
            trainer.resume(resume)
        try:
            trainer.fit()
        except Stopped:
            pass
        finally:
            cluster.close()
            writer.close()
    return read_metrics(path), net.state_dict()


def equal(names: list[str], kernels: dict[str, int]) -> dict[str, dict[str, int]]:
    """Each layer's kernels split equally among ``names``, as an uncalibrated cluster splits them."""
    return {layer: dict(zip(names, apportion([1.0] * len(names), f), strict=True)) for layer, f in kernels.items()}


# (arch, workers, {worker: the step it dies in}): the last, both workers one after the other, the master left alone
LOSSES = [("6:10", 3, {2: 3}), ("5:9", 2, {0: 2, 1: 6}), ("7:4", 1, {0: 4}), ("4:11", 3, {1: 8})]


@pytest.mark.parametrize("arch,workers,deaths", LOSSES)
def test_redistribution_of_real_losses(lesson, tmp_path, arch, workers, deaths):
    records, _ = run(tmp_path / "m.jsonl", arch, workers, deaths)
    kernels = dict(zip(("conv1", "conv2"), map(int, arch.split(":")), strict=True))
    events = [r for r in records if r["event"] == "worker_lost"]
    got = list(lesson.redistribution(records))
    assert len(got) == len(deaths) == len(events), f"one dict per worker_lost event: {len(events)} in these records"
    names = ["master"] + [f"worker{i}" for i in range(workers)]
    for (k, step), loss, event in zip(sorted(deaths.items(), key=lambda d: d[1]), got, events, strict=True):
        left = [n for n in names if n != f"worker{k}"]
        want = {"in_step": step, "worker": f"worker{k}", "reason": event["reason"],
                "before": equal(names, kernels), "after": equal(left, kernels)}  # fmt: skip
        assert dict(loss) == want, f"worker{k}, which died in step {step}"
        names = left


def test_redistribution_reads_only_what_it_needs(lesson):
    """Other events (some with a step field), hand-made splits that are not equal ones, records in file order."""
    step = {"event": "step", "epoch": 1, "loss": 2.0, "acc": 0.1, "lr": 0.01}
    records = [
        {"event": "calibration", "participants": ["master", "worker0", "worker1"], "shares": {"conv1": [9, 9, 9]}},
        {**step, "step": 1, "participants": ["master", "worker0", "worker1"], "shares": {"conv1": [2, 5, 3]}},
        {**step, "step": 2, "participants": ["master", "worker0", "worker1"], "shares": {"conv1": [1, 6, 3]}},
        {"event": "future_event", "step": 2, "participants": ["nobody"], "shares": {}},
        {**step, "step": 3, "participants": ["master", "worker1"], "shares": {"conv1": [6, 4]}},
        {"event": "worker_lost", "step": 2, "worker": "worker0", "reason": "gone", "shares": {"conv1": [6, 4]}},
        {"event": "epoch", "epoch": 1, "steps": 3, "test_acc": 0.2},
        {**step, "step": 4, "participants": ["master", "worker1"], "shares": {"conv1": [7, 3]}},
        {**step, "step": 5, "participants": ["master"], "shares": {"conv1": [10]}},
        {"event": "worker_lost", "step": 4, "worker": "worker1", "reason": "late", "shares": {"conv1": [10]}},
    ]
    got = [dict(d) for d in lesson.redistribution(records)]
    assert got == [
        {"in_step": 3, "worker": "worker0", "reason": "gone", "before": {"conv1": {"master": 1, "worker0": 6,
         "worker1": 3}}, "after": {"conv1": {"master": 6, "worker1": 4}}},
        {"in_step": 5, "worker": "worker1", "reason": "late", "before": {"conv1": {"master": 7, "worker1": 3}},
         "after": {"conv1": {"master": 10}}},
    ]  # fmt: skip
    assert list(lesson.redistribution(records[:4])) == []  # no loss, no dict


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    """{stop_after: (the straight run's records and state, the resumed run's, the resumed-with-another-split's)}:
    3 workers of which worker1 dies in step 3; the master stopped after step 5, 8 (an epoch's end) or 11."""
    folder = tmp_path_factory.mktemp("lesson9")
    straight = run(folder / "straight.jsonl", "6:10", 3, {1: 3})
    runs = {}
    for after in (5, 8, 11):
        checkpoint = folder / f"c{after}.npz"
        run(folder / f"stopped{after}.jsonl", "6:10", 3, {1: 3}, stop_after=after, checkpoint=str(checkpoint))
        same = run(folder / f"resumed{after}.jsonl", "6:10", 2, {}, resume=checkpoint)  # master, worker0, worker2
        other = run(folder / f"other{after}.jsonl", "6:10", 3, {}, resume=checkpoint)  # master and three fresh ones
        runs[after] = (straight, same, other)
    return runs


def steps_of(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if r["event"] == "step"}


@pytest.mark.parametrize("after", [5, 8, 11])
def test_a_resume_with_the_same_split_is_the_same_run(lesson, resumed_runs, after):
    (straight, _), (resumed, _), _ = resumed_runs[after]
    assert min(steps_of(resumed)) == after + 1
    assert lesson.first_divergence(straight, resumed) is None


@pytest.mark.parametrize("after", [5, 8, 11])
def test_a_resume_with_another_split_parts_where_a_step_differs(lesson, resumed_runs, after):
    """float32 sums in another grouping: the runs may part, a few units in the last place, from some step on."""
    (straight, _), _, (other, _) = resumed_runs[after]
    a, b = steps_of(straight), steps_of(other)
    differs = [s for s in sorted(b) if any(a[s][k] != b[s][k] for k in ("loss", "acc", "lr"))]
    assert lesson.first_divergence(straight, other) == (differs[0] if differs else None)


@pytest.mark.parametrize("after", [5, 11])
def test_first_divergence_finds_one_bit_a_missing_step_and_an_extra_one(lesson, resumed_runs, after):
    (straight, _), (resumed, _), _ = resumed_runs[after]
    last = max(steps_of(straight))

    def changed(step: int, key: str, value) -> list[dict]:
        return [{**r, key: value} if r["event"] == "step" and r["step"] == step else r for r in resumed]

    one_ulp = float(np.nextafter(steps_of(resumed)[after + 2]["loss"], np.inf))
    assert lesson.first_divergence(straight, changed(after + 2, "loss", one_ulp)) == after + 2
    assert lesson.first_divergence(straight, changed(last, "acc", 1.0 - steps_of(resumed)[last]["acc"])) == last
    assert lesson.first_divergence(straight, changed(after + 1, "lr", 0.5)) == after + 1
    skipped = [r for r in resumed if not (r["event"] == "step" and r["step"] == after + 3)]
    assert lesson.first_divergence(straight, skipped) == after + 3
    short = [r for r in resumed if not (r["event"] == "step" and r["step"] == last)]
    assert lesson.first_divergence(straight, short) == last  # stopped before the end
    beyond = [*resumed, {**steps_of(resumed)[last], "step": last + 1}]
    assert lesson.first_divergence(straight, beyond) == last + 1  # a step the straight run never had
    earlier = [{**r, "loss": -1.0} if r["event"] == "step" and r["step"] <= after else r for r in straight]
    assert lesson.first_divergence(earlier, resumed) is None  # before the resumed run began: not its business


@pytest.mark.parametrize("after", [5, 8])
def test_differing_arrays_of_real_runs(lesson, resumed_runs, after):
    (_, a), (_, same), (_, other) = resumed_runs[after]
    assert list(lesson.differing_arrays(a, same)) == []
    want = sorted(k for k in a if a[k].tobytes() != other[k].tobytes())
    assert list(lesson.differing_arrays(a, other)) == want


def test_differing_arrays_by_the_bits(lesson):
    a = {
        "nan": np.array([np.nan, 1.0], np.float32),
        "zero": np.zeros(3, np.float32),
        "wide": np.arange(4, dtype=np.float32),
        "shape": np.arange(6, dtype=np.float32).reshape(2, 3),
        "ulp": np.ones(2, np.float32),
        "only_a": np.zeros(1),
    }
    b = {
        "nan": np.array([np.nan, 1.0], np.float32),  # the same bits, though nan != nan
        "zero": -np.zeros(3, np.float32),  # == says equal; the sign bit differs
        "wide": np.arange(4, dtype=np.float64),  # the same numbers in another dtype
        "shape": np.arange(6, dtype=np.float32).reshape(3, 2),  # the same bytes in another shape
        "ulp": np.array([1.0, np.nextafter(np.float32(1), np.float32(2))], np.float32),
        "only_b": np.zeros(1),
    }
    assert list(lesson.differing_arrays(a, b)) == ["only_a", "only_b", "shape", "ulp", "wide", "zero"]
    assert list(lesson.differing_arrays(a, {k: v.copy() for k, v in a.items()})) == []

# %% [markdown]
# # Lesson 9 — A worker dies: its kernels go to the others, and a checkpoint brings the master back
#
# **Time:** about 25 minutes. **Needs:** one machine (the workers are threads).
#
# A lab's machines come and go: a laptop is closed, a process runs out of memory, the Wi-Fi drops.
# A run split across them must not depend on any one worker, and a run that stops — the master's
# machine too can go down — must go on where it stopped, not from the start. You will
#
# 1. run a short training with two in-process workers, one of which dies in step 5, and watch the run
#    go on without it;
# 2. read the `worker_lost` event in the metrics file, and the split before and after it;
# 3. stop the master itself mid-run and resume it from its checkpoint: bit for bit the run that never
#    stopped — as long as the split is the same;
# 4. and write, in the exercises, the reader of a loss and the two checks of a resumed run.
#
# **What exists in tinyconv.** The loss and the new split: `tinyconv/distributed/runtime.py` (`lose`),
# `docs/how-it-works.md`, "When workers come and go"; the events: `docs/metrics.md`; checkpoints:
# `tinyconv/checkpoint.py` and `Trainer.save` / `Trainer.resume` (`tinyconv/trainer.py`); from the shell,
# `--checkpoint FILE` and `--resume FILE`. tests/test_chaos.py runs 100 steps while workers die, hang, fail,
# lie and join; tests/test_chaos_processes.py kills real worker processes.

# %% tags=["setup"]
import json
import os

# One BLAS thread per participant: the participants already run side by side (lesson 5 says why).
# It must be set before numpy loads: in a notebook, restart the kernel before running this cell.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from charts import FIGURES, QUICK, show  # noqa: E402 -- beside the lessons: their size, their charts

import tinyconv as tc  # noqa: E402

# %%
from tinyconv.checkpoint import read_checkpoint  # noqa: E402
from tinyconv.distributed.protocol import VERSION  # noqa: E402
from tinyconv.distributed.worker.handler import Worker  # noqa: E402
from tinyconv.lab.plot.run_charts import plot_runs  # noqa: E402
from tinyconv.metrics import MetricsWriter, read_metrics  # noqa: E402

# %% [markdown]
# ## 1. How a worker is lost
#
# The master loses a worker when the transport says it is gone (a thread that ended, a process whose
# connection closed or fell silent: four missed heartbeats over ZeroMQ), when it answers with an error
# (out of memory, a driver's), when it computes past its deadline (twice its expected compute and a
# second), when its result has the wrong shape or NaNs from finite inputs, or when the spot check,
# recomputing a sample of its work, finds its numbers wrong. Then the cluster
#
# * drops it, and splits every layer again among the others by eq. 1 on their calibrated times (equally
#   if, as here, nobody was timed) — the master among them: it holds every weight, so it can always
#   finish alone;
# * runs the op again without it (a backward whose forward had the lost worker runs that forward again
#   first, on the input it kept), so the step completes, with the same numbers up to float32 round-off;
# * and records a `worker_lost` event: `step` (the steps *finished* when it was lost: it happened in the
#   next one, which the others completed), `worker`, `reason`, and `shares`, the new split, in the order
#   of the participants that remain.
#
# ## 2. A run in which a worker dies
#
# The workers are threads here (the `inproc` transport, as in lesson 5). `Mortal` is tinyconv's worker,
# but for one thing: in the backward of step `dies_in` its thread ends — as a process does that is
# killed. Every task's header says how many steps were finished when it was sent, so the step is known
# without a clock, and the run is the same each time. The split is not timed (`attach`: an equal split)
# and not rebalanced, so that every run below starts from the same one.


# %%
class Mortal(Worker):
    """tinyconv's worker, whose thread ends in the backward of step ``dies_in`` (None: never)."""

    def __init__(self, backend, dies_in: int | None = None) -> None:
        super().__init__(backend)
        self.dies_in = dies_in

    def handle(self, msg):
        if self.dies_in is not None and msg.kind == "block_backward" and msg.header["step"] + 1 >= self.dies_in:
            raise SystemExit("switched off")  # ends the thread, and Python says nothing of it
        return super().handle(msg)


arch, size, batch, epochs = ("8:16", 16, 16, 2) if QUICK else ("16:32", 32, 32, 3)
data = tc.synthetic_dataset(n_train=8 * batch, n_test=64, seed=0, image_size=size)  # 8 steps an epoch
DIES_IN, UNPLUGGED_AFTER = 5, 10  # worker1 dies in step 5; in part 3 the master goes down after step 10


def train(metrics, workers: int = 2, dies_in: int | None = None, checkpoint=None, resume=None) -> tc.Trainer:
    """Train ``arch`` with the master and ``workers`` in-process workers, worker1 dying in step ``dies_in``;
    the records to ``metrics`` (a MetricsWriter); ``checkpoint``: where to save, ``resume``: what from."""
    net = tc.paper_net(arch, backend="numpy", image_size=size, seed=0)
    make = lambda i: Mortal(tc.get_backend("numpy"), dies_in if i == 1 else None)  # noqa: E731
    with tc.get_transport("inproc", handler_factory=make, protocol=VERSION) as transport:
        cluster = tc.Cluster(transport, transport.start(workers, timeout=30), net.backend, split="kernels",
                             fuse=False, rebalance=False)  # fmt: skip
        cluster.attach(net)  # an equal split, not timed: the same in every run
        config = tc.TrainConfig(epochs=epochs, batch_size=batch, lr=0.02, progress=False, checkpoint=checkpoint)
        trainer = tc.Trainer(net, data, config, metrics=metrics, cluster=cluster)
        if resume is not None:
            print(trainer.resume(resume))  # what it did with the checkpoint's split
        try:
            trainer.fit()
        finally:
            cluster.close()  # the network gets its own layers back
            metrics.close()
    return trainer


straight_path = FIGURES / "lesson9_straight.jsonl"
straight = train(MetricsWriter(straight_path), dies_in=DIES_IN)
straight_records = read_metrics(straight_path)

# %% [markdown]
# The run went on: the line `step 4: worker1 lost: ...` is the terminal's, and it counts, as the event
# does, the steps finished. Here is the event, and the step records around it:

# %%
(event,) = [r for r in straight_records if r["event"] == "worker_lost"]
print(json.dumps(event))
for r in straight_records:
    if r["event"] == "step" and DIES_IN - 2 <= r["step"] <= DIES_IN + 1:
        print(f"step {r['step']}: participants {r['participants']}, shares {r['shares']}, loss {r['loss']:.4f}")

# %% [markdown]
# Step 4 ran on three participants, step 5 lost worker1 and ended on two: its record already shows the new
# split, and the event comes after it in the file. Each layer's kernels still add up (8 and 16): the master
# and worker0 took worker1's share, equally, since nobody was timed. Calibrated (`cluster.calibrate`),
# they would have split it by eq. 1 on their own times.
#
# `tinyconv plot` (`plot_runs` in Python) draws each layer's split over the run, the loss marked:

# %%
for path in plot_runs([straight_path], FIGURES / "lesson9_plots"):
    if path.name in ("shares.svg", "curves.svg"):
        show(path.read_text(), f"lesson9_{path.name}")

# %% [markdown]
# ## 3. The master goes down, and comes back
#
# A worker lost costs a share; the master lost would cost the run, but for checkpoints. A checkpoint
# (`tinyconv/checkpoint.py`) is one `.npz` file with everything a step reads: the parameters, the
# optimizer's momentum, the progress (step, epoch, batch in the epoch), the states of both random
# generators (the shuffle's and the augmentation's) and the split. The trainer writes one at every
# epoch's end, every `checkpoint_every` steps if asked, and on its way out, however training ends — an
# error, Ctrl-C, SIGTERM — always of a whole step (one cut short is rolled back first). Written to a
# temporary file and renamed, so a crash leaves the old checkpoint or the new one, never half of one.
#
# Here the master goes down after step 10: an exception raised as the metrics file gets step 10's record,
# which the trainer meets as it would meet Ctrl-C.


# %%
class Unplugged(Exception):
    """The master's machine going down."""


class UnpluggedAfter(MetricsWriter):
    """A metrics file whose writer goes down as it gets the record of step ``step``."""

    def __init__(self, path, step: int) -> None:
        super().__init__(path)
        self.step = step

    def write(self, event: str, **fields) -> None:
        super().write(event, **fields)
        if event == "step" and fields["step"] == self.step:
            raise Unplugged(f"the master went down after step {self.step}")


checkpoint = FIGURES / "lesson9_checkpoint.npz"
try:  # the checkpoint's path as a str: the checkpoint keeps the config as JSON
    train(UnpluggedAfter(FIGURES / "lesson9_unplugged.jsonl", UNPLUGGED_AFTER), dies_in=DIES_IN,
          checkpoint=str(checkpoint))  # fmt: skip
except Unplugged as e:
    print(f"{e}; it left {checkpoint.name}, {checkpoint.stat().st_size / 1e3:.0f} KB")
saved = read_checkpoint(checkpoint)
print(f"step {saved.meta['step']}, epoch {saved.meta['epoch']}, batch {saved.meta['batch_in_epoch']} of the epoch")
print("the split:", saved.meta["plan"])
print("arrays:", ", ".join(f"{k} {v.shape}" for k, v in {**saved.model, **saved.optim}.items()))

# %% [markdown]
# The master comes back (`--resume` from the shell). worker1 is still dead, worker0 still there: a run
# of the master and one worker has the checkpoint's participants, so it takes up the checkpoint's split.
# A second resume has two fresh workers: other participants, so it keeps its own split, an equal one
# among three.

# %%
resumed_path, other_path = FIGURES / "lesson9_resumed.jsonl", FIGURES / "lesson9_resumed_3.jsonl"
resumed = train(MetricsWriter(resumed_path), workers=1, resume=checkpoint)
other = train(MetricsWriter(other_path), workers=2, resume=checkpoint)
resumed_records, other_records = read_metrics(resumed_path), read_metrics(other_path)
losses = [{r["step"]: r["loss"] for r in rs if r["event"] == "step"} for rs in (straight_records, resumed_records,
                                                                            other_records)]  # fmt: skip
print(" step  the loss: straight run  resumed, same split  resumed, 3 participants")
for step in sorted(losses[1]):
    print(f"{step:5d}  {losses[0][step]!r:22}  {losses[1][step]!r:19}  {losses[2][step]!r}")

# %% [markdown]
# The same split gives the same numbers, to the last bit. Another split gives other sums: each
# participant's partial `dx` is added by the master in another grouping, and float32 addition is not
# associative, so the runs part by a few units in the last place — and go on parting, a little. The
# losses may agree for a step or two after the weights already differ (a loss is a mean that rounds a
# small difference away): the weights tell first. Nothing is wrong with either run; but "resumed
# correctly" can only be checked bit for bit where the split is the same, which is why the checkpoint
# keeps it.
#
# ## Exercises
#
# 1. `redistribution(records)`: for each `worker_lost` event of a metrics file's records, when the worker
#    was lost and how its kernels went to the others: a dict with `in_step` (the step it was lost in: the
#    event's `step` counts those finished before), `worker`, `reason`, `before` and `after`, each split as
#    `{layer: {participant: kernels}}`. `before` is the split of the last step finished before the loss
#    (the `step` record numbered as the event's `step`: it has `participants` and `shares`); `after` is
#    the event's `shares`, among the same participants less the lost one. In these runs a worker is lost
#    after at least one step, one at most a step, and none joins.
# 2. `first_divergence(straight, resumed)`: the first step at which a resumed run is not the straight
#    run bit for bit: from the resumed run's first step on, the first step that one of the two lacks, or
#    whose `loss`, `acc` or `lr` differ — exactly (`==`: JSON keeps a float's every bit). `None` if none.
# 3. `differing_arrays(a, b)`: the sorted names of the arrays of two state dicts (`net.state_dict()`: name
#    -> numpy array) that are not the same bit for bit — another dtype, another shape, any other bit — or
#    that only one of them has. Careful: `np.array_equal` says `nan != nan` (the same bits) and
#    `-0.0 == 0.0` (other bits).
#
# Grade: `pytest course/ --student-dir YOUR_FOLDER -k lesson9`.


# %% tags=["exercise"]
def redistribution(records: list[dict]) -> list[dict]:
    """One dict per worker_lost event, in order: in_step, worker, reason, before and after
    ({layer: {participant: kernels}})."""
    # BEGIN SOLUTION
    # TODO: find each loss's step record by the event's step; pair names with counts, the lost one gone after
    steps = {r["step"]: r for r in records if r.get("event") == "step"}
    out = []
    for e in records:
        if e.get("event") != "worker_lost":
            continue
        last = steps[e["step"]]
        names = last["participants"]
        left = [name for name in names if name != e["worker"]]
        out.append(
            {
                "in_step": e["step"] + 1,
                "worker": e["worker"],
                "reason": e["reason"],
                "before": {layer: dict(zip(names, counts, strict=True)) for layer, counts in last["shares"].items()},
                "after": {layer: dict(zip(left, counts, strict=True)) for layer, counts in e["shares"].items()},
            }
        )
    return out
    # END SOLUTION


def first_divergence(straight: list[dict], resumed: list[dict]) -> int | None:
    """The first step, from the resumed run's first on, that one run lacks or whose loss, acc or lr
    differ between them; None if the resumed run is the straight run's continuation bit for bit."""
    # BEGIN SOLUTION
    # TODO: each run's step records by step; walk every step either has from the resumed run's first on, in order
    a = {r["step"]: r for r in straight if r.get("event") == "step"}
    b = {r["step"]: r for r in resumed if r.get("event") == "step"}
    start = min(b)
    for step in sorted({s for s in a if s >= start} | set(b)):
        if step not in a or step not in b or any(a[step][k] != b[step][k] for k in ("loss", "acc", "lr")):
            return step
    return None
    # END SOLUTION


def differing_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """Sorted names of the arrays not the same bit for bit in a and b, or in one of them only."""
    # BEGIN SOLUTION
    # TODO: the same means the same dtype, the same shape and the same bytes; a name in one dict only differs
    differ = []
    for k in sorted(a.keys() | b.keys()):
        if k not in a or k not in b:
            differ.append(k)
        elif (a[k].dtype, a[k].shape, a[k].tobytes()) != (b[k].dtype, b[k].shape, b[k].tobytes()):
            differ.append(k)
    return differ
    # END SOLUTION


# %% [markdown]
# ### Try them on the runs above

# %%
(loss,) = redistribution(straight_records)
print(f"{loss['worker']} lost in step {loss['in_step']}: {loss['reason']}")
for layer in loss["before"]:
    print(f"  {layer}: {loss['before'][layer]} -> {loss['after'][layer]}")
adds_up = all(sum(loss["before"][k].values()) == sum(loss["after"][k].values()) for k in loss["before"])
print("ok" if loss["in_step"] == DIES_IN and adds_up and loss["worker"] not in loss["after"]["conv1"] else "look again")

same = (
    first_divergence(straight_records, resumed_records),
    differing_arrays(straight.net.state_dict(), resumed.net.state_dict()),
)
print(f"resumed, same split: first divergence {same[0]}, arrays that differ {same[1]}:",
      "ok" if same == (None, []) else "look again")  # fmt: skip
apart = (
    first_divergence(straight_records, other_records),
    differing_arrays(straight.net.state_dict(), other.net.state_dict()),
)
print(f"resumed, 3 participants: first divergence {apart[0]}, arrays that differ {apart[1]}")

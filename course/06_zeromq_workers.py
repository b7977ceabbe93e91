# %% [markdown]
# # Lesson 6 — ZeroMQ workers: on one machine, then on two; where a step's time goes
#
# **Time:** about 35 minutes. **Needs:** one machine for parts 1–3; two (or a lab) on one network
# for part 4.
#
# Lesson 5's workers were threads. Real ones are processes, on this machine or another, that talk
# to the master over ZeroMQ: `tinyconv worker`. The master sends each conv op's arrays (msgpack
# header + raw float32 frames, never pickles), the worker computes its kernels and sends its maps
# back. The paper splits each step's time three ways (its Fig. 6), and so does every metrics file:
#
# * **conv** — summed over the step's conv operations, the slowest participant's compute time
#   (with the tails fused, its ReLU/LRN/pool too);
# * **comm** — the rest of those operations' wall time: sending, waiting, receiving, stacking;
# * **comp** — everything else: the other layers, the loss, the SGD update.
#
# (`docs/how-it-works.md`, "What a step costs".)

# %% tags=["setup"]
import json
import os
import statistics

# One BLAS thread per process: the master and its local workers already share the cores, and each
# one's BLAS starting a thread per core on top oversubscribes them. The workers inherit this. It
# must be set before numpy loads: in a notebook, restart the kernel before running this cell.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from charts import FIGURES, QUICK, show  # noqa: E402 -- beside the lessons: their size, their charts

import tinyconv as tc  # noqa: E402
from tinyconv.lab.plot.bars import Bar, Group, stacked_bars  # noqa: E402

# %%
from tinyconv.metrics import MetricsWriter  # noqa: E402

# %% [markdown]
# ## 1. Workers on this machine
#
# `tc.distribute(net, transport="zmq", workers=N)` starts N `tinyconv worker` processes on this
# machine, waits for their hellos, times each on every conv layer's shape and splits by eq. 1.
# Inside the `with` block the network trains as before; its convolutions run in shards. Each run
# below writes a metrics file; the master alone is the baseline.

# %%
arch, size, steps = ("8:16", 16, 4) if QUICK else ("50:500", 32, 12)
data = tc.synthetic_dataset(n_train=32 * steps, n_test=64, seed=0, image_size=size)
# eval_batch_size 32 too: the workers accept messages up to the largest batch distribute() was told of
config = tc.TrainConfig(
    epochs=1, batch_size=32, eval_batch_size=32, lr=0.02, max_steps=steps, progress=False, augment=False
)
runs = {}
for workers in (0, 1) if QUICK else (0, 1, 2):
    net = tc.paper_net(arch, backend="numpy", image_size=size, seed=0)
    path = FIGURES / f"lesson6_{workers}_workers.jsonl"
    FIGURES.mkdir(parents=True, exist_ok=True)
    writer = MetricsWriter(path)
    if workers == 0:
        tc.Trainer(net, data, config, metrics=writer).fit()
    else:
        with tc.distribute(
            net,
            transport="zmq",
            workers=workers,
            batch_size=32,
            image_size=size,
            split="kernels",
            announce=lambda _: None,
        ) as cluster:
            tc.Trainer(net, data, config, metrics=writer, cluster=cluster).fit()
            print(f"{workers} worker(s): participants {cluster.participants}, shares {cluster.last_step['shares']}")
    writer.close()
    runs[workers] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

# %% [markdown]
# ## 2. comm / conv / comp, per configuration
#
# The median step of each run (the first is left out: it pays for warming up), split three ways.
# On one machine the workers share its cores with the master, so more workers do not make a step
# faster here: the bars show what the split *costs* — comm appears, and the master's share of conv
# shrinks. Across machines (part 4) the workers bring their own cores.


# %%
def median_of(events: list[dict], key: str) -> float:
    return statistics.median(e[key] for e in events if e["event"] == "step" and e["step"] > 1)


bars = [
    Bar(f"{n} worker{'s' if n != 1 else ''}", {k: median_of(ev, k) for k in ("comm_s", "conv_s", "comp_s")})
    for n, ev in runs.items()
]
for bar in bars:
    print(f"{bar.label:10s}", {k: round(v, 4) for k, v in bar.parts.items()})
show(
    stacked_bars(
        f"The median training step of {arch}, batch 32, on one machine",
        "seconds",
        [Group("ZeroMQ workers on this machine", bars)],
        [("comm_s", "comm", "#d62728"), ("conv_s", "conv", "#1f77b4"), ("comp_s", "comp", "#2ca02c")],
    ),
    "lesson6_split.svg",
)
last = [e for e in runs[max(runs)] if e["event"] == "step"][-1]
print(
    "bytes one step moved:",
    {k: last[k] for k in ("bytes_sent", "bytes_recv")},
    "per participant sent:",
    dict(zip(last["participants"], last["participant_bytes_sent"], strict=True)),
)

# %% [markdown]
# ## 3. The same from the shell
#
#     python examples/cifar10_dist.py --dataset synthetic --steps 20 --transport zmq --workers 2 \
#         --metrics-out two.jsonl
#     python examples/cifar10_dist.py --dataset synthetic --steps 20 --workers 0 --metrics-out solo.jsonl
#     tinyconv plot solo.jsonl two.jsonl -o plots/      # curves.svg, split.svg, speedup.svg
#
# ## 4. On two machines
#
# Every machine gets a CURVE key pair; the master accepts only the workers whose public keys it
# holds, and every message is encrypted. On the master (address 192.168.1.20, say):
#
#     tinyconv keygen keys/ --name master            # keys/master.key (public), keys/master.key_secret
#     # copy each worker's public key into workers/, and keys/master.key to every worker
#     python examples/cifar10_dist.py --transport zmq --workers 1 --external-workers \
#         --key keys/master.key_secret --authorized-keys workers/ --metrics-out lan.jsonl
#
# It prints the command for each worker machine; there:
#
#     tinyconv keygen keys/ --name laptop1
#     tinyconv worker --connect tcp://192.168.1.20:5555 --key keys/laptop1.key_secret --master-key master.key
#
# Open TCP port 5555 on the master to the lab's network only. Compare `lan.jsonl`'s comm with the
# one-machine run's: the same bytes, now over the real link. `docs/teaching.md` has a whole lab.
# From Python the same is `tc.distribute(net, "zmq", workers=1, external=True, key=...,
# authorized_keys=...)`.
#
# ## Exercises
#
# 1. `split_fractions(step)`: a `step` event's comm, conv and comp as fractions of their sum.
# 2. `link_seconds(nbytes, mb_per_s, latency_s=0.0, messages=1)`: how long a link of `mb_per_s`
#    MB/s (10^6 bytes) with a latency per message takes to carry `nbytes` in `messages` messages.
# 3. `imbalance(participant_conv_s)`: how far the slowest participant lags the mean,
#    (max − mean) / mean — the number tinyconv's rebalancer compares with its 10 % threshold.
#    Participants that computed nothing (0 s) are left out.
#
# Grade: `pytest course/ --student-dir YOUR_FOLDER -k lesson6`.


# %% tags=["exercise"]
def split_fractions(step: dict) -> dict[str, float]:
    """{"comm": ..., "conv": ..., "comp": ...}: each of the step's comm_s, conv_s, comp_s over their sum."""
    # BEGIN SOLUTION
    # TODO: each part over the whole the three make
    total = step["comm_s"] + step["conv_s"] + step["comp_s"]
    return {k: step[f"{k}_s"] / total for k in ("comm", "conv", "comp")}
    # END SOLUTION


def link_seconds(nbytes: int, mb_per_s: float, latency_s: float = 0.0, messages: int = 1) -> float:
    """Seconds to move nbytes at mb_per_s (10^6 bytes/s), with latency_s per message."""
    # BEGIN SOLUTION
    # TODO: bytes over bytes per second, plus one latency per message
    return nbytes / (mb_per_s * 1e6) + messages * latency_s
    # END SOLUTION


def imbalance(participant_conv_s: list[float]) -> float:
    """(max - mean) / mean of the participants' compute times, leaving out those at 0."""
    # BEGIN SOLUTION
    # TODO: leave out the idle; how far the slowest is above the mean, as a fraction of the mean
    busy = [t for t in participant_conv_s if t > 0]
    mean = sum(busy) / len(busy)
    return (max(busy) - mean) / mean
    # END SOLUTION


# %% [markdown]
# ### Try them on your runs: what would the paper's 5 MB/s Wi-Fi have cost?

# %%
print("fractions of the last step:", {k: round(v, 3) for k, v in split_fractions(last).items()})
moved = last["bytes_sent"] + last["bytes_recv"]
for rate in (5, 100, 1000):
    seconds = link_seconds(moved, rate, 0.002, 4 * len(last["shares"]))  # 4 messages per layer, 2 ms each
    print(f"{moved / 1e6:.1f} MB a step over {rate:4d} MB/s: {seconds:.3f} s")
print("imbalance of the last step's conv compute:", round(imbalance(last["participant_conv_s"]), 3))

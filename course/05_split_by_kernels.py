# %% [markdown]
# # Lesson 5 — Splitting a convolution by kernels: the paper's eq. 1
#
# **Time:** about 30 minutes. **Needs:** one machine (the workers are threads).
#
# The paper's idea (Marques, Falcão & Alexandre 2017): every participant gets the **same input**
# and a **different slice of the kernels**; each computes the output maps of its own kernels, and
# the master stacks them. A faster device gets more kernels, in proportion to its speed — eq. 1.
# You will
#
# 1. check that a convolution split by kernels is the same convolution,
# 2. compute eq. 1's shares, and round them to whole kernels,
# 3. run the split over tinyconv's in-process transport, with one worker made 3x slower, and
#    watch its share and its step times,
# 4. and write eq. 1, the rounding and the split yourself.

# %% tags=["setup"]
import math
import os
from fractions import Fraction

# One BLAS thread per participant: the participants already run side by side, and each one's BLAS
# starting a thread per core on top oversubscribes the cores (lesson 5 ran 35 s instead of 5 s so).
# It must be set before numpy loads: in a notebook, restart the kernel before running this cell.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from charts import QUICK, show  # noqa: E402 -- beside the lessons: their size, their charts

import tinyconv as tc  # noqa: E402

be = tc.get_backend("numpy")

# %%
from tinyconv.distributed.protocol import VERSION  # noqa: E402
from tinyconv.distributed.shard.balance import apportion, speed_weights  # noqa: E402
from tinyconv.distributed.worker.handler import Worker  # noqa: E402
from tinyconv.lab.plot.lines import Panel, Series, line_chart  # noqa: E402
from tinyconv.lab.plot.svg import colors  # noqa: E402

# %% [markdown]
# ## 1. Why the split is exact
#
# Output channel $f$ of a convolution reads all of the input and only kernel $f$:
# $y[:, f] = b_f + \sum_c w[f, c] \star x[:, c]$. So the kernels `w[a:b]` give exactly the output
# channels `y[:, a:b]`, and stacking the slices gives $y$. The backward splits the same way:
# each participant's `dw`, `db` are those of its kernels, and `dx` is the **sum** of the partial
# `dx` of every slice (every kernel reads all of `x`), which the master adds up.

# %%
rng = np.random.default_rng(0)
x = rng.standard_normal((2, 8, 12, 12)).astype(np.float32)
w = rng.standard_normal((10, 8, 5, 5)).astype(np.float32)
b = rng.standard_normal(10).astype(np.float32)
y, _ = be.conv2d_forward(x, w, b, 1, 2)
pieces = [be.conv2d_forward(x, w[a:z], b[a:z], 1, 2)[0] for a, z in [(0, 6), (6, 9), (9, 10)]]
print("stacked slices vs the whole convolution, max |difference|:", np.abs(np.concatenate(pieces, axis=1) - y).max())

# %% [markdown]
# ## 2. Eq. 1, and whole kernels
#
# Each participant $i$ is timed on the layer (its $t_i$, forward and backward); its weight is
#
# $$w_i = \frac{\max_j t_j / t_i}{\sum_k \max_j t_j / t_k}, \qquad \text{i.e. } w_i \propto 1/t_i.$$
#
# $F w_i$ kernels is rarely a whole number. Rounding each can miss $F$ by a few; the
# *largest-remainder* method (Hamilton's) gives each $\lfloor F w_i \rfloor$, then the kernels left
# over one each to the largest fractional parts — the counts add up to $F$ exactly.
# tinyconv's `speed_weights` and `apportion` (`tinyconv/distributed/shard/balance.py`) do this:

# %%
for times in ([1.0, 2.0, 4.0], [1.0, 1.0, 3.0], [0.2, 0.25, 0.3, 0.9]):
    weights = speed_weights(times)
    print(
        f"times {times} -> weights {[round(v, 3) for v in weights]} -> of 32 kernels {apportion(weights, 32)}"
        f"  (rounded one by one: {[round(32 * v) for v in weights]})"
    )

# %% [markdown]
# ## 3. The split over the in-process transport
#
# Three workers as threads of this process (the `inproc` transport; lesson 6 makes them processes
# talking ZeroMQ), one made 3x slower with `slowdown=3` (it waits twice its compute time after each
# task: a slower device, emulated). `cluster.calibrate` times every participant on the layer's own
# shape, one at a time, and splits by eq. 1; then each step's shares and compute times are in
# `cluster.last_step`. As in the paper, the split then stays: `rebalance=False`. (tinyconv's
# rebalancer, on in the main job, moves kernels when the measured step times say the split is off;
# here the four participants are threads sharing this machine's cores, so their step times mostly
# measure that sharing, and it would chase noise.)

# %%
batch, c_in, kernels, size, steps = (8, 16, 48, 12, 6) if QUICK else (16, 32, 96, 16, 15)
conv = tc.Conv2D(be, c_in, kernels, 5, padding=2, rng=np.random.default_rng(0))
net = tc.Network(be, [conv])  # one layer: just this convolution
x = rng.standard_normal((batch, c_in, size, size)).astype(np.float32)
dy = rng.standard_normal((batch, kernels, size, size)).astype(np.float32)
y_ref, dx_ref = conv.forward(x), conv.backward(dy)

slowdowns = [1.0, 1.0, 3.0]
make = lambda i: Worker(tc.get_backend("numpy"), slowdown=slowdowns[i])  # noqa: E731
history = []
with tc.get_transport("inproc", handler_factory=make, protocol=VERSION) as transport:
    workers = transport.start(len(slowdowns), timeout=30)
    cluster = tc.Cluster(transport, workers, be, split="kernels", rebalance=False)  # the paper's fixed split
    calibration = cluster.calibrate(net, batch_size=batch, image_size=size)
    block = net.layers[0]
    print("participants:", cluster.participants, "(worker2 is 3x slower)")
    print(
        "calibrated s:",
        [round(t, 4) for t in calibration["times"][block.name]],
        "-> eq. 1 kernels:",
        calibration["shares"][block.name],
    )
    for _ in range(steps):
        y_split, dx_split = block.forward(x), block.backward(dy)
        history.append(cluster.last_step)
    names = cluster.participants
print("final kernels:", history[-1]["shares"][block.name])
print(
    f"max |y difference| {np.abs(y_split - y_ref).max():.1e}, max |dx difference| {np.abs(dx_split - dx_ref).max():.1e}"
)
kernels_series = [
    Series(n, [(s, h["shares"][block.name][i]) for s, h in enumerate(history)], c)
    for i, (n, c) in enumerate(zip(names, colors(len(names)), strict=True))
]
time_series = [
    Series(n, [(s, h["participant_conv_s"][i] * 1e3) for s, h in enumerate(history)], c)
    for i, (n, c) in enumerate(zip(names, colors(len(names)), strict=True))
]
show(
    line_chart(
        "One convolution split by kernels by eq. 1, one worker 3x slower",
        [
            Panel(kernels_series, "step", "kernels", xinteger=True),
            Panel(time_series, "step", "compute ms (forward + backward)", xinteger=True),
        ],
    ),
    "lesson5_split.svg",
)

# %% [markdown]
# Read the chart: the slow worker has about a third of a fast worker's kernels (eq. 1 on its
# measured time). Eq. 1 aims to make every participant finish together, since the layer ends when
# the *last* one does. Is the slow worker's time close to the others'? Usually it is still the
# longest: each participant also repeats work that does not shrink with its share (the im2col of
# the whole input, the col2im of the whole dX), and the slow worker repeats it 3x slower. Eq. 1
# assumes time proportional to kernels; `tinyconv/distributed/cost.py` fits a fixed part beside it, and
# the rebalancer uses that fit. (Exercise for the keen: fit $t = a + b k$ to these numbers.)
#
# ## Exercises
#
# 1. `eq1_weights(times)`: eq. 1 (above). A clear `ValueError` for an empty list or a time that is
#    not a positive finite number.
# 2. `largest_remainder(weights, total)`: whole counts summing to `total`: each its floor of
#    `total * w_i / sum(w)`, the rest one each to the largest fractional parts (ties to the lower
#    index). Use `fractions.Fraction` so float noise cannot break a tie.
# 3. `conv_by_kernels(x, w, b, counts, stride, padding)`: the convolution as the participants
#    compute it: slices of `counts[i]` kernels in order, each convolved with `be.conv2d_forward`, the
#    outputs stacked along the channels. (A participant with 0 kernels computes nothing.)
#
# Grade: `pytest course/ --student-dir YOUR_FOLDER -k lesson5`.


# %% tags=["exercise"]
def eq1_weights(times: list[float]) -> list[float]:
    """Eq. 1: w_i = (max t / t_i) / sum_j (max t / t_j), from each participant's seconds."""
    # BEGIN SOLUTION
    # TODO: refuse bad times first; then eq. 1: each weight inversely proportional to its time, all summing to 1
    if not times:
        raise ValueError("eq1_weights needs at least one time")
    for i, t in enumerate(times):
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"time {i} is {t!r}: every time must be a finite number of seconds > 0")
    ratios = [max(times) / t for t in times]
    return [r / sum(ratios) for r in ratios]
    # END SOLUTION


def largest_remainder(weights: list[float], total: int) -> list[int]:
    """Whole counts in proportion to weights, summing to total (Hamilton's method)."""
    # BEGIN SOLUTION
    # TODO: exact quotas (Fractions), whole parts first, then what is left one by one by the largest remainders
    exact = [Fraction(v) for v in weights]
    quotas = [total * v / sum(exact) for v in exact]
    counts = [math.floor(q) for q in quotas]
    for i in sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))[: total - sum(counts)]:
        counts[i] += 1
    return counts
    # END SOLUTION


def conv_by_kernels(
    x: np.ndarray, w: np.ndarray, b: np.ndarray, counts: list[int], stride: int = 1, padding: int = 0
) -> np.ndarray:
    """The convolution of x by w, b computed slice by slice of counts[i] kernels, stacked."""
    # BEGIN SOLUTION
    # TODO: walk the counts with a running start; conv each non-empty slice w[start:stop]; concatenate on axis 1
    outs, start = [], 0
    for c in counts:
        if c:
            outs.append(be.conv2d_forward(x, w[start : start + c], b[start : start + c], stride, padding)[0])
        start += c
    return np.concatenate(outs, axis=1)
    # END SOLUTION


# %% [markdown]
# ### Try them

# %%
print(
    "eq. 1 on 1, 2, 4 s:",
    [round(v, 3) for v in eq1_weights([1.0, 2.0, 4.0])],
    "-> of 32 kernels:",
    largest_remainder(eq1_weights([1.0, 2.0, 4.0]), 32),
)
w_all, b_all = conv.params["w"], conv.params["b"]
counts = [5, 0, kernels - 5]  # three participants, the second sitting out
mine = conv_by_kernels(x[:2], w_all, b_all, counts, 1, 2)
print("split by", counts, "== whole:", np.allclose(mine, be.conv2d_forward(x[:2], w_all, b_all, 1, 2)[0], atol=1e-5))

"""Grades lesson 7 against tinyconv.lab.eq2's eq. 2 on the paper's networks, hand-made cases, and the bytes that
real data-parallel and hybrid steps move (tinyconv's runtime, in-process workers)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tinyconv as tc
from tinyconv.distributed.replica import flat
from tinyconv.distributed.replica.batch import UNIT
from tinyconv.distributed.replica.conv_part import conv_part, feature_shape
from tinyconv.lab.eq2 import F32, conv_shapes, eq2_bytes, equal_counts

LESSON = "07_data_vs_model_parallelism"


@pytest.mark.parametrize("arch,batch,participants", [("50:500", 64, 2), ("50:500", 16, 4), ("8:16", 3, 3)])
def test_eq2_equals_tinyconvs(lesson, arch, batch, participants):
    convs = conv_shapes(tc.paper_net(arch, backend="numpy"), batch)
    counts = equal_counts(convs, participants)
    assert lesson.eq2(convs, counts) == eq2_bytes(convs, counts)
    assert lesson.eq2(convs, counts, word=F32) == eq2_bytes(convs, counts, F32)


def test_eq2_counts_the_input_once_per_worker_with_kernels(lesson):
    convs = conv_shapes(tc.paper_net("8:16", backend="numpy"), 2)
    uneven = [[8, 0, 0], [4, 0, 12]]  # conv1 all on the master: nothing moves for it
    assert lesson.eq2(convs, uneven) == eq2_bytes(convs, uneven)
    assert lesson.eq2(convs, [[8], [16]]) == 0  # the master alone


def test_data_parallel_bytes(lesson):
    # docs/how-it-works.md: 4 (2 P + n_i (C H W + classes)) + 8 n_i
    assert lesson.data_parallel_bytes(949_310, 32, 3 * 32 * 32, 10) == 4 * (2 * 949_310 + 32 * 3082) + 256
    assert lesson.data_parallel_bytes(10, 0, 12, 3) == 80
    assert lesson.data_parallel_bytes(0, 1, 1, 1) == 16


def test_hybrid_bytes(lesson):
    # docs/how-it-works.md: 4 (2 P_conv + n_i (C H W + 2 F)); the labels stay on the master
    assert lesson.hybrid_bytes(629_300, 32, 3 * 32 * 32, 32_000) == 4 * (2 * 629_300 + 32 * (3072 + 64_000))
    assert lesson.hybrid_bytes(10, 0, 12, 5) == 80  # the weights out, the gradient back
    assert lesson.hybrid_bytes(0, 1, 1, 1) == 12


def real_step(parallel: str, arch: str, size: int, shares: list[int]) -> tuple[tc.Network, list[int]]:
    """One step of ``parallel`` ("data" or "hybrid") with the master and len(shares) - 1 in-process workers on
    ``shares`` images each: the network and the bytes each worker's messages carried, both ways together."""
    net = tc.paper_net(arch, backend="numpy", image_size=size, seed=1)
    rng = np.random.default_rng(sum(shares))
    x = rng.standard_normal((sum(shares), 3, size, size), dtype=np.float32)
    y = rng.integers(0, 10, sum(shares))
    with tc.distribute(net, "inproc", len(shares) - 1, parallel=parallel, calibrate=False, rebalance=False,
                       batch_size=len(x), image_size=size, announce=lambda _: None) as runtime:  # fmt: skip
        runtime.set_plan(UNIT, shares)
        runtime.train_batch(net, x, y)
        step = runtime.last_step
    assert step["shares"] == {UNIT: shares}
    sent, recv = step["participant_bytes_sent"][1:], step["participant_bytes_recv"][1:]
    return net, [s + r for s, r in zip(sent, recv, strict=True)]


# uneven slices, an idle worker, other image sizes: the formulas must hold for what really crossed the wire
CASES = [("6:10", 16, [2, 5, 0]), ("8:16", 32, [1, 4, 3]), ("4:6", 8, [3, 1])]


@pytest.mark.parametrize("arch,size,shares", CASES)
def test_data_parallel_bytes_equal_what_a_real_step_moves(lesson, arch, size, shares):
    net, moved = real_step("data", arch, size, shares)
    params = sum(flat.sizes(net))
    assert [lesson.data_parallel_bytes(params, n, 3 * size * size, 10) if n else 0 for n in shares[1:]] == moved


@pytest.mark.parametrize("arch,size,shares", CASES)
def test_hybrid_bytes_equal_what_a_real_step_moves(lesson, arch, size, shares):
    net, moved = real_step("hybrid", arch, size, shares)
    p_conv, f = sum(flat.sizes(conv_part(net))), math.prod(feature_shape(net, size))
    assert [lesson.hybrid_bytes(p_conv, n, 3 * size * size, f) if n else 0 for n in shares[1:]] == moved


def test_break_even_batch(lesson):
    assert lesson.break_even_batch(lambda b: 100 + 10 * b, 1000) == 90
    assert lesson.break_even_batch(lambda b: 5000, 1000) == 1
    assert lesson.break_even_batch(lambda b: b, 10**9, largest=64) is None

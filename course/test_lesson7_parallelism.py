"""Grades lesson 7 against tinyconv.lab.eq2's eq. 2 on the paper's networks, and hand-made cases."""

from __future__ import annotations

import pytest

import tinyconv as tc
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


def test_break_even_batch(lesson):
    assert lesson.break_even_batch(lambda b: 100 + 10 * b, 1000) == 90
    assert lesson.break_even_batch(lambda b: 5000, 1000) == 1
    assert lesson.break_even_batch(lambda b: b, 10**9, largest=64) is None

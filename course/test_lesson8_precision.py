"""Grades lesson 8: bfloat16 rounding against a reference built another way (frexp) and against tinyconv's own
wire (``--wire-precision bf16``), and the bytes against what real narrowed steps move."""

from __future__ import annotations

import numpy as np
import pytest

from tinyconv.distributed.wire_precision import narrow, widen
from tinyconv.lab.eq2 import measure

LESSON = "08_reduced_precision"


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round each (normal) float32 to 8 significant bits, ties to even: np.round is round-half-even."""
    m, e = np.frexp(x.astype(np.float64))  # x = m 2^e, 0.5 <= |m| < 1: 8 bits of m are m * 256
    return np.ldexp(np.round(m * 256) / 256, e).astype(np.float32)


def test_to_bfloat16_rounds_to_nearest(lesson):
    x = np.random.default_rng(0).standard_normal(10_000) * 10.0 ** np.random.default_rng(1).integers(-20, 20, 10_000)
    x = x.astype(np.float32)
    got = np.asarray(lesson.to_bfloat16(x))
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got, bf16_reference(x))


def test_to_bfloat16_ties_go_to_even(lesson):
    one_and_half_step = np.float32(1 + 2**-8)  # exactly between 1 and 1 + 2^-7: to 1 (even)
    three_halves_step = np.float32(1 + 3 * 2**-8)  # between 1 + 2^-7 and 1 + 2^-6: to 1 + 2^-6 (even)
    got = np.asarray(lesson.to_bfloat16(np.array([one_and_half_step, three_halves_step, -one_and_half_step])))
    np.testing.assert_array_equal(got, np.array([1.0, 1 + 2**-6, -1.0], np.float32))


def test_to_bfloat16_equals_what_the_bf16_wire_delivers(lesson):
    """Bit for bit what a worker receives under --wire-precision bf16: normal and subnormal numbers, both signs, 0."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(20_000) * 10.0 ** rng.integers(-44, 37, 20_000)
    # and exact ties: the dropped 16 bits exactly half a step, under kept bits ending in 0 and in 1, both signs
    kept, sign = rng.integers(0x0080, 0x7F00, 2_000).astype(np.uint32), rng.integers(0, 2, 2_000).astype(np.uint32)
    ties = ((sign << 31) | (kept << 16) | np.uint32(0x8000)).view(np.float32)
    x = np.concatenate([x.astype(np.float32), np.float32([0.0, -0.0, 1.0, -1.5]), ties])
    wire = widen(narrow(x, "bf16").carried, "bf16")
    np.testing.assert_array_equal(np.asarray(lesson.to_bfloat16(x)).view(np.uint32), wire.view(np.uint32))


def test_to_bfloat16_leaves_its_input_alone(lesson):
    x = np.array([1.001, 2.5, -3.3], np.float32)
    before = x.copy()
    lesson.to_bfloat16(x)
    np.testing.assert_array_equal(x, before)


@pytest.mark.parametrize(
    "approx,exact,want", [([1.0, 2.1], [1.0, 2.0], 0.05), ([0.0], [0.0], 0.0), ([[1, -3.5]], [[1, -4]], 0.125)]
)
def test_relative_error(lesson, approx, exact, want):
    assert lesson.relative_error(np.array(approx), np.array(exact)) == pytest.approx(want, rel=1e-12)


def test_wire_bytes(lesson):
    assert lesson.wire_bytes(4_000, 2) == 2_000
    assert lesson.wire_bytes(4_000, 8) == 8_000


@pytest.mark.parametrize("arch,batch,participants", [("4:6", 3, 2), ("6:10", 4, 3)])
def test_wire_bytes_gives_the_bytes_of_a_real_narrowed_step(lesson, arch, batch, participants):
    """One step of the paper's split with in-process workers, each way: bf16 and fp16 in 2 bytes, adt24 in 3."""
    fp32 = measure(arch, batch, participants, image_size=16)
    for fmt, word in (("bf16", 2), ("fp16", 2), ("adt24", 3)):
        narrowed = measure(arch, batch, participants, image_size=16, wire_precision=fmt)
        assert tuple(lesson.wire_bytes(b, word) for b in fp32) == narrowed, fmt

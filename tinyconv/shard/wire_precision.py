"""Reduced-precision words on the wire: float32 arrays narrowed to 3 or 2 bytes per number, and back.

A shard's arrays (input maps, weights, feature maps, gradients) are float32, 4 bytes a number.
Most of those bits are mantissa the training does not need to *see* on the way: the master keeps
every weight in float32 and all arithmetic runs in float32; only the transfer is narrowed (right
before a message is sent), and widened back to float32 right after it is validated. The formats::

    format   bytes  carried as                      kept of a float32 (sign s, exponent e, mantissa m)
    fp32     4      float32 (x)                     everything
    adt24    3      uint8 (x..., 3)                 s, e, the top 15 of m's 23 bits (ADT's 24-bit word)
    bf16     2      uint16 (x)                      s, e, the top 7 bits of m (bfloat16)
    fp16     2      float16 (x)                     IEEE half: s, 5-bit e, 10-bit m; |x| <= 65504

adt24 and bf16 are a float32 with its low 1 or 2 bytes dropped (Zhuang, Malossi and Casas's ADT
packs words this way), rounded to nearest, ties to even (RNE), not truncated: the error is half a
unit in the last kept place, and unbiased. Round-trip error bounds, for a finite float32 x that
stays finite (``widen(narrow(x))`` = x'):

    fp32    x' = x
    adt24   |x' - x| <= 2^-16 |x|   for normal x (|x| >= 2^-126); <= 2^-142 absolute for subnormals
    bf16    |x' - x| <= 2^-8  |x|   for normal x;                   <= 2^-134 absolute for subnormals
    fp16    |x' - x| <= 2^-11 |x|   for 2^-14 <= |x| <= 65504;      <= 2^-25 absolute below 2^-14
            (fp16's subnormals end at 2^-24: smaller numbers become +-0)

+-0, +-inf and NaN travel as themselves in every format (a NaN stays a NaN, its payload may not).

**Safety.** Narrowing must never *make* a number non-finite: fp16 overflows above 65504, and
bf16 / adt24 round the very largest float32s (within half a unit of 2^128) up to infinity.
:func:`narrow` checks, and when any finite number would become inf it sends that array in fp32
instead and says so (the caller counts these fallbacks in the step's metrics). A NaN or an
infinity already in the float32 data is not narrowing's doing: it travels narrowed like any
other number, so the master's check on workers that answer finite inputs with NaN still works.

ADT's 8-bit word (the top byte: the sign and 7 of the 8 exponent bits, no mantissa) is not
offered: every number becomes a power of 4 -- truncated, the relative error on 10^6 N(0, 1)
numbers had a median of 52 % and a maximum of 75 % (rounded to nearest: 34 %, up to 100 %) --
which no map, weight or gradient survives.

Everything here is vectorised numpy on whole arrays: a handful of passes over the data.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# format -> bytes per number on the wire
WORD_BYTES: dict[str, int] = {"fp32": 4, "adt24": 3, "bf16": 2, "fp16": 2}
FORMATS = tuple(WORD_BYTES)
# format -> (the wire dtype it is carried as, the trailing axis it adds)
CARRIER: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
    "fp32": (np.dtype("<f4"), ()),
    "adt24": (np.dtype("u1"), (3,)),
    "bf16": (np.dtype("<u2"), ()),
    "fp16": (np.dtype("<f2"), ()),
}
# the bound on |x' - x| / |x| for a normal x, stated above and checked by the tests
RELATIVE_ERROR: dict[str, float] = {"fp32": 0.0, "adt24": 2.0**-16, "bf16": 2.0**-8, "fp16": 2.0**-11}

_EXPONENT = np.uint32(0x7F800000)
_MANTISSA = np.uint32(0x007FFFFF)


class Narrowed(NamedTuple):
    """One array as it goes on the wire: ``carried`` in ``fmt`` ("fp32" when it fell back)."""

    carried: np.ndarray
    fmt: str
    fell_back: bool  # a narrower format was asked for, but it would have made finite numbers inf


def check_format(fmt: object) -> str:
    """``fmt`` if it is a known format, else a ValueError naming them."""
    if not isinstance(fmt, str) or fmt not in WORD_BYTES:
        raise ValueError(f"unknown wire format {fmt!r}; the formats are {', '.join(FORMATS)}")
    return fmt


def carried_shape(shape: tuple[int, ...], fmt: str) -> tuple[int, ...]:
    """The shape an array of ``shape`` float32 numbers has on the wire in ``fmt``."""
    return (*shape, *CARRIER[fmt][1])


def check_carried(fmt: object, a: np.ndarray) -> None:
    """Raise ValueError unless ``a`` is a well-formed carrier of ``fmt``: its dtype, and for adt24 a
    trailing axis of 3 bytes. Checked before anything is widened (or allocated)."""
    fmt = check_format(fmt)
    dtype, extra = CARRIER[fmt]
    if a.dtype != dtype:
        raise ValueError(f"declared {fmt}, which travels as {dtype.name}, but the array is {a.dtype}")
    if extra and (a.ndim == 0 or a.shape[-1:] != extra):
        raise ValueError(f"declared {fmt}, which travels as uint8 with a last axis of 3 bytes, but the shape "
                         f"is {tuple(a.shape)}")  # fmt: skip


def _rne_drop(bits: np.ndarray, drop: int) -> np.ndarray:
    """float32 bit patterns (uint32) -> their top 32 - ``drop`` bits, rounded to nearest, ties to even.

    Adding 2^(drop-1) - 1, plus the lowest kept bit, then shifting, rounds the dropped part: above
    half a unit up, below down, exactly half towards the even kept value. A carry out of the mantissa
    correctly bumps the exponent (up to inf, which :func:`narrow` catches). NaNs are set apart first:
    rounding could carry a NaN's low payload bits away and leave an infinity."""
    keep = (bits >> np.uint32(drop)) & np.uint32(1)
    rounded = (bits + (np.uint32((1 << (drop - 1)) - 1) + keep)) >> np.uint32(drop)
    nan = ((bits & _EXPONENT) == _EXPONENT) & ((bits & _MANTISSA) != 0)
    if nan.any():  # a quiet NaN of the same sign: the top mantissa bit kept set
        quiet = (bits >> np.uint32(drop)) | np.uint32(1 << (22 - drop))
        rounded = np.where(nan, quiet, rounded)
    return rounded


def _infinite_bits(rounded: np.ndarray, drop: int) -> np.ndarray:
    """Where narrowed bit patterns (float32's top bits) are +-inf or NaN: the exponent all ones."""
    exponent = _EXPONENT >> np.uint32(drop)
    return (rounded & exponent) == exponent


def narrow(x: np.ndarray, fmt: str) -> Narrowed:
    """x (any shape, float32) -> how it travels in ``fmt``: a new C-contiguous array of the carrier
    dtype (``carried_shape``), or x itself for fp32 -- or in fp32, if ``fmt`` would turn one of x's
    finite numbers into an infinity (fp16 above 65504; the largest float32s in bf16 and adt24)."""
    check_format(fmt)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if fmt == "fp32" or x.size == 0:
        return Narrowed(x, "fp32", False) if fmt == "fp32" else Narrowed(_empty(x.shape, fmt), fmt, False)
    if fmt == "fp16":
        with np.errstate(over="ignore"):  # overflow is checked just below
            carried = x.astype(np.float16)  # numpy rounds to nearest, ties to even
        overflow = ~np.isfinite(carried)
    else:
        drop = 16 if fmt == "bf16" else 8
        rounded = _rne_drop(x.view(np.uint32), drop)
        overflow = _infinite_bits(rounded, drop)
        if fmt == "bf16":
            carried = rounded.astype(np.uint16)
        else:  # the low 3 bytes of the little-endian uint32: float32's top 3
            carried = np.ascontiguousarray(rounded.astype("<u4").view(np.uint8).reshape(*x.shape, 4)[..., :3])
    if overflow.any() and (overflow & np.isfinite(x)).any():  # finite numbers made infinite: not here
        return Narrowed(x, "fp32", True)
    return Narrowed(carried, fmt, False)


def widen(carried: np.ndarray, fmt: str) -> np.ndarray:
    """An array as it came off the wire in ``fmt`` -> float32 (a new array; fp32: ``carried`` itself).
    ``carried`` must have passed :func:`check_carried`."""
    check_format(fmt)
    if fmt == "fp32":
        return carried
    if fmt == "fp16":
        return carried.astype(np.float32)
    if fmt == "bf16":
        return (carried.astype(np.uint32) << np.uint32(16)).view(np.float32)
    shape = carried.shape[:-1]
    word = np.zeros((*shape, 4), np.uint8)  # a zero low byte, then the three that came
    word[..., 1:] = carried
    return word.view("<f4").reshape(shape)


def _empty(shape: tuple[int, ...], fmt: str) -> np.ndarray:
    dtype, extra = CARRIER[fmt]
    return np.empty((*shape, *extra), dtype)


def nbytes(n: int, fmt: str) -> int:
    """Bytes ``n`` numbers take on the wire in ``fmt``."""
    return n * WORD_BYTES[fmt]

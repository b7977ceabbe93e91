"""Reduced-precision words on the wire: float32 arrays narrowed to 3, 2 or 1 bytes per number, and back.

Only the transfer is narrowed: every weight stays float32 on the master and all arithmetic runs in float32
(``wire_codec.py`` applies these formats to messages). The formats, their error bounds and s8's layout (an int8
per number and a float32 scale per (H, W) plane): docs/how-it-works.md, "Narrower words on the wire".

**Safety.** Narrowing must never *make* a number non-finite: fp16 overflows above 65504, bf16 and adt24 round
the very largest float32s up to infinity, and a plane holding an inf or NaN has no s8 scale. :func:`narrow`
then sends that array in fp32 and says so (a *fallback*). A NaN or an infinity already in the data travels like
any other number, so the master's check on workers that answer finite inputs with NaN still works.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

# format -> bytes per number on the wire (s8 adds SCALE_BYTES per plane: see nbytes_of)
WORD_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "adt24": 3, "s8": 1}
FORMATS = tuple(WORD_BYTES)
SCALE_BYTES = 4  # s8's float32 scale, ahead of each plane's values
# format -> (the wire dtype it is carried as, the trailing axis it adds); s8 reshapes instead (carried_shape)
CARRIER: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
    "fp32": (np.dtype("<f4"), ()),
    "adt24": (np.dtype("u1"), (3,)),
    "bf16": (np.dtype("<u2"), ()),
    "fp16": (np.dtype("<f2"), ()),
    "s8": (np.dtype("u1"), ()),
}
# the bound on |x' - x| / |x| for a normal x (docs/how-it-works.md), checked by the tests (s8's is absolute: S8_STEPS)
RELATIVE_ERROR: dict[str, float] = {"fp32": 0.0, "adt24": 2.0**-16, "bf16": 2.0**-8, "fp16": 2.0**-11}
S8_STEPS = 127  # s8's largest |q|: a plane's largest magnitude is 127 steps of its scale

_EXPONENT = np.uint32(0x7F800000)
_MANTISSA = np.uint32(0x007FFFFF)


# what a message's header declares of one narrowed array: its format, and for s8 also its plane
Declared = str | list


class Narrowed(NamedTuple):
    """One array as it goes on the wire: ``carried`` in ``fmt`` ("fp32" when it fell back), and
    ``declared``, what the header's ``narrow`` says of it (``fmt``; for s8 ``["s8", *plane]``)."""

    carried: np.ndarray
    fmt: str
    fell_back: bool  # a narrower format was asked for, but it could not carry the array (overflow; s8: inf, NaN)
    declared: Declared = "fp32"


def check_format(fmt: object) -> str:
    """``fmt`` if it is a known format, else a ValueError naming them."""
    if not isinstance(fmt, str) or fmt not in WORD_BYTES:
        raise ValueError(f"unknown wire format {fmt!r}; the formats are {', '.join(FORMATS)}")
    return fmt


def plane_of(shape: tuple[int, ...]) -> tuple[int, ...]:
    """s8's plane of an array of ``shape``: its last two axes with 3 or more, else the whole shape."""
    return tuple(shape[-2:]) if len(shape) >= 3 else tuple(shape)


def declare(fmt: str, shape: tuple[int, ...]) -> Declared:
    """What a header declares for an array of ``shape`` narrowed to ``fmt``: ``fmt``, or for s8
    ``["s8", *plane]`` (its carrier does not say how the plane's numbers were laid out)."""
    return ["s8", *plane_of(shape)] if check_format(fmt) == "s8" else fmt


def check_declared(declared: object) -> tuple[str, tuple[int, ...] | None]:
    """A header's declaration of one array -> (its format, its s8 plane or None); else a ValueError
    saying what a declaration looks like."""
    if isinstance(declared, list) and declared and declared[0] == "s8":
        plane = declared[1:]
        if len(plane) > 2 or not all(type(d) is int and d >= 0 for d in plane):
            raise ValueError(
                f"an s8 array is declared as ['s8', H, W] (its plane: up to 2 sizes >= 0), got {declared!r}"
            )
        return "s8", tuple(plane)
    if declared == "s8":
        raise ValueError("an s8 array is declared with its plane, ['s8', H, W], not 's8' alone")
    return check_format(declared), None


def carried_shape(shape: tuple[int, ...], fmt: str) -> tuple[int, ...]:
    """The shape an array of ``shape`` float32 numbers has on the wire in ``fmt``: s8's is
    (lead..., 4 + plane size) with lead = ``shape[:-2]`` for 3 or more dimensions, () otherwise."""
    if fmt == "s8":
        lead = tuple(shape[:-2]) if len(shape) >= 3 else ()
        return (*lead, SCALE_BYTES + math.prod(plane_of(shape)))
    return (*shape, *CARRIER[fmt][1])


def nbytes_of(shape: tuple[int, ...], fmt: str) -> int:
    """Bytes an array of ``shape`` takes on the wire in ``fmt``, exactly (s8: a scale per plane)."""
    return math.prod(carried_shape(shape, fmt)) * CARRIER[fmt][0].itemsize


def check_carried(declared: object, a: np.ndarray) -> None:
    """Raise ValueError unless ``a`` is a well-formed carrier of what the header ``declared``: its
    dtype; for adt24 a trailing axis of 3 bytes; for s8 a last axis of 4 + the declared plane's size
    (and a plane of 2 sizes if it has more axes) and finite scales >= 0. Checked before anything is
    widened (or allocated, but for a copy of s8's scales: 4 bytes a plane)."""
    fmt, plane = check_declared(declared)
    dtype, extra = CARRIER[fmt]
    if a.dtype != dtype:
        raise ValueError(f"declared {fmt}, which travels as {dtype.name}, but the array is {a.dtype}")
    if extra and (a.ndim == 0 or a.shape[-1:] != extra):
        raise ValueError(f"declared {fmt}, which travels as uint8 with a last axis of 3 bytes, but the shape "
                         f"is {tuple(a.shape)}")  # fmt: skip
    if fmt == "s8":
        assert plane is not None
        want = SCALE_BYTES + math.prod(plane)
        if a.ndim == 0 or a.shape[-1] != want or (a.ndim > 1 and len(plane) != 2):
            raise ValueError(f"declared {declared!r}, which travels as uint8 (lead..., {want}): 4 scale bytes and "
                             f"{math.prod(plane)} values a plane, but the shape is {tuple(a.shape)}")  # fmt: skip
        scales = _scales(a)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise ValueError(f"declared {declared!r}, but a plane's scale is not a finite number >= 0")


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


def narrow(x: np.ndarray, fmt: str) -> Narrowed:
    """x (any shape, float32) -> how it travels in ``fmt``: a new C-contiguous array of the carrier
    dtype (``carried_shape``), or x itself for fp32 -- or in fp32, if ``fmt`` would turn one of x's
    finite numbers into an infinity (fp16 above 65504; the largest float32s in bf16 and adt24)."""
    check_format(fmt)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if fmt == "s8":
        return _narrow_s8(x)
    if fmt == "fp32":
        return Narrowed(x, "fp32", False, "fp32")
    if fmt == "fp16":
        with np.errstate(over="ignore"):  # overflow is checked just below
            carried = x.astype(np.float16)  # numpy rounds to nearest, ties to even
        overflow = ~np.isfinite(carried)
    else:
        drop = 16 if fmt == "bf16" else 8
        rounded = _rne_drop(x.view(np.uint32), drop)
        exponent = _EXPONENT >> np.uint32(drop)
        overflow = (rounded & exponent) == exponent  # +-inf or NaN: the exponent all ones
        if fmt == "bf16":
            carried = rounded.astype(np.uint16)
        else:  # the low 3 bytes of the little-endian uint32: float32's top 3
            carried = np.ascontiguousarray(rounded.astype("<u4").view(np.uint8).reshape(*x.shape, 4)[..., :3])
    if overflow.any() and (overflow & np.isfinite(x)).any():  # finite numbers made infinite: not here
        return Narrowed(x, "fp32", True, "fp32")
    return Narrowed(carried, fmt, False, fmt)


def _narrow_s8(x: np.ndarray) -> Narrowed:
    """x (float32, C-contiguous) -> s8: per plane a scale and int8 multiples of it (docs/how-it-works.md)."""
    lead = carried_shape(x.shape, "s8")[:-1]
    planes = x.reshape(*lead, math.prod(plane_of(x.shape)))  # (lead..., plane size): each row one plane
    m = np.abs(planes).max(axis=-1, keepdims=True, initial=np.float32(0))  # NaN propagates
    if not np.isfinite(m).all():  # an inf or NaN has no scale: the whole array goes fp32
        return Narrowed(x, "fp32", True, "fp32")
    scale = (m / np.float32(S8_STEPS)).astype(np.float32)
    low = scale.astype(np.float64) * S8_STEPS < m  # rounded below m / 127 (subnormals): one ulp up, so |q| <= 127
    scale = np.where(low, np.nextafter(scale, np.float32(np.inf)), scale)
    with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0 in a zero plane: set to 0 just below
        q = np.rint(planes.astype(np.float64) / scale)  # float64: exact enough that ties are true ties
    q = np.where(scale > 0, q, 0.0).astype(np.int8)
    carried = np.empty((*lead, SCALE_BYTES + planes.shape[-1]), np.uint8)
    carried[..., :SCALE_BYTES] = scale.astype("<f4").view(np.uint8)
    carried[..., SCALE_BYTES:] = q.view(np.uint8)
    return Narrowed(carried, "s8", False, declare("s8", x.shape))


def _scales(carried: np.ndarray) -> np.ndarray:
    """An s8 carrier's scales, (lead..., 1) float32 (a small copy: 4 bytes a plane)."""
    return np.ascontiguousarray(carried[..., :SCALE_BYTES]).view("<f4")


def widen(carried: np.ndarray, declared: Declared) -> np.ndarray:
    """An array as it came off the wire, as the header ``declared`` it (its format; s8 with its plane)
    -> float32 (a new array; fp32: ``carried`` itself). ``carried`` must have passed :func:`check_carried`."""
    fmt, plane = check_declared(declared)
    if fmt == "s8":
        assert plane is not None
        q = carried[..., SCALE_BYTES:].view(np.int8)
        return (q.astype(np.float32) * _scales(carried)).reshape(*carried.shape[:-1], *plane)
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

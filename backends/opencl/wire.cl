// Wire words on the device: float32 <-> bfloat16, bit for bit as tinyconv/distributed/wire_precision.py
// narrows and widens them on the host (an optimisation: a worker that narrows its result here
// reads back 2 bytes a number instead of 4; see narrow_wire / widen_wire in backend.py).
//
// Built into the ops program after ops.cl, whose CHUNK_BOUNDS the rows twins use. Everything is
// integer arithmetic on the float32 bit patterns (the buffers are read and written as uint, never
// as float, so no NaN payload can be changed by a float load or store).

// One number, float32 bits b -> bfloat16 bits, wire_precision._rne_drop(b, 16):
//   rounded = (b + 0x7FFF + keep) >> 16,  keep = bit 16 of b (the lowest kept bit)
// rounds to nearest, ties to even (above half a unit up, below down, a tie to the even kept
// value); a carry out of the mantissa bumps the exponent, up to inf. A NaN is set apart first:
// its sign and top mantissa bits with the quiet bit (bit 6 of the 16) set, so it stays a NaN.
// Returns 1 when a finite number became infinite (the exponent all ones after rounding, not
// before): the caller then sends the array in float32, as wire_precision.narrow does.
inline int narrow_bf16_at(__global const uint* x, const int e, __global ushort* out)
{
    const uint b = x[e];
    const uint rounded = (b + (0x7FFFu + ((b >> 16) & 1u))) >> 16;  // unsigned: wraps like numpy's uint32
    const int special = (b & 0x7F800000u) == 0x7F800000u;         // inf or NaN already
    const int nan = special & ((b & 0x007FFFFFu) != 0u);
    const uint r = nan ? ((b >> 16) | 0x40u) : rounded;
    out[e] = (ushort)r;
    return ((r & 0x7F80u) == 0x7F80u) & !special;
}

// bfloat16 bits -> float32 bits: the 16 kept bits on top, zeros below (wire_precision.widen).
inline void widen_bf16_at(__global const ushort* c, const int e, __global uint* y)
{
    y[e] = (uint)c[e] << 16;
}

// x: total float32 numbers (as uint); out: total bfloat16 words; overflow: one int, 0 before,
// set to 1 if any finite number rounded to inf. Only a work-item that saw one writes it, and
// atomically, so there is no race (and no cost when, as nearly always, none does).
__kernel void narrow_bf16(__global const uint* x, const int total, __global ushort* out,
                          __global int* overflow)
{
    const int e = get_global_id(0);
    if (e < total && narrow_bf16_at(x, e, out)) atomic_or(overflow, 1);
}

__kernel void widen_bf16(__global const ushort* c, const int total, __global uint* y)
{
    const int e = get_global_id(0);
    if (e < total) widen_bf16_at(c, e, y);
}

// Row variants (CPU devices, as in ops.cl): one work-item walks a chunk; the overflow flags of
// its numbers are or-ed in a register (a select, so the loop stays vector code), written once.
__kernel void narrow_bf16_rows(__global const uint* restrict x, const int total, __global ushort* restrict out,
                               __global int* restrict overflow, const int chunk)
{
    CHUNK_BOUNDS(start, end, total, chunk);
    int over = 0;
    for (int e = start; e < end; e++) over |= narrow_bf16_at(x, e, out);
    if (over) atomic_or(overflow, 1);
}

__kernel void widen_bf16_rows(__global const ushort* restrict c, const int total, __global uint* restrict y,
                              const int chunk)
{
    CHUNK_BOUNDS(start, end, total, chunk);
    for (int e = start; e < end; e++) widen_bf16_at(c, e, y);
}

// The data layout of the GEMM-based convolution (backends/opencl/conv.py) and of the
// linear layer: im2col and im2row straight into the GEMM's B panels (gemm.cl), packing,
// transposes, and col2im. OpenCL C 1.2, float32, NCHW. Built into one program with
// ops.cl, whose header gives the conventions (one work-item per output, bounds checks,
// windows compiled in, no fused multiply-add).

#pragma OPENCL FP_CONTRACT OFF

// im2col reads x_pad[n, c, oh*s + i - pad, ow*s + j - pad] for column p = (n, oh, ow)
// and row k = (c, i, j). Splitting a flat index into (n, oh, ow) takes integer
// divisions, which cost more than the copy itself (measured: ~10x slower on PoCL),
// so each side is split once into a small table and the copy adds table entries:
//   pixel[p] = (n*C*H*W, oh*s - pad, ow*s - pad)     tap[k] = (c*H*W, i, j)
// (PoCL leaves this copy scalar: its loads of int4 do not vectorise. Planar tables
// make it vectorise -- into AVX-512 gathers, which measured no faster.)

__kernel void pixel_table(const int C, const int H, const int W, const int OH, const int OW,
                          const int stride, const int pad, const int NP, __global int4* pixel)
{
    const int p = get_global_id(0);
    if (p >= NP) return;
    const int ow = p % OW, oh = (p / OW) % OH, n = p / (OW * OH);
    pixel[p] = (int4)(n * C * H * W, oh * stride - pad, ow * stride - pad, 0);
}

__kernel void tap_table(const int H, const int W, const int kh, const int kw, const int Kdim,
                        __global int4* tap)
{
    const int k = get_global_id(0);
    if (k >= Kdim) return;
    const int j = k % kw, i = (k / kw) % kh, c = k / (kw * kh);
    tap[k] = (int4)(c * H * W, i, j, 0);
}

inline float im2col_at(__global const float* x, const int4 px, const int4 tp, const int H, const int W)
{
    const int h = px.y + tp.y, w = px.z + tp.z;
    return (h >= 0 && h < H && w >= 0 && w < W) ? x[px.x + tp.x + h * W + w] : 0.0f;
}

// cols (Kdim, NP) in the GEMM's B-panel layout (gemm.cl): panel q holds columns
// [q*NB, (q+1)*NB) as a (Kdim, NB) row-major block, zero past NP.
// global (NB, Kdim, n_panels): work-item (t, k, q) writes column p = q*NB + t of row k.
__kernel void im2col_panels(__global const float* x, __global const int4* pixel,
                            __global const int4* tap, const int H, const int W, const int NP,
                            const int Kdim, const int NB, __global float* out)
{
    const int t = get_global_id(0), k = get_global_id(1), q = get_global_id(2);
    if (t >= NB || k >= Kdim || q * NB >= NP) return;
    const int p = q * NB + t;
    out[((size_t)q * Kdim + k) * NB + t] = p < NP ? im2col_at(x, pixel[p], tap[k], H, W) : 0.0f;
}

// [cols^T | 1] (NP, Kdim + 1) in the B-panel layout: the B of [dW | db] = dY [cols^T | 1].
// Column Kdim is all ones, so the same GEMM also sums dY over (n, oh, ow): the bias
// gradient, at no cost when it falls in the panel padding. Panel q holds columns
// [q*NB, (q+1)*NB) as a (NP, NB) row-major block, zero past Kdim. global (NB, NP, n_panels).
__kernel void im2row_panels(__global const float* x, __global const int4* pixel,
                            __global const int4* tap, const int H, const int W, const int NP,
                            const int Kdim, const int NB, __global float* out)
{
    const int t = get_global_id(0), p = get_global_id(1), q = get_global_id(2);
    if (t >= NB || p >= NP || q * NB > Kdim) return;
    const int k = q * NB + t;
    float v = k == Kdim ? 1.0f : 0.0f;
    if (k < Kdim) v = im2col_at(x, pixel[p], tap[k], H, W);
    out[((size_t)q * NP + p) * NB + t] = v;
}

// A strided (K, N) matrix, B(k, n) = src[k*sk + n*sn], in the B-panel layout.
// global (NB, K, n_panels).
__kernel void pack_panels(__global const float* src, const int K, const int N, const int sk,
                          const int sn, const int NB, __global float* out)
{
    const int t = get_global_id(0), k = get_global_id(1), q = get_global_id(2);
    if (t >= NB || k >= K || q * NB >= N) return;
    const int n = q * NB + t;
    out[((size_t)q * K + k) * NB + t] = n < N ? src[k * sk + n * sn] : 0.0f;
}

// src (R, C + 1) -> its first C columns into first (R, C) and its last into last (R,).
// global (C + 1, R).
__kernel void split_last_column(__global const float* src, const int R, const int C,
                                __global float* first, __global float* last)
{
    const int c = get_global_id(0), r = get_global_id(1);
    if (c > C || r >= R) return;
    if (c < C)
        first[r * C + c] = src[r * (C + 1) + c];
    else
        last[r] = src[r * (C + 1) + c];
}

// dst (C, R) = src (R, C)^T. global (C, R).
__kernel void transpose(__global const float* src, const int R, const int C, __global float* dst)
{
    const int c = get_global_id(0), r = get_global_id(1);
    if (c < C && r < R) dst[c * R + r] = src[r * C + c];
}

#ifdef KH  // ------------------------------------------------ col2im, built per (KH, KW, STRIDE, PAD)

// Adjoint of im2col: dx[n, c, h, w] = sum of dcols[(c, i, j), (n, oh, ow)] over the
// windows that read x[n, c, h, w]. A gather, one work-item per dx element: no atomics.
// The geometry is compiled in so the tap loops unroll and divide by a constant:
// PoCL then vectorises across work-items (3x faster than with runtime loops).
// Window oh covers h when i = h + PAD - oh*STRIDE is in [0, KH); the last such oh is
// (h + PAD) / STRIDE and the others step back by one, at most ceil(KH/STRIDE) of them.
// dcols is row-major (C*KH*KW, NP). global (W, H, N*C).
__kernel void col2im(__global const float* dcols, const int C, const int H, const int W,
                     const int OH, const int OW, const int NP, const int planes, __global float* dx)
{
    const int w = get_global_id(0), h = get_global_id(1), plane = get_global_id(2);
    if (w >= W || h >= H || plane >= planes) return;
    const int c = plane % C, n = plane / C;
    const int oh_last = (h + PAD) / STRIDE, ow_last = (w + PAD) / STRIDE;
    float s = 0.0f;
    // taps in ascending (i, j), numpy's col2im summation order
#pragma unroll
    for (int ti = 0; ti < (KH + STRIDE - 1) / STRIDE; ti++) {
        const int oh = oh_last - ti, i = h + PAD - oh * STRIDE;
        if (oh < 0 || oh >= OH || i >= KH) continue;
#pragma unroll
        for (int tj = 0; tj < (KW + STRIDE - 1) / STRIDE; tj++) {
            const int ow = ow_last - tj, j = w + PAD - ow * STRIDE;
            if (ow < 0 || ow >= OW || j >= KW) continue;
            s += dcols[(size_t)((c * KH + i) * KW + j) * NP + (n * OH + oh) * OW + ow];
        }
    }
    dx[((size_t)plane * H + h) * W + w] = s;
}

// Optimisation of col2im for CPUs (conv.py picks it there), the same sums in the same order:
// one work-item per input row (h of plane (n, c)) adds the taps' terms along the row, tap by tap
// in col2im's order (ti, then tj), each a walk along a dcols row (contiguous for stride 1) that
// vectorises, into dx's row, which starts at zero: each dx element gets col2im's terms in
// col2im's order. global (H, N*C).
__kernel void col2im_rows(__global const float* restrict dcols, const int C, const int H, const int W,
                          const int OH, const int OW, const int NP, const int planes,
                          __global float* restrict dx)
{
    const int h = get_global_id(0), plane = get_global_id(1);
    if (h >= H || plane >= planes) return;
    const int n = plane / C, c = plane - n * C;
    __global float* dxr = dx + ((size_t)plane * H + h) * W;
    for (int w = 0; w < W; w++) dxr[w] = 0.0f;
    const int oh_last = (h + PAD) / STRIDE;
#pragma unroll
    for (int ti = 0; ti < (KH + STRIDE - 1) / STRIDE; ti++) {
        const int oh = oh_last - ti, i = h + PAD - oh * STRIDE;
        if (oh < 0 || oh >= OH || i >= KH) continue;  // the same for the whole row
        __global const float* d = dcols + (size_t)(c * KH + i) * KW * NP + (n * OH + oh) * OW;
#pragma unroll
        for (int tj = 0; tj < (KW + STRIDE - 1) / STRIDE; tj++) {
            if (STRIDE == 1) {  // tap j = tj, read at ow = w + PAD - j: a contiguous walk over the w it covers
                const int lo = tj - PAD > 0 ? tj - PAD : 0, end = OW + tj - PAD < W ? OW + tj - PAD : W;
                __global const float* dj = d + (size_t)tj * NP + PAD - tj;  // dj[w]: ow = w + PAD - tj
                for (int w = lo; w < end; w++) dxr[w] += dj[w];
            } else {
                for (int w = 0; w < W; w++) {
                    const int ow = (w + PAD) / STRIDE - tj, j = w + PAD - ow * STRIDE;
                    const bool in = ow >= 0 && ow < OW && j < KW;
                    const float v = d[in ? (size_t)j * NP + ow : 0];
                    dxr[w] = in ? dxr[w] + v : dxr[w];
                }
            }
        }
    }
}

// Optimisation of im2col_panels for CPUs (conv.py picks it there), the same values in the same
// places: PoCL runs the per-element kernel above as scalar code with two table lookups per
// value. Here one work-item takes a tap k = (c, i, j) over image n: output row by output row,
// the OW columns p = (n*OH + oh)*OW + ow read one input row at w = ow*STRIDE - PAD + j, and
// land in runs that end at panel edges. Within a run, the columns whose w is inside the row
// are a plain strided copy (contiguous for stride 1), which vectorises; the others are
// padding. The item of the last image zeroes the rest of the last panel. global (Kdim, N).
#define MIN_(a, b) ((a) < (b) ? (a) : (b))  // PoCL's CPU builds call min and max out of line
#define MAX_(a, b) ((a) > (b) ? (a) : (b))
__kernel void im2col_panels_rows(__global const float* restrict x, const int C, const int H, const int W,
                                 const int OH, const int OW, const int N, const int NB,
                                 __global float* restrict out)
{
    const int k = get_global_id(0), n = get_global_id(1);
    const int Kdim = C * KH * KW;
    if (k >= Kdim || n >= N) return;
    const int c = k / (KH * KW), i = k / KW - c * KH, j = k - (k / KW) * KW;
    __global const float* xp = x + (size_t)(n * C + c) * H * W;
    // columns lo .. hi - 1 of a row read inside it: 0 <= ow*STRIDE - PAD + j < W
    const int lo = MIN_((MAX_(PAD - j, 0) + STRIDE - 1) / STRIDE, OW);
    const int hi = W - 1 + PAD - j >= 0 ? MAX_(MIN_((W - 1 + PAD - j) / STRIDE + 1, OW), lo) : lo;
    const int p0 = n * OH * OW;
    int q = p0 / NB, t = p0 - q * NB;
    for (int oh = 0; oh < OH; oh++) {
        const int h = oh * STRIDE - PAD + i;
        const bool row_in = h >= 0 && h < H;
        __global const float* xr = xp + (row_in ? h : 0) * W;
        const int row_lo = row_in ? lo : OW, row_hi = row_in ? hi : OW;
        for (int ow = 0; ow < OW;) {
            const int end = ow + MIN_(NB - t, OW - ow);
            __global float* dst = out + ((size_t)q * Kdim + k) * NB + t - ow;  // dst[ow'], ow' in the run
            const int a = MIN_(MAX_(row_lo, ow), end), b = MAX_(MIN_(row_hi, end), a);
            for (int u = ow; u < a; u++) dst[u] = 0.0f;
            for (int u = a; u < b; u++) dst[u] = xr[u * STRIDE - PAD + j];
            for (int u = b; u < end; u++) dst[u] = 0.0f;
            t += end - ow;
            ow = end;
            if (t == NB) {
                t = 0;
                q++;
            }
        }
    }
    if (n == N - 1)  // past NP: zero to the end of the last panel
        for (; t > 0 && t < NB; t++) out[((size_t)q * Kdim + k) * NB + t] = 0.0f;
}

// Optimisation of im2row_panels for CPUs, the same values in the same places: one work-item
// writes panel q's block of image n, the OH*OW*NB contiguous floats of its pixels (16 KB for a
// 16x16 image and NB 16: it stays in the L1 cache), tap by tap, so each tap's source is worked
// out once, then row by row, column by column along the input row (the columns inside it a
// strided copy, the others padding). Column Kdim is the ones of [cols^T | 1], columns past it
// zero. global (n_panels, N).
__kernel void im2row_panels_rows(__global const float* restrict x, const int C, const int H, const int W,
                                 const int OH, const int OW, const int N, const int NB,
                                 __global float* restrict out)
{
    const int q = get_global_id(0), n = get_global_id(1);
    const int Kdim = C * KH * KW, NP = N * OH * OW;
    if (q * NB > Kdim || n >= N) return;
    __global float* block = out + ((size_t)q * NP + n * OH * OW) * NB;  // block[(oh*OW + ow)*NB + t]
    for (int t = 0; t < NB; t++) {
        const int k = q * NB + t;
        if (k >= Kdim) {
            for (int e = 0; e < OH * OW; e++) block[e * NB + t] = k == Kdim ? 1.0f : 0.0f;
            continue;
        }
        const int c = k / (KH * KW), i = k / KW - c * KH, j = k - (k / KW) * KW;
        __global const float* xp = x + (size_t)(n * C + c) * H * W;
        const int lo = MIN_((MAX_(PAD - j, 0) + STRIDE - 1) / STRIDE, OW);
        const int hi = W - 1 + PAD - j >= 0 ? MAX_(MIN_((W - 1 + PAD - j) / STRIDE + 1, OW), lo) : lo;
        for (int oh = 0; oh < OH; oh++) {
            __global float* dst = block + oh * OW * NB + t;  // dst[ow*NB]
            const int h = oh * STRIDE - PAD + i;
            const int row_hi = h >= 0 && h < H ? hi : lo;  // a padding row: no column inside
            __global const float* xr = xp + (h >= 0 && h < H ? h : 0) * W;
            int ow = 0;
            for (; ow < lo; ow++) dst[ow * NB] = 0.0f;
            for (; ow < row_hi; ow++) dst[ow * NB] = xr[ow * STRIDE - PAD + j];
            for (; ow < OW; ow++) dst[ow * NB] = 0.0f;
        }
    }
}
#undef MIN_
#undef MAX_

// ---- im2col and im2row 8 pixels at a time: CPUs, stride 1 or 2, OW and NB multiples of 8;
// col2im 8 dx elements at a time (col2im_lanes, at the end): stride 1, W a multiple of 8
//
// Optimisation of the two row walks above for the common shapes (the paper's layers), the same
// values in the same places; conv.py picks these when lanes_fit() says the shape allows it, the
// walks otherwise. The walks copy runs whose ends are known only at run time (panel edges, the
// padding), which PoCL compiles as short vector loops between scalar ones: 4-12 GB/s at the
// paper's shapes, where ReLU and max pool reach 13-30. Here the unit of work is a vector of
// LANES = 8 pixels of one output row, ow0 .. ow0 + 7 (8 floats: an AVX2 register; AVX-512 builds
// use half of theirs). When OW and the panel width NB are multiples of 8, each such vector lies
// in one output row and one panel, and for stride 1 a tap (c, i, j) reads it as one unaligned
// vector load, x[n, c, h, ow0 - PAD + j ..+7] with h = oh - PAD + i, whose lanes outside the
// input row are then set to zero: no per-element index arithmetic, no branch per element.
// Stride 2 loads 16 floats and keeps the even ones.
#define LANES 8
#define MAX_NB 64  // im2row_panels_lanes keeps its panel's taps in arrays of this size
// PoCL's CPU builds call vload8, vstore8 and select out of line, a call per vector (measured: no
// faster than the walks). So the kernels load and store through pointers to a float8 type whose
// alignment is lowered to a float's (allowed on a typedef), and select with the vector `?:`.
typedef float8 __attribute__((aligned(4))) float8_any;
typedef float16 __attribute__((aligned(4))) float16_any;

// The 8 floats x[row + w0 + u*STRIDE], u < 8, those whose column w0 + u*STRIDE is outside [0, W)
// zero (+0.0, as the per-element kernels write). row is the offset of an input row in x (a
// plane's offset + h*W). Lanes outside the row read the row before or after it, in one vector
// load (of LANES*STRIDE floats), then masked: inside x (size floats) everywhere but at x's first
// and last row, where each lane is clamped into the row and loaded alone.
inline __attribute__((always_inline)) float8 row_lanes(__global const float* restrict x, const int row,
                                                       const int w0, const int W, const int size)
{
    const int8 w = (int8)(w0) + (int8)(0, 1, 2, 3, 4, 5, 6, 7) * STRIDE;
    const int8 in = (w >= 0) & (w < W);  // -1 where the column is inside the row
    float8 v;
    if (row + w0 >= 0 && row + w0 <= size - LANES * STRIDE) {
#if STRIDE == 1
        v = *(__global const float8_any*)(x + row + w0);
#else  // 2 (lanes_fit)
        v = (*(__global const float16_any*)(x + row + w0)).even;
#endif
    } else {
        const int8 wc = w < 0 ? (int8)(0) : w >= W ? (int8)(W - 1) : w;
        v = (float8)(x[row + wc.s0], x[row + wc.s1], x[row + wc.s2], x[row + wc.s3],
                     x[row + wc.s4], x[row + wc.s5], x[row + wc.s6], x[row + wc.s7]);
    }
    return in ? v : (float8)(0.0f);
}

// cols in the B-panel layout, as im2col_panels: one work-item per panel q writes the panel's
// (Kdim, NB) block, a column of 8-pixel vectors at a time: for the vector at panel column u
// (image n, output row oh, columns ow0 ..), every tap k = (c, i, j) in order, one row_lanes each,
// stored at row k. Vectors past NP (the last panel's tail) are zeros. Measured against the panel's
// vectors innermost (each tap's NB values written together, whole cache lines): no better overall
// (conv2 up to 1.2x faster, conv1 at NB 16 1.15x slower), and more code. global (n_panels).
__kernel void im2col_panels_lanes(__global const float* restrict x, const int C, const int H, const int W,
                                  const int OH, const int OW, const int N, const int NB,
                                  __global float* restrict out)
{
    const int q = get_global_id(0);
    const int NP = N * OH * OW, Kdim = C * KH * KW, size = N * C * H * W;
    if (q * NB >= NP) return;
    for (int u = 0; u < NB; u += LANES) {
        __global float* dst = out + (size_t)q * Kdim * NB + u;  // tap k's 8 values at dst[k*NB]
        const int p = q * NB + u;
        if (p >= NP) {
            for (int k = 0; k < Kdim; k++) *(__global float8_any*)(dst + k * NB) = (float8)(0.0f);
            continue;
        }
        const int n = p / (OH * OW), oh = (p - n * OH * OW) / OW, ow0 = p - n * OH * OW - oh * OW;
        for (int c = 0; c < C; c++) {
            const int plane = (n * C + c) * H * W;
#pragma unroll
            for (int i = 0; i < KH; i++) {
                const int h = oh * STRIDE - PAD + i;
                const bool row_in = h >= 0 && h < H;
#pragma unroll
                for (int j = 0; j < KW; j++) {
                    *(__global float8_any*)dst =
                        row_in ? row_lanes(x, plane + h * W, ow0 * STRIDE - PAD + j, W, size) : (float8)(0.0f);
                    dst += NB;
                }
            }
        }
    }
}

// r[0..7] <- its transpose: r[e].s<u> becomes r[u].s<e>. Three rounds of shuffles of two vectors
// each (interleave single floats, then pairs, then halves), 24 in all, which LLVM turns into
// unpck/perm instructions on x86; each vector built from two others' elements is one shuffle.
inline __attribute__((always_inline)) void transpose8(float8* r)
{
    float8 a[8], b[8];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {  // rows e, e+1 interleaved: elements 0 1 4 5, then 2 3 6 7
        a[e] = (float8)(r[e].s0, r[e + 1].s0, r[e].s1, r[e + 1].s1, r[e].s4, r[e + 1].s4, r[e].s5, r[e + 1].s5);
        a[e + 1] = (float8)(r[e].s2, r[e + 1].s2, r[e].s3, r[e + 1].s3, r[e].s6, r[e + 1].s6, r[e].s7, r[e + 1].s7);
    }
#pragma unroll
    for (int e = 0; e < 8; e += 4) {  // rows e .. e+3's elements 0 (and 4), 1 (5), 2 (6), 3 (7)
        b[e] = (float8)(a[e].s01, a[e + 2].s01, a[e].s45, a[e + 2].s45);
        b[e + 1] = (float8)(a[e].s23, a[e + 2].s23, a[e].s67, a[e + 2].s67);
        b[e + 2] = (float8)(a[e + 1].s01, a[e + 3].s01, a[e + 1].s45, a[e + 3].s45);
        b[e + 3] = (float8)(a[e + 1].s23, a[e + 3].s23, a[e + 1].s67, a[e + 3].s67);
    }
#pragma unroll
    for (int e = 0; e < 4; e++) {  // rows 0-3's half and rows 4-7's
        r[e] = (float8)(b[e].lo, b[e + 4].lo);
        r[e + 4] = (float8)(b[e].hi, b[e + 4].hi);
    }
}

// [cols^T | 1] in the B-panel layout, as im2row_panels: one work-item writes panel q's block of
// image n, its OH*OW pixels' runs of NB values, vector of pixels by vector: for each group of 8
// of the panel's taps, the taps' row_lanes (as in im2col_panels_lanes) are an 8x8 tile of (tap,
// pixel), transposed in registers into 8 pixels' runs of 8 taps, each one vector store. Every
// tap's source is worked out once, into arrays. Column Kdim is ones, columns past it zero (as
// taps whose row is never inside). Measured against the tap groups outermost: ~1.3x faster.
// global (n_panels, N); NB <= MAX_NB.
__kernel void im2row_panels_lanes(__global const float* restrict x, const int C, const int H, const int W,
                                  const int OH, const int OW, const int N, const int NB,
                                  __global float* restrict out)
{
    const int q = get_global_id(0), n = get_global_id(1);
    const int Kdim = C * KH * KW, NP = N * OH * OW, size = N * C * H * W;
    if (q * NB > Kdim || n >= N || NB > MAX_NB) return;
    int plane[MAX_NB], ti[MAX_NB], tj[MAX_NB];  // tap q*NB + t: x's plane (c of image n), i, j
    float fill[MAX_NB];                         // its value where its row is outside the input
    for (int t = 0; t < NB; t++) {
        const int k = q * NB + t, c = k / (KH * KW), i = k / KW - c * KH, j = k - (k / KW) * KW;
        plane[t] = k < Kdim ? (n * C + c) * H * W : 0;
        ti[t] = k < Kdim ? i : -H - PAD;  // past Kdim: a row above the input for every oh
        tj[t] = j;
        fill[t] = k == Kdim ? 1.0f : 0.0f;
    }
    __global float* dst = out + ((size_t)q * NP + n * OH * OW) * NB;  // pixel (oh, ow)'s run: dst[(oh*OW + ow)*NB]
    for (int oh = 0; oh < OH; oh++) {
        for (int ow0 = 0; ow0 < OW; ow0 += LANES, dst += LANES * NB) {
            for (int t0 = 0; t0 < NB; t0 += LANES) {
                float8 r[LANES];  // r[e]: tap t0 + e at the 8 pixels
#pragma unroll
                for (int e = 0; e < LANES; e++) {
                    const int t = t0 + e, h = oh * STRIDE - PAD + ti[t];
                    r[e] = h >= 0 && h < H ? row_lanes(x, plane[t] + h * W, ow0 * STRIDE - PAD + tj[t], W, size)
                                           : (float8)(fill[t]);
                }
                transpose8(r);  // r[u]: pixel ow0 + u at the taps t0 .. t0 + 7
#pragma unroll
                for (int u = 0; u < LANES; u++) *(__global float8_any*)(dst + u * NB + t0) = r[u];
            }
        }
    }
}

// Optimisation of col2im (and of col2im_rows) for CPUs, stride 1 and W a multiple of 8
// (conv.col2im_lanes_fit), the same sums in the same order. col2im_rows walks each tap's run
// between ends known only at run time: 7 GB/s at conv2's shape, where the other data movement
// reaches 15-30. Here the unit is a vector of 8 dx elements of one input row, w0 .. w0 + 7,
// summed in registers: for stride 1, tap (i, j) adds dcols[(c, i, j), (n, oh, ow0 .. ow0 + 7)]
// with oh = h + PAD - i and ow0 = w0 + PAD - j, 8 contiguous floats of a dcols row, one
// row_lanes load whose lanes outside the output row (ow < 0 or >= OW: no window there) are
// +0.0. The taps go in col2im's order (i, then j, ascending); a masked lane adds +0.0, which
// leaves the sum as it was, since a sum that starts at +0.0 is never -0.0 (x + -x is +0.0).
// A tap row outside [0, OH) is skipped, as in col2im. The work-items go in (c, n) order, so
// neighbours read on along the same KH*KW dcols rows (sequential streams); in col2im_rows' (n, c)
// order each plane jumped to KH*KW other rows 64 KB apart at conv2's shape (measured: 9.1 ms, no
// faster than the walk; in (c, n) order 3.3 ms). Built for stride 1 only (row_lanes loads every
// STRIDE-th float). global (H, N*C).
#if STRIDE == 1
__kernel void col2im_lanes(__global const float* restrict dcols, const int C, const int H, const int W,
                           const int OH, const int OW, const int NP, const int planes,
                           __global float* restrict dx)
{
    const int h = get_global_id(0), g = get_global_id(1);
    if (h >= H || g >= planes) return;
    // work-items in (c, n) order: neighbours read along the same KH*KW dcols rows
    const int N = planes / C, c = g / N, n = g - c * N, plane = n * C + c, size = C * KH * KW * NP;
    __global float* dxr = dx + ((size_t)plane * H + h) * W;
    for (int w0 = 0; w0 < W; w0 += LANES) {
        float8 s = (float8)(0.0f);
#pragma unroll
        for (int i = 0; i < KH; i++) {
            const int oh = h + PAD - i;
            if (oh < 0 || oh >= OH) continue;  // the same for the whole row
            const int row = (c * KH + i) * KW * NP + (n * OH + oh) * OW;  // dcols[(c, i, 0), (n, oh, 0)]
#pragma unroll
            for (int j = 0; j < KW; j++) s += row_lanes(dcols, row + j * NP, w0 + PAD - j, OW, size);
        }
        *(__global float8_any*)(dxr + w0) = s;
    }
}
#endif  // STRIDE == 1
#undef LANES
#undef MAX_NB

#endif  // KH

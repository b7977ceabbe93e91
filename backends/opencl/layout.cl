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

#endif  // KH

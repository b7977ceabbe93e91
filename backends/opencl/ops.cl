// Every op of the OpenCL backend except the convolution's data layout (layout.cl,
// built into the same program) and the GEMM (gemm.cl), in the order of
// backends/base.py. OpenCL C 1.2, float32, NCHW.
//
// One work-item per output element wherever possible: PoCL turns the loop over a
// work-group's items into SIMD code only when the kernel body has no loop of its
// own (nor a call it cannot inline: its CPU builds call even min, max, fmax and isnan out of
// line, so the kernels spell those as comparisons), and GPUs want many small items anyway. Grids
// are 1-3 dimensional so no work-item has to split a flat index by division
// (slow on CPUs); they are rounded up to whole work-groups, so every kernel starts
// with a bounds check. The kernels whose loops depend on a layer's window (col2im in
// layout.cl, LRN, max pool) are built per window, with it compiled in, so those loops
// unroll.
//
// Row variants (an optimisation, beside the per-element kernels, which stay: the reference,
// and the choice on GPUs). PoCL's CPU devices vectorise a loop *inside* a work-item -- a walk
// along contiguous memory becomes AVX code -- far better than they vectorise across
// work-items: a per-element ReLU measured 7.5-20 GB/s here, the same ReLU as a loop over a
// chunk 35-48 GB/s. So each op's arithmetic is an inline function of one element (`..._at`),
// called once by the per-element kernel and in a loop by its `..._rows` twin (one work-item
// per chunk, image plane or output row): the same float operations in the same order, so the
// two give the same bits. Inside the loops every condition is a select, never a branch, and
// the rows kernels' buffers are `restrict` (the backend never aliases them), so the loop
// vectorises without run-time overlap checks. ClRuntime.rows (cl_runtime.py) picks them on CPUs.
//
// Arithmetic follows backends/numpy_backend.py operation by operation (same
// order, same float32 roundings), and contraction of a*b+c into a fused
// multiply-add is off, so the elementwise ops agree with numpy to the last bit or
// two; reductions differ only in summation order.

#pragma OPENCL FP_CONTRACT OFF

// For the helpers the rows kernels call inside their loops: a call left in a loop keeps it scalar,
// and PoCL's inliner leaves some (the max pool's window helpers, with their private arrays).
#define ALWAYS_INLINE inline __attribute__((always_inline))

// ------------------------------------------------------------------ per-channel reductions

// out[m] = (sum over a < NA, b < NB of f(src[m*s0 + a*s1 + b*s2])) / divisor, with
// f = x (mode 0), x * src2[same index] (mode 1), (x - center[m])^2 (mode 2).
// One work-group of RL (a power of two) work-items per m, a tree in local memory.
// Used for the linear bias gradient and batchnorm's statistics and gradients (the conv
// bias gradient comes out of the dW GEMM, see im2row_panels in layout.cl).
__kernel void reduce_rows(__global const float* src, __global const float* src2,
                          __global const float* center, const int mode, const int NA, const int NB,
                          const int s0, const int s1, const int s2, const float divisor,
                          __global float* out)
{
    __local float part[RL];
    const int m = get_group_id(0), l = get_local_id(0);
    float s = 0.0f;
    // e = l, l + RL, ... as (a, b) = (e / NB, e % NB), stepped without a division per element
    const int da = RL / NB, db = RL % NB;
    for (int a = l / NB, b = l % NB; a < NA; a += da, b += db) {
        if (b >= NB) {
            b -= NB;
            a++;
            if (a >= NA) break;
        }
        const int idx = m * s0 + a * s1 + b * s2;
        const float v = src[idx];
        if (mode == 0) {
            s += v;
        } else if (mode == 1) {
            s += v * src2[idx];
        } else {
            const float d = v - center[m];
            s += d * d;
        }
    }
    part[l] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int width = RL / 2; width > 0; width /= 2) {
        if (l < width) part[l] += part[l + width];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (l == 0) out[m] = part[0] / divisor;
}

// Optimisation of reduce_rows for batch norm's statistics and gradients on CPUs, in two steps.
// Here: partial[n*C + c] = the sum over plane (n, c) (H*W contiguous elements) of f as above:
// one work-item per plane, 16 running sums (lane j takes q = j mod 16, in order), combined
// pairwise, then the tail. The lanes are a private array in unrolled loops, which the
// compiler turns into vector registers without reassociating anything (vload16 is a call on
// PoCL). Then reduce_rows sums the N partials of each channel. The order of the terms
// differs from reduce_rows' (and numpy's), so the sums agree within round-off, not to the
// bit. global (C, N).
#define LANES 16
#define PLANE_SUM(f)                                                         \
    do {                                                                     \
        float acc[LANES];                                                    \
        _Pragma("unroll") for (int j = 0; j < LANES; j++) acc[j] = 0.0f;     \
        int q = 0;                                                           \
        for (; q + LANES <= HW; q += LANES)                                  \
            _Pragma("unroll") for (int j = 0; j < LANES; j++) acc[j] += f(q + j); \
        _Pragma("unroll") for (int w = LANES / 2; w > 0; w /= 2)             \
            _Pragma("unroll") for (int j = 0; j < w; j++) acc[j] += acc[j + w]; \
        s = acc[0];                                                          \
        for (; q < HW; q++) s += f(q);                                       \
    } while (0)

__kernel void reduce_planes(__global const float* restrict src, __global const float* restrict src2,
                            __global const float* restrict center, const int mode, const int C, const int HW,
                            const int N, __global float* restrict partial)
{
    const int c = get_global_id(0), n = get_global_id(1);
    if (c >= C || n >= N) return;
    const int e0 = (n * C + c) * HW;
    __global const float* a = src + e0;
    float s;
    if (mode == 0) {
#define F(q) a[q]
        PLANE_SUM(F);
#undef F
    } else if (mode == 1) {
        __global const float* b = src2 + e0;
#define F(q) (a[q] * b[q])
        PLANE_SUM(F);
#undef F
    } else {
        const float m = center[c];
#define F(q) ((a[q] - m) * (a[q] - m))
        PLANE_SUM(F);
#undef F
    }
    partial[n * C + c] = s;
}

// ------------------------------------------------------------------ elementwise

// NaN stays NaN, as with np.maximum, so a diverging run shows it.
inline void relu_forward_at(__global const float* x, const int e, __global float* y)
{
    y[e] = x[e] < 0.0f ? 0.0f : x[e];  // NaN compares false: it stays NaN
}

// numpy: dy * (y > 0), where y is the forward output (y > 0 exactly when x > 0).
inline void relu_backward_at(__global const float* dy, __global const float* y, const int e,
                             __global float* dx)
{
    dx[e] = dy[e] * (y[e] > 0.0f ? 1.0f : 0.0f);
}

__kernel void relu_forward(__global const float* x, const int total, __global float* y)
{
    const int e = get_global_id(0);
    if (e < total) relu_forward_at(x, e, y);
}

__kernel void relu_backward(__global const float* dy, __global const float* y, const int total,
                            __global float* dx)
{
    const int e = get_global_id(0);
    if (e < total) relu_backward_at(dy, y, e, dx);
}

// Row variants, the arguments of the per-element kernels and then chunk: work-item i walks
// elements [i*chunk, (i+1)*chunk) of the flat array (an item
// past the end returns; no int overflows near 2^31 elements).
#define CHUNK_BOUNDS(start, end, total, chunk)                             \
    const int i_ = get_global_id(0);                                       \
    if ((long)i_ * (chunk) >= (total)) return;                             \
    const int start = i_ * (chunk);                                        \
    const int end = (total) - start < (chunk) ? (total) : start + (chunk)

__kernel void relu_forward_rows(__global const float* restrict x, const int total,
                                __global float* restrict y, const int chunk)
{
    CHUNK_BOUNDS(start, end, total, chunk);
    for (int e = start; e < end; e++) relu_forward_at(x, e, y);
}

__kernel void relu_backward_rows(__global const float* restrict dy, __global const float* restrict y,
                                 const int total, __global float* restrict dx, const int chunk)
{
    CHUNK_BOUNDS(start, end, total, chunk);
    for (int e = start; e < end; e++) relu_backward_at(dy, y, e, dx);
}

// On PoCL's CPU devices (the runtime defines POCL_CPU), whose builds call sqrt out of line, a
// square root as one instruction: clang's builtin, the same correctly rounded root. Not elsewhere:
// other clang-based runtimes need not run the intrinsic it becomes (Oclgrind cannot).
#ifdef POCL_CPU
#define SQRT(x) __builtin_sqrtf(x)
#else
#define SQRT(x) sqrt(x)
#endif

// s ** -beta, with beta = 0.75 done by square roots as numpy's _neg_pow does. Which of the two
// is compiled in (LRN_BETA_075, with the window): a pow call in the kernel, even one never taken,
// keeps PoCL from running the work-items as SIMD lanes.
inline float neg_pow(const float s, const float beta)
{
#if LRN_BETA_075
    const float r = 1.0f / SQRT(s);
    return r * SQRT(r);
#else
    return pow(s, -beta);
#endif
}

#ifdef LRN_BEFORE  // ------------------------------- LRN, built per window (LRN_BEFORE, LRN_AFTER)
// (and the walk kernels per block, LRN_BLOCK)

// out = a(c) + a(c-1) + ... + a(c-before) + a(c+1) + ... + a(c+after), clipped to [0, C):
// numpy's _channel_window_sum, same order. a(cc) reads channel cc of this pixel. The
// window is compiled in so the loops unroll. A channel outside [0, C) is read at a clamped
// index and not added (`out = in ? out + v : out` is `if (in) out += v`): no branch, so the
// rows kernels' loops over pixels vectorise.
#define CHANNEL_WINDOW_SUM(out, a, c, C, before, after)                   \
    do {                                                                   \
        out = a(c);                                                        \
        _Pragma("unroll") for (int d = 1; d <= (before); d++) {            \
            const float v_ = a((c) - d >= 0 ? (c) - d : 0);                \
            out = (c) - d >= 0 ? out + v_ : out;                           \
        }                                                                  \
        _Pragma("unroll") for (int d = 1; d <= (after); d++) {             \
            const float v_ = a((c) + d < (C) ? (c) + d : (C) - 1);         \
            out = (c) + d < (C) ? out + v_ : out;                          \
        }                                                                  \
    } while (0)

// The per-pixel arithmetic. xq, dyq, ...: the map at image n, channel 0, pixel q (channel cc
// of the pixel is xq[cc * HW]); e = (n*C + c)*HW + q, this element.

// y = x * s^-beta, s = k + alpha/size * sum over the channel window of x^2.
// Keeps s and p = s^-beta for the backward, as numpy does.
inline void lrn_forward_at(__global const float* xq, const int c, const int C, const int HW, const int e,
                           const float alpha_over_size, const float k, const float beta,
                           __global float* y, __global float* s_out, __global float* p_out)
{
#define SQ(cc) (xq[(cc) * HW] * xq[(cc) * HW])
    float s;
    CHANNEL_WINDOW_SUM(s, SQ, c, C, LRN_BEFORE, LRN_AFTER);
#undef SQ
    s = s * alpha_over_size;
    s = s + k;
    const float p = neg_pow(s, beta);
    y[e] = xq[c * HW] * p;
    s_out[e] = s;
    p_out[e] = p;
}

// dx_j = dy_j p_j - (2 alpha beta / size) x_j * sum over the mirrored window of dy_i y_i / s_i
// (see LocalResponseNorm in tinyconv/layers.py for the derivation).
inline void lrn_backward_at(__global const float* dyq, __global const float* xq, __global const float* yq,
                            __global const float* sq, __global const float* pq, const int c, const int C,
                            const int HW, const int e, const float coef, __global float* dx)
{
#define U(cc) (dyq[(cc) * HW] * yq[(cc) * HW] / sq[(cc) * HW])
    float t;
    CHANNEL_WINDOW_SUM(t, U, c, C, LRN_AFTER, LRN_BEFORE);  // the mirrored window
#undef U
    dx[e] = dyq[c * HW] * pq[c * HW] - coef * xq[c * HW] * t;
}

// ReLU then LRN in one kernel each way: an optimisation beside the plain kernels above and
// relu_forward/relu_backward, which stay (backends/base.py's relu_lrn_forward is their
// composition). The map is read once and written once: r = max(x, 0) is never stored, since the
// backward gets it from x again, nor is p = s^-beta, which the backward recomputes from s (the
// same operations, so the same bits). The plain pair moves 15 maps' worth of memory per step
// (relu 2 + 3, LRN 4 + 6), this one 7 (forward: x in, y and s out; backward: dy, x, y, s in, dx out).

// y = r * s^-beta with r = max(x, 0) (a NaN stays NaN) and s = k + alpha/size * the window sum
// of r^2.
inline void relu_lrn_forward_at(__global const float* xq, const int c, const int C, const int HW, const int e,
                                const float alpha_over_size, const float k, const float beta,
                                __global float* y, __global float* s_out)
{
#define R(cc) (xq[(cc) * HW] < 0.0f ? 0.0f : xq[(cc) * HW])
#define SQ(cc) (R(cc) * R(cc))
    float s;
    CHANNEL_WINDOW_SUM(s, SQ, c, C, LRN_BEFORE, LRN_AFTER);
#undef SQ
    s = s * alpha_over_size;
    s = s + k;
    const float r = R(c);
#undef R
    y[e] = r * neg_pow(s, beta);
    s_out[e] = s;
}

// dx_j = [r_j > 0] * (dy_j p_j - (2 alpha beta / size) r_j * sum over the mirrored window of
// dy_i y_i / s_i), r = max(x, 0), p = s^-beta: lrn_backward, then relu_backward's mask as a
// product (so a NaN in dy stays NaN, as numpy's dy * (r > 0)).
inline void relu_lrn_backward_at(__global const float* dyq, __global const float* xq, __global const float* yq,
                                 __global const float* sq, const int c, const int C, const int HW, const int e,
                                 const float beta, const float coef, __global float* dx)
{
#define U(cc) (dyq[(cc) * HW] * yq[(cc) * HW] / sq[(cc) * HW])
    float t;
    CHANNEL_WINDOW_SUM(t, U, c, C, LRN_AFTER, LRN_BEFORE);  // the mirrored window
#undef U
    const float r = xq[c * HW] < 0.0f ? 0.0f : xq[c * HW];
    const float dr = dyq[c * HW] * neg_pow(sq[c * HW], beta) - coef * r * t;
    dx[e] = dr * (r > 0.0f ? 1.0f : 0.0f);
}

// The per-element kernels: global (H*W, C, N), one work-item per (q, c, n).
#define LRN_ELEMENT                                                          \
    const int q = get_global_id(0), c = get_global_id(1), n = get_global_id(2); \
    if (q >= HW || c >= C || n >= N) return;                                 \
    const int at = n * C * HW + q, e = at + c * HW

__kernel void lrn_forward(__global const float* x, const int C, const int HW, const int N,
                          const float alpha_over_size, const float k, const float beta,
                          __global float* y, __global float* s_out, __global float* p_out)
{
    LRN_ELEMENT;
    lrn_forward_at(x + at, c, C, HW, e, alpha_over_size, k, beta, y, s_out, p_out);
}

__kernel void lrn_backward(__global const float* dy, __global const float* x,
                           __global const float* y, __global const float* s,
                           __global const float* p, const int C, const int HW, const int N,
                           const float coef, __global float* dx)
{
    LRN_ELEMENT;
    lrn_backward_at(dy + at, x + at, y + at, s + at, p + at, c, C, HW, e, coef, dx);
}

__kernel void relu_lrn_forward(__global const float* x, const int C, const int HW, const int N,
                               const float alpha_over_size, const float k, const float beta,
                               __global float* y, __global float* s_out)
{
    LRN_ELEMENT;
    relu_lrn_forward_at(x + at, c, C, HW, e, alpha_over_size, k, beta, y, s_out);
}

__kernel void relu_lrn_backward(__global const float* dy, __global const float* x,
                                __global const float* y, __global const float* s, const int C,
                                const int HW, const int N, const float beta, const float coef,
                                __global float* dx)
{
    LRN_ELEMENT;
    relu_lrn_backward_at(dy + at, x + at, y + at, s + at, c, C, HW, e, beta, coef, dx);
}

// The rows kernels (an optimisation, for CPUs): global (C, N), one work-item per image plane
// (n, c), walking its H*W pixels; the same arguments as the per-element kernels.
#define LRN_PLANE                                                            \
    const int c = get_global_id(0), n = get_global_id(1);                   \
    if (c >= C || n >= N) return;                                            \
    const int at = n * C * HW, e0 = at + c * HW

__kernel void lrn_forward_rows(__global const float* restrict x, const int C, const int HW, const int N,
                               const float alpha_over_size, const float k, const float beta,
                               __global float* restrict y, __global float* restrict s_out,
                               __global float* restrict p_out)
{
    LRN_PLANE;
    for (int q = 0; q < HW; q++)
        lrn_forward_at(x + at + q, c, C, HW, e0 + q, alpha_over_size, k, beta, y, s_out, p_out);
}

__kernel void lrn_backward_rows(__global const float* restrict dy, __global const float* restrict x,
                                __global const float* restrict y, __global const float* restrict s,
                                __global const float* restrict p, const int C, const int HW, const int N,
                                const float coef, __global float* restrict dx)
{
    LRN_PLANE;
    for (int q = 0; q < HW; q++)
        lrn_backward_at(dy + at + q, x + at + q, y + at + q, s + at + q, p + at + q, c, C, HW, e0 + q, coef, dx);
}

__kernel void relu_lrn_forward_rows(__global const float* restrict x, const int C, const int HW, const int N,
                                    const float alpha_over_size, const float k, const float beta,
                                    __global float* restrict y, __global float* restrict s_out)
{
    LRN_PLANE;
    for (int q = 0; q < HW; q++)
        relu_lrn_forward_at(x + at + q, c, C, HW, e0 + q, alpha_over_size, k, beta, y, s_out);
}

__kernel void relu_lrn_backward_rows(__global const float* restrict dy, __global const float* restrict x,
                                     __global const float* restrict y, __global const float* restrict s,
                                     const int C, const int HW, const int N, const float beta,
                                     const float coef, __global float* restrict dx)
{
    LRN_PLANE;
    for (int q = 0; q < HW; q++)
        relu_lrn_backward_at(dy + at + q, x + at + q, y + at + q, s + at + q, c, C, HW, e0 + q, beta, coef, dx);
}

// Optimisation of the rows backward kernels for CPUs, the same bits: a work-item walks the
// channels of a block of LRN_BLOCK pixels of one image (global (blocks of H*W, N); the block is
// compiled in). Each pixel's term u(cc) = dy y / s of channel cc is computed once, when the walk
// first needs it, into a ring of the window's channels (row cc % LRN_WIN), so an element costs
// one division where lrn_backward_at's window sum does LRN_WIN; the window is then summed from the
// ring in CHANNEL_WINDOW_SUM's order, the same terms, so dx keeps its bits. A channel outside
// [0, C) reads the ring at the clamped channel (always held) and is not added, as there. The ring
// is filled and read in separate loops over the block: of one loop doing both, at offsets the
// compiler cannot tell apart, PoCL vectorised the plain LRN's behind run-time overlap checks and
// left the fused one's scalar (2-3.5x slower than its per-element kernel; split, 5-10x faster).
#ifdef LRN_BLOCK
#define LRN_WIN (LRN_BEFORE + LRN_AFTER + 1)

// row[k] = u of channel cc at the block's pixel k: at = (n*C + cc)*HW + q0. (The kernels' buffers
// are restrict; a restrict here would leave an intrinsic in the inlined code that Oclgrind cannot run.)
ALWAYS_INLINE void lrn_u_row(__global const float* dy, __global const float* y, __global const float* s,
                             const int at, const int qn, float* row)
{
    for (int k = 0; k < qn; k++) row[k] = dy[at + k] * y[at + k] / s[at + k];
}

// dx of every channel for the block; TAIL(e, t) is dx[e] of the op, t its window sum.
#define LRN_BACKWARD_WALK(TAIL)                                                         \
    const int b = get_global_id(0), n = get_global_id(1);                               \
    const int q0 = b * LRN_BLOCK;                                                       \
    if (q0 >= HW || n >= N) return;                                                     \
    const int at = n * C * HW + q0, qn = HW - q0 < LRN_BLOCK ? HW - q0 : LRN_BLOCK;     \
    float ring[LRN_WIN * LRN_BLOCK];                                                    \
    for (int cc = 0; cc < LRN_BEFORE && cc < C; cc++)                                   \
        lrn_u_row(dy, y, s, at + cc * HW, qn, ring + cc * LRN_BLOCK);                   \
    for (int c = 0, base = 0; c < C; c++, base = base + 1 == LRN_WIN ? 0 : base + 1) {  \
        float* u[LRN_WIN]; /* u[LRN_AFTER + k]: the ring row of channel c + k, clamped */ \
        _Pragma("unroll") for (int k = -LRN_AFTER; k <= LRN_BEFORE; k++) {              \
            const int cc = c + k < 0 ? 0 : c + k >= C ? C - 1 : c + k;                  \
            const int r = base + (cc - c);                                              \
            u[LRN_AFTER + k] = ring + (r < 0 ? r + LRN_WIN : r >= LRN_WIN ? r - LRN_WIN : r) * LRN_BLOCK; \
        }                                                                               \
        if (c + LRN_BEFORE < C) /* channel c + LRN_BEFORE enters the ring */            \
            lrn_u_row(dy, y, s, at + (c + LRN_BEFORE) * HW, qn, u[LRN_WIN - 1]);        \
        for (int k = 0; k < qn; k++) {                                                  \
            float t = u[LRN_AFTER][k];                                                  \
            _Pragma("unroll") for (int d = 1; d <= LRN_AFTER; d++)                      \
                t = c - d >= 0 ? t + u[LRN_AFTER - d][k] : t;                           \
            _Pragma("unroll") for (int d = 1; d <= LRN_BEFORE; d++)                     \
                t = c + d < C ? t + u[LRN_AFTER + d][k] : t;                            \
            const int e = at + c * HW + k;                                              \
            TAIL(e, t);                                                                 \
        }                                                                               \
    }

__kernel void lrn_backward_walk(__global const float* restrict dy, __global const float* restrict x,
                                __global const float* restrict y, __global const float* restrict s,
                                __global const float* restrict p, const int C, const int HW, const int N,
                                const float coef, __global float* restrict dx)
{
#define TAIL(e, t) dx[e] = dy[e] * p[e] - coef * x[e] * (t)  // as lrn_backward_at
    LRN_BACKWARD_WALK(TAIL)
#undef TAIL
}

__kernel void relu_lrn_backward_walk(__global const float* restrict dy, __global const float* restrict x,
                                     __global const float* restrict y, __global const float* restrict s,
                                     const int C, const int HW, const int N, const float beta,
                                     const float coef, __global float* restrict dx)
{
#define TAIL(e, t)                                                     \
    do { /* as relu_lrn_backward_at */                                 \
        const float r = x[e] < 0.0f ? 0.0f : x[e];                     \
        const float dr = dy[e] * neg_pow(s[e], beta) - coef * r * (t); \
        dx[e] = dr * (r > 0.0f ? 1.0f : 0.0f);                         \
    } while (0)
    LRN_BACKWARD_WALK(TAIL)
#undef TAIL
}
#endif  // LRN_BLOCK

#endif  // LRN_BEFORE

// ------------------------------------------------------------------ batch norm

// r <- (1 - momentum) r + momentum * stat, for the running mean and (unbiased) variance.
__kernel void bn_update_running(__global float* rmean, __global float* rvar,
                                __global const float* mean, __global const float* var, const int C,
                                const float keep, const float momentum, const float var_factor)
{
    const int c = get_global_id(0);
    if (c >= C) return;
    rmean[c] = rmean[c] * keep + momentum * mean[c];
    rvar[c] = rvar[c] * keep + var_factor * var[c];
}

__kernel void bn_invstd(__global const float* var, const float eps, const int C,
                        __global float* invstd)
{
    const int c = get_global_id(0);
    if (c < C) invstd[c] = 1.0f / sqrt(var[c] + eps);
}

// xhat = (x - mean) * invstd, y = xhat * gamma + beta, for element e of a channel whose
// statistics and parameters are given.
inline void bn_forward_at(__global const float* x, const int e, const float mean, const float invstd,
                          const float gamma, const float beta, __global float* xhat, __global float* y)
{
    const float xh = (x[e] - mean) * invstd;
    xhat[e] = xh;
    y[e] = xh * gamma + beta;
}

// training: dx = g * (dy - dbeta/m - xhat * dgamma/m);  eval: dx = g * dy;  g = gamma * invstd,
// with db_m = dbeta/m and dg_m = dgamma/m of this element's channel.
inline void bn_backward_at(__global const float* dy, __global const float* xhat, const int e, const float g,
                           const float db_m, const float dg_m, const int training, __global float* dx)
{
    dx[e] = training ? g * (dy[e] - db_m - xhat[e] * dg_m) : dy[e] * g;
}

// global (H*W, C, N), one work-item per element.
__kernel void bn_forward(__global const float* x, __global const float* mean,
                         __global const float* invstd, __global const float* gamma,
                         __global const float* beta, const int C, const int HW, const int N,
                         __global float* xhat, __global float* y)
{
    const int q = get_global_id(0), c = get_global_id(1), n = get_global_id(2);
    if (q >= HW || c >= C || n >= N) return;
    bn_forward_at(x, (n * C + c) * HW + q, mean[c], invstd[c], gamma[c], beta[c], xhat, y);
}

__kernel void bn_backward(__global const float* dy, __global const float* xhat,
                          __global const float* gamma, __global const float* invstd,
                          __global const float* dgamma, __global const float* dbeta,
                          const int training, const float m, const int C, const int HW,
                          const int N, __global float* dx)
{
    const int q = get_global_id(0), c = get_global_id(1), n = get_global_id(2);
    if (q >= HW || c >= C || n >= N) return;
    bn_backward_at(dy, xhat, (n * C + c) * HW + q, gamma[c] * invstd[c], dbeta[c] / m, dgamma[c] / m,
                   training, dx);
}

// The rows kernels (an optimisation, for CPUs): global (C, N), one work-item per plane (n, c),
// its channel's values read once, walking its H*W elements; the same arguments.
__kernel void bn_forward_rows(__global const float* restrict x, __global const float* restrict mean,
                              __global const float* restrict invstd, __global const float* restrict gamma,
                              __global const float* restrict beta, const int C, const int HW, const int N,
                              __global float* restrict xhat, __global float* restrict y)
{
    const int c = get_global_id(0), n = get_global_id(1);
    if (c >= C || n >= N) return;
    const float mc = mean[c], ic = invstd[c], gc = gamma[c], bc = beta[c];
    const int e0 = (n * C + c) * HW;
    for (int e = e0; e < e0 + HW; e++) bn_forward_at(x, e, mc, ic, gc, bc, xhat, y);
}

__kernel void bn_backward_rows(__global const float* restrict dy, __global const float* restrict xhat,
                               __global const float* restrict gamma, __global const float* restrict invstd,
                               __global const float* restrict dgamma, __global const float* restrict dbeta,
                               const int training, const float m, const int C, const int HW,
                               const int N, __global float* restrict dx)
{
    const int c = get_global_id(0), n = get_global_id(1);
    if (c >= C || n >= N) return;
    const float g = gamma[c] * invstd[c], db_m = dbeta[c] / m, dg_m = dgamma[c] / m;
    const int e0 = (n * C + c) * HW;
    for (int e = e0; e < e0 + HW; e++) bn_backward_at(dy, xhat, e, g, db_m, dg_m, training, dx);
}

// ------------------------------------------------------------------ max pool

#ifdef POOL  // --------------------------------------- built per (POOL = window, STRIDE, PAD)

// y = the max over the window, arg = its position h*W + w in the input plane: the
// first maximum in row-major window order (strict >), as numpy's separable max picks,
// or, if the window holds a NaN, its last NaN (y = NaN): torch's max_pool2d loop.
// Padding is skipped, which is the same as padding with -inf. global (OW, OH, N*C).
__kernel void maxpool_forward(__global const float* x, const int H, const int W, const int OH,
                              const int OW, const int planes, __global float* y, __global int* arg)
{
    const int ow = get_global_id(0), oh = get_global_id(1), plane = get_global_id(2);
    if (ow >= OW || oh >= OH || plane >= planes) return;
    __global const float* xp = x + plane * H * W;
    const int h0 = oh * STRIDE - PAD, w0 = ow * STRIDE - PAD;
    int best = (h0 > 0 ? h0 : 0) * W + (w0 > 0 ? w0 : 0);  // the first element inside the input
    float v = xp[best];
#pragma unroll
    for (int i = 0; i < POOL; i++) {
        const int h = h0 + i;
        if (h < 0 || h >= H) continue;
#pragma unroll
        for (int j = 0; j < POOL; j++) {
            const int w = w0 + j;
            if (w < 0 || w >= W) continue;
            const float xv = xp[h * W + w];
            if (xv > v || xv != xv) {  // xv != xv: a NaN; once v is NaN, only a later NaN replaces it
                v = xv;
                best = h * W + w;
            }
        }
    }
    const int e = (plane * OH + oh) * OW + ow;
    y[e] = v;
    arg[e] = best;
}

// Optimisation of maxpool_forward, the same results (1.5 -> ~3 GB/s on PoCL): the simple
// kernel's bounds checks and `xv > v || xv != xv` keep the compiler from a branch-free
// loop, and the argmax branch mispredicts on random data. Here rows are clamped (a clamped
// row repeats its in-window neighbour: neither the first maximum nor the last NaN moves),
// a column outside the input is loaded anyway -- from the row before or after, in the same
// buffer because planes 0 and planes - 1 are left to maxpool_forward -- and masked to -inf,
// so the scan is strict > alone. NaN is only noted, as integer bits, and a window holding
// one is scanned again for its last NaN. global (OW, OH, planes - 2).
__kernel void maxpool_forward_inner(__global const float* x, const int H, const int W, const int OH,
                                    const int OW, const int planes, __global float* y, __global int* arg)
{
    const int ow = get_global_id(0), oh = get_global_id(1), plane = get_global_id(2) + 1;
    if (ow >= OW || oh >= OH || plane >= planes - 1) return;
    __global const float* xp = x + plane * H * W;
    const int h0 = oh * STRIDE - PAD, w0 = ow * STRIDE - PAD;
    float v = -INFINITY;  // the same as starting from the first element inside
    int best = clamp(h0, 0, H - 1) * W + max(w0, 0), nan = 0;
#pragma unroll
    for (int i = 0; i < POOL; i++) {
        const int h = clamp(h0 + i, 0, H - 1);
#pragma unroll
        for (int j = 0; j < POOL; j++) {
            const int w = w0 + j;
            const float raw = xp[h * W + w];
            const float xv = (w >= 0 && w < W) ? raw : -INFINITY;
            nan |= (as_int(xv) & 0x7fffffff) > 0x7f800000;
            const bool take = xv > v;
            v = take ? xv : v;
            best = take ? h * W + w : best;
        }
    }
    if (nan) {  // rare: the last NaN, as the simple kernel finds it
#pragma unroll
        for (int i = 0; i < POOL; i++) {
            const int h = clamp(h0 + i, 0, H - 1);
#pragma unroll
            for (int j = 0; j < POOL; j++) {
                const int w = clamp(w0 + j, 0, W - 1);
                const float xv = xp[h * W + w];
                if (xv != xv) {
                    v = xv;
                    best = h * W + w;
                }
            }
        }
    }
    const int e = (plane * OH + oh) * OW + ow;
    y[e] = v;
    arg[e] = best;
}

// One tap of a max pool window: the running maximum and its index, and the last NaN and its index
// (which replaces the maximum at the end), all as selects, which vectorise.
ALWAYS_INLINE void pool_tap(const float xv, const int at, float* v, int* best, float* nan_v, int* nan_at)
{
    const bool take = xv > *v, is_nan = xv != xv;
    *v = take ? xv : *v;
    *best = take ? at : *best;
    *nan_v = is_nan ? xv : *nan_v;
    *nan_at = is_nan ? at : *nan_at;
}

// Optimisation of maxpool_forward for CPUs, the same results: one work-item per output row,
// walking it. The window's rows are clamped into the plane once per row (a clamped row repeats
// its in-window neighbour: neither the first maximum nor the last NaN moves); the columns are
// checked only in the windows at the row's two ends, so the walk between them is loads,
// compares and selects, which vectorise. The last NaN is tracked beside the maximum, as
// selects, and replaces it at the end. global (OH, planes).
ALWAYS_INLINE void maxpool_window(__global const float* xp, const int* hw, const int ow, const int W,
                           const bool checked, __global float* yr, __global int* ar)
{
    const int w0 = ow * STRIDE - PAD;
    float v = -INFINITY, nan_v = 0.0f;  // -inf: the same as starting from the first element inside
    int best = hw[0] + (w0 > 0 ? w0 : 0), nan_at = -1;
#pragma unroll
    for (int i = 0; i < POOL; i++) {
#pragma unroll
        for (int j = 0; j < POOL; j++) {
            const int w = w0 + j;
            const bool inside = !checked || (w >= 0 && w < W);
            const float raw = xp[hw[i] + (!checked ? w : w < 0 ? 0 : w >= W ? W - 1 : w)];
            pool_tap(inside ? raw : -INFINITY, hw[i] + w, &v, &best, &nan_v, &nan_at);
        }
    }
    yr[ow] = nan_at >= 0 ? nan_v : v;
    ar[ow] = nan_at >= 0 ? nan_at : best;
}

__kernel void maxpool_forward_rows(__global const float* restrict x, const int H, const int W, const int OH,
                                   const int OW, const int planes, __global float* restrict y,
                                   __global int* restrict arg)
{
    const int oh = get_global_id(0), plane = get_global_id(1);
    if (oh >= OH || plane >= planes) return;
    __global const float* xp = x + plane * H * W;
    int hw[POOL];  // the window's rows, clamped, as offsets h*W in the plane
#pragma unroll
    for (int i = 0; i < POOL; i++) {
        const int h = oh * STRIDE - PAD + i;
        hw[i] = (h < 0 ? 0 : h >= H ? H - 1 : h) * W;
    }
    __global float* yr = y + (plane * OH + oh) * OW;
    __global int* ar = arg + (plane * OH + oh) * OW;
    // windows lo .. hi - 1 lie inside the row: ow*STRIDE - PAD >= 0 and ow*STRIDE - PAD + POOL <= W
    const int lo = (PAD + STRIDE - 1) / STRIDE < OW ? (PAD + STRIDE - 1) / STRIDE : OW;
    const int fit = W + PAD - POOL >= 0 ? (W + PAD - POOL) / STRIDE + 1 : 0;
    const int hi = fit < lo ? lo : fit > OW ? OW : fit;
    int ow = 0;
    for (; ow < lo; ow++) maxpool_window(xp, hw, ow, W, true, yr, ar);
    for (; ow < hi; ow++) maxpool_window(xp, hw, ow, W, false, yr, ar);
    for (; ow < OW; ow++) maxpool_window(xp, hw, ow, W, true, yr, ar);
}

#ifdef PLANE_H  // ------------------------- and per plane size (PLANE_H x PLANE_W): the planes kernels
#define PLANE_OH ((PLANE_H + 2 * PAD - POOL) / STRIDE + 1)
#define PLANE_OW ((PLANE_W + 2 * PAD - POOL) / STRIDE + 1)

// 0, added to h and w in the planes and lanes kernels. Elsewhere than on PoCL's CPU devices a 0 not
// known at compile time (the backend passes H = PLANE_H, W = PLANE_W), since with oh and ow known
// non-negative LLVM turns the clamps `h < 0 ? 0 : h` into saturating subtractions, an intrinsic
// Oclgrind cannot run. Not on PoCL: there the unknown 0 made the planes kernel ~3x slower at conv2's shape.
#ifdef POCL_CPU
#define PLANE_ZERO(H, W) 0
#else
#define PLANE_ZERO(H, W) (((H) - PLANE_H) + ((W) - PLANE_W))
#endif

// The rows of output row oh's windows, clamped into the plane, as offsets h*W (the planes and lanes kernels).
ALWAYS_INLINE void pool_rows(const int oh, const int zero, int* hw)
{
#pragma unroll
    for (int i = 0; i < POOL; i++) {
        const int h = oh * STRIDE - PAD + i + zero;
        hw[i] = (h < 0 ? 0 : h >= PLANE_H ? PLANE_H - 1 : h) * PLANE_W;
    }
}

// Optimisation of maxpool_forward for CPUs, the same results: one work-item per plane (or
// PLANE_GROUP planes), the plane's size and the window compiled in. The rows kernel above walks
// an output row between its checked edges: at conv2's shape (8 windows a row) that walk is
// shorter than a vector. Here every window of a row is one loop of known length, checked as
// selects: the window's rows clamped once per row (as there), a column outside the plane read
// from the row before or after, unclamped -- so the loads stay strided, not gathers -- and
// masked to -inf. Only the buffer's first and last plane clamp the column too (the row before
// or after would be outside the buffer). The last NaN is tracked beside the maximum, as in
// maxpool_window. global (planes / PLANE_GROUP).
__kernel void maxpool_forward_planes(__global const float* restrict x, const int H, const int W, const int OH,
                                     const int OW, const int planes, __global float* restrict y,
                                     __global int* restrict arg)
{
    for (int plane = get_global_id(0) * PLANE_GROUP, end = plane + PLANE_GROUP; plane < end && plane < planes; plane++) {
    __global const float* xp = x + plane * (PLANE_H * PLANE_W);
    // a tap left or right of the plane reads the row before or after (masked): inside the buffer
    // except at its very ends, where the first and last plane clamp the column instead
    const bool edge = plane == 0 || plane == planes - 1;
    const int zero = PLANE_ZERO(H, W);  // 0, added to h and w below
    for (int oh = 0; oh < PLANE_OH; oh++) {
        int hw[POOL];
        pool_rows(oh, zero, hw);
        __global float* yr = y + (plane * PLANE_OH + oh) * PLANE_OW;
        __global int* ar = arg + (plane * PLANE_OH + oh) * PLANE_OW;
        for (int ow = 0; ow < PLANE_OW; ow++) {
            const int w0 = ow * STRIDE - PAD + zero;
            float v = -INFINITY, nan_v = 0.0f;  // -inf: the same as starting from the first element inside
            int best = hw[0] + (w0 > 0 ? w0 : 0), nan_at = -1;
#pragma unroll
            for (int i = 0; i < POOL; i++) {
#pragma unroll
                for (int j = 0; j < POOL; j++) {
                    const int w = w0 + j;
                    const bool inside = w >= 0 && w < PLANE_W;
                    const int wc = edge ? (w < 0 ? 0 : w >= PLANE_W ? PLANE_W - 1 : w) : w;
                    const float raw = xp[hw[i] + wc];
                    pool_tap(inside ? raw : -INFINITY, hw[i] + w, &v, &best, &nan_v, &nan_at);
                }
            }
            yr[ow] = nan_at >= 0 ? nan_v : v;
            ar[ow] = nan_at >= 0 ? nan_at : best;
        }
    }
    }
}

// Optimisation of maxpool_backward for CPUs, the same sums in the same order: one work-item per
// plane scatters dy to its argmaxes, into a plane of zeros, visiting the windows from the last to
// the first. The gather adds an input's windows latest window row first, then latest window
// column: that is this descending walk's order, so each dx is the same additions of the same
// terms from 0.0f, bit for bit. The walk is scalar (two windows may pick the same input) but it
// is one load, add and store per window, against the gather's POOL_T^2 checks per input.
// global (planes).
__kernel void maxpool_backward_planes(__global const float* restrict dy, __global const int* restrict arg,
                                      const int H, const int W, const int OH, const int OW, const int planes,
                                      __global float* restrict dx)
{
    for (int plane = get_global_id(0) * PLANE_GROUP, end = plane + PLANE_GROUP; plane < end && plane < planes; plane++) {
    __global const float* dyp = dy + plane * (PLANE_OH * PLANE_OW);
    __global const int* ap = arg + plane * (PLANE_OH * PLANE_OW);
    __global float* dxp = dx + plane * (PLANE_H * PLANE_W);
    for (int q = 0; q < PLANE_H * PLANE_W; q++) dxp[q] = 0.0f;
    for (int o = PLANE_OH * PLANE_OW - 1; o >= 0; o--) {
        const int a = ap[o];
        if ((uint)a < (uint)(PLANE_H * PLANE_W)) dxp[a] += dyp[o];  // always, from maxpool_forward
    }
    }
}
// Optimisation of maxpool_forward_planes for CPUs, the same results, for output rows of whole
// vectors (maxpool.lanes_fit: OW a multiple of 8, stride 1 or 2): the same walk over planes, 8
// windows of an output row at a time in float8 and int8 vectors. PoCL left the planes kernel's
// loop over a row's windows scalar (its loads are strided, its index clamped at the buffer's
// ends); here a tap of the 8 windows is one vector load (stride 2: 16 floats, the even ones kept),
// and the scan's compares and selects are vector ones (the `?:` of vectors: select() is a call on
// PoCL): 3-5x the planes kernel's speed on the paper's maps. global (planes / PLANE_GROUP).
#define POOL_LANES 8
typedef float8 __attribute__((aligned(4))) pool_float8;  // any float's alignment, as in layout.cl
typedef float16 __attribute__((aligned(4))) pool_float16;
typedef int8 __attribute__((aligned(4))) pool_int8;

// x[at + u*STRIDE], u < 8, -inf in the lanes whose column w is outside the row: one vector load
// (a lane outside the row reads the row before or after), or at the buffer's ends (x's first `size`
// floats) lane by lane, each index clamped into the buffer.
ALWAYS_INLINE float8 pool_lanes(__global const float* x, const int at, const int8 w, const int size)
{
    float8 v;
    if (at >= 0 && at <= size - POOL_LANES * STRIDE) {
#if STRIDE == 1
        v = *(__global const pool_float8*)(x + at);
#else  // 2 (lanes_fit)
        v = (*(__global const pool_float16*)(x + at)).even;
#endif
    } else {
        const int8 a = (int8)(at) + (int8)(0, 1, 2, 3, 4, 5, 6, 7) * STRIDE;
        const int8 c = a < 0 ? (int8)(0) : a >= size ? (int8)(size - 1) : a;
        v = (float8)(x[c.s0], x[c.s1], x[c.s2], x[c.s3], x[c.s4], x[c.s5], x[c.s6], x[c.s7]);
    }
    return ((w >= 0) & (w < PLANE_W)) ? v : (float8)(-INFINITY);
}

__kernel void maxpool_forward_lanes(__global const float* restrict x, const int H, const int W, const int OH,
                                    const int OW, const int planes, __global float* restrict y,
                                    __global int* restrict arg)
{
    const int zero = PLANE_ZERO(H, W), size = planes * (PLANE_H * PLANE_W);
    for (int plane = get_global_id(0) * PLANE_GROUP, end = plane + PLANE_GROUP; plane < end && plane < planes; plane++) {
        const int xp = plane * (PLANE_H * PLANE_W);
        for (int oh = 0; oh < PLANE_OH; oh++) {
            int hw[POOL];
            pool_rows(oh, zero, hw);
            const int o = (plane * PLANE_OH + oh) * PLANE_OW;
            for (int ow0 = 0; ow0 < PLANE_OW; ow0 += POOL_LANES) {
                // the 8 windows' first columns; the scan as pool_tap's, lane by lane
                const int8 w0 = (int8)(ow0 * STRIDE - PAD + zero) + (int8)(0, 1, 2, 3, 4, 5, 6, 7) * STRIDE;
                float8 v = (float8)(-INFINITY), nan_v = (float8)(0.0f);
                int8 best = (int8)(hw[0]) + (w0 > 0 ? w0 : (int8)(0)), nan_at = (int8)(-1);
#pragma unroll
                for (int i = 0; i < POOL; i++) {
#pragma unroll
                    for (int j = 0; j < POOL; j++) {
                        const int8 w = w0 + (int8)(j), at = (int8)(hw[i]) + w;
                        const float8 xv = pool_lanes(x, xp + hw[i] + ow0 * STRIDE - PAD + j + zero, w, size);
                        const int8 take = xv > v, is_nan = xv != xv;
                        v = take ? xv : v;
                        best = take ? at : best;
                        nan_v = is_nan ? xv : nan_v;
                        nan_at = is_nan ? at : nan_at;
                    }
                }
                const int8 has_nan = nan_at >= 0;
                *(__global pool_float8*)(y + o + ow0) = has_nan ? nan_v : v;
                *(__global pool_int8*)(arg + o + ow0) = has_nan ? nan_at : best;
            }
        }
    }
}

#if POOL == 3 && STRIDE == 2 && PAD == 1
// Optimisation of maxpool_backward_planes for CPUs, the same sums in the same order, for the
// network's pool (3x3, stride 2, pad 1) on planes of W = 2*OW columns with output rows of whole
// vectors (maxpool.forward's lanes_back). The scatter's dx[a] += dy chains through memory whenever two
// windows pick one input; this is the gather, 8 windows of a row at a time in vectors. Column 2k
// lies in window k alone, column 2k+1 in windows k+1 and k; row 2m in window row m alone, row
// 2m+1 in m+1 and m. So an input row's 16 columns are two float8 sums (even and odd columns) over
// one or two rows of dy and arg, each read as a vector and shifted by one window (lanes 1-7, then
// the next window's), and stored interleaved as one float16. A sum adds its terms latest window
// row first, then latest column -- the scatter's order -- and a window that did not pick the input
// adds 0.0f, which changes no sum (it starts at +0 and is never -0). global (planes / PLANE_GROUP).
__kernel void maxpool_backward_lanes(__global const float* restrict dy, __global const int* restrict arg,
                                     const int H, const int W, const int OH, const int OW, const int planes,
                                     __global float* restrict dx)
{
    for (int plane = get_global_id(0) * PLANE_GROUP, end = plane + PLANE_GROUP; plane < end && plane < planes; plane++) {
        __global const float* dyp = dy + plane * (PLANE_OH * PLANE_OW);
        __global const int* ap = arg + plane * (PLANE_OH * PLANE_OW);
        __global float* dxp = dx + plane * (PLANE_H * PLANE_W);
        for (int h = 0; h < PLANE_H; h++) {
            const int last = (h + 1) / 2;  // the latest window row holding row h; h odd: last - 1 too
            for (int ow0 = 0; ow0 < PLANE_OW; ow0 += POOL_LANES) {
                const int8 even_at = (int8)(h * PLANE_W + 2 * ow0) + (int8)(0, 2, 4, 6, 8, 10, 12, 14);
                const int8 odd_at = even_at + (int8)(1);
                const bool more = ow0 + POOL_LANES < PLANE_OW;  // window ow0 + 8 is in the row
                float8 even = (float8)(0.0f), odd = (float8)(0.0f);
                for (int oh = last; oh >= last - (h & 1); oh--) {
                    if (oh >= PLANE_OH) continue;
                    const int o = oh * PLANE_OW + ow0;
                    const int8 a = *(__global const pool_int8*)(ap + o);
                    const float8 d = *(__global const pool_float8*)(dyp + o);
                    const int8 a1 = (int8)(a.s1234, a.s567, more ? ap[o + POOL_LANES] : -1);
                    const float8 d1 = (float8)(d.s1234, d.s567, more ? dyp[o + POOL_LANES] : 0.0f);
                    even += a == even_at ? d : (float8)(0.0f);
                    odd += a1 == odd_at ? d1 : (float8)(0.0f);
                    odd += a == odd_at ? d : (float8)(0.0f);
                }
                *(__global pool_float16*)(dxp + h * PLANE_W + 2 * ow0) =
                    (float16)(even.s0, odd.s0, even.s1, odd.s1, even.s2, odd.s2, even.s3, odd.s3, even.s4, odd.s4,
                              even.s5, odd.s5, even.s6, odd.s6, even.s7, odd.s7);
            }
        }
    }
}
#endif
#undef POOL_LANES
#endif  // PLANE_H

// dx[h, w] = sum of dy over the windows that selected (h, w): a gather over the at most
// ceil(POOL/STRIDE)^2 windows that contain it, so overlaps sum without atomics. Window oh
// covers h when h - (oh*STRIDE - PAD) is in [0, POOL): the last is (h + PAD) / STRIDE.
// global (W, H, N*C).
__kernel void maxpool_backward(__global const float* dy, __global const int* arg, const int H,
                               const int W, const int OH, const int OW, const int planes,
                               __global float* dx)
{
    const int w = get_global_id(0), h = get_global_id(1), plane = get_global_id(2);
    if (w >= W || h >= H || plane >= planes) return;
    const int here = h * W + w;
    const int oh_last = (h + PAD) / STRIDE, ow_last = (w + PAD) / STRIDE;
    float s = 0.0f;
#pragma unroll
    for (int ti = 0; ti < (POOL + STRIDE - 1) / STRIDE; ti++) {
        const int oh = oh_last - ti;
        if (oh < 0 || oh >= OH || h + PAD - oh * STRIDE >= POOL) continue;
#pragma unroll
        for (int tj = 0; tj < (POOL + STRIDE - 1) / STRIDE; tj++) {
            const int ow = ow_last - tj;
            if (ow < 0 || ow >= OW || w + PAD - ow * STRIDE >= POOL) continue;
            const int o = (plane * OH + oh) * OW + ow;
            if (arg[o] == here) s += dy[o];
        }
    }
    dx[(plane * H + h) * W + w] = s;
}

// Optimisation of maxpool_backward, the same sums in the same order (on PoCL ~2.5x faster for
// pool1 of 50:500, ~1.4x for pool2): PoCL runs the gather above as scalar code, one
// work-item at a time, and pays each item's start-up and division; a work-item that walks a
// whole input row finds its rows of windows once, reads them contiguously, and has no
// bounds checks between the row's edges. A row's columns go in groups of STRIDE sharing
// their last window g = (w + PAD) / STRIDE. Used on CPUs (backend.py); GPUs want the
// per-element gather's many small items. global (planes * H).
#define POOL_T ((POOL + STRIDE - 1) / STRIDE)  // the windows per axis that can hold one input

// dx of the STRIDE columns w = g*STRIDE - PAD + jj of a row: the gather's terms in its order
// (latest window row first, then latest window column). `checked` masks windows and
// columns outside the row, at its edges.
ALWAYS_INLINE void maxpool_backward_group(__global const float* const* dyr, __global const int* const* ar,
                                   const int* here, const int g, const int W, const int OW,
                                   const bool checked, __global float* dxr)
{
#pragma unroll
    for (int jj = 0; jj < STRIDE; jj++) {
        const int w = g * STRIDE - PAD + jj;
        float s = 0.0f;
#pragma unroll
        for (int ti = 0; ti < POOL_T; ti++) {
#pragma unroll
            for (int t = 0; t < POOL_T; t++) {
                if (jj + t * STRIDE >= POOL) continue;  // window g - t ends before column w
                const int o = g - t;
                const bool in = !checked || (o >= 0 && o < OW);
                const int oc = !checked ? o : o < 0 ? 0 : o >= OW ? OW - 1 : o;
                const bool hit = in && ar[ti][oc] == here[ti] + w;
                s = hit ? s + dyr[ti][oc] : s;  // as `if (hit) s += ...`, without the branch
            }
        }
        if (!checked || (w >= 0 && w < W)) dxr[w] = s;
    }
}

__kernel void maxpool_backward_rows(__global const float* dy, __global const int* arg, const int H,
                                    const int W, const int OH, const int OW, const int planes,
                                    __global float* dx)
{
    const int r = get_global_id(0);
    if (r >= planes * H) return;
    const int plane = r / H, h = r - plane * H;
    // the window rows oh = (h + PAD) / STRIDE - ti that may hold row h; one that does not (or
    // lies outside) reads a real row but compares against a position no argmax has
    __global const float* dyr[POOL_T];
    __global const int* ar[POOL_T];
    int here[POOL_T];
#pragma unroll
    for (int ti = 0; ti < POOL_T; ti++) {
        const int oh = (h + PAD) / STRIDE - ti;
        const bool holds = oh >= 0 && oh < OH && h + PAD - oh * STRIDE < POOL;
        const int o = (plane * OH + (oh < 0 ? 0 : oh >= OH ? OH - 1 : oh)) * OW;
        dyr[ti] = dy + o;
        ar[ti] = arg + o;
        here[ti] = holds ? h * W : -W - 1;  // -W - 1 + w < 0 <= any argmax
    }
    __global float* dxr = dx + r * W;
    // groups first .. last hold the row's columns; lo .. hi those with every column inside
    // and every window g - t in 0 .. OW - 1, walked unchecked
    const int first = PAD / STRIDE, last = (W - 1 + PAD) / STRIDE;
    // (ternaries, not min and max: PoCL's CPU builds call those out of line)
#define MAX_(a, b) ((a) > (b) ? (a) : (b))
#define MIN_(a, b) ((a) < (b) ? (a) : (b))
    const int lo = MIN_(MAX_(MAX_(POOL_T - 1, (PAD + STRIDE - 1) / STRIDE), first), last + 1);
    const int hi = MAX_(MIN_(MIN_(OW - 1, (W + PAD - STRIDE) / STRIDE), last), lo - 1);
#undef MAX_
#undef MIN_
    int g = first;
    for (; g < lo; g++) maxpool_backward_group(dyr, ar, here, g, W, OW, true, dxr);
    for (; g <= hi; g++) maxpool_backward_group(dyr, ar, here, g, W, OW, false, dxr);
    for (; g <= last; g++) maxpool_backward_group(dyr, ar, here, g, W, OW, true, dxr);
}

#endif  // POOL

// ------------------------------------------------------------------ loss

// Per row: z = logits - max, loss = log(sum e^z) - z[label], d = (softmax - onehot) / N.
__kernel void softmax_xent(__global const float* logits, __global const int* labels, const int N,
                           const int K, __global float* dlogits, __global float* row_loss)
{
    const int r = get_global_id(0);
    if (r >= N) return;
    __global const float* z = logits + r * K;
    __global float* d = dlogits + r * K;
    float mx = z[0];
    for (int k = 1; k < K; k++) mx = fmax(mx, z[k]);
    float se = 0.0f;
    for (int k = 0; k < K; k++) {
        const float ek = exp(z[k] - mx);
        d[k] = ek;
        se += ek;
    }
    const int y = labels[r];
    row_loss[r] = log(se) - (z[y] - mx);
    for (int k = 0; k < K; k++) d[k] = d[k] / se;
    d[y] = d[y] - 1.0f;
    for (int k = 0; k < K; k++) d[k] = d[k] / (float)N;
}

// out[0] = mean of the N row losses (a single work-item: N is a batch size).
__kernel void mean_of(__global const float* v, const int N, __global float* out)
{
    if (get_global_id(0) != 0) return;
    float s = 0.0f;
    for (int i = 0; i < N; i++) s += v[i];
    out[0] = s / (float)N;
}

// ------------------------------------------------------------------ optimiser

// PyTorch SGD, numpy's order: v = momentum*v + g (+ weight_decay*param); param -= lr*v.
inline void sgd_update_at(__global float* param, __global const float* grad, __global float* velocity,
                          const int e, const float lr, const float momentum, const float weight_decay)
{
    float v = velocity[e] * momentum;
    v = v + grad[e];
    const float decayed = v + weight_decay * param[e];
    v = weight_decay != 0.0f ? decayed : v;  // `if (weight_decay != 0) v += ...`, as a select
    velocity[e] = v;
    param[e] = param[e] - lr * v;
}

__kernel void sgd_update(__global float* param, __global const float* grad, __global float* velocity,
                         const float lr, const float momentum, const float weight_decay,
                         const int total)
{
    const int e = get_global_id(0);
    if (e < total) sgd_update_at(param, grad, velocity, e, lr, momentum, weight_decay);
}

// The rows kernel (an optimisation, for CPUs): work-item i walks [i*chunk, (i+1)*chunk).
__kernel void sgd_update_rows(__global float* restrict param, __global const float* restrict grad,
                              __global float* restrict velocity, const float lr, const float momentum,
                              const float weight_decay, const int total, const int chunk)
{
    CHUNK_BOUNDS(start, end, total, chunk);
    for (int e = start; e < end; e++) sgd_update_at(param, grad, velocity, e, lr, momentum, weight_decay);
}

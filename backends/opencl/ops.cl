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
// Arithmetic follows backends/numpy_backend.py operation by operation (same
// order, same float32 roundings), and contraction of a*b+c into a fused
// multiply-add is off, so the elementwise ops agree with numpy to the last bit or
// two; reductions differ only in summation order.

#pragma OPENCL FP_CONTRACT OFF

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

// ------------------------------------------------------------------ elementwise

// NaN stays NaN, as with np.maximum, so a diverging run shows it.
__kernel void relu_forward(__global const float* x, const int total, __global float* y)
{
    const int e = get_global_id(0);
    if (e < total) y[e] = x[e] < 0.0f ? 0.0f : x[e];  // NaN compares false: it stays NaN
}

// numpy: dy * (y > 0), where y is the forward output (y > 0 exactly when x > 0).
__kernel void relu_backward(__global const float* dy, __global const float* y, const int total,
                            __global float* dx)
{
    const int e = get_global_id(0);
    if (e < total) dx[e] = dy[e] * (y[e] > 0.0f ? 1.0f : 0.0f);
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

// out = a(c) + a(c-1) + ... + a(c-before) + a(c+1) + ... + a(c+after), clipped to [0, C):
// numpy's _channel_window_sum, same order. a(cc) reads channel cc of this pixel. The
// window is compiled in so the loops unroll and PoCL vectorises across work-items.
#define CHANNEL_WINDOW_SUM(out, a, c, C, before, after)                   \
    do {                                                                   \
        out = a(c);                                                        \
        _Pragma("unroll") for (int d = 1; d <= (before); d++)              \
            if ((c) - d >= 0) out += a((c) - d);                           \
        _Pragma("unroll") for (int d = 1; d <= (after); d++)               \
            if ((c) + d < (C)) out += a((c) + d);                          \
    } while (0)

// y = x * s^-beta, s = k + alpha/size * sum over the channel window of x^2.
// Keeps s and p = s^-beta for the backward, as numpy does. global (H*W, C, N).
__kernel void lrn_forward(__global const float* x, const int C, const int HW, const int N,
                          const float alpha_over_size, const float k, const float beta,
                          __global float* y, __global float* s_out, __global float* p_out)
{
    const int q = get_global_id(0), c = get_global_id(1), n = get_global_id(2);
    if (q >= HW || c >= C || n >= N) return;
    const int e = (n * C + c) * HW + q;
    __global const float* xn = x + n * C * HW + q;
#define SQ(cc) (xn[(cc) * HW] * xn[(cc) * HW])
    float s;
    CHANNEL_WINDOW_SUM(s, SQ, c, C, LRN_BEFORE, LRN_AFTER);
#undef SQ
    s = s * alpha_over_size;
    s = s + k;
    const float p = neg_pow(s, beta);
    y[e] = x[e] * p;
    s_out[e] = s;
    p_out[e] = p;
}

// dx_j = dy_j p_j - (2 alpha beta / size) x_j * sum over the mirrored window of dy_i y_i / s_i
// (see LocalResponseNorm in tinyconv/layers.py for the derivation). global (H*W, C, N).
__kernel void lrn_backward(__global const float* dy, __global const float* x,
                           __global const float* y, __global const float* s,
                           __global const float* p, const int C, const int HW, const int N,
                           const float coef, __global float* dx)
{
    const int q = get_global_id(0), c = get_global_id(1), n = get_global_id(2);
    if (q >= HW || c >= C || n >= N) return;
    const int e = (n * C + c) * HW + q;
    const int base = n * C * HW + q;
#define U(cc) (dy[base + (cc) * HW] * y[base + (cc) * HW] / s[base + (cc) * HW])
    float t;
    CHANNEL_WINDOW_SUM(t, U, c, C, LRN_AFTER, LRN_BEFORE);  // the mirrored window
#undef U
    dx[e] = dy[e] * p[e] - coef * x[e] * t;
}

// ReLU then LRN in one kernel each way: an optimisation beside the plain kernels above and
// relu_forward/relu_backward, which stay (backends/base.py's relu_lrn_forward is their
// composition). The map is read once and written once: r = max(x, 0) is never stored, since the
// backward gets it from x again, nor is p = s^-beta, which the backward recomputes from s (the
// same operations, so the same bits). The plain pair moves 15 maps' worth of memory per step
// (relu 2 + 3, LRN 4 + 6), this one 7 (forward: x in, y and s out; backward: dy, x, y, s in, dx out).

// y = r * s^-beta with r = max(x, 0) (a NaN stays NaN) and s = k + alpha/size * the window sum
// of r^2. global (H*W, C, N).
__kernel void relu_lrn_forward(__global const float* x, const int C, const int HW, const int N,
                               const float alpha_over_size, const float k, const float beta,
                               __global float* y, __global float* s_out)
{
    const int q = get_global_id(0), c = get_global_id(1), n = get_global_id(2);
    if (q >= HW || c >= C || n >= N) return;
    const int e = (n * C + c) * HW + q;
    __global const float* xn = x + n * C * HW + q;
#define R(cc) (xn[(cc) * HW] < 0.0f ? 0.0f : xn[(cc) * HW])
#define SQ(cc) (R(cc) * R(cc))
    float s;
    CHANNEL_WINDOW_SUM(s, SQ, c, C, LRN_BEFORE, LRN_AFTER);
#undef SQ
#undef R
    s = s * alpha_over_size;
    s = s + k;
    const float r = x[e] < 0.0f ? 0.0f : x[e];
    y[e] = r * neg_pow(s, beta);
    s_out[e] = s;
}

// dx_j = [r_j > 0] * (dy_j p_j - (2 alpha beta / size) r_j * sum over the mirrored window of
// dy_i y_i / s_i), r = max(x, 0), p = s^-beta: lrn_backward, then relu_backward's mask as a
// product (so a NaN in dy stays NaN, as numpy's dy * (r > 0)). global (H*W, C, N).
__kernel void relu_lrn_backward(__global const float* dy, __global const float* x,
                                __global const float* y, __global const float* s, const int C,
                                const int HW, const int N, const float beta, const float coef,
                                __global float* dx)
{
    const int q = get_global_id(0), c = get_global_id(1), n = get_global_id(2);
    if (q >= HW || c >= C || n >= N) return;
    const int e = (n * C + c) * HW + q;
    const int base = n * C * HW + q;
#define U(cc) (dy[base + (cc) * HW] * y[base + (cc) * HW] / s[base + (cc) * HW])
    float t;
    CHANNEL_WINDOW_SUM(t, U, c, C, LRN_AFTER, LRN_BEFORE);  // the mirrored window
#undef U
    const float r = x[e] < 0.0f ? 0.0f : x[e];
    const float dr = dy[e] * neg_pow(s[e], beta) - coef * r * t;
    dx[e] = dr * (r > 0.0f ? 1.0f : 0.0f);
}

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

// xhat = (x - mean) * invstd, y = xhat * gamma + beta. global (H*W, C, N).
__kernel void bn_forward(__global const float* x, __global const float* mean,
                         __global const float* invstd, __global const float* gamma,
                         __global const float* beta, const int C, const int HW, const int N,
                         __global float* xhat, __global float* y)
{
    const int q = get_global_id(0), c = get_global_id(1), n = get_global_id(2);
    if (q >= HW || c >= C || n >= N) return;
    const int e = (n * C + c) * HW + q;
    const float xh = (x[e] - mean[c]) * invstd[c];
    xhat[e] = xh;
    y[e] = xh * gamma[c] + beta[c];
}

// training: dx = g * (dy - dbeta/m - xhat * dgamma/m);  eval: dx = g * dy;  g = gamma * invstd.
// global (H*W, C, N).
__kernel void bn_backward(__global const float* dy, __global const float* xhat,
                          __global const float* gamma, __global const float* invstd,
                          __global const float* dgamma, __global const float* dbeta,
                          const int training, const float m, const int C, const int HW,
                          const int N, __global float* dx)
{
    const int q = get_global_id(0), c = get_global_id(1), n = get_global_id(2);
    if (q >= HW || c >= C || n >= N) return;
    const int e = (n * C + c) * HW + q;
    const float g = gamma[c] * invstd[c];
    if (training)
        dx[e] = g * (dy[e] - dbeta[c] / m - xhat[e] * (dgamma[c] / m));
    else
        dx[e] = dy[e] * g;
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
inline void maxpool_backward_group(__global const float* const* dyr, __global const int* const* ar,
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
    const int lo = min(max(max(POOL_T - 1, (PAD + STRIDE - 1) / STRIDE), first), last + 1);
    const int hi = max(min(min(OW - 1, (W + PAD - STRIDE) / STRIDE), last), lo - 1);
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
__kernel void sgd_update(__global float* param, __global const float* grad, __global float* velocity,
                         const float lr, const float momentum, const float weight_decay,
                         const int total)
{
    const int e = get_global_id(0);
    if (e >= total) return;
    float v = velocity[e] * momentum;
    v = v + grad[e];
    if (weight_decay != 0.0f) v = v + weight_decay * param[e];
    velocity[e] = v;
    param[e] = param[e] - lr * v;
}

// GEMM for the OpenCL backend:  C (M x N) = A (M x K) @ B (K x N)  [+ bias per row].
//
// OpenCL C 1.2, float32. Every GEMM of the backend (the three of a convolution,
// the three of a linear layer) is this one product; only the index maps differ:
//
//   A(m, k) = A[m*sam + (k / KI)*sakb + (k % KI)*sak]
//       a strided matrix whose reduction axis may be split in two ("K = KB x KI"),
//       e.g. dY in NCHW read as (F, N*OH*OW): k = (n, q), row f.
//   B(k, n) = B[(n / NB)*K*NB + k*NB + n % NB]
//       "panels": column blocks of width NB stored one after another, each
//       K x NB row-major, zero-padded past column N. im2col writes this layout
//       directly, so the inner loop reads B contiguously (what BLAS calls packing).
//   C(m, n) -> C[m*scm + (n / CI)*scb + (n % CI)*scn]
//       e.g. the conv output written straight into NCHW: n = (image, pixel).
//
// Split-K: work-group row z of dimension 2 sums k in [z*KC, min(K, (z+1)*KC)) and
// writes a row-major partial product to C + z*M*N; gemm_sum_splits adds them up.
// That gives parallelism and cache-sized B chunks when K is long (dW, linear).
//
// Two variants with identical arguments, chosen per device and shape by timing
// (backends/opencl/gemm.py):
//   gemm_vec    register blocking with explicit vectors, no local memory: each
//               work-item computes RM rows x NB = VW*RN columns. Best on CPUs,
//               where PoCL runs a work-item as a scalar loop unless the code
//               itself is written in vectors.
//   gemm_tiled  the GPU classic: a work-group stages TSK-deep tiles of A and B in
//               local memory and each work-item computes WM x WN outputs from them.

// No built-in function in gemm_vec: PoCL's CPU builds (3.0's wheel) call vload8, vstore8 and even
// min() out of line, and around each call the compiler spills every live vector register -- all
// the accumulators. Vectors are read through a vector pointer instead (aligned: the panels of B
// start at multiples of NB floats), and stored lane by lane. Measured on an 8-wide AVX2 target:
// 67 -> 211 GFLOP/s, from a third of OpenBLAS's SGEMM to more than all of it.
#define IMIN(a, b) ((a) < (b) ? (a) : (b))

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

// Where C(m, n) lives (see the header).
#define C_INDEX(m, n) ((m)*scm + ((n) / CI) * scb + ((n) % CI) * scn)

#define GEMM_ARGS                                                                      \
    const int M, const int N, const int K, const int KC,                               \
    __global const float* A, const int sam, const int sak, const int KI, const int sakb, \
    __global const float* B,                                                           \
    __global float* C, const int scm, const int scn, const int CI, const int scb,       \
    __global const float* bias, const int has_bias

#ifdef RM  // ------------------------------------------------------------------ gemm_vec

#define VEC CAT(float, VW)
#define NB (VW * RN)

// acc[i][:] += A(m0 + i, k + t) * B(k + t, panel) for t < len. Written as a plain
// a * b + c: OpenCL C contracts that to a fused multiply-add where the device has one
// (FP_CONTRACT is on by default), while PoCL compiles mad() to a separate multiply and
// add -- half the speed (measured: 98 vs ~50 GFLOP/s on AVX-512).
#define VEC_GEMM_LOOP(STEP)                                                            \
    for (int t = 0; t < len; t++) {                                                    \
        VEC bv[RN];                                                                    \
        _Pragma("unroll") for (int j = 0; j < RN; j++) bv[j] = ((__global const VEC*)(bk + t * NB))[j]; \
        _Pragma("unroll") for (int i = 0; i < RM; i++) {                               \
            const VEC av = (VEC)(ap[i][t * (STEP)]);                                   \
            _Pragma("unroll") for (int j = 0; j < RN; j++) acc[i][j] += av * bv[j]; \
        }                                                                              \
    }

// global (ceil(M/RM), N_panels, splits), any local size along dimension 0.
__kernel void gemm_vec(GEMM_ARGS)
{
    const int m0 = get_global_id(0) * RM;
    const int panel = get_global_id(1);
    const int z = get_global_id(2);
    if (m0 >= M) return;
    const int k_begin = z * KC;
    const int k_end = IMIN(K, k_begin + KC);

    VEC acc[RM][RN];
#pragma unroll
    for (int i = 0; i < RM; i++)
#pragma unroll
        for (int j = 0; j < RN; j++) acc[i][j] = (VEC)(0.0f);

    __global const float* bpanel = B + (size_t)panel * K * NB;
    int k = k_begin;
    while (k < k_end) {  // one pass per contiguous run of the split reduction axis
        const int kb = k / KI;
        const int ki = k - kb * KI;
        const int len = IMIN(KI - ki, k_end - k);
        __global const float* bk = bpanel + (size_t)k * NB;
        // Rows past M read row M-1 (valid memory); their results are never stored.
        __global const float* ap[RM];
#pragma unroll
        for (int i = 0; i < RM; i++) ap[i] = A + IMIN(m0 + i, M - 1) * sam + kb * sakb + ki * sak;
        // The same loop twice: with the A step a literal 1 (the common case) the
        // compiler keeps plain pointer increments; measured ~20% faster on PoCL.
        if (sak == 1) {
            VEC_GEMM_LOOP(1)
        } else {
            VEC_GEMM_LOOP(sak)
        }
        k += len;
    }

    C += (size_t)z * M * N;  // split z > 0 writes its partial product to slice z of the scratch
    const int n0 = panel * NB;
#pragma unroll
    for (int i = 0; i < RM; i++) {
        const int m = m0 + i;
        if (m >= M) break;
        const float bm = has_bias ? bias[m] : 0.0f;
#pragma unroll
        for (int j = 0; j < RN; j++) {
            const int n = n0 + j * VW;
            const VEC v = acc[i][j] + (VEC)(bm);
            const float* lanes = (const float*)&v;
            if (scn == 1 && n + VW <= N && (n % CI) + VW <= CI) {  // VW floats in a row of C
                __global float* c = C + C_INDEX(m, n);
#pragma unroll
                for (int l = 0; l < VW; l++) c[l] = lanes[l];
            } else {  // a block that crosses the edge of C or of an image: one by one
                for (int l = 0; l < VW && n + l < N; l++) C[C_INDEX(m, n + l)] = lanes[l];
            }
        }
    }
}

#endif  // RM

#ifdef TSK  // ---------------------------------------------------------------- gemm_tiled

// Work-group (TX, TY); it computes a TSM x NB block of C, TSM = TY*WM, NB = TX*WN.
// Work-item (tx, ty) owns rows ty + i*TY and columns tx + j*TX, so neighbouring
// work-items read neighbouring local-memory words (no bank conflicts).
#define TSM (TY * WM)
#define NB (TX * WN)

// global (TX * N_panels, TY * ceil(M/TSM), splits), local (TX, TY, 1).
__kernel __attribute__((reqd_work_group_size(TX, TY, 1))) void gemm_tiled(GEMM_ARGS)
{
    __local float As[TSK][TSM + 1];  // +1: a column walk does not hit one bank
    __local float Bs[TSK][NB];
    const int tx = get_local_id(0), ty = get_local_id(1);
    const int lid = ty * TX + tx;
    const int panel = get_group_id(0);
    const int mt = get_group_id(1) * TSM;
    const int z = get_group_id(2);
    const int k_begin = z * KC;
    const int k_end = IMIN(K, k_begin + KC);
    __global const float* bpanel = B + (size_t)panel * K * NB;

    float acc[WM][WN];
#pragma unroll
    for (int i = 0; i < WM; i++)
#pragma unroll
        for (int j = 0; j < WN; j++) acc[i][j] = 0.0f;

    for (int k0 = k_begin; k0 < k_end; k0 += TSK) {
        // stage the A tile (TSM x TSK), consecutive work-items on consecutive k
        for (int e = lid; e < TSM * TSK; e += TX * TY) {
            const int kk = e % TSK, mm = e / TSK;
            const int k = k0 + kk, m = mt + mm;
            float v = 0.0f;
            if (k < k_end && m < M) v = A[m * sam + (k / KI) * sakb + (k % KI) * sak];
            As[kk][mm] = v;
        }
        // stage the B tile: TSK whole rows of the panel, one contiguous block
        for (int e = lid; e < TSK * NB; e += TX * TY) {
            const int kk = e / NB, nn = e % NB;
            Bs[kk][nn] = (k0 + kk < k_end) ? bpanel[(size_t)(k0 + kk) * NB + nn] : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#pragma unroll
        for (int kk = 0; kk < TSK; kk++) {
            float a[WM], b[WN];
#pragma unroll
            for (int i = 0; i < WM; i++) a[i] = As[kk][ty + i * TY];
#pragma unroll
            for (int j = 0; j < WN; j++) b[j] = Bs[kk][tx + j * TX];
#pragma unroll
            for (int i = 0; i < WM; i++)
#pragma unroll
                for (int j = 0; j < WN; j++) acc[i][j] += a[i] * b[j];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    C += (size_t)z * M * N;
#pragma unroll
    for (int i = 0; i < WM; i++) {
        const int m = mt + ty + i * TY;
        if (m < M) {
            const float bm = has_bias ? bias[m] : 0.0f;
#pragma unroll
            for (int j = 0; j < WN; j++) {
                const int n = panel * NB + tx + j * TX;
                if (n < N) C[C_INDEX(m, n)] = acc[i][j] + bm;
            }
        }
    }
}

#endif  // TSK

// Sum the S partial products (S, M, N) of a split-K GEMM into C (same index map),
// adding the bias. global (N, M) rounded up.
__kernel void gemm_sum_splits(const int M, const int N, const int S, __global const float* P,
                              __global float* C, const int scm, const int scn,
                              const int CI, const int scb, __global const float* bias,
                              const int has_bias)
{
    const int n = get_global_id(0), m = get_global_id(1);
    if (n >= N || m >= M) return;
    float s = 0.0f;
    for (int z = 0; z < S; z++) s += P[((size_t)z * M + m) * N + n];
    if (has_bias) s += bias[m];
    C[C_INDEX(m, n)] = s;
}

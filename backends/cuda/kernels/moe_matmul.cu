// ---- mixture-of-experts: the experts' matmuls, one launch per projection --------------------
//
// grid (ceil(n / 4), experts), 4 warps: block (x, e) computes outputs 4x .. 4x + 3 of expert e
// over expert e's grouped rows [offsets[e], offsets[e + 1]) (offsets from moe_plan, on the
// device), 8 rows per pass over the weights with the GEMV kernels' arithmetic (gemv_*_body of
// matmul.cu, bit for bit what gemv_*_r8 computes on the same rows). An expert with no rows
// returns at once. `wt` holds 3 device addresses per expert: its weights, scales and minimums
// (the packed layout of matmul.cu; the last two unused by f16w and dense). The rows are the
// gathered rows, so a quantized format reads their 8-bit form (quantize_q8 over all of them,
// rows k apart) and f16w / dense the rows themselves.

typedef unsigned long long u64;

#define MOE_MM_ROWS 8

// Dense weights in the activation type: n rows of k values of T, products in f32 (gemv_f16w's
// order: lanes over 8-value chunks when k is a multiple of 8, else over single values).
template <typename T, int R>
__device__ __forceinline__ void gemv_dense_body(const T* w, int n, int k, const T* x, int ldx,
                                                int rows, T* out, int ldo) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= n) {
        return; // the whole warp: this kernel has no block-wide barrier
    }
    float acc[R];
    for (int r = 0; r < R; ++r) {
        acc[r] = 0.0f;
    }
    const T* wr = w + (i64)o * k;
    if ((k & 7) == 0) {
        for (int c = lane * 8; c < k; c += 256) {
            for (int r = 0; r < R; ++r) {
                if (r < rows) {
                    const T* xr = x + (i64)r * ldx + c;
                    float s = 0.0f;
                    for (int j = 0; j < 8; ++j) {
                        s = fmaf(to_f32(wr[c + j]), to_f32(xr[j]), s);
                    }
                    acc[r] += s;
                }
            }
        }
    } else {
        for (int c = lane; c < k; c += 32) {
            const float wv = to_f32(wr[c]);
            for (int r = 0; r < R; ++r) {
                if (r < rows) {
                    acc[r] = fmaf(wv, to_f32(x[(i64)r * ldx + c]), acc[r]);
                }
            }
        }
    }
    store_rows<T, R>(acc, lane, rows, out + o, ldo);
}

template <typename T, int FMT>
__device__ __forceinline__ void moe_mm_q_body(const u64* wt, const int* offsets, int n, int k,
                                              const signed char* xq, const u32* xs, T* out,
                                              int ldo) {
    const int e = blockIdx.y;
    const int r_end = offsets[e + 1];
    const u8* w = (const u8*)wt[3 * e];
    const u16* wd = (const u16*)wt[3 * e + 1];
    const u16* wm = (const u16*)wt[3 * e + 2];
    const int nb = k >> 5;
    for (int r0 = offsets[e]; r0 < r_end; r0 += MOE_MM_ROWS) {
        const int rows = min(MOE_MM_ROWS, r_end - r0);
        gemv_q_body<T, FMT, MOE_MM_ROWS>(w, wd, wm, n, k, xq + (i64)r0 * k,
                                         xs + (i64)r0 * nb * 4, rows, out + (i64)r0 * ldo, ldo);
    }
}

template <typename T, bool F16W>
__device__ __forceinline__ void moe_mm_f_body(const u64* wt, const int* offsets, int n, int k,
                                              const T* x, int ldx, T* out, int ldo) {
    const int e = blockIdx.y;
    const int r_end = offsets[e + 1];
    for (int r0 = offsets[e]; r0 < r_end; r0 += MOE_MM_ROWS) {
        const int rows = min(MOE_MM_ROWS, r_end - r0);
        const T* xr = x + (i64)r0 * ldx;
        T* o = out + (i64)r0 * ldo;
        if (F16W) {
            gemv_f16w_body<T, MOE_MM_ROWS>((const u8*)wt[3 * e], n, k, xr, ldx, rows, o, ldo);
        } else {
            gemv_dense_body<T, MOE_MM_ROWS>((const T*)wt[3 * e], n, k, xr, ldx, rows, o, ldo);
        }
    }
}

#define MOE_MM_Q_ONE(T, S, FMT, FS)                                                                \
    extern "C" __global__ void moe_mm_##FS##_##S(const u64* wt, const int* offsets, int n, int k, \
                                                 const signed char* xq, const u32* xs, T* out,     \
                                                 int ldo) {                                        \
        moe_mm_q_body<T, FMT>(wt, offsets, n, k, xq, xs, out, ldo);                               \
    }
#define MOE_MM_F_ONE(T, S, F16W, FS)                                                               \
    extern "C" __global__ void moe_mm_##FS##_##S(const u64* wt, const int* offsets, int n, int k, \
                                                 const T* x, int ldx, T* out, int ldo) {           \
        moe_mm_f_body<T, F16W>(wt, offsets, n, k, x, ldx, out, ldo);                              \
    }
#define MOE_MM(T, S)                                                                               \
    MOE_MM_F_ONE(T, S, true, f16w)                                                                 \
    MOE_MM_Q_ONE(T, S, WF_Q4_0, q4_0)                                                              \
    MOE_MM_Q_ONE(T, S, WF_Q4_1, q4_1)                                                              \
    MOE_MM_Q_ONE(T, S, WF_Q8_0, q8_0)                                                              \
    MOE_MM_F_ONE(T, S, false, dense)
NPU_FOR_EACH_ACT(MOE_MM)

// A decode layer's whole feed-forward block in one launch (backends/cuda/src/fold_ffn.rs,
// `NPU_SERVING_CUDA_FUSE=4`): RMS norm of the residual rows, the gate/up product, SwiGLU, the
// 8-bit form of the activations, the down product and the residual add.
//
// Block b owns units [32 b, 32 b + 32) of the intermediate dimension (FFN_UNITS, one block of 32
// of the 8-bit activations, so their quantization is local to the block and exact):
// 1. every block normalises every row of x (the residual) itself with the norm kernel's code
//    (`rms_row_scale`, `rms_scale_row`, as `gemv_fold_body` does; the host gives the block
//    row_threads(k, 256) threads, as it gives the norm) into 8-bit rows in dynamic shared memory;
//    block 0 also writes the normalised rows to xn;
// 2. its gate and up rows, SwiGLU, into gu and h (`gemv_fold_body`'s FOLD_SWIGLU code: the same
//    bits as FUSE=2 and 3), and h's 8-bit block (`q8_store_block`) into shared memory;
// 3. its part of the down product: for every output o and row r, the product of weight block
//    (o, b) of the down matrix with that 8-bit block (`gemv_q_partial`'s arithmetic for one
//    block), into partials[b][r][o] (f32);
// 4. `__threadfence`, then one `atomicInc` of the counter per block: the block that takes the
//    last ticket (the counter wraps back to 0 there, ready for the next launch or graph replay)
//    adds, for each (r, o), the partials of blocks 0, 1, ... in that order, writes the sum to out
//    and adds it into the residual (rounded as `add` rounds it).
// The sum's order is fixed, so every run (and a graph replay) gives the same bits, but it is not
// the GEMV's lane order: out and x differ from the separate launches' in the last bits.
//
// grid (ff / 32), dynamic shared memory rows * k * 3 / 2 bytes. The down matrix's format is an
// argument (dfmt, WF_*), the gate/up matrix's a template parameter.

#define FFN_UNITS 32

// Partial down products of block `blockIdx.x` (weight blocks (o, blockIdx.x) of a DFMT matrix of
// n rows, nb blocks each) with the 8-bit rows hq / hs (one block of 32 each): partials[b][r][o].
template <int DFMT, int R>
__device__ __forceinline__ void ffn_down_part(const u8* w, const u16* wd, const u16* wm, int n,
                                              int nb, const uint4* hq, const uint4* hs, int rows,
                                              float* partials) {
    const int b = blockIdx.x;
    const int qb = DFMT == WF_Q8_0 ? 32 : 16;
    const int offset = DFMT == WF_Q4_0 ? 8 : 0;
    for (int o = threadIdx.x; o < n; o += blockDim.x) {
        const i64 blk = (i64)o * nb + b;
        u32 wq[8];
        const uint4* wp = (const uint4*)(w + blk * qb);
        const uint4 w0 = wp[0];
        wq[0] = w0.x;
        wq[1] = w0.y;
        wq[2] = w0.z;
        wq[3] = w0.w;
        if (DFMT == WF_Q8_0) {
            const uint4 w1 = wp[1];
            wq[4] = w1.x;
            wq[5] = w1.y;
            wq[6] = w1.z;
            wq[7] = w1.w;
        }
        const float dw = f16_bits_to_f32(wd[blk]);
        const float mw = DFMT == WF_Q4_1 ? f16_bits_to_f32(wm[blk]) : 0.0f;
        for (int r = 0; r < R && r < rows; ++r) {
            const uint4 s4 = hs[r];
            int dot = block_dot<DFMT>(wq, hq[2 * r], hq[2 * r + 1]);
            dot -= offset * (int)s4.z;
            float acc = fmaf((float)dot, dw * __uint_as_float(s4.x), 0.0f);
            if (DFMT == WF_Q4_1) {
                acc = fmaf(mw, __uint_as_float(s4.y), acc);
            }
            partials[((i64)b * rows + r) * n + o] = acc;
        }
    }
}

template <typename T, int FMT, int R>
__device__ __forceinline__ void ffn_fused_body(const u8* gw, const u16* gwd, const u16* gwm,
                                               int ff, int k, const u8* dw, const u16* dwd,
                                               const u16* dwm, int dfmt, int n, T* x, int ldx,
                                               const void* nw, int nwdt, float eps, T* xn,
                                               int ldxn, int rows, T* gu, int ldgu, T* h,
                                               int ldh, T* out, int ldo, float* partials,
                                               u32* counter) {
    __shared__ float red[32];
    __shared__ float hv[R * FFN_UNITS];
    __shared__ uint4 hq[R * 2];
    __shared__ uint4 hs[R];
    __shared__ int last;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    // 1. The norm, into 8-bit rows (gemv_fold_body's prologue).
    signed char* sq = (signed char*)DYN_SMEM;
    u32* ss = (u32*)(DYN_SMEM + (i64)rows * k);
    for (int r = 0; r < rows; ++r) {
        const T* xr = x + (i64)r * ldx;
        const float scale = rms_row_scale<T>(xr, k, eps, red);
        T* o = blockIdx.x == 0 ? xn + (i64)r * ldxn : (T*)0;
        rms_scale_row<T>(xr, nw, nwdt, scale, k, o, r, sq, ss);
    }
    __syncthreads();
    // 2. Gate and up rows of the block's units, SwiGLU (gemv_fold_body's FOLD_SWIGLU).
    const int u0 = blockIdx.x * FFN_UNITS;
    for (int i = warp; i < FFN_UNITS && u0 + i < ff; i += warps) {
        const int u = u0 + i;
        float acc[R];
        gemv_q_partial<FMT, R>(gw, gwd, gwm, u, k, sq, ss, rows, acc);
        int r;
        const float t = fold_total<R>(acc, lane, rows, &r);
        float acc_up[R];
        gemv_q_partial<FMT, R>(gw, gwd, gwm, ff + u, k, sq, ss, rows, acc_up);
        int r_up;
        const float t_up = fold_total<R>(acc_up, lane, rows, &r_up);
        if (r >= 0) {
            const T g = from_f32<T>(t);
            const T up = from_f32<T>(t_up);
            gu[(i64)r * ldgu + u] = g;
            gu[(i64)r * ldgu + ff + u] = up;
            const T v = swiglu_value<T>(to_f32(g), to_f32(up));
            h[(i64)r * ldh + u] = v;
            hv[r * FFN_UNITS + i] = to_f32(v);
        }
    }
    __syncthreads();
    // The block's 8-bit activations: one block of 32 per row.
    for (int r = warp; r < rows; r += warps) {
        q8_store_block(hv[r * FFN_UNITS + lane], r, FFN_UNITS, 0, (signed char*)hq, (u32*)hs);
    }
    __syncthreads();
    // 3. The block's part of the down product.
    const int nb = ff / FFN_UNITS;
    if (dfmt == WF_Q4_0) {
        ffn_down_part<WF_Q4_0, R>(dw, dwd, dwm, n, nb, hq, hs, rows, partials);
    } else if (dfmt == WF_Q4_1) {
        ffn_down_part<WF_Q4_1, R>(dw, dwd, dwm, n, nb, hq, hs, rows, partials);
    } else {
        ffn_down_part<WF_Q8_0, R>(dw, dwd, dwm, n, nb, hq, hs, rows, partials);
    }
    // 4. The last block to finish adds the partials in block order.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicInc(counter, gridDim.x - 1) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    const volatile float* p = partials;
    const int blocks = gridDim.x;
    for (int i = threadIdx.x; i < rows * n; i += blockDim.x) {
        const int r = i / n;
        const int o = i - r * n;
        float s = 0.0f;
        for (int b = 0; b < blocks; ++b) {
            s += p[((i64)b * rows + r) * n + o];
        }
        const T y = from_f32<T>(s);
        out[(i64)r * ldo + o] = y;
        T* q = x + (i64)r * ldx + o;
        *q = from_f32<T>(to_f32(*q) + to_f32(y));
    }
}

#define FFN_FUSED_ONE(T, S, FMT, FS, R)                                                            \
    extern "C" __global__ void ffn_fused_##FS##_r##R##_##S(                                        \
        const u8* gw, const u16* gwd, const u16* gwm, int ff, int k, const u8* dw,                \
        const u16* dwd, const u16* dwm, int dfmt, int n, T* x, int ldx, const void* nw, int nwdt, \
        float eps, T* xn, int ldxn, int rows, T* gu, int ldgu, T* h, int ldh, T* out, int ldo,    \
        float* partials, u32* counter) {                                                           \
        ffn_fused_body<T, FMT, R>(gw, gwd, gwm, ff, k, dw, dwd, dwm, dfmt, n, x, ldx, nw, nwdt,    \
                                  eps, xn, ldxn, rows, gu, ldgu, h, ldh, out, ldo, partials,       \
                                  counter);                                                        \
    }
#define FFN_FUSED(T, S)                                                                            \
    FFN_FUSED_ONE(T, S, WF_Q4_0, q4_0, 1)                                                          \
    FFN_FUSED_ONE(T, S, WF_Q4_0, q4_0, 8)                                                          \
    FFN_FUSED_ONE(T, S, WF_Q4_1, q4_1, 1)                                                          \
    FFN_FUSED_ONE(T, S, WF_Q4_1, q4_1, 8)                                                          \
    FFN_FUSED_ONE(T, S, WF_Q8_0, q8_0, 1)                                                          \
    FFN_FUSED_ONE(T, S, WF_Q8_0, q8_0, 8)
NPU_FOR_EACH_ACT(FFN_FUSED)

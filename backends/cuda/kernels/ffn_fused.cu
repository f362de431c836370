// A decode layer's whole feed-forward block in one launch (backends/cuda/src/fold_ffn.rs,
// `NPU_SERVING_CUDA_FUSE=4`): RMS norm of the residual rows, the gate/up product, SwiGLU, the
// 8-bit form of the activations, the down product and the residual add.
//
// Block b owns units [U b, U b + U) of the intermediate dimension, U = `units` (32 or 64, the
// host's choice: 64 where 32 would make a grid of many waves), one or two blocks of 32 of the
// 8-bit activations, so their quantization is local to the block and exact:
// 1. every block normalises every row of x (the residual) itself with the norm kernel's code
//    (`rms_row_scale`, `rms_scale_row`, as `gemv_fold_body` does; the host gives the block
//    row_threads(k, 256) threads, as it gives the norm) into 8-bit rows in dynamic shared memory;
//    block 0 also writes the normalised rows to xn;
// 2. its gate and up rows, SwiGLU, into gu and h (`gemv_fold_body`'s FOLD_SWIGLU code: the same
//    bits as FUSE=2 and 3), and h's 8-bit blocks (`q8_store_block`) into shared memory;
// 3. its share of the down product: for every output o and row r, the products of weight blocks
//    (o, U/32 b + j), j = 0, 1, ..., with the 8-bit blocks, chained by fmaf in j order from 0
//    (`gemv_q_partial`'s arithmetic for each block), into shares[b][r][o] (f32);
// 4. a two-level reduction, deterministic (no float atomics; each level sums in a fixed order):
//    the blocks form groups of G = `group` consecutive blocks (the last group may be shorter).
//    After `__threadfence`, each block takes a ticket on its group's counter (`atomicInc`); the
//    group's last finisher sums, for each (r, o), the shares of the group's blocks in block order
//    (0.0f + s[first] + s[first + 1] + ...) into group_sums[g][r][o], then takes a ticket on the
//    global counter; the last group finisher sums the group sums in group order
//    (0.0f + gs[0] + gs[1] + ...), writes the sum to out and adds it into the residual (rounded
//    as `add` rounds it). Each counter's last ticket wraps it back to 0, ready for the next
//    launch or graph replay. In both levels thread t owns the flat (r, o) indices t, t + threads,
//    ..., so a warp reads 32 neighbouring floats of each share: coalesced.
// The order depends only on the shapes and G, so every run (and a graph replay) gives the same
// bits, but it is not the GEMV's lane order: out and x differ from the separate launches' in the
// last bits.
//
// grid (ff / U), dynamic shared memory rows * k * 3 / 2 bytes; counters[0] is the global
// counter, counters[1 + g] group g's. The down matrix's format is an argument (dfmt, WF_*), the
// gate/up matrix's a template parameter.

#define FFN_MAX_UNITS 64

// Share of block `blockIdx.x` of the down product (weight blocks (o, U/32 b + j) of a DFMT matrix
// of n rows, nb blocks each) with the 8-bit rows hq / hs (U/32 blocks of 32 a row):
// shares[b][r][o].
template <int DFMT, int R>
__device__ __forceinline__ void ffn_down_part(const u8* w, const u16* wd, const u16* wm, int n,
                                              int nb, int units, const uint4* hq,
                                              const uint4* hs, int rows, float* shares) {
    const int b = blockIdx.x;
    const int sub = units >> 5;
    const int offset = DFMT == WF_Q4_0 ? 8 : 0;
    for (int o = threadIdx.x; o < n; o += blockDim.x) {
        float acc[R];
        for (int r = 0; r < R; ++r) {
            acc[r] = 0.0f;
        }
        for (int j = 0; j < sub; ++j) {
            const i64 blk = (i64)o * nb + (i64)b * sub + j;
            u32 wq[8];
            load_block_quants<DFMT>(w, blk, wq);
            const float dw = f16_bits_to_f32(wd[blk]);
            const float mw = DFMT == WF_Q4_1 ? f16_bits_to_f32(wm[blk]) : 0.0f;
            for (int r = 0; r < R && r < rows; ++r) {
                const int q = r * sub + j;
                const uint4 s4 = hs[q];
                int dot = block_dot<DFMT>(wq, hq[2 * q], hq[2 * q + 1]);
                dot -= offset * (int)s4.z;
                acc[r] = fmaf((float)dot, dw * __uint_as_float(s4.x), acc[r]);
                if (DFMT == WF_Q4_1) {
                    acc[r] = fmaf(mw, __uint_as_float(s4.y), acc[r]);
                }
            }
        }
        for (int r = 0; r < R && r < rows; ++r) {
            shares[((i64)b * rows + r) * n + o] = acc[r];
        }
    }
}

template <typename T, int FMT, int R>
__device__ __forceinline__ void ffn_fused_body(const u8* gw, const u16* gwd, const u16* gwm,
                                               int ff, int k, const u8* dw, const u16* dwd,
                                               const u16* dwm, int dfmt, int n, T* x, int ldx,
                                               const void* nw, int nwdt, float eps, T* xn,
                                               int ldxn, int rows, T* gu, int ldgu, T* h,
                                               int ldh, T* out, int ldo, int units, int group,
                                               float* shares, float* group_sums, u32* counters) {
    __shared__ float red[32];
    __shared__ float hv[R * FFN_MAX_UNITS];
    __shared__ uint4 hq[R * FFN_MAX_UNITS / 16];
    __shared__ uint4 hs[R * FFN_MAX_UNITS / 32];
    __shared__ int last;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int sub = units >> 5;
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
    const int u0 = blockIdx.x * units;
    for (int i = warp; i < units && u0 + i < ff; i += warps) {
        const int u = u0 + i;
        float acc[R];
        gemv_q_partial_wide<FMT, R>(gw, gwd, gwm, u, k, sq, ss, rows, acc);
        int r;
        const float t = fold_total<R>(acc, lane, rows, &r);
        float acc_up[R];
        gemv_q_partial_wide<FMT, R>(gw, gwd, gwm, ff + u, k, sq, ss, rows, acc_up);
        int r_up;
        const float t_up = fold_total<R>(acc_up, lane, rows, &r_up);
        if (r >= 0) {
            const T g = from_f32<T>(t);
            const T up = from_f32<T>(t_up);
            gu[(i64)r * ldgu + u] = g;
            gu[(i64)r * ldgu + ff + u] = up;
            const T v = swiglu_value<T>(to_f32(g), to_f32(up));
            h[(i64)r * ldh + u] = v;
            hv[r * units + i] = to_f32(v);
        }
    }
    __syncthreads();
    // The block's 8-bit activations: U/32 blocks of 32 per row.
    for (int it = warp; it < rows * sub; it += warps) {
        const int r = it / sub;
        const int j = it - r * sub;
        q8_store_block(hv[r * units + j * 32 + lane], r, units, j, (signed char*)hq, (u32*)hs);
    }
    __syncthreads();
    // 3. The block's share of the down product.
    const int nb = ff >> 5;
    if (dfmt == WF_Q4_0) {
        ffn_down_part<WF_Q4_0, R>(dw, dwd, dwm, n, nb, units, hq, hs, rows, shares);
    } else if (dfmt == WF_Q4_1) {
        ffn_down_part<WF_Q4_1, R>(dw, dwd, dwm, n, nb, units, hq, hs, rows, shares);
    } else {
        ffn_down_part<WF_Q8_0, R>(dw, dwd, dwm, n, nb, units, hq, hs, rows, shares);
    }
    // 4a. The group's last block to finish sums the group's shares in block order.
    const int blocks = gridDim.x;
    const int g = blockIdx.x / group;
    const int first = g * group;
    const int size = blocks - first < group ? blocks - first : group;
    const int total = rows * n;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicInc(counters + 1 + g, (u32)(size - 1)) == (u32)(size - 1);
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    const volatile float* p = shares;
    float* gs = group_sums + (i64)g * total;
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
        float s = 0.0f;
        for (int b = first; b < first + size; ++b) {
            s += p[(i64)b * total + i];
        }
        gs[i] = s;
    }
    // 4b. The last group to finish sums the group sums in group order, into out and x.
    const int groups = (blocks + group - 1) / group;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicInc(counters, (u32)(groups - 1)) == (u32)(groups - 1);
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    const volatile float* q = group_sums;
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
        float s = 0.0f;
        for (int c = 0; c < groups; ++c) {
            s += q[(i64)c * total + i];
        }
        const int r = i / n;
        const int o = i - r * n;
        const T y = from_f32<T>(s);
        out[(i64)r * ldo + o] = y;
        T* xo = x + (i64)r * ldx + o;
        *xo = from_f32<T>(to_f32(*xo) + to_f32(y));
    }
}

#define FFN_FUSED_ONE(T, S, FMT, FS, R)                                                            \
    extern "C" __global__ void ffn_fused_##FS##_r##R##_##S(                                        \
        const u8* gw, const u16* gwd, const u16* gwm, int ff, int k, const u8* dw,                \
        const u16* dwd, const u16* dwm, int dfmt, int n, T* x, int ldx, const void* nw, int nwdt, \
        float eps, T* xn, int ldxn, int rows, T* gu, int ldgu, T* h, int ldh, T* out, int ldo,    \
        int units, int group, float* shares, float* group_sums, u32* counters) {                   \
        ffn_fused_body<T, FMT, R>(gw, gwd, gwm, ff, k, dw, dwd, dwm, dfmt, n, x, ldx, nw, nwdt,    \
                                  eps, xn, ldxn, rows, gu, ldgu, h, ldh, out, ldo, units, group,   \
                                  shares, group_sums, counters);                                   \
    }
#define FFN_FUSED(T, S)                                                                            \
    FFN_FUSED_ONE(T, S, WF_Q4_0, q4_0, 1)                                                          \
    FFN_FUSED_ONE(T, S, WF_Q4_0, q4_0, 8)                                                          \
    FFN_FUSED_ONE(T, S, WF_Q4_1, q4_1, 1)                                                          \
    FFN_FUSED_ONE(T, S, WF_Q4_1, q4_1, 8)                                                          \
    FFN_FUSED_ONE(T, S, WF_Q8_0, q8_0, 1)                                                          \
    FFN_FUSED_ONE(T, S, WF_Q8_0, q8_0, 8)
NPU_FOR_EACH_ACT(FFN_FUSED)

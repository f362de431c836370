// Decode attention, the output projection and the residual add in one launch
// (backends/cuda/src/fold_attn.rs; `NPU_SERVING_CUDA_FUSE=4`).
//
// grid (work items, kv heads, splits) as `attention` has it for a decode-only step (one token per
// work item, so one row per block), blockDim at least group * 32 threads: the warps past the
// group's find no token of theirs (the item's only token is warp / group = 0) and only help with
// the projection.
//
// 1. The block runs `attention_body` (attention.cu) for its (row, kv head, split). Unsplit, it
//    writes the group's normalised heads to `out`. Split, it writes its (m, l, acc) to `part`;
//    then the split that finishes last (a counter per (item, kv head),
//    `counters[1 + item * n_kv + kvh]`, wrapped back to 0 by `atomicInc`) merges them as
//    `attention_combine` does (the same arithmetic per element, so the same bits) into `out`.
//    The block then quantizes the group's columns of the row (group * hd a multiple of 32: whole
//    blocks of 32) into xq / xs with `q8_store_block`, as `quantize_q8` would.
// 2. That block multiplies the group's columns of the quantized output matrix (n rows, k =
//    n_heads * hd columns, blocks of 32) by the row's 8-bit heads: one thread per output o, the
//    group's weight blocks in order, each block's term as `gemv_q_partial` forms it; the partial
//    sum goes to proj[(row * n_kv + kvh) * n + o].
// 3. After `__threadfence` (every thread) and a barrier, thread 0 takes an `atomicInc` ticket on
//    counters[0] (wrapped back to 0 by the last): the grid's last block sums each (row, o) over
//    the kv heads in order 0, 1, ..., writes y (the product) and adds it into the residual as
//    `add` rounds it.
// Deterministic (the sums' order is fixed whichever block runs last), but not bit for bit the
// separate `attention` + `matmul_add` launches: the GEMV adds each output's blocks across the
// lanes of a warp in another order.

template <typename T>
__device__ __forceinline__ void attention_out_combine(const volatile float* part, int n_splits,
                                                      int n_heads, int hd, i64 row, int head0,
                                                      int group, T* out, int ldo) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    for (int g = warp; g < group; g += (blockDim.x >> 5)) {
        const int head = head0 + g;
        const volatile float* pp = part + (row * n_heads + head) * n_splits * (i64)(hd + 2);
        float mx = NEG_INF;
        for (int s = 0; s < n_splits; ++s) {
            mx = fmaxf(mx, pp[s * (hd + 2)]);
        }
        float den = 0.0f;
        for (int s = 0; s < n_splits; ++s) {
            const float ms = pp[s * (hd + 2)];
            if (ms != NEG_INF) {
                den += pp[s * (hd + 2) + 1] * expf(ms - mx);
            }
        }
        for (int d = lane; d < hd; d += 32) {
            float num = 0.0f;
            for (int s = 0; s < n_splits; ++s) {
                const float ms = pp[s * (hd + 2)];
                if (ms != NEG_INF) {
                    num += pp[s * (hd + 2) + 2 + d] * expf(ms - mx);
                }
            }
            out[row * ldo + (i64)head * hd + d] = from_f32<T>(num / den);
        }
    }
}

// Output o's partial sum over weight blocks [b0, b1) of its row, times the 8-bit row `row`.
template <int FMT>
__device__ __forceinline__ float attention_out_dot(const u8* w, const u16* wd, const u16* wm,
                                                   int o, int nb, int b0, int b1,
                                                   const signed char* xq, const u32* xs,
                                                   i64 row) {
    const int offset = FMT == WF_Q4_0 ? 8 : 0;
    float acc = 0.0f;
    for (int b = b0; b < b1; ++b) {
        const i64 blk = (i64)o * nb + b;
        u32 wq[8];
        load_block_quants<FMT>(w, blk, wq);
        const float dw = f16_bits_to_f32(wd[blk]);
        const uint4* xp = (const uint4*)(xq + row * (i64)nb * 32 + b * 32);
        const uint4 s4 = *(const uint4*)(xs + (row * nb + b) * 4);
        int dot = block_dot<FMT>(wq, xp[0], xp[1]);
        dot -= offset * (int)s4.z;
        acc = fmaf((float)dot, dw * __uint_as_float(s4.x), acc);
        if (FMT == WF_Q4_1) {
            acc = fmaf(f16_bits_to_f32(wm[blk]), __uint_as_float(s4.y), acc);
        }
    }
    return acc;
}

template <typename T, int FMT>
__device__ __forceinline__ void attention_out_body(
    const T* q, int ldq, T* out, int ldo, const u16* pool, i64 block_stride, i64 layer_off,
    const int* items, const int* seq_info, const int* block_tables, int max_blocks, int n_heads,
    int n_kv, int hd, int bs, float scale, int window, int n_splits, int tiles_per_split,
    float* part, signed char* xq, u32* xs, const u8* w, const u16* wd, const u16* wm, int n,
    float* proj, u32* counters, int rows, T* y, int ldy, T* res, int ldr) {
    __shared__ u32 last;
    const int group = n_heads / n_kv;
    const int item = blockIdx.x;
    const int kvh = blockIdx.y;
    attention_body<T>(q, ldq, out, ldo, pool, block_stride, layer_off, items, 1, seq_info,
                      block_tables, max_blocks, n_heads, n_kv, hd, bs, scale, window, n_splits,
                      tiles_per_split, part, (signed char*)0, (u32*)0);
    const int seq = items[2 * item];
    const i64 row = (i64)seq_info[3 * seq] + items[2 * item + 1];
    if (n_splits > 1) {
        __threadfence(); // each thread's partial visible to the grid before the ticket
        __syncthreads();
        if (threadIdx.x == 0) {
            const u32 before = atomicInc(counters + 1 + item * n_kv + kvh, (u32)(n_splits - 1));
            last = before == (u32)(n_splits - 1) ? 1u : 0u;
        }
        __syncthreads();
        if (!last) {
            return; // the whole block
        }
        __threadfence();
        attention_out_combine<T>(part, n_splits, n_heads, hd, row, kvh * group, group, out, ldo);
    }
    __syncthreads(); // the group's heads of the row are in `out`
    const int nb = (n_heads * hd) >> 5;
    const int b0 = (kvh * group * hd) >> 5;
    const int b1 = b0 + ((group * hd) >> 5);
    for (int b = b0 + (threadIdx.x >> 5); b < b1; b += (blockDim.x >> 5)) {
        q8_store_block(to_f32(out[row * ldo + b * 32 + (threadIdx.x & 31)]), row, nb * 32, b, xq,
                       xs);
    }
    __syncthreads(); // and their 8-bit form in xq / xs
    for (int o = threadIdx.x; o < n; o += blockDim.x) {
        proj[(row * n_kv + kvh) * n + o] = attention_out_dot<FMT>(w, wd, wm, o, nb, b0, b1, xq,
                                                                  xs, row);
    }
    __threadfence(); // each thread's partial sums visible to the grid before the ticket
    __syncthreads();
    const u32 groups = gridDim.x * (u32)n_kv;
    if (threadIdx.x == 0) {
        const u32 before = atomicInc(counters, groups - 1u);
        last = before == groups - 1u ? 1u : 0u;
    }
    __syncthreads();
    if (!last) {
        return; // the whole block
    }
    __threadfence();
    const volatile float* pv = proj;
    for (i64 e = threadIdx.x; e < (i64)rows * n; e += blockDim.x) {
        const i64 r = e / n;
        const int o = (int)(e - r * n);
        float s = 0.0f;
        for (int h = 0; h < n_kv; ++h) {
            s += pv[(r * n_kv + h) * n + o];
        }
        const T v = from_f32<T>(s);
        y[r * ldy + o] = v;
        T* p = res + r * ldr + o;
        *p = from_f32<T>(to_f32(*p) + to_f32(v));
    }
}

#define ATTENTION_OUT_ONE(T, S, FMT, FS)                                                           \
    extern "C" __global__ void __launch_bounds__(ATT_MAX_THREADS) attention_out_##FS##_##S(        \
        const T* q, int ldq, T* out, int ldo, const u16* pool, i64 block_stride, i64 layer_off,   \
        const int* items, const int* seq_info, const int* block_tables, int max_blocks,            \
        int n_heads, int n_kv, int hd, int bs, float scale, int window, int n_splits,              \
        int tiles_per_split, float* part, signed char* xq, u32* xs, const u8* w, const u16* wd,    \
        const u16* wm, int n, float* proj, u32* counters, int rows, T* y, int ldy, T* res,         \
        int ldr) {                                                                                 \
        attention_out_body<T, FMT>(q, ldq, out, ldo, pool, block_stride, layer_off, items,        \
                                   seq_info, block_tables, max_blocks, n_heads, n_kv, hd, bs,      \
                                   scale, window, n_splits, tiles_per_split, part, xq, xs, w, wd,  \
                                   wm, n, proj, counters, rows, y, ldy, res, ldr);                 \
    }
#define ATTENTION_OUT(T, S)                                                                        \
    ATTENTION_OUT_ONE(T, S, WF_Q4_0, q4_0)                                                         \
    ATTENTION_OUT_ONE(T, S, WF_Q4_1, q4_1)                                                         \
    ATTENTION_OUT_ONE(T, S, WF_Q8_0, q8_0)
NPU_FOR_EACH_ACT(ATTENTION_OUT)

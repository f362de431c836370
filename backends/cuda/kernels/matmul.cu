// Matrix products out[r][o] = x[r] . w[o] with the weights kept in their quantized form, and the
// dequantization of a whole matrix for the cuBLAS path.
//
// Quantized weights multiply 8-bit activations, as ggml does (and so llama.cpp, and the CPU
// backend bit for bit per block): `quantize_q8` cuts each activation row into blocks of 32 with
// d = amax / 127 and s = d * sum(q), both rounded through f16, and the integer sum; a block's
// contribution is (sum_j qw_j qx_j - offset * isum) * (dw * dx), plus mw * sx for Q4_1.
//
// Weight formats (repacked at load from the GGUF blocks, values and their order unchanged):
//   WF_F16  : n rows of k f16 values.
//   WF_Q4_0 : qs = n * k/32 blocks of 16 bytes (byte j: element j in the low nibble, element
//             j + 16 in the high one), wd = one f16 scale per block; value = (q - 8) * d.
//   WF_Q4_1 : as Q4_0 plus wm = one f16 minimum per block; value = q * d + m.
//   WF_Q8_0 : qs = n * k/32 blocks of 32 signed bytes, wd as above; value = q * d.
// Splitting the scales from the quants keeps every block's quants 16-byte aligned, so a lane reads
// a Q4 block with one 128-bit load.

#define WF_F16 0
#define WF_Q4_0 1
#define WF_Q4_1 2
#define WF_Q8_0 3

__device__ __forceinline__ void unpack_halves(const uint4 v, float* out, bool bf) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; ++i) {
        if (bf) {
            out[2 * i] = bf16_bits_to_f32((u16)(w[i] & 0xffffu));
            out[2 * i + 1] = bf16_bits_to_f32((u16)(w[i] >> 16));
        } else {
            out[2 * i] = lo_f16(w[i]);
            out[2 * i + 1] = hi_f16(w[i]);
        }
    }
}

// The 32 values of quantized block `blk`.
template <int FMT>
__device__ __forceinline__ void dequant_block(const u8* qs, const u16* wd, const u16* wm, i64 blk,
                                              float* wf) {
    const float d = f16_bits_to_f32(wd[blk]);
    if (FMT == WF_Q8_0) {
        const uint4* p = (const uint4*)(qs + blk * 32);
        for (int h = 0; h < 2; ++h) {
            const uint4 v = p[h];
            const u32 w[4] = {v.x, v.y, v.z, v.w};
            for (int i = 0; i < 4; ++i) {
                for (int b = 0; b < 4; ++b) {
                    wf[16 * h + 4 * i + b] = (float)(signed char)((w[i] >> (8 * b)) & 0xffu) * d;
                }
            }
        }
    } else {
        const uint4 v = *(const uint4*)(qs + blk * 16);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
        const float m = FMT == WF_Q4_1 ? f16_bits_to_f32(wm[blk]) : 0.0f;
        for (int i = 0; i < 4; ++i) {
            for (int b = 0; b < 4; ++b) {
                const u32 byte = (w[i] >> (8 * b)) & 0xffu;
                const int j = 4 * i + b;
                if (FMT == WF_Q4_1) {
                    wf[j] = __fadd_rn(__fmul_rn((float)(byte & 15u), d), m);
                    wf[j + 16] = __fadd_rn(__fmul_rn((float)(byte >> 4), d), m);
                } else {
                    wf[j] = (float)((int)(byte & 15u) - 8) * d;
                    wf[j + 16] = (float)((int)(byte >> 4) - 8) * d;
                }
            }
        }
    }
}

// ---- activation quantization -------------------------------------------------------------------

// grid (ceil(k / 32 / 8), rows), 8 warps: warp w quantizes block blockIdx.x * 8 + w of row
// blockIdx.y. xq: rows x k int8; xs: per block 4 words (d, s as f32 bits, integer sum, 0).
template <typename T>
__device__ __forceinline__ void quantize_q8_body(const T* x, int ldx, int k, signed char* xq,
                                                 u32* xs) {
    const int nb = k >> 5;
    const int b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= nb) {
        return; // the whole warp: no block-wide barrier here
    }
    const int lane = threadIdx.x & 31;
    const i64 r = blockIdx.y;
    q8_store_block(to_f32(x[r * ldx + b * 32 + lane]), r, k, b, xq, xs);
}

#define QUANTIZE_Q8(T, S)                                                                          \
    extern "C" __global__ void quantize_q8_##S(const T* x, int ldx, int k, signed char* xq,       \
                                               u32* xs) {                                          \
        quantize_q8_body<T>(x, ldx, k, xq, xs);                                                   \
    }
NPU_FOR_EACH_ACT(QUANTIZE_Q8)

// ---- GEMV: up to R activation rows per pass over the weights ---------------------------------------
//
// grid (ceil(n / warps per block)), one warp per output o; lanes stride over the 32-value blocks
// of the weight row, load each block's quants once and apply them to up to R activation rows.

// Reduces the R per-lane partial sums over the warp and writes out[r * ldo] for r < rows.
template <typename T, int R>
__device__ __forceinline__ void store_rows(float* acc, int lane, int rows, T* out, int ldo) {
    if (R == 8) {
        const float total = warp_sum8(acc);
        const int r = lane >> 2;
        if ((lane & 3) == 0 && r < rows) {
            out[(i64)r * ldo] = from_f32<T>(total);
        }
    } else {
        for (int r = 0; r < R; ++r) {
            acc[r] = warp_sum(acc[r]);
        }
        if (lane == 0) {
            for (int r = 0; r < R; ++r) {
                if (r < rows) {
                    out[(i64)r * ldo] = from_f32<T>(acc[r]);
                }
            }
        }
    }
}

// The integer dot product of one weight block with one quantized activation block.
template <int FMT>
__device__ __forceinline__ int block_dot(const u32* wq, const uint4 xa, const uint4 xb) {
    const int xw[8] = {(int)xa.x, (int)xa.y, (int)xa.z, (int)xa.w,
                       (int)xb.x, (int)xb.y, (int)xb.z, (int)xb.w};
    int dot = 0;
    if (FMT == WF_Q8_0) {
        for (int i = 0; i < 8; ++i) {
            dot = __dp4a((int)wq[i], xw[i], dot);
        }
    } else {
        // Byte i of word j: element 4j + i in the low nibble, element 16 + 4j + i in the high one.
        for (int j = 0; j < 4; ++j) {
            dot = __dp4a((int)(wq[j] & 0x0f0f0f0fu), xw[j], dot);
            dot = __dp4a((int)((wq[j] >> 4) & 0x0f0f0f0fu), xw[4 + j], dot);
        }
    }
    return dot;
}

// The 32-bit words of packed weight block `blk` (16 bytes of nibbles for Q4_0/Q4_1, 32 bytes of
// int8 for Q8_0) into wq[0..4) or wq[0..8), read as 16-byte vectors.
template <int FMT>
__device__ __forceinline__ void load_block_quants(const u8* w, i64 blk, u32* wq) {
    const int qb = FMT == WF_Q8_0 ? 32 : 16;
    const uint4* wp = (const uint4*)(w + blk * qb);
    const uint4 w0 = wp[0];
    wq[0] = w0.x;
    wq[1] = w0.y;
    wq[2] = w0.z;
    wq[3] = w0.w;
    if (FMT == WF_Q8_0) {
        const uint4 w1 = wp[1];
        wq[4] = w1.x;
        wq[5] = w1.y;
        wq[6] = w1.z;
        wq[7] = w1.w;
    }
}

// Adds weight block `blk` (column block b; quants wq, scale dw, minimum mw) times activation
// block b of each of the `rows` rows into acc: the GEMV's arithmetic for one block, shared by
// `gemv_q_partial` and `gemv_q_partial_wide` so their bits cannot drift apart.
template <int FMT, int R>
__device__ __forceinline__ void gemv_q_block(const u32* wq, float dw, float mw, int b, int nb,
                                             int k, const signed char* xq, const u32* xs,
                                             int rows, float* acc) {
    const int offset = FMT == WF_Q4_0 ? 8 : 0;
    for (int r = 0; r < R; ++r) {
        if (r < rows) {
            const uint4* xp = (const uint4*)(xq + (i64)r * k + b * 32);
            const uint4 s4 = *(const uint4*)(xs + ((i64)r * nb + b) * 4);
            int dot = block_dot<FMT>(wq, xp[0], xp[1]);
            dot -= offset * (int)s4.z;
            acc[r] = fmaf((float)dot, dw * __uint_as_float(s4.x), acc[r]);
            if (FMT == WF_Q4_1) {
                acc[r] = fmaf(mw, __uint_as_float(s4.y), acc[r]);
            }
        }
    }
}

// Lane `lane`'s partial sums of output o for up to R activation rows: blocks lane, lane + 32, ...
// of weight row o (the GEMV's order; `gemv_fold_body` runs the same order on the wide schedule).
template <int FMT, int R>
__device__ __forceinline__ void gemv_q_partial(const u8* w, const u16* wd, const u16* wm, int o,
                                               int k, const signed char* xq, const u32* xs,
                                               int rows, float* acc) {
    const int lane = threadIdx.x & 31;
    for (int r = 0; r < R; ++r) {
        acc[r] = 0.0f;
    }
    const int nb = k >> 5;
    for (int b = lane; b < nb; b += 32) {
        const i64 blk = (i64)o * nb + b;
        u32 wq[8];
        load_block_quants<FMT>(w, blk, wq);
        const float dw = f16_bits_to_f32(wd[blk]);
        const float mw = FMT == WF_Q4_1 ? f16_bits_to_f32(wm[blk]) : 0.0f;
        gemv_q_block<FMT, R>(wq, dw, mw, b, nb, k, xq, xs, rows, acc);
    }
}

// ---- the wide GEMV (`gemv_wide_*`, NPU_SERVING_CUDA_GEMV=wide) ---------------------------------
//
// The same blocks per lane, added in the same order with the same arithmetic (`gemv_q_block`),
// so the bits are `gemv_q_partial`'s: only the schedule differs. A lane issues the loads of
// GEMV_WIDE blocks (lane + 32 j, j < GEMV_WIDE: quants, scales, minima) before the first of
// their dot products, through the read-only data path (`__ldg`: the weights never change during
// a kernel), so several 16- or 32-byte weight loads per lane are in flight instead of one; the
// blocks past the last whole group of GEMV_WIDE go one at a time, as in `gemv_q_partial`. A
// lane's blocks lie 32 blocks apart, so their scales are not adjacent: read one u16 each.

#define GEMV_WIDE 4

template <int FMT>
__device__ __forceinline__ void load_block_quants_nc(const u8* w, i64 blk, u32* wq) {
    const int qb = FMT == WF_Q4_0 || FMT == WF_Q4_1 ? 16 : 32;
    const uint4* wp = (const uint4*)(w + blk * qb);
    const uint4 w0 = __ldg(wp);
    wq[0] = w0.x;
    wq[1] = w0.y;
    wq[2] = w0.z;
    wq[3] = w0.w;
    if (FMT == WF_Q8_0) {
        const uint4 w1 = __ldg(wp + 1);
        wq[4] = w1.x;
        wq[5] = w1.y;
        wq[6] = w1.z;
        wq[7] = w1.w;
    }
}

template <int FMT, int R>
__device__ __forceinline__ void gemv_q_partial_wide(const u8* w, const u16* wd, const u16* wm,
                                                    int o, int k, const signed char* xq,
                                                    const u32* xs, int rows, float* acc) {
    const int lane = threadIdx.x & 31;
    for (int r = 0; r < R; ++r) {
        acc[r] = 0.0f;
    }
    const int nb = k >> 5;
    const i64 row0 = (i64)o * nb;
    int b = lane;
    // Whole groups: blocks b, b + 32, ..., b + 32 (GEMV_WIDE - 1), all below nb.
    for (; b + 32 * (GEMV_WIDE - 1) < nb; b += 32 * GEMV_WIDE) {
        u32 wq[GEMV_WIDE][8];
        u16 dh[GEMV_WIDE];
        u16 mh[GEMV_WIDE];
#pragma unroll
        for (int j = 0; j < GEMV_WIDE; ++j) {
            const i64 blk = row0 + b + 32 * j;
            load_block_quants_nc<FMT>(w, blk, wq[j]);
            dh[j] = __ldg(wd + blk);
            mh[j] = FMT == WF_Q4_1 ? __ldg(wm + blk) : (u16)0;
        }
#pragma unroll
        for (int j = 0; j < GEMV_WIDE; ++j) {
            const float dw = f16_bits_to_f32(dh[j]);
            const float mw = FMT == WF_Q4_1 ? f16_bits_to_f32(mh[j]) : 0.0f;
            gemv_q_block<FMT, R>(wq[j], dw, mw, b + 32 * j, nb, k, xq, xs, rows, acc);
        }
    }
    // The tail: at most GEMV_WIDE - 1 blocks, in order.
    for (; b < nb; b += 32) {
        const i64 blk = row0 + b;
        u32 wq[8];
        load_block_quants_nc<FMT>(w, blk, wq);
        const float dw = f16_bits_to_f32(__ldg(wd + blk));
        const float mw = FMT == WF_Q4_1 ? f16_bits_to_f32(__ldg(wm + blk)) : 0.0f;
        gemv_q_block<FMT, R>(wq, dw, mw, b, nb, k, xq, xs, rows, acc);
    }
}

template <typename T, int FMT, int R>
__device__ __forceinline__ void gemv_q_wide_body(const u8* w, const u16* wd, const u16* wm,
                                                 int n, int k, const signed char* xq,
                                                 const u32* xs, int rows, T* out, int ldo) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= n) {
        return; // the whole warp: this kernel has no block-wide barrier
    }
    float acc[R];
    gemv_q_partial_wide<FMT, R>(w, wd, wm, o, k, xq, xs, rows, acc);
    store_rows<T, R>(acc, lane, rows, out + o, ldo);
}

template <typename T, int FMT, int R>
__device__ __forceinline__ void gemv_q_body(const u8* w, const u16* wd, const u16* wm, int n,
                                            int k, const signed char* xq, const u32* xs, int rows,
                                            T* out, int ldo) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= n) {
        return; // the whole warp: this kernel has no block-wide barrier
    }
    float acc[R];
    gemv_q_partial<FMT, R>(w, wd, wm, o, k, xq, xs, rows, acc);
    store_rows<T, R>(acc, lane, rows, out + o, ldo);
}

// An activation as it meets an f16 weight: f32 rounded to f16 first, as llama.cpp's CPU build
// (the references) converts its f32 activations to f16 for f16 weights (F16's vec_dot_type);
// f16 as it is; bf16 as it is (its values may lie beyond f16's range).
__device__ __forceinline__ float f16w_operand(float v) {
    return f16_bits_to_f32(f32_to_f16_bits(v));
}
__device__ __forceinline__ float f16w_operand(f16 v) { return to_f32(v); }
__device__ __forceinline__ float f16w_operand(bf16 v) { return to_f32(v); }

// F16 weights: activations in T (f32 ones rounded to f16: `f16w_operand`), products in f32.
template <typename T, int R>
__device__ __forceinline__ void gemv_f16w_body(const u8* w, int n, int k, const T* x, int ldx,
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
    const u16* wr = (const u16*)w + (i64)o * k;
    if ((k & 7) == 0) {
        for (int c = lane * 8; c < k; c += 256) {
            float wf[8];
            unpack_halves(*(const uint4*)(wr + c), wf, false);
            for (int r = 0; r < R; ++r) {
                if (r < rows) {
                    const T* xr = x + (i64)r * ldx + c;
                    float s = 0.0f;
                    for (int j = 0; j < 8; ++j) {
                        s = fmaf(wf[j], f16w_operand(xr[j]), s);
                    }
                    acc[r] += s;
                }
            }
        }
    } else {
        for (int c = lane; c < k; c += 32) {
            const float wv = f16_bits_to_f32(wr[c]);
            for (int r = 0; r < R; ++r) {
                if (r < rows) {
                    acc[r] = fmaf(wv, f16w_operand(x[(i64)r * ldx + c]), acc[r]);
                }
            }
        }
    }
    store_rows<T, R>(acc, lane, rows, out + o, ldo);
}

#define GEMV_Q_ONE(T, S, FMT, FS, R)                                                               \
    extern "C" __global__ void gemv_##FS##_r##R##_##S(                                             \
        const u8* w, const u16* wd, const u16* wm, int n, int k, const signed char* xq,           \
        const u32* xs, int rows, T* out, int ldo) {                                                \
        gemv_q_body<T, FMT, R>(w, wd, wm, n, k, xq, xs, rows, out, ldo);                          \
    }
#define GEMV_F16_ONE(T, S, R)                                                                      \
    extern "C" __global__ void gemv_f16w_r##R##_##S(const u8* w, int n, int k, const T* x,        \
                                                    int ldx, int rows, T* out, int ldo) {          \
        gemv_f16w_body<T, R>(w, n, k, x, ldx, rows, out, ldo);                                    \
    }
#define GEMV(T, S)                                                                                 \
    GEMV_F16_ONE(T, S, 1)                                                                          \
    GEMV_F16_ONE(T, S, 8)                                                                          \
    GEMV_Q_ONE(T, S, WF_Q4_0, q4_0, 1)                                                             \
    GEMV_Q_ONE(T, S, WF_Q4_0, q4_0, 8)                                                             \
    GEMV_Q_ONE(T, S, WF_Q4_1, q4_1, 1)                                                             \
    GEMV_Q_ONE(T, S, WF_Q4_1, q4_1, 8)                                                             \
    GEMV_Q_ONE(T, S, WF_Q8_0, q8_0, 1)                                                             \
    GEMV_Q_ONE(T, S, WF_Q8_0, q8_0, 8)
NPU_FOR_EACH_ACT(GEMV)

#define GEMV_WIDE_ONE(T, S, FMT, FS, R)                                                            \
    extern "C" __global__ void gemv_wide_##FS##_r##R##_##S(                                        \
        const u8* w, const u16* wd, const u16* wm, int n, int k, const signed char* xq,           \
        const u32* xs, int rows, T* out, int ldo) {                                                \
        gemv_q_wide_body<T, FMT, R>(w, wd, wm, n, k, xq, xs, rows, out, ldo);                     \
    }
#define GEMV_WIDE_ALL(T, S)                                                                        \
    GEMV_WIDE_ONE(T, S, WF_Q4_0, q4_0, 1)                                                          \
    GEMV_WIDE_ONE(T, S, WF_Q4_0, q4_0, 8)                                                          \
    GEMV_WIDE_ONE(T, S, WF_Q4_1, q4_1, 1)                                                          \
    GEMV_WIDE_ONE(T, S, WF_Q4_1, q4_1, 8)                                                          \
    GEMV_WIDE_ONE(T, S, WF_Q8_0, q8_0, 1)                                                          \
    GEMV_WIDE_ONE(T, S, WF_Q8_0, q8_0, 8)
NPU_FOR_EACH_ACT(GEMV_WIDE_ALL)

// ---- GEMV with its neighbours folded in -----------------------------------------------------------
//
// One launch for two or three ops of a decode layer (backends/cuda/src/fold.rs), with the bits of
// the separate kernels:
// - with `nw` (not null), the RMS norm of the input rows first: every block normalises each row
//   of x itself with the `rms_norm` kernel's code (`rms_row_scale`, `rms_scale_row`; the host gives
//   the block row_threads(k, 256) threads, as it gives the norm, so the sums are the same),
//   quantizes it into shared memory with `q8_store_block`, and block 0 also writes the normalised
//   rows to `xn`; without it the 8-bit rows come in xq / xs as for `gemv_*`;
// - after the product, by `fold`: FOLD_STORE writes out; FOLD_ADD writes out and adds it into the
//   residual (res += out, rounded as `add` rounds it; each element is one lane's); FOLD_SWIGLU
//   reads the matrix as gate rows 0..u then up rows u..2u (the fused gate/up matrix): the warp
//   that computes gate row j computes up row u + j too, writes both into out, then h[j] =
//   silu(g) * u as `swiglu` computes it, and with `hq` (u a multiple of 32) h's 8-bit form: a
//   block's 32 units are one block of 32 of h, quantized after the block's barrier; FOLD_ROPE
//   (the Q/K/V product: n_heads query, n_kv key, n_kv value heads of hd) stores out, and block h,
//   which owns head h (hd units), then rotates a query or key head as `rope_kv_write` does and
//   writes key and value heads to the f16 KV cache (`rope_head_to_cache`, attention.cu), after
//   the block's barrier, from the values as stored.
// Each output's sum is gemv_q_body's (`gemv_q_partial`, then store_rows' reduction). grid
// (ceil(units / 32)), a block of 32 units (outputs; gate/up pairs with FOLD_SWIGLU; a head with
// FOLD_ROPE), warp w taking units w, w + warps, ...; dynamic shared memory rows * k * 3 / 2 bytes
// with the norm, else none.
#define FOLD_STORE 0
#define FOLD_ADD 1
#define FOLD_SWIGLU 2
#define FOLD_ROPE 3
#define FOLD_UNITS 32

// A query or key head `hp` of hd values normalised in place as `rms_norm_heads` normalises it
// with a block of `nt` threads (row_threads(hd, 256), at most blockDim.x): the block's first nt
// threads take its loops and its sum, which adds the same warp sums in the same order as
// `block_sum` in a block of nt threads; the others add nothing. Every thread must call it; the
// values are rewritten before it returns (after a barrier).
template <typename T>
__device__ __forceinline__ void head_norm_first(T* hp, int hd, const void* w, int wdt, float eps,
                                                int nt, float* red) {
    const int t = threadIdx.x;
    const int lane = t & 31;
    float s = 0.0f;
    if (t < nt) {
        for (int c = t; c < hd; c += nt) {
            const float v = to_f32(hp[c]);
            s = fmaf(v, v, s);
        }
    }
    s = warp_sum(s);
    if (lane == 0 && (t >> 5) < (nt >> 5)) {
        red[t >> 5] = s;
    }
    __syncthreads();
    float tot = lane < (nt >> 5) ? red[lane] : 0.0f;
    tot = warp_sum(tot);
    __syncthreads();
    const float scale = 1.0f / sqrtf(tot / (float)hd + eps);
    if (t < nt) {
        for (int c = t; c < hd; c += nt) {
            hp[c] = from_f32<T>(__fmul_rn(__fmul_rn(to_f32(hp[c]), scale), load_dt(w, wdt, c)));
        }
    }
    __syncthreads();
}

// The warp's total of row *r of the R partial sums, reduced as store_rows reduces them; *r = -1
// on the lanes that hold no row's total (R is 1 or 8).
template <int R> __device__ __forceinline__ float fold_total(float* acc, int lane, int rows, int* r) {
    if (R == 8) {
        const float t = warp_sum8(acc);
        *r = ((lane & 3) == 0 && (lane >> 2) < rows) ? (lane >> 2) : -1;
        return t;
    }
    const float t = warp_sum(acc[0]);
    *r = (lane == 0 && rows > 0) ? 0 : -1;
    return t;
}

template <typename T, int FMT, int R>
__device__ __forceinline__ void gemv_fold_body(const u8* w, const u16* wd, const u16* wm, int n,
                                               int k, const T* x, int ldx, const void* nw,
                                               int nwdt, float eps, T* xn, int ldxn,
                                               const signed char* xq, const u32* xs, int rows,
                                               T* out, int ldo, int fold, T* res, int ldr, T* h,
                                               int ldh, signed char* hq, u32* hs, int n_heads,
                                               int n_kv, int hd, int dims, int halves,
                                               float theta_scale, float freq_scale, const int* pos,
                                               const float* factors, const int* slots, u16* pool,
                                               i64 block_stride, i64 layer_off, int bs,
                                               const void* qw, int qwdt, const void* kw,
                                               int kwdt, int head_threads) {
    __shared__ float red[32];
    __shared__ float hv[R * FOLD_UNITS];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    if (nw) {
        signed char* sq = (signed char*)DYN_SMEM;
        u32* ss = (u32*)(DYN_SMEM + (i64)rows * k);
        for (int r = 0; r < rows; ++r) {
            const T* xr = x + (i64)r * ldx;
            const float scale = rms_row_scale<T>(xr, k, eps, red);
            T* o = blockIdx.x == 0 ? xn + (i64)r * ldxn : (T*)0;
            rms_scale_row<T>(xr, nw, nwdt, scale, k, o, r, sq, ss);
        }
        __syncthreads();
        xq = sq;
        xs = ss;
    }
    const int units = fold == FOLD_SWIGLU ? (n >> 1) : n;
    const int upb = fold == FOLD_ROPE ? hd : FOLD_UNITS;
    const int u0 = blockIdx.x * upb;
    for (int i = warp; i < upb && u0 + i < units; i += warps) {
        const int u = u0 + i;
        float acc[R];
        // The wide schedule (several weight loads in flight a lane; the same bits): a fold
        // launch has n / 32 blocks of 8 warps, about one block an SM, so one 16-byte load a
        // lane would leave each SM 4 KB in flight, a sixth of what the HBM's latency asks for.
        gemv_q_partial_wide<FMT, R>(w, wd, wm, u, k, xq, xs, rows, acc);
        int r;
        const float t = fold_total<R>(acc, lane, rows, &r);
        if (fold == FOLD_SWIGLU) {
            float acc_up[R];
            gemv_q_partial_wide<FMT, R>(w, wd, wm, units + u, k, xq, xs, rows, acc_up);
            int r_up;
            const float t_up = fold_total<R>(acc_up, lane, rows, &r_up);
            if (r >= 0) {
                const T g = from_f32<T>(t);
                const T up = from_f32<T>(t_up);
                out[(i64)r * ldo + u] = g;
                out[(i64)r * ldo + units + u] = up;
                const T v = swiglu_value<T>(to_f32(g), to_f32(up));
                h[(i64)r * ldh + u] = v;
                hv[r * FOLD_UNITS + i] = to_f32(v);
            }
        } else if (r >= 0) {
            const T y = from_f32<T>(t);
            out[(i64)r * ldo + u] = y;
            if (fold == FOLD_ADD) {
                T* p = res + (i64)r * ldr + u;
                *p = from_f32<T>(to_f32(*p) + to_f32(y));
            }
        }
    }
    if (fold == FOLD_SWIGLU && hq) {
        __syncthreads();
        for (int r = warp; r < rows; r += warps) {
            q8_store_block(hv[r * FOLD_UNITS + lane], r, units, blockIdx.x, hq, hs);
        }
    }
    if (fold == FOLD_ROPE) {
        __syncthreads();
        const int head = blockIdx.x;
        const i64 head_elems = (i64)bs * hd;
        for (int r = 0; r < rows; ++r) {
            const int slot = slots[r];
            const i64 base = (i64)(slot / bs) * block_stride + layer_off + (i64)(slot % bs) * hd;
            T* hp = out + (i64)r * ldo + (i64)head * hd;
            if (head >= n_heads + n_kv) {
                u16* at = pool + base + (i64)(head - n_heads) * head_elems;
                for (int c = threadIdx.x; c < hd; c += blockDim.x) {
                    at[c] = f32_to_f16_bits(to_f32(hp[c]));
                }
            } else {
                const bool key = head >= n_heads;
                if (qw) {
                    head_norm_first<T>(hp, hd, key ? kw : qw, key ? kwdt : qwdt, eps,
                                       head_threads, red);
                }
                u16* at = key ? pool + base + (i64)(head - n_heads) * head_elems : pool;
                rope_head_to_cache<T>(hp, key, hd, dims, halves, theta_scale, freq_scale,
                                      (u32)pos[r], factors, at);
            }
        }
    }
}

#define GEMV_FOLD_ONE(T, S, FMT, FS, R)                                                            \
    extern "C" __global__ void gemv_fold_##FS##_r##R##_##S(                                        \
        const u8* w, const u16* wd, const u16* wm, int n, int k, const T* x, int ldx,             \
        const void* nw, int nwdt, float eps, T* xn, int ldxn, const signed char* xq,              \
        const u32* xs, int rows, T* out, int ldo, int fold, T* res, int ldr, T* h, int ldh,       \
        signed char* hq, u32* hs, int n_heads, int n_kv, int hd, int dims, int halves,            \
        float theta_scale, float freq_scale, const int* pos, const float* factors,                \
        const int* slots, u16* pool, i64 block_stride, i64 layer_off, int bs, const void* qw,     \
        int qwdt, const void* kw, int kwdt, int head_threads) {                                    \
        gemv_fold_body<T, FMT, R>(w, wd, wm, n, k, x, ldx, nw, nwdt, eps, xn, ldxn, xq, xs, rows, \
                                  out, ldo, fold, res, ldr, h, ldh, hq, hs, n_heads, n_kv, hd,     \
                                  dims, halves, theta_scale, freq_scale, pos, factors, slots,      \
                                  pool, block_stride, layer_off, bs, qw, qwdt, kw, kwdt,           \
                                  head_threads);                                                   \
    }
#define GEMV_FOLD(T, S)                                                                            \
    GEMV_FOLD_ONE(T, S, WF_Q4_0, q4_0, 1)                                                          \
    GEMV_FOLD_ONE(T, S, WF_Q4_0, q4_0, 8)                                                          \
    GEMV_FOLD_ONE(T, S, WF_Q4_1, q4_1, 1)                                                          \
    GEMV_FOLD_ONE(T, S, WF_Q4_1, q4_1, 8)                                                          \
    GEMV_FOLD_ONE(T, S, WF_Q8_0, q8_0, 1)                                                          \
    GEMV_FOLD_ONE(T, S, WF_Q8_0, q8_0, 8)
NPU_FOR_EACH_ACT(GEMV_FOLD)

// ---- dequantization for cuBLAS -------------------------------------------------------------------

// Grid-stride over the n * k / 32 blocks (n * k elements for WF_F16): out = the n x k matrix in T.
template <typename T, int FMT>
__device__ __forceinline__ void dequant_body(const u8* w, const u16* wd, const u16* wm, int n,
                                             int k, T* out) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    if (FMT == WF_F16) {
        const i64 total = (i64)n * k;
        for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
            out[i] = from_f32<T>(f16_bits_to_f32(((const u16*)w)[i]));
        }
    } else {
        const i64 total = (i64)n * (k >> 5);
        for (i64 b = (i64)blockIdx.x * blockDim.x + threadIdx.x; b < total; b += stride) {
            float wf[32];
            dequant_block<FMT>(w, wd, wm, b, wf);
            T* o = out + b * 32;
            for (int j = 0; j < 32; ++j) {
                o[j] = from_f32<T>(wf[j]);
            }
        }
    }
}

#define DEQUANT_ONE(T, S, FMT, FS)                                                                 \
    extern "C" __global__ void dequant_##FS##_##S(const u8* w, const u16* wd, const u16* wm,      \
                                                  int n, int k, T* out) {                          \
        dequant_body<T, FMT>(w, wd, wm, n, k, out);                                               \
    }
#define DEQUANT(T, S)                                                                              \
    DEQUANT_ONE(T, S, WF_F16, f16w)                                                                \
    DEQUANT_ONE(T, S, WF_Q4_0, q4_0)                                                               \
    DEQUANT_ONE(T, S, WF_Q4_1, q4_1)                                                               \
    DEQUANT_ONE(T, S, WF_Q8_0, q8_0)
NPU_FOR_EACH_ACT(DEQUANT)

// ---- GEMM on the int8 tensor cores (sm_80 and later): many activation rows at once ---------------
//
// The same arithmetic as the GEMV kernels, bit for bit: a block's integer dot product is exact
// whichever unit computes it, and each output's float sum is taken in the GEMV's order. The GEMV
// gives lane L of a warp the blocks L, L + 32, L + 64, ... of a row (one fmaf each, in that
// order) and then adds the 32 lane sums with the xor butterfly of `warp_sum` (pairs 16 apart
// first, then 8, 4, 2, 1). Here one thread owns an output and walks the same 32 partial sums
// itself, in bit-reversed lane order, so that the butterfly becomes a left-to-right pairwise sum
// (leaves 2i and 2i + 1 are lanes rev(2i) and rev(2i) ^ 16, and so on up the tree).
//
// Tiles: a warp computes 16 rows x 16 outputs with two mma.m16n8k32 per weight block (k = 32 is
// one block); a block of 4 warps covers 32 rows x 32 outputs. grid (ceil(rows / 32), ceil(n / 32)):
// the blocks that run together share weight tiles, which are read from memory about once.

// c = A B for one warp: A 16 x 32 int8 (row-major fragments a), B 32 x 8 int8 (column-major
// fragments b), c 16 x 8 int32, in the register layout the PTX ISA gives for mma.m16n8k32 with
// 8-bit types (g = lane / 4, t = lane % 4): a[0] = A[g][4t..4t+3], a[1] = A[g+8][4t..],
// a[2] = A[g][16+4t..], a[3] = A[g+8][16+4t..]; b[0] = B[4t..4t+3][g], b[1] = B[16+4t..][g];
// c[0] = C[g][2t], c[1] = C[g][2t+1], c[2] = C[g+8][2t], c[3] = C[g+8][2t+1]. The emulation
// gathers the fragments with shuffles and computes the same products.
__device__ __forceinline__ void mma_s8_16x8x32(int* c, const u32* a, const u32* b) {
#ifdef NPU_EMULATION
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    int ra[2][8];
    for (int s = 0; s < 4; ++s) {
        const int src = g * 4 + s;
        ra[0][s] = __shfl_sync(FULL_MASK, (int)a[0], src);
        ra[1][s] = __shfl_sync(FULL_MASK, (int)a[1], src);
        ra[0][4 + s] = __shfl_sync(FULL_MASK, (int)a[2], src);
        ra[1][4 + s] = __shfl_sync(FULL_MASK, (int)a[3], src);
    }
    int rb[2][8];
    for (int j = 0; j < 2; ++j) {
        for (int s = 0; s < 4; ++s) {
            const int src = (t * 2 + j) * 4 + s;
            rb[j][s] = __shfl_sync(FULL_MASK, (int)b[0], src);
            rb[j][4 + s] = __shfl_sync(FULL_MASK, (int)b[1], src);
        }
    }
    for (int i = 0; i < 4; ++i) {
        int dot = 0;
        for (int q = 0; q < 8; ++q) {
            dot = __dp4a(ra[i >> 1][q], rb[i & 1][q], dot);
        }
        c[i] = dot;
    }
#elif __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0));
#else
    __trap(); // the host launches these kernels on sm_80 and later only
#endif
}

// What one warp's tile needs: its rows (r_lo = g, r_hi = g + 8 of the tile) and outputs.
struct GemmWarp {
    const u8* w;
    const u16* wd;
    const u16* wm;
    int n;
    int nb;
    int k;
    const signed char* xq;
    const u32* xs;
    int r_lo;      // this thread's first row; r_lo + 8 its second
    bool ok_lo;    // r_lo < rows
    bool ok_hi;    // r_lo + 8 < rows
    int o_frag[2]; // the weight row this lane loads for n-tile 0 and 1 (o0 + 8 j + g)
    int o_out[4];  // the outputs of this thread's results: o0 + 8 j + 2 t + i, at 2 j + i
};

// Adds block b's contributions to the thread's 8 partial sums: p[4 j + i] = (r_lo, o_out[2 j + i]),
// p[4 j + 2 + i] = (r_hi, o_out[2 j + i]).
template <int FMT>
__device__ __forceinline__ void gemm_block(const GemmWarp& s, int b, float* p) {
    const int t = threadIdx.x & 3;
    const int qb = FMT == WF_Q8_0 ? 32 : 16;
    const int offset = FMT == WF_Q4_0 ? 8 : 0;
    u32 a[4] = {0u, 0u, 0u, 0u};
    uint4 s_lo = {0u, 0u, 0u, 0u};
    uint4 s_hi = {0u, 0u, 0u, 0u};
    if (s.ok_lo) {
        const signed char* x = s.xq + (i64)s.r_lo * s.k + b * 32 + t * 4;
        a[0] = *(const u32*)x;
        a[2] = *(const u32*)(x + 16);
        s_lo = *(const uint4*)(s.xs + ((i64)s.r_lo * s.nb + b) * 4);
    }
    if (s.ok_hi) {
        const signed char* x = s.xq + (i64)(s.r_lo + 8) * s.k + b * 32 + t * 4;
        a[1] = *(const u32*)x;
        a[3] = *(const u32*)(x + 16);
        s_hi = *(const uint4*)(s.xs + ((i64)(s.r_lo + 8) * s.nb + b) * 4);
    }
    for (int j = 0; j < 2; ++j) {
        u32 bq[2] = {0u, 0u};
        if (s.o_frag[j] < s.n) {
            const u8* q = s.w + ((i64)s.o_frag[j] * s.nb + b) * qb + t * 4;
            if (FMT == WF_Q8_0) {
                bq[0] = *(const u32*)q;
                bq[1] = *(const u32*)(q + 16);
            } else {
                // Byte i: element i in the low nibble, element i + 16 in the high one.
                const u32 v = *(const u32*)q;
                bq[0] = v & 0x0f0f0f0fu;
                bq[1] = (v >> 4) & 0x0f0f0f0fu;
            }
        }
        int c[4];
        mma_s8_16x8x32(c, a, bq);
        for (int i = 0; i < 2; ++i) {
            const int o = s.o_out[2 * j + i];
            if (o >= s.n) {
                continue;
            }
            const i64 blk = (i64)o * s.nb + b;
            const float dw = f16_bits_to_f32(s.wd[blk]);
            const float mw = FMT == WF_Q4_1 ? f16_bits_to_f32(s.wm[blk]) : 0.0f;
            float* lo = p + 4 * j + i;
            float* hi = p + 4 * j + 2 + i;
            const int dot_lo = c[i] - offset * (int)s_lo.z;
            const int dot_hi = c[2 + i] - offset * (int)s_hi.z;
            *lo = fmaf((float)dot_lo, dw * __uint_as_float(s_lo.x), *lo);
            *hi = fmaf((float)dot_hi, dw * __uint_as_float(s_hi.x), *hi);
            if (FMT == WF_Q4_1) {
                *lo = fmaf(mw, __uint_as_float(s_lo.y), *lo);
                *hi = fmaf(mw, __uint_as_float(s_hi.y), *hi);
            }
        }
    }
}

// Four consecutive leaves of the butterfly: lane classes c, c + 16, c + 8 and c + 24 (blocks
// class, class + 32, ... each, in that order), walked together so that four independent chains
// of loads and products are in flight; out = their sum in the butterfly's order.
template <int FMT>
__device__ __forceinline__ void gemm_lane_group(const GemmWarp& s, int c, float* out) {
    float p[4][8];
    for (int m = 0; m < 4; ++m) {
        for (int i = 0; i < 8; ++i) {
            p[m][i] = 0.0f;
        }
    }
    for (int base = c; base < s.nb; base += 32) {
        gemm_block<FMT>(s, base, p[0]);
        if (base + 16 < s.nb) {
            gemm_block<FMT>(s, base + 16, p[1]);
        }
        if (base + 8 < s.nb) {
            gemm_block<FMT>(s, base + 8, p[2]);
        }
        if (base + 24 < s.nb) {
            gemm_block<FMT>(s, base + 24, p[3]);
        }
    }
    for (int i = 0; i < 8; ++i) {
        out[i] = (p[0][i] + p[1][i]) + (p[2][i] + p[3][i]);
    }
}

// The butterfly's sum of lane classes in sequence positions [S, S + 2^LEVEL), in bit-reversed
// order: position q holds lane class rev5(q). Groups of four positions are one lane group.
template <int FMT, int LEVEL, int S>
struct GemmTree {
    static __device__ __forceinline__ void sum(const GemmWarp& s, float* out) {
        float right[8];
        GemmTree<FMT, LEVEL - 1, S>::sum(s, out);
        GemmTree<FMT, LEVEL - 1, S + (1 << (LEVEL - 1))>::sum(s, right);
        for (int i = 0; i < 8; ++i) {
            out[i] = out[i] + right[i];
        }
    }
};
template <int FMT, int S>
struct GemmTree<FMT, 2, S> {
    static __device__ __forceinline__ void sum(const GemmWarp& s, float* out) {
        // rev5(S) for S a multiple of 4: bits 2, 3, 4 of S reversed into bits 2, 1, 0.
        const int c = (S & 4) | ((S & 8) >> 2) | ((S & 16) >> 4);
        gemm_lane_group<FMT>(s, c, out);
    }
};

template <typename T, int FMT>
__device__ __forceinline__ void gemm_q_body(const u8* w, const u16* wd, const u16* wm, int n,
                                            int k, const signed char* xq, const u32* xs, int rows,
                                            T* out, int ldo) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int r0 = blockIdx.x * 32 + (warp & 1) * 16;
    const int o0 = blockIdx.y * 32 + (warp >> 1) * 16;
    if (r0 >= rows || o0 >= n) {
        return; // the whole warp: this kernel has no block-wide barrier
    }
    GemmWarp s;
    s.w = w;
    s.wd = wd;
    s.wm = wm;
    s.n = n;
    s.nb = k >> 5;
    s.k = k;
    s.xq = xq;
    s.xs = xs;
    s.r_lo = r0 + g;
    s.ok_lo = r0 + g < rows;
    s.ok_hi = r0 + g + 8 < rows;
    for (int j = 0; j < 2; ++j) {
        s.o_frag[j] = o0 + 8 * j + g;
        for (int i = 0; i < 2; ++i) {
            s.o_out[2 * j + i] = o0 + 8 * j + 2 * t + i;
        }
    }
    float total[8];
    GemmTree<FMT, 5, 0>::sum(s, total);
    for (int j = 0; j < 2; ++j) {
        for (int i = 0; i < 2; ++i) {
            const int o = s.o_out[2 * j + i];
            if (o >= n) {
                continue;
            }
            if (s.ok_lo) {
                out[(i64)s.r_lo * ldo + o] = from_f32<T>(total[4 * j + i]);
            }
            if (s.ok_hi) {
                out[(i64)(s.r_lo + 8) * ldo + o] = from_f32<T>(total[4 * j + 2 + i]);
            }
        }
    }
}

#define GEMM_Q_ONE(T, S, FMT, FS)                                                                  \
    extern "C" __global__ void gemm_##FS##_##S(const u8* w, const u16* wd, const u16* wm, int n,  \
                                               int k, const signed char* xq, const u32* xs,       \
                                               int rows, T* out, int ldo) {                        \
        gemm_q_body<T, FMT>(w, wd, wm, n, k, xq, xs, rows, out, ldo);                             \
    }
#define GEMM_Q(T, S)                                                                               \
    GEMM_Q_ONE(T, S, WF_Q4_0, q4_0)                                                                \
    GEMM_Q_ONE(T, S, WF_Q4_1, q4_1)                                                                \
    GEMM_Q_ONE(T, S, WF_Q8_0, q8_0)
NPU_FOR_EACH_ACT(GEMM_Q)

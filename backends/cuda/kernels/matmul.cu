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
    const float v = to_f32(x[r * ldx + b * 32 + lane]);
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const float rq = rintf(__fmul_rn(v, id));
    const int q = rq != rq ? 0 : (int)fminf(fmaxf(rq, -127.0f), 127.0f);
    int sum = q;
    for (int o = 16; o > 0; o >>= 1) {
        sum += __shfl_xor_sync(FULL_MASK, sum, o);
    }
    xq[r * k + b * 32 + lane] = (signed char)q;
    if (lane == 0) {
        u32* o = xs + (r * nb + b) * 4;
        o[0] = __float_as_uint(f16_bits_to_f32(f32_to_f16_bits(d)));
        o[1] = __float_as_uint(f16_bits_to_f32(f32_to_f16_bits(d * (float)sum)));
        o[2] = (u32)sum;
        o[3] = 0;
    }
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
    for (int r = 0; r < R; ++r) {
        acc[r] = 0.0f;
    }
    const int nb = k >> 5;
    const int qb = FMT == WF_Q8_0 ? 32 : 16;
    const int offset = FMT == WF_Q4_0 ? 8 : 0;
    for (int b = lane; b < nb; b += 32) {
        const i64 blk = (i64)o * nb + b;
        u32 wq[8];
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
        const float dw = f16_bits_to_f32(wd[blk]);
        const float mw = FMT == WF_Q4_1 ? f16_bits_to_f32(wm[blk]) : 0.0f;
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
    store_rows<T, R>(acc, lane, rows, out + o, ldo);
}

// F16 weights: activations in T, products in f32.
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
                        s = fmaf(wf[j], to_f32(xr[j]), s);
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
                    acc[r] = fmaf(wv, to_f32(x[(i64)r * ldx + c]), acc[r]);
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

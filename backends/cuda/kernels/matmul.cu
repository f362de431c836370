// Matrix products out[r][o] = x[r] . w[o] with the weights kept in their quantized form, and the
// dequantization of a whole matrix for the cuBLAS path.
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

// 32 activations from 16-byte aligned memory, as f32.
__device__ __forceinline__ void load_x32(const float* x, float* xf) {
    const float4* p = (const float4*)x;
    for (int i = 0; i < 8; ++i) {
        const float4 v = p[i];
        xf[4 * i] = v.x;
        xf[4 * i + 1] = v.y;
        xf[4 * i + 2] = v.z;
        xf[4 * i + 3] = v.w;
    }
}

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

__device__ __forceinline__ void load_x32(const f16* x, float* xf) {
    const uint4* p = (const uint4*)x;
    for (int i = 0; i < 4; ++i) {
        unpack_halves(p[i], xf + 8 * i, false);
    }
}

__device__ __forceinline__ void load_x32(const bf16* x, float* xf) {
    const uint4* p = (const uint4*)x;
    for (int i = 0; i < 4; ++i) {
        unpack_halves(p[i], xf + 8 * i, true);
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
                    wf[j] = fmaf((float)(byte & 15u), d, m);
                    wf[j + 16] = fmaf((float)(byte >> 4), d, m);
                } else {
                    wf[j] = (float)((int)(byte & 15u) - 8) * d;
                    wf[j + 16] = (float)((int)(byte >> 4) - 8) * d;
                }
            }
        }
    }
}

// ---- GEMV: few activation rows ---------------------------------------------------------------------
//
// grid (ceil(n / warps per block)), one warp per output o; lanes stride over the 32-value blocks
// of the weight row, dequantize each once and apply it to up to R activation rows. `x` rows are
// 16-byte aligned and `ldx` keeps them so (the host copies other layouts to an aligned scratch).

template <typename T, int FMT, int R>
__device__ __forceinline__ void gemv_body(const u8* w, const u16* wd, const u16* wm, int n, int k,
                                          const T* x, int ldx, int rows, T* out, int ldo) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= n) {
        return; // the whole warp: this kernel has no block-wide barrier
    }
    float acc[R];
    for (int r = 0; r < R; ++r) {
        acc[r] = 0.0f;
    }
    if (FMT == WF_F16) {
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
    } else {
        const int nb = k >> 5;
        for (int b = lane; b < nb; b += 32) {
            float wf[32];
            dequant_block<FMT>(w, wd, wm, (i64)o * nb + b, wf);
            for (int r = 0; r < R; ++r) {
                if (r < rows) {
                    float xf[32];
                    load_x32(x + (i64)r * ldx + b * 32, xf);
                    float s = 0.0f;
                    for (int j = 0; j < 32; ++j) {
                        s = fmaf(wf[j], xf[j], s);
                    }
                    acc[r] += s;
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        acc[r] = warp_sum(acc[r]);
    }
    if (lane == 0) {
        for (int r = 0; r < R; ++r) {
            if (r < rows) {
                out[(i64)r * ldo + o] = from_f32<T>(acc[r]);
            }
        }
    }
}

#define GEMV_ONE(T, S, FMT, FS, R)                                                                 \
    extern "C" __global__ void gemv_##FS##_r##R##_##S(const u8* w, const u16* wd, const u16* wm,  \
                                                      int n, int k, const T* x, int ldx, int rows, \
                                                      T* out, int ldo) {                           \
        gemv_body<T, FMT, R>(w, wd, wm, n, k, x, ldx, rows, out, ldo);                            \
    }
#define GEMV(T, S)                                                                                 \
    GEMV_ONE(T, S, WF_F16, f16w, 1)                                                                \
    GEMV_ONE(T, S, WF_F16, f16w, 8)                                                                \
    GEMV_ONE(T, S, WF_Q4_0, q4_0, 1)                                                               \
    GEMV_ONE(T, S, WF_Q4_0, q4_0, 8)                                                               \
    GEMV_ONE(T, S, WF_Q4_1, q4_1, 1)                                                               \
    GEMV_ONE(T, S, WF_Q4_1, q4_1, 8)                                                               \
    GEMV_ONE(T, S, WF_Q8_0, q8_0, 1)                                                               \
    GEMV_ONE(T, S, WF_Q8_0, q8_0, 8)
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

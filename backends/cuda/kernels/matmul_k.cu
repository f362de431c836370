// The packed Q4_K GEMV: Q4_K matrices kept in the file's bytes (NPU_SERVING_CUDA_KQUANTS=packed)
// multiplied by 8-bit activations from `quantize_q8`, as llama.cpp's CUDA mmvq multiplies them.
//
// Weight format (the GGUF's blocks as they are, n rows of k / 256 blocks of 144 bytes):
//   bytes 0..2 d (f16), 2..4 dmin (f16), 4..16 twelve bytes of 6-bit sub-block scales and
//   minimums (ggml's get_scale_min_k4 packing), 16..144 the 256 4-bit quants: 32-byte chunk c
//   holds values 64c + i in the low nibbles and 64c + 32 + i in the high ones (i < 32).
// 144 is a multiple of 16, so every block's quants are 16-byte aligned and a lane reads a
// sub-block's 32 quant bytes with two 128-bit loads.
// Sub-block j (32 values) of a block: value = d * sc_j * q - dmin * m_j. Its dot with activation
// block (dx, qx, isum = sum qx) is dx * (d * sc_j * sum(q * qx) - dmin * m_j * isum), the integer
// sum by dp4a.

// Byte i of the 16-byte block header.
__device__ __forceinline__ u32 q4k_hbyte(const u32* h, int i) {
    return (h[i >> 2] >> (8 * (i & 3))) & 0xffu;
}

// Sub-block j's 6-bit scale and minimum (ggml's get_scale_min_k4 over header bytes 4..16).
__device__ __forceinline__ void q4k_scale_min(const u32* h, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = (int)(q4k_hbyte(h, 4 + j) & 63u);
        *m = (int)(q4k_hbyte(h, 8 + j) & 63u);
    } else {
        *sc = (int)((q4k_hbyte(h, 8 + j) & 15u) | ((q4k_hbyte(h, j) >> 6) << 4));
        *m = (int)((q4k_hbyte(h, 8 + j) >> 4) | ((q4k_hbyte(h, 4 + j) >> 6) << 4));
    }
}

// One warp per output o; lanes stride over the 32-value sub-blocks of the weight row and apply
// each to up to R activation rows. grid (ceil(n / warps per block)).
template <typename T, int R>
__device__ __forceinline__ void gemv_q4k_body(const u8* w, int n, int k, const signed char* xq,
                                              const u32* xs, int rows, T* out, int ldo) {
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
    const int nsb = k >> 8;
    for (int b = lane; b < nb; b += 32) {
        const int j = b & 7;
        const u8* blk = w + ((i64)o * nsb + (b >> 3)) * 144;
        const uint4 hv = *(const uint4*)blk;
        const u32 h[4] = {hv.x, hv.y, hv.z, hv.w};
        int sc, m;
        q4k_scale_min(h, j, &sc, &m);
        const float dl = __fmul_rn(lo_f16(h[0]), (float)sc);
        const float ml = __fmul_rn(hi_f16(h[0]), (float)m);
        const uint4* qp = (const uint4*)(blk + 16 + 32 * (j >> 1));
        const uint4 q0 = qp[0];
        const uint4 q1 = qp[1];
        const int shift = 4 * (j & 1);
        const u32 wq[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
        for (int r = 0; r < R; ++r) {
            if (r < rows) {
                const uint4* xp = (const uint4*)(xq + (i64)r * k + b * 32);
                const uint4 xa = xp[0];
                const uint4 xb = xp[1];
                const int xw[8] = {(int)xa.x, (int)xa.y, (int)xa.z, (int)xa.w,
                                   (int)xb.x, (int)xb.y, (int)xb.z, (int)xb.w};
                int dot = 0;
                for (int i = 0; i < 8; ++i) {
                    dot = __dp4a((int)((wq[i] >> shift) & 0x0f0f0f0fu), xw[i], dot);
                }
                const uint4 s4 = *(const uint4*)(xs + ((i64)r * nb + b) * 4);
                const float part =
                    __fsub_rn(__fmul_rn(dl, (float)dot), __fmul_rn(ml, (float)(int)s4.z));
                acc[r] = fmaf(__uint_as_float(s4.x), part, acc[r]);
            }
        }
    }
    store_rows<T, R>(acc, lane, rows, out + o, ldo);
}

#define GEMV_Q4K_ONE(T, S, R)                                                                      \
    extern "C" __global__ void gemv_q4_k_r##R##_##S(const u8* w, int n, int k,                     \
                                                    const signed char* xq, const u32* xs,         \
                                                    int rows, T* out, int ldo) {                   \
        gemv_q4k_body<T, R>(w, n, k, xq, xs, rows, out, ldo);                                     \
    }
#define GEMV_Q4K(T, S)                                                                             \
    GEMV_Q4K_ONE(T, S, 1)                                                                          \
    GEMV_Q4K_ONE(T, S, 8)
NPU_FOR_EACH_ACT(GEMV_Q4K)

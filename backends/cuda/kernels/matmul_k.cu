// The packed K-quant GEMVs (NPU_SERVING_CUDA_KQUANTS=packed): Q4_K and Q6_K matrices in the
// file's bytes multiplied by 8-bit activations from `quantize_q8k` (256 values a scale, as
// llama.cpp's CPU build quantizes them for K-quants), with llama.cpp's mmvq integer scheme.
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

// ---- Q8_K activations for the packed K-quant products -------------------------------------------
//
// llama.cpp's CPU build (the references) multiplies K-quant weights by activations quantized 256
// values a scale (Q8_K, `quantize_row_q8_K_ref`): per 256 values the one of largest magnitude
// (the first, on ties) `max`, iscale = -127 / max, each value rint(iscale * x) at most 127, the
// scale 1 / iscale in f32. `quantize_q8k` writes that, in `quantize_q8`'s layout so the K-quant
// kernels read it unchanged: the int8 rows in xq, and for each 32-value block 4 words (the
// super-block's scale, the f16-rounded scale * block sum (as Q8_0's s), the block's integer sum,
// 0). The CPU backend's `quantize_row_q8k` is the same arithmetic, value for value.
// grid (ceil(k / 256 / 8), rows), 8 warps: warp w quantizes super-block blockIdx.x * 8 + w of row
// blockIdx.y, lane l its values 8l .. 8l + 7.
template <typename T>
__device__ __forceinline__ void quantize_q8k_body(const T* x, int ldx, int k, signed char* xq,
                                                  u32* xs) {
    const int nsb = k >> 8;
    const int sb = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (sb >= nsb) {
        return; // the whole warp: no block-wide barrier here
    }
    const int lane = threadIdx.x & 31;
    const i64 r = blockIdx.y;
    const T* xr = x + r * ldx + sb * 256 + lane * 8;
    float v[8];
    float amax = 0.0f;
    float vmax = 0.0f;
    int at = 0x7fffffff;
    for (int i = 0; i < 8; ++i) {
        v[i] = to_f32(xr[i]);
        const float a = fabsf(v[i]);
        if (a > amax) { // strict: the first of equal magnitudes; NaN never wins
            amax = a;
            vmax = v[i];
            at = lane * 8 + i;
        }
    }
    // The warp's largest magnitude, the lowest index on ties.
    for (int o = 16; o > 0; o >>= 1) {
        const float oa = __shfl_xor_sync(FULL_MASK, amax, o);
        const float ov = __shfl_xor_sync(FULL_MASK, vmax, o);
        const int oat = __shfl_xor_sync(FULL_MASK, at, o);
        if (oa > amax || (oa == amax && oat < at)) {
            amax = oa;
            vmax = ov;
            at = oat;
        }
    }
    int q[8];
    float scale = 0.0f;
    if (amax == 0.0f) {
        for (int i = 0; i < 8; ++i) {
            q[i] = 0;
        }
    } else {
        const float iscale = __fdiv_rn(-127.0f, vmax);
        for (int i = 0; i < 8; ++i) {
            const float rq = rintf(__fmul_rn(iscale, v[i]));
            q[i] = rq != rq ? 0 : (int)fminf(fmaxf(rq, -128.0f), 127.0f);
        }
        scale = __fdiv_rn(1.0f, iscale);
    }
    u32 lo = 0, hi = 0;
    int sum = 0;
    for (int i = 0; i < 4; ++i) {
        lo |= ((u32)q[i] & 0xffu) << (8 * i);
        hi |= ((u32)q[4 + i] & 0xffu) << (8 * i);
        sum += q[i] + q[4 + i];
    }
    u32* xw = (u32*)(xq + r * k + sb * 256 + lane * 8);
    xw[0] = lo;
    xw[1] = hi;
    // A 32-value block is lanes 4j .. 4j + 3: their sums, in order.
    sum += __shfl_xor_sync(FULL_MASK, sum, 1);
    sum += __shfl_xor_sync(FULL_MASK, sum, 2);
    if ((lane & 3) == 0) {
        u32* o = xs + (r * (k >> 5) + sb * 8 + (lane >> 2)) * 4;
        o[0] = __float_as_uint(scale);
        o[1] = __float_as_uint(f16_bits_to_f32(f32_to_f16_bits(scale * (float)sum)));
        o[2] = (u32)sum;
        o[3] = 0;
    }
}

#define QUANTIZE_Q8K(T, S)                                                                         \
    extern "C" __global__ void quantize_q8k_##S(const T* x, int ldx, int k, signed char* xq,      \
                                                u32* xs) {                                         \
        quantize_q8k_body<T>(x, ldx, k, xq, xs);                                                  \
    }
NPU_FOR_EACH_ACT(QUANTIZE_Q8K)

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

// Q6_K (matrices of n * k / 256 blocks; `pack_kquant` splits the file's 210-byte blocks):
//   w[0 .. blocks * 192): each block's ql (128 bytes) then qh (64 bytes), as in the file;
//   then 16 signed 8-bit sub-block scales per block; then one f16 d per block.
// Value y[128h + 32t + l] (h < 2, t < 4, l < 32) of a block is
//   d * sc[8h + 2t + l / 16] * (q - 32), q = nibble (t >> 1) of ql[64h + 32(t & 1) + l]
//   | bits 2t..2t+1 of qh[32h + l] << 4,
// so activation block j = 4h + t of the block meets 32 bytes of ql and 32 of qh, two scales.
// Its dot: dx * d * sum over its two halves of sc * (sum q qx - 32 sum qx), integers by dp4a.
template <typename T, int R>
__device__ __forceinline__ void gemv_q6k_body(const u8* w, int n, int k, const signed char* xq,
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
    const i64 blocks = (i64)n * nsb;
    const signed char* scales = (const signed char*)(w + blocks * 192);
    const u16* wd = (const u16*)(w + blocks * 208);
    for (int b = lane; b < nb; b += 32) {
        const int j = b & 7;
        const int h = j >> 2;
        const int t = j & 3;
        const i64 blk = (i64)o * nsb + (b >> 3);
        const u8* base = w + blk * 192;
        const uint4* lp = (const uint4*)(base + 64 * h + 32 * (t & 1));
        const uint4* hp = (const uint4*)(base + 128 + 32 * h);
        const uint4 l0 = lp[0];
        const uint4 l1 = lp[1];
        const uint4 h0 = hp[0];
        const uint4 h1 = hp[1];
        const u32 lw[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
        const u32 hw[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
        const int lshift = 4 * (t >> 1);
        const int hshift = 2 * t;
        u32 wq[8];
        for (int i = 0; i < 8; ++i) {
            wq[i] = ((lw[i] >> lshift) & 0x0f0f0f0fu) | (((hw[i] >> hshift) & 0x03030303u) << 4);
        }
        const int sc0 = (int)scales[blk * 16 + 8 * h + 2 * t];
        const int sc1 = (int)scales[blk * 16 + 8 * h + 2 * t + 1];
        const float d = f16_bits_to_f32(wd[blk]);
        for (int r = 0; r < R; ++r) {
            if (r < rows) {
                const uint4* xp = (const uint4*)(xq + (i64)r * k + b * 32);
                const uint4 xa = xp[0];
                const uint4 xb = xp[1];
                const int xw[8] = {(int)xa.x, (int)xa.y, (int)xa.z, (int)xa.w,
                                   (int)xb.x, (int)xb.y, (int)xb.z, (int)xb.w};
                int dq0 = 0, dq1 = 0, sx0 = 0, sx1 = 0;
                for (int i = 0; i < 4; ++i) {
                    dq0 = __dp4a((int)wq[i], xw[i], dq0);
                    sx0 = __dp4a(0x01010101, xw[i], sx0);
                    dq1 = __dp4a((int)wq[4 + i], xw[4 + i], dq1);
                    sx1 = __dp4a(0x01010101, xw[4 + i], sx1);
                }
                const int dot = sc0 * (dq0 - 32 * sx0) + sc1 * (dq1 - 32 * sx1);
                const uint4 s4 = *(const uint4*)(xs + ((i64)r * nb + b) * 4);
                acc[r] = fmaf(__fmul_rn(d, __uint_as_float(s4.x)), (float)dot, acc[r]);
            }
        }
    }
    store_rows<T, R>(acc, lane, rows, out + o, ldo);
}

#define GEMV_Q6K_ONE(T, S, R)                                                                      \
    extern "C" __global__ void gemv_q6_k_r##R##_##S(const u8* w, int n, int k,                     \
                                                    const signed char* xq, const u32* xs,         \
                                                    int rows, T* out, int ldo) {                   \
        gemv_q6k_body<T, R>(w, n, k, xq, xs, rows, out, ldo);                                     \
    }
#define GEMV_Q6K(T, S)                                                                             \
    GEMV_Q6K_ONE(T, S, 1)                                                                          \
    GEMV_Q6K_ONE(T, S, 8)
NPU_FOR_EACH_ACT(GEMV_Q6K)

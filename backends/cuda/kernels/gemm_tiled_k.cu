// The int8 tensor-core GEMM tiled through shared memory for packed Q4_K and Q6_K matrices
// (sm_80 and later), for prefill steps of many token rows: the arithmetic of the K-quant GEMVs
// (`gemv_q4_k_*`, `gemv_q6_k_*`, matmul_k.cu) bit for bit, so a row's outputs do not depend on
// how many rows share its step.
//
// The tile, the walk and the sums are gemm_tiled.cu's (its helpers are used here: cp_async16,
// gt_rev5, gt_next, gt_push): a block of 8 warps computes 64 token rows x 64 outputs, the k
// dimension walked one 32-value sub-block at a time in the GEMV's lane classes (sub-block b is
// lane b % 32's), the classes in the warp butterfly's bit-reversed order, each class one fmaf
// chain from 0 and the class sums added by the pairwise stack. Per sub-block and (row, output)
// the float steps are the GEMV's, from the same exact integer dot:
//   Q4_K: dl = d * sc, ml = dmin * m (__fmul_rn), part = dl * dot - ml * isum (each product
//         rounded, then the difference), acc = fmaf(dx, part, acc); dot = sum q * qx (q 0..15)
//         by one mma.m16n8k32.
//   Q6_K: dot = sc0 * (sum over values 0..15 of (q - 32) qx) + sc1 * (the same over 16..31),
//         integers (the GEMV's dq - 32 sx per half is the same integer), each half by one
//         mma.m16n8k32 with the other half's weight bytes zero (q - 32 fits in 8 signed bits);
//         acc = fmaf(d * dx, (float)dot, acc).
//
// Staged per sub-block and output (cp.async.cg, 16 bytes at a time, all 16-byte aligned):
//   Q4_K (KB = 48): the block's 16-byte header (d, dmin, the 12 scale/min bytes), then the 32
//         quant bytes holding the sub-block (low nibbles for even sub-blocks, high for odd).
//   Q6_K (KB = 80): the 32 ql bytes, the 32 qh bytes, the block's 16 scales; d (2 bytes) by a
//         plain load and store.
// Activations and their scale words as in gemm_tiled.cu. Q4_K keeps GT_STAGES (3) stages;
// Q6_K two (its stages are larger: three would pass the 48 KiB of static shared memory), with
// the same one barrier a stage (the copy issued after it goes into the buffer computed before it).
// Rows past `rows` and outputs past `n` read the last valid row or output; their results are
// never stored. grid (ceil(rows / 64), ceil(n / 64)), 256 threads; 43,776 bytes of static
// shared memory (Q4_K), 37,376 (Q6_K). NVRTC 13.5's resource report (sm_90): 166 to 172
// registers a thread (Q4_K), 158 to 163 (Q6_K), no spills and no stack frame. Not yet run on a GPU.

#define KT_Q4K 0
#define KT_Q6K 1

template <int FMT> struct KtFmt;
template <> struct KtFmt<KT_Q4K> {
    static constexpr int KB = 48;
    static constexpr int STAGES = GT_STAGES;
};
template <> struct KtFmt<KT_Q6K> {
    static constexpr int KB = 80;
    static constexpr int STAGES = 2;
};

template <int KB> struct __align__(16) KtStage {
    u8 x[GT_ROWS * GT_XP];
    uint4 xs[GT_ROWS * GT_STEPS];
    u8 w[GT_OUTS * (GT_STEPS * KB + 16)];
    u16 wd[GT_OUTS * GT_STEPS];
};

// Issues the copies of the walk's next GT_STEPS sub-blocks (cursor *lw) into stage buffer st.
template <int FMT>
__device__ __forceinline__ void kt_load(KtStage<KtFmt<FMT>::KB>* st, GtWalk* lw, int nb, int k,
                                        int n, int rows, int r0, int o0, const u8* w,
                                        const signed char* xq, const u32* xs) {
    constexpr int KB = KtFmt<FMT>::KB;
    const int tid = threadIdx.x;
    const int nsb = k >> 8;
    int blk[GT_STEPS];
    for (int j = 0; j < GT_STEPS; ++j) {
        blk[j] = -1;
        if (lw->q < 32) {
            blk[j] = lw->b;
            gt_next(lw, nb);
        }
    }
    // Activations: 64 rows x GT_STEPS sub-blocks x 2 chunks = 256 chunks, one a thread.
    {
        const int row = tid >> 2;
        const int j = (tid >> 1) & 1;
        const int h = tid & 1;
        const int bj = gt_pick(blk, j);
        if (bj >= 0) {
            const int r = min(r0 + row, rows - 1);
            cp_async16(st->x + row * GT_XP + j * 32 + h * 16,
                       xq + (i64)r * k + (i64)bj * 32 + h * 16);
        }
    }
    if (tid < GT_ROWS * GT_STEPS) {
        const int row = tid >> 1;
        const int j = tid & 1;
        const int bj = gt_pick(blk, j);
        if (bj >= 0) {
            const int r = min(r0 + row, rows - 1);
            cp_async16(&st->xs[row * GT_STEPS + j], xs + ((i64)r * nb + bj) * 4);
        }
    }
    // Weights: 64 outputs x GT_STEPS sub-blocks x KB / 16 chunks.
    const int wp = GT_STEPS * KB + 16;
    const int chunks = KB / 16;
    const i64 blocks = (i64)n * nsb;
    for (int c = tid; c < GT_OUTS * GT_STEPS * chunks; c += GT_THREADS) {
        const int o = c / (GT_STEPS * chunks);
        const int j = (c / chunks) % GT_STEPS;
        const int h = c % chunks;
        const int bj = gt_pick(blk, j);
        if (bj >= 0) {
            const int sub = bj & 7;
            const i64 b = (i64)min(o0 + o, n - 1) * nsb + (bj >> 3);
            const u8* src;
            if (FMT == KT_Q4K) {
                const u8* base = w + b * 144;
                src = h == 0 ? base : base + 16 + 32 * (sub >> 1) + 16 * (h - 1);
            } else {
                const u8* base = w + b * 192;
                const int hh = sub >> 2;
                const int tt = sub & 3;
                if (h < 2) {
                    src = base + 64 * hh + 32 * (tt & 1) + 16 * h;
                } else if (h < 4) {
                    src = base + 128 + 32 * hh + 16 * (h - 2);
                } else {
                    src = w + blocks * 192 + b * 16;
                }
            }
            cp_async16(st->w + o * wp + j * KB + h * 16, src);
        }
    }
    if (FMT == KT_Q6K && tid < GT_OUTS * GT_STEPS) {
        const int o = tid >> 1;
        const int j = tid & 1;
        const int bj = gt_pick(blk, j);
        if (bj >= 0) {
            const i64 b = (i64)min(o0 + o, n - 1) * nsb + (bj >> 3);
            st->wd[o * GT_STEPS + j] = ((const u16*)(w + blocks * 208))[b];
        }
    }
}

// q - 32 for four 6-bit values q packed in bytes, as signed bytes (no borrow between bytes:
// q | 0x80 - 0x20 stays in 0x60..0x9f).
__device__ __forceinline__ u32 kt_minus32(u32 q) {
    return ((q | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
}

template <typename T, int FMT>
__device__ __forceinline__ void gemm_tiled_k_body(const u8* w, int n, int k,
                                                  const signed char* xq, const u32* xs, int rows,
                                                  T* out, int ldo) {
    constexpr int KB = KtFmt<FMT>::KB;
    constexpr int STAGES = KtFmt<FMT>::STAGES;
    __shared__ KtStage<KB> stages[STAGES];
    const int nb = k >> 5;
    const int r0 = blockIdx.x * GT_ROWS;
    const int o0 = blockIdx.y * GT_OUTS;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int wr = (warp & 3) * 16;
    const int wn = (warp >> 2) * 32;
    const int wp = GT_STEPS * KB + 16;
    const int n_stages = (nb + GT_STEPS - 1) / GT_STEPS;

    GtWalk lw = {0, 0};
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_stages) {
            kt_load<FMT>(&stages[s], &lw, nb, k, n, rows, r0, o0, w, xq, xs);
        }
        cp_async_commit();
    }

    float acc[16];
    float stack[16][5];
    for (int i = 0; i < 16; ++i) {
        acc[i] = 0.0f;
    }
    GtWalk cw = {0, 0};
    for (int s = 0; s < n_stages; ++s) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        // The buffer of stage s - 1, computed by every thread before this barrier.
        const int next = s + STAGES - 1;
        if (next < n_stages) {
            kt_load<FMT>(&stages[next % STAGES], &lw, nb, k, n, rows, r0, o0, w, xq, xs);
        }
        cp_async_commit();
        const KtStage<KB>* st = &stages[s % STAGES];
        const int steps = min(GT_STEPS, nb - s * GT_STEPS);
        for (int j = 0; j < steps; ++j) {
            const int sub = cw.b & 7;
            const u8* xr = st->x + (wr + g) * GT_XP + j * 32 + t * 4;
            u32 a[4];
            a[0] = *(const u32*)xr;
            a[1] = *(const u32*)(xr + 8 * GT_XP);
            a[2] = *(const u32*)(xr + 16);
            a[3] = *(const u32*)(xr + 8 * GT_XP + 16);
            const uint4 s_lo = st->xs[(wr + g) * GT_STEPS + j];
            const uint4 s_hi = st->xs[(wr + g + 8) * GT_STEPS + j];
#pragma unroll
            for (int jn = 0; jn < 4; ++jn) {
                const u8* wb = st->w + (wn + 8 * jn + g) * wp + j * KB;
                if (FMT == KT_Q4K) {
                    const int shift = 4 * (sub & 1);
                    u32 bq[2];
                    bq[0] = (*(const u32*)(wb + 16 + t * 4) >> shift) & 0x0f0f0f0fu;
                    bq[1] = (*(const u32*)(wb + 32 + t * 4) >> shift) & 0x0f0f0f0fu;
                    int c[4];
                    mma_s8_16x8x32(c, a, bq);
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const int ol = wn + 8 * jn + 2 * t + i;
                        const u32* h = (const u32*)(st->w + ol * wp + j * KB);
                        int sc, m;
                        q4k_scale_min(h, sub, &sc, &m);
                        const float dl = __fmul_rn(lo_f16(h[0]), (float)sc);
                        const float ml = __fmul_rn(hi_f16(h[0]), (float)m);
                        const float p_lo = __fsub_rn(__fmul_rn(dl, (float)c[i]),
                                                     __fmul_rn(ml, (float)(int)s_lo.z));
                        const float p_hi = __fsub_rn(__fmul_rn(dl, (float)c[2 + i]),
                                                     __fmul_rn(ml, (float)(int)s_hi.z));
                        acc[4 * jn + i] = fmaf(__uint_as_float(s_lo.x), p_lo, acc[4 * jn + i]);
                        acc[4 * jn + 2 + i] =
                            fmaf(__uint_as_float(s_hi.x), p_hi, acc[4 * jn + 2 + i]);
                    }
                } else {
                    const int lshift = 4 * ((sub & 3) >> 1);
                    const int hshift = 2 * (sub & 3);
                    u32 bq[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const u32 l = *(const u32*)(wb + 16 * e + t * 4);
                        const u32 hb = *(const u32*)(wb + 32 + 16 * e + t * 4);
                        bq[e] = kt_minus32(((l >> lshift) & 0x0f0f0f0fu) |
                                           (((hb >> hshift) & 0x03030303u) << 4));
                    }
                    const u32 b0[2] = {bq[0], 0u};
                    const u32 b1[2] = {0u, bq[1]};
                    int c0[4], c1[4];
                    mma_s8_16x8x32(c0, a, b0);
                    mma_s8_16x8x32(c1, a, b1);
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const int ol = wn + 8 * jn + 2 * t + i;
                        const signed char* scp =
                            (const signed char*)(st->w + ol * wp + j * KB + 64 + 2 * sub);
                        const int sc0 = (int)scp[0];
                        const int sc1 = (int)scp[1];
                        const float d = f16_bits_to_f32(st->wd[ol * GT_STEPS + j]);
                        const int dot_lo = sc0 * c0[i] + sc1 * c1[i];
                        const int dot_hi = sc0 * c0[2 + i] + sc1 * c1[2 + i];
                        acc[4 * jn + i] = fmaf(__fmul_rn(d, __uint_as_float(s_lo.x)),
                                               (float)dot_lo, acc[4 * jn + i]);
                        acc[4 * jn + 2 + i] = fmaf(__fmul_rn(d, __uint_as_float(s_hi.x)),
                                                   (float)dot_hi, acc[4 * jn + 2 + i]);
                    }
                }
            }
            const int q = cw.q;
            if (gt_next(&cw, nb)) {
                // Class rev5(q) is complete: its leaf, then the 0 leaves of the empty classes
                // after it; after leaf 31, acc holds the totals.
#pragma unroll
                for (int i = 0; i < 16; ++i) {
                    float v = gt_push(stack[i], q, acc[i]);
                    for (int e = q + 1; e < cw.q; ++e) {
                        v = gt_push(stack[i], e, 0.0f);
                    }
                    acc[i] = cw.q == 32 ? v : 0.0f;
                }
            }
        }
    }
    cp_async_wait<0>();
    for (int jn = 0; jn < 4; ++jn) {
        for (int i = 0; i < 2; ++i) {
            const int o = o0 + wn + 8 * jn + 2 * t + i;
            if (o >= n) {
                continue;
            }
            const int r_lo = r0 + wr + g;
            if (r_lo < rows) {
                out[(i64)r_lo * ldo + o] = from_f32<T>(acc[4 * jn + i]);
            }
            if (r_lo + 8 < rows) {
                out[(i64)(r_lo + 8) * ldo + o] = from_f32<T>(acc[4 * jn + 2 + i]);
            }
        }
    }
}

#define GEMM_TILED_K_ONE(T, S, FMT, FS)                                                            \
    extern "C" __global__ void __launch_bounds__(GT_THREADS)                                       \
        gemm_tiled_##FS##_##S(const u8* w, int n, int k, const signed char* xq, const u32* xs,    \
                              int rows, T* out, int ldo) {                                         \
        gemm_tiled_k_body<T, FMT>(w, n, k, xq, xs, rows, out, ldo);                               \
    }
#define GEMM_TILED_K(T, S)                                                                         \
    GEMM_TILED_K_ONE(T, S, KT_Q4K, q4_k)                                                           \
    GEMM_TILED_K_ONE(T, S, KT_Q6K, q6_k)
NPU_FOR_EACH_ACT(GEMM_TILED_K)

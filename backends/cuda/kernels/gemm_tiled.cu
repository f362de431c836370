// The int8 tensor-core GEMM tiled through shared memory (sm_80 and later), for prefill steps of
// many token rows: the arithmetic of `gemm_*` (matmul.cu) and so of the GEMV kernels, bit for bit.
//
// A block of 8 warps computes GT_ROWS (64) token rows x GT_OUTS (64) outputs. The k dimension is
// walked one 32-value block at a time, in the order the sums need: each output's float sum is the
// GEMV's, lane class c (blocks c, c + 32, c + 64, ... chained with one fmaf each, from 0) for the
// 32 classes, the class sums added by the warp butterfly's tree, which is a left-to-right pairwise
// sum over the classes in bit-reversed order (see matmul.cu). So the walk takes the classes in
// that order, class rev5(0) = 0, rev5(1) = 16, rev5(2) = 8, ..., each class's blocks in turn; a
// thread keeps one running chain per result and, at a class's end, pushes the chain's value into
// a pairwise-sum stack (5 levels: position q's value meets the pending left halves of the tree at
// the levels where q has a 1 bit). A class with no block (k < 1024) is a 0 leaf, as the GEMV's
// idle lanes add 0. Each block's integer product is exact on the tensor cores, and its scales
// enter as the GEMV's: fmaf(dot - offset * isum, dw * dx, acc), then fmaf(mw, sx, acc) for Q4_1.
//
// Stages of GT_STEPS (2) blocks of that walk are staged through shared memory, GT_STAGES (3)
// deep: the tile's 8-bit activations (32 bytes a row and block), their scale words (16 bytes)
// and the weight blocks' quants (16 or 32 bytes an output) by `cp.async.cg` 16 bytes at a time;
// the weight scales and minimums (2 bytes each, not contiguous in the walk's order) by plain
// loads and stores. One barrier per stage: after it, the stage's data is every thread's, and the
// buffer computed on one stage before is free for the copy issued next. Rows past `rows` and
// outputs past `n` read the last valid row or output (addresses stay inside the buffers); their
// results are never stored. Shared rows are padded by 16 bytes so the fragment loads of a warp
// hit 32 distinct banks.
//
// Warp w owns rows 16 (w % 4) .. + 16 and outputs 32 (w / 4) .. + 32 of the tile: per block one
// activation fragment and four mma.m16n8k32 (n-tiles of 8 outputs), 16 results a thread.
// grid (ceil(rows / 64), ceil(n / 64)), 256 threads, 38,400 bytes of static shared memory
// (32,256 for Q4). NVRTC 13.5's resource report (sm_90): 170 to 180 registers a thread, no
// spills and no local memory (the tree's stack in registers); one block (8 warps) an SM at that
// count. Its SASS: IMMA.16832.S8.S8, LDGSTS.E.BYPASS.128 (the copies), LDGDEPBAR / DEPBAR.LE.

#define GT_ROWS 64
#define GT_OUTS 64
#define GT_STEPS 2
#define GT_STAGES 3
#define GT_THREADS 256
#define GT_XP (GT_STEPS * 32 + 16) // bytes per activation row of a stage (padded)

// 16 bytes global -> shared without passing through registers (cp.async.cg: cached in L2 only).
// Both addresses must be 16-byte aligned; the emulation copies at once and refuses misaligned
// addresses as the PTX ISA does.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
#ifdef NPU_EMULATION
    npu_emu::cp_async(dst, src, 16);
#elif __CUDA_ARCH__ >= 800
    u32 s;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
                 : "=r"(s)
                 : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
#else
    __trap(); // the host launches these kernels on sm_80 and later only
#endif
}

// Closes the copies issued since the last commit into one group.
__device__ __forceinline__ void cp_async_commit() {
#if !defined(NPU_EMULATION) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most N of this thread's groups are pending (a barrier after it makes the
// landed data every thread's).
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if !defined(NPU_EMULATION) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Lane class at position q of the butterfly's left-to-right order (5 bits reversed).
__device__ __forceinline__ int gt_rev5(int q) {
    return ((q & 1) << 4) | ((q & 2) << 2) | (q & 4) | ((q & 8) >> 2) | ((q & 16) >> 4);
}

// The walk over the k blocks: position q (32: done) and block b of class rev5(q).
struct GtWalk {
    int q;
    int b;
};

// Moves past block w->b; true when that was its class's last block. Classes without a block
// are skipped here (the compute side pushes their 0 leaves).
__device__ __forceinline__ bool gt_next(GtWalk* w, int nb) {
    w->b += 32;
    if (w->b < nb) {
        return false;
    }
    w->q += 1;
    while (w->q < 32 && gt_rev5(w->q) >= nb) {
        w->q += 1;
    }
    if (w->q < 32) {
        w->b = gt_rev5(w->q);
    }
    return true;
}

// Leaf q of the pairwise tree with value x: adds it to the pending left halves from the lowest
// level up while q has a 1 bit there (left + right, as the butterfly adds), then parks the sum
// at the first level where q has a 0 bit. Returns the sum (the whole sum after leaf 31). The
// levels are unrolled with constant indices so the stack stays in registers.
__device__ __forceinline__ float gt_push(float* stack, int q, float x) {
    bool parked = false;
#pragma unroll
    for (int l = 0; l < 5; ++l) {
        if (!parked) {
            if ((q >> l) & 1) {
                x = stack[l] + x;
            } else {
                stack[l] = x;
                parked = true;
            }
        }
    }
    return x;
}

// One stage's shared memory: activations, their scale words, weight quants, weight scales and
// minimums (QB bytes of quants per weight block).
template <int QB> struct __align__(16) GtStage {
    u8 x[GT_ROWS * GT_XP];
    uint4 xs[GT_ROWS * GT_STEPS];
    u8 w[GT_OUTS * (GT_STEPS * QB + 16)];
    u16 wd[GT_OUTS * GT_STEPS];
    u16 wm[GT_OUTS * GT_STEPS];
};

// blk[j] for a j that varies by thread, by selects (no local-memory array).
__device__ __forceinline__ int gt_pick(const int* blk, int j) {
    int v = blk[0];
#pragma unroll
    for (int s = 1; s < GT_STEPS; ++s) {
        v = j == s ? blk[s] : v;
    }
    return v;
}

// Issues the copies of the walk's next GT_STEPS blocks (cursor *lw) into stage buffer st.
template <int FMT, int QB>
__device__ __forceinline__ void gt_load(GtStage<QB>* st, GtWalk* lw, int nb, int k, int n, int rows,
                                        int r0, int o0, const u8* w, const u16* wd, const u16* wm,
                                        const signed char* xq, const u32* xs) {
    const int tid = threadIdx.x;
    int blk[GT_STEPS];
    for (int j = 0; j < GT_STEPS; ++j) {
        blk[j] = -1;
        if (lw->q < 32) {
            blk[j] = lw->b;
            gt_next(lw, nb);
        }
    }
    const int wp = GT_STEPS * QB + 16;
    // Activations: 64 rows x GT_STEPS blocks x 2 chunks = 256 chunks, one a thread.
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
    // Weight quants: 64 outputs x GT_STEPS blocks x QB / 16 chunks.
    const int chunks = QB / 16;
    for (int c = tid; c < GT_OUTS * GT_STEPS * chunks; c += GT_THREADS) {
        const int o = c / (GT_STEPS * chunks);
        const int j = (c / chunks) % GT_STEPS;
        const int h = c % chunks;
        const int bj = gt_pick(blk, j);
        if (bj >= 0) {
            const int og = min(o0 + o, n - 1);
            cp_async16(st->w + o * wp + j * QB + h * 16, w + ((i64)og * nb + bj) * QB + h * 16);
        }
    }
    if (tid < GT_OUTS * GT_STEPS) {
        const int o = tid >> 1;
        const int j = tid & 1;
        const int bj = gt_pick(blk, j);
        if (bj >= 0) {
            const i64 b = (i64)min(o0 + o, n - 1) * nb + bj;
            st->wd[o * GT_STEPS + j] = wd[b];
            if (FMT == WF_Q4_1) {
                st->wm[o * GT_STEPS + j] = wm[b];
            }
        }
    }
}

template <typename T, int FMT>
__device__ __forceinline__ void gemm_tiled_body(const u8* w, const u16* wd, const u16* wm, int n,
                                                int k, const signed char* xq, const u32* xs,
                                                int rows, T* out, int ldo) {
    constexpr int QB = FMT == WF_Q8_0 ? 32 : 16;
    __shared__ GtStage<QB> stages[GT_STAGES];
    const int nb = k >> 5;
    const int r0 = blockIdx.x * GT_ROWS;
    const int o0 = blockIdx.y * GT_OUTS;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int wr = (warp & 3) * 16;
    const int wn = (warp >> 2) * 32;
    const int wp = GT_STEPS * QB + 16;
    const int offset = FMT == WF_Q4_0 ? 8 : 0;
    const int n_stages = (nb + GT_STEPS - 1) / GT_STEPS;

    GtWalk lw = {0, 0};
    for (int s = 0; s < GT_STAGES - 1; ++s) {
        if (s < n_stages) {
            gt_load<FMT, QB>(&stages[s], &lw, nb, k, n, rows, r0, o0, w, wd, wm, xq, xs);
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
        cp_async_wait<GT_STAGES - 2>();
        __syncthreads();
        // The buffer of stage s - 1, computed by every thread before this barrier.
        const int next = s + GT_STAGES - 1;
        if (next < n_stages) {
            gt_load<FMT, QB>(&stages[next % GT_STAGES], &lw, nb, k, n, rows, r0, o0, w, wd, wm,
                             xq, xs);
        }
        cp_async_commit();
        const GtStage<QB>* st = &stages[s % GT_STAGES];
        const int steps = min(GT_STEPS, nb - s * GT_STEPS);
        for (int j = 0; j < steps; ++j) {
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
                const u8* q = st->w + (wn + 8 * jn + g) * wp + j * QB + t * 4;
                u32 bq[2];
                if (FMT == WF_Q8_0) {
                    bq[0] = *(const u32*)q;
                    bq[1] = *(const u32*)(q + 16);
                } else {
                    // Byte i: element i in the low nibble, element i + 16 in the high one.
                    const u32 v = *(const u32*)q;
                    bq[0] = v & 0x0f0f0f0fu;
                    bq[1] = (v >> 4) & 0x0f0f0f0fu;
                }
                int c[4];
                mma_s8_16x8x32(c, a, bq);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const int ol = wn + 8 * jn + 2 * t + i;
                    const float dw = f16_bits_to_f32(st->wd[ol * GT_STEPS + j]);
                    float* lo = acc + 4 * jn + i;
                    float* hi = acc + 4 * jn + 2 + i;
                    const int dot_lo = c[i] - offset * (int)s_lo.z;
                    const int dot_hi = c[2 + i] - offset * (int)s_hi.z;
                    *lo = fmaf((float)dot_lo, dw * __uint_as_float(s_lo.x), *lo);
                    *hi = fmaf((float)dot_hi, dw * __uint_as_float(s_hi.x), *hi);
                    if (FMT == WF_Q4_1) {
                        const float mw = f16_bits_to_f32(st->wm[ol * GT_STEPS + j]);
                        *lo = fmaf(mw, __uint_as_float(s_lo.y), *lo);
                        *hi = fmaf(mw, __uint_as_float(s_hi.y), *hi);
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

#define GEMM_TILED_ONE(T, S, FMT, FS)                                                              \
    extern "C" __global__ void __launch_bounds__(GT_THREADS)                                       \
        gemm_tiled_##FS##_##S(const u8* w, const u16* wd, const u16* wm, int n, int k,            \
                              const signed char* xq, const u32* xs, int rows, T* out, int ldo) {   \
        gemm_tiled_body<T, FMT>(w, wd, wm, n, k, xq, xs, rows, out, ldo);                         \
    }
#define GEMM_TILED(T, S)                                                                           \
    GEMM_TILED_ONE(T, S, WF_Q4_0, q4_0)                                                            \
    GEMM_TILED_ONE(T, S, WF_Q4_1, q4_1)                                                            \
    GEMM_TILED_ONE(T, S, WF_Q8_0, q8_0)
NPU_FOR_EACH_ACT(GEMM_TILED)

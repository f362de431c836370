// DeepSeek's ops: scored expert routing, and multi-head latent attention over a paged cache of
// latents (the up-projections absorbed: every head attends over the same cached rows).
//
// Latent pool layout (f16): [block][layer][block_pos][row], a row being `hd` values: the token's
// latent (`lat` values) then its rotated key. One block's rows for every layer are contiguous (a
// block moves with one copy, as the K/V pool's do); `layer_off` is the element offset of a
// layer's rows inside a block.

// ---- scored routing ----------------------------------------------------------------------------

// The better of two (value, index) candidates: the larger value, ties to the lower index; an
// index < 0 is no candidate.
__device__ __forceinline__ bool route_better(float v, int i, float bv, int bi) {
    return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

// grid (rows), one warp a row, dynamic shared memory of 2 * ne + 2 * n_groups words: row r's
// scores (`sigmoid`: each logit's sigmoid; else the softmax, exp in f32 after the row's max is
// subtracted, the sum in double in index order, then each value times the sum's f32 inverse),
// the scores plus `bias` (ne f32 values, or null) to choose by; with groups (`n_groups` > 0)
// each group of ne / n_groups experts scored by the sum of its two best biased scores and every
// expert outside the `used` best groups (ties: the lower group) masked out; then the k best
// experts by biased score in descending order (ties: the lower index) into ids[r], their
// unbiased scores into w[r], divided by their f32 sum in pick order (at least 2^-14) when
// `normalize`, then times `scale` unless it is 0 or 1: the CPU backend's route_scored_row.
template <typename T>
__device__ __forceinline__ void moe_route_scored_body(const T* x, int ldx, int ne, int k,
                                                      const float* bias, int sigmoid,
                                                      int normalize, float scale, int n_groups,
                                                      int used, int* ids, int ldi, float* w,
                                                      int ldw) {
    const int lane = threadIdx.x & 31;
    const i64 r = blockIdx.x;
    const T* row = x + r * ldx;
    float* probs = (float*)DYN_SMEM;
    float* sel = probs + ne;
    float* gscore = sel + ne;
    int* keep = (int*)(gscore + n_groups);
    if (sigmoid) {
        for (int i = lane; i < ne; i += 32) {
            probs[i] = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-to_f32(row[i]))));
        }
    } else {
        float mx = NEG_INF;
        for (int i = lane; i < ne; i += 32) {
            mx = fmaxf(mx, to_f32(row[i]));
        }
        mx = warp_max(mx);
        for (int i = lane; i < ne; i += 32) {
            probs[i] = expf(__fsub_rn(to_f32(row[i]), mx));
        }
        __syncthreads();
        float inv = 0.0f;
        if (lane == 0) {
            double sum = 0.0;
            for (int i = 0; i < ne; i++) {
                sum += (double)probs[i];
            }
            inv = (float)(1.0 / sum);
        }
        inv = __shfl_sync(FULL_MASK, inv, 0);
        __syncthreads();
        for (int i = lane; i < ne; i += 32) {
            probs[i] = __fmul_rn(probs[i], inv);
        }
    }
    for (int i = lane; i < ne; i += 32) {
        sel[i] = bias ? __fadd_rn(probs[i], bias[i]) : probs[i];
    }
    __syncthreads();
    if (n_groups > 0) {
        const int per = ne / n_groups;
        for (int g = lane; g < n_groups; g += 32) {
            const float* part = sel + (i64)g * per;
            float b1 = 0.0f, b2 = 0.0f;
            int i1 = -1, i2 = -1;
            for (int i = 0; i < per; i++) {
                if (route_better(part[i], i, b1, i1)) {
                    b2 = b1;
                    i2 = i1;
                    b1 = part[i];
                    i1 = i;
                } else if (route_better(part[i], i, b2, i2)) {
                    b2 = part[i];
                    i2 = i;
                }
            }
            gscore[g] = i2 >= 0 ? __fadd_rn(b1, b2) : b1;
        }
        __syncthreads();
        // A group is kept when fewer than `used` groups come before it.
        for (int g = lane; g < n_groups; g += 32) {
            int before = 0;
            for (int h = 0; h < n_groups; h++) {
                before += route_better(gscore[h], h, gscore[g], g) ? 1 : 0;
            }
            keep[g] = before < used;
        }
        __syncthreads();
        for (int i = lane; i < ne; i += 32) {
            if (!keep[i / per]) {
                sel[i] = NEG_INF;
            }
        }
        __syncthreads();
    }
    // The j-th pick is the best candidate ordered after the (j-1)-th: smaller, or equal with a
    // higher index; each lane finds its own best, the warp the best of those.
    float pv = 0.0f;
    int pi = -1;
    float s = 0.0f;
    for (int j = 0; j < k; j++) {
        float bv = 0.0f;
        int bi = -1;
        for (int i = lane; i < ne; i += 32) {
            const float v = sel[i];
            const bool after = pi < 0 || v < pv || (v == pv && i > pi);
            if (after && route_better(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (route_better(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            const float p = bi >= 0 ? probs[bi] : 0.0f;
            ids[r * ldi + j] = bi;
            w[r * ldw + j] = p;
            s = __fadd_rn(s, p);
        }
        pv = bv;
        pi = bi;
    }
    if (lane != 0) {
        return;
    }
    if (normalize) {
        s = fmaxf(s, 6.103515625e-5f);
        for (int j = 0; j < k; j++) {
            w[r * ldw + j] = __fdiv_rn(w[r * ldw + j], s);
        }
    }
    if (scale != 0.0f && scale != 1.0f) {
        for (int j = 0; j < k; j++) {
            w[r * ldw + j] = __fmul_rn(w[r * ldw + j], scale);
        }
    }
}

#define MOE_ROUTE_SCORED(T, S)                                                                     \
    extern "C" __global__ void moe_route_scored_##S(                                               \
        const T* x, int ldx, int ne, int k, const float* bias, int sigmoid, int normalize,         \
        float scale, int n_groups, int used, int* ids, int ldi, float* w, int ldw) {              \
        moe_route_scored_body<T>(x, ldx, ne, k, bias, sigmoid, normalize, scale, n_groups, used,  \
                                 ids, ldi, w, ldw);                                                \
    }
NPU_FOR_EACH_ACT(MOE_ROUTE_SCORED)

// ---- latent KV write ---------------------------------------------------------------------------

// grid (rows): token r's row, its latent (lat values) then its rotated key (hd - lat values),
// goes to slot slots[r] (block slot / bs, position slot % bs) of the layer.
template <typename T>
__device__ __forceinline__ void kv_write_latent_body(const T* lat, int ldl, int lat_dim,
                                                     const T* rope, int ldr, const int* slots,
                                                     u16* pool, i64 block_stride, i64 layer_off,
                                                     int hd, int bs) {
    const i64 r = blockIdx.x;
    const int slot = slots[r];
    const i64 base = (i64)(slot / bs) * block_stride + layer_off + (i64)(slot % bs) * hd;
    for (int e = threadIdx.x; e < hd; e += blockDim.x) {
        const float v = e < lat_dim ? to_f32(lat[r * ldl + e]) : to_f32(rope[r * ldr + e - lat_dim]);
        pool[base + e] = f32_to_f16_bits(v);
    }
}

#define KV_WRITE_LATENT(T, S)                                                                      \
    extern "C" __global__ void kv_write_latent_##S(const T* lat, int ldl, int lat_dim,            \
                                                   const T* rope, int ldr, const int* slots,       \
                                                   u16* pool, i64 block_stride, i64 layer_off,     \
                                                   int hd, int bs) {                               \
        kv_write_latent_body<T>(lat, ldl, lat_dim, rope, ldr, slots, pool, block_stride,         \
                                layer_off, hd, bs);                                                \
    }
NPU_FOR_EACH_ACT(KV_WRITE_LATENT)

// ---- latent attention --------------------------------------------------------------------------
//
// grid (token rows, head chunks): a block holds one warp per query head of its chunk, and they
// share every tile of cached rows the block loads into shared memory. items[2 r] is row r's
// sequence and items[2 r + 1] its token in the sequence (the step's one-token work list); token
// t of a sequence (position start + t) sees positions 0..=start + t. The query and the
// probabilities meet the f16 cache as f16, as llama.cpp's attention without flash attention
// computes it (and the CPU backend): the query is rounded to f16 as it is loaded, and each warp
// goes over the 32-position tiles twice, first for the softmax's maximum m and sum l (online),
// then for the output, each probability exp(s - m) / l rounded to f16 before it weighs its
// latent. In both passes lane j scores
// position p0 + j against the whole row, (q_latent . latent + q_rope . rope) * scale, and lanes
// own pairs of the output's latent dimensions (the value is the latent).

#define ATTL_TILE 32
#define ATTL_MAX_LAT 512
#define ATTL_MAX_WORDS (ATTL_MAX_LAT / 64)
#define ATTL_MAX_THREADS 512

template <typename T>
__device__ __forceinline__ void attention_latent_body(
    const T* ql, int ldql, const T* qr, int ldqr, T* out, int ldo, const u16* pool,
    i64 block_stride, i64 layer_off, const int* items, const int* seq_info,
    const int* block_tables, int max_blocks, int n_heads, int lat, int hd, int bs, float scale) {
    const i64 row = blockIdx.x;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int head = blockIdx.y * warps + warp;
    const bool active = head < n_heads; // uniform in the warp
    const int seq = items[2 * row];
    const int tok = items[2 * row + 1];
    const int ctx = seq_info[3 * seq + 2] + tok + 1;
    const int half_hd = hd >> 1;
    const int half_lat = lat >> 1;
    const int rope_dim = hd - lat;
    const int words = half_hd + 1; // padded shared row: conflict-free column reads

    u32* rs = (u32*)DYN_SMEM;
    float* qs = (float*)(rs + ATTL_TILE * words) + warp * hd;
    if (active) {
        for (int d = lane; d < hd; d += 32) {
            const float v = d < lat ? to_f32(ql[row * ldql + (i64)head * lat + d])
                                    : to_f32(qr[row * ldqr + (i64)head * rope_dim + d - lat]);
            qs[d] = f16_bits_to_f32(f32_to_f16_bits(v));
        }
    }
    float m = NEG_INF;
    float l = 0.0f;
    float acc[2 * ATTL_MAX_WORDS];
    for (int i = 0; i < 2 * ATTL_MAX_WORDS; ++i) {
        acc[i] = 0.0f;
    }
    const int* bt = block_tables + (i64)seq * max_blocks;
    const int n_tiles = (ctx + ATTL_TILE - 1) / ATTL_TILE;
    float inv = 0.0f;
    for (int pass = 0; pass < 2; ++pass) {
        for (int tile = 0; tile < n_tiles; ++tile) {
            const int p0 = tile * ATTL_TILE;
            __syncthreads(); // the previous tile's readers are done (and q is in place)
            for (int wi = threadIdx.x; wi < ATTL_TILE * half_hd; wi += blockDim.x) {
                const int j = wi / half_hd;
                const int c = wi - j * half_hd;
                const int p = p0 + j;
                u32 word = 0;
                if (p < ctx) {
                    const i64 at =
                        (i64)bt[p / bs] * block_stride + layer_off + (i64)(p % bs) * hd + 2 * c;
                    word = *(const u32*)(pool + at);
                }
                rs[j * words + c] = word;
            }
            __syncthreads();
            if (!active) {
                continue;
            }
            const int p = p0 + lane;
            const bool seen = p < ctx;
            float s = NEG_INF;
            if (seen) {
                float dot = 0.0f;
                const u32* rr = rs + lane * words;
                for (int c = 0; c < half_hd; ++c) {
                    const u32 kw = rr[c];
                    dot = fmaf(qs[2 * c], lo_f16(kw), dot);
                    dot = fmaf(qs[2 * c + 1], hi_f16(kw), dot);
                }
                s = dot * scale;
            }
            if (pass == 0) {
                const float m_new = fmaxf(m, warp_max(s));
                const float pj = seen ? expf(s - m_new) : 0.0f;
                l = l * expf(m - m_new) + warp_sum(pj);
                m = m_new;
                continue;
            }
            const float pj = seen ? f16_bits_to_f32(f32_to_f16_bits(expf(s - m) * inv)) : 0.0f;
            const int n_seen = min(ATTL_TILE, ctx - p0);
            for (int j = 0; j < n_seen; ++j) {
                const float pb = __shfl_sync(FULL_MASK, pj, j);
                const u32* vr = rs + j * words;
                for (int i = 0; i < ATTL_MAX_WORDS; ++i) {
                    const int c = lane + 32 * i;
                    if (c < half_lat) {
                        const u32 vw = vr[c];
                        acc[2 * i] = fmaf(pb, lo_f16(vw), acc[2 * i]);
                        acc[2 * i + 1] = fmaf(pb, hi_f16(vw), acc[2 * i + 1]);
                    }
                }
            }
        }
        inv = 1.0f / l;
    }
    if (!active) {
        return;
    }
    T* o = out + row * ldo + (i64)head * lat;
    for (int i = 0; i < ATTL_MAX_WORDS; ++i) {
        const int c = lane + 32 * i;
        if (c < half_lat) {
            o[2 * c] = from_f32<T>(acc[2 * i]);
            o[2 * c + 1] = from_f32<T>(acc[2 * i + 1]);
        }
    }
}

#define ATTENTION_LATENT(T, S)                                                                     \
    extern "C" __global__ void __launch_bounds__(ATTL_MAX_THREADS) attention_latent_##S(           \
        const T* ql, int ldql, const T* qr, int ldqr, T* out, int ldo, const u16* pool,            \
        i64 block_stride, i64 layer_off, const int* items, const int* seq_info,                    \
        const int* block_tables, int max_blocks, int n_heads, int lat, int hd, int bs,            \
        float scale) {                                                                             \
        attention_latent_body<T>(ql, ldql, qr, ldqr, out, ldo, pool, block_stride, layer_off,     \
                                 items, seq_info, block_tables, max_blocks, n_heads, lat, hd, bs,  \
                                 scale);                                                           \
    }
NPU_FOR_EACH_ACT(ATTENTION_LATENT)

// The int8 KV pool (`kv_cache_dtype: int8`): its writes and paged attention over it.
//
// Pool layout (the CPU backend's int8 block bytes, byte for byte): a block is its int8 values,
// then its f16 scales. Values: for each layer, K as [kv_head][head_dim][block_pos] then V as
// [kv_head][block_pos][head_dim]. Scales: for each layer, K's [kv_head][block_pos] then V's.
// `layer_off` is the byte offset in a block of a layer's K values (its V values follow
// n_kv * hd * bs bytes later), `scale_off` of its K scales (its V scales follow n_kv * bs
// scales later); `block_stride` is a block's bytes.
//
// A row of hd values (one token's K or V of one KV head) is quantized with one scale:
// scale = f16(min(max|x| / 127, 65504)), q = round(x / scale) (half away from zero) clamped to
// ±127, 0 for NaN; every q 0 where the scale is 0. That is the CPU backend's quantize_row_i8,
// operation for operation (IEEE division, `--fmad=false`), so both backends write the same bytes
// from the same values.

// The scale of a row whose largest magnitude is `amax` (as f16 bits; 0 where the row is zero).
__device__ __forceinline__ u16 kv_i8_scale(float amax) {
    const u16 bits = f32_to_f16_bits(fminf(amax / 127.0f, 65504.0f));
    const float s = f16_bits_to_f32(bits);
    return (s == 0.0f || !(s <= 65504.0f)) ? (u16)0 : bits;
}

// `x` quantized with the scale `s` (not 0).
__device__ __forceinline__ signed char kv_i8_q(float x, float s) {
    const float r = roundf(x / s);
    return r != r ? (signed char)0 : (signed char)(int)fminf(fmaxf(r, -127.0f), 127.0f);
}

// Quantizes one row of hd <= 256 values held by a warp (lane l holds element l + 32i in v[i])
// and stores it: element e to q[e * step], the scale to *scale. Every lane of the warp calls it.
__device__ __forceinline__ void kv_i8_store_row(const float* v, int hd, signed char* q, i64 step,
                                                u16* scale) {
    const int lane = threadIdx.x & 31;
    float amax = 0.0f;
    for (int i = 0; i < 8; ++i) {
        if (lane + 32 * i < hd) {
            amax = fmaxf(amax, fabsf(v[i]));
        }
    }
    amax = warp_max(amax);
    const u16 sb = kv_i8_scale(amax);
    const float s = f16_bits_to_f32(sb);
    for (int i = 0; i < 8; ++i) {
        const int e = lane + 32 * i;
        if (e < hd) {
            q[(i64)e * step] = sb == 0 ? (signed char)0 : kv_i8_q(v[i], s);
        }
    }
    if (lane == 0) {
        *scale = sb;
    }
}

// Where token slot `slot`'s rows of KV head `kvh` go: K values (step bs), V values (step 1), and
// the two scales.
struct KvI8Slot {
    signed char* k;
    signed char* v;
    u16* ks;
    u16* vs;
};

__device__ __forceinline__ KvI8Slot kv_i8_slot(signed char* pool, i64 block_stride, i64 layer_off,
                                               i64 scale_off, int slot, int kvh, int n_kv, int hd,
                                               int bs) {
    const int t = slot % bs;
    signed char* blk = pool + (i64)(slot / bs) * block_stride;
    const i64 head = (i64)n_kv * hd * bs;
    KvI8Slot r;
    r.k = blk + layer_off + (i64)kvh * hd * bs + t;
    r.v = blk + layer_off + head + (i64)kvh * bs * hd + (i64)t * hd;
    u16* sc = (u16*)(blk + scale_off);
    r.ks = sc + kvh * bs + t;
    r.vs = sc + n_kv * bs + kvh * bs + t;
    return r;
}

// ---- KV write ----------------------------------------------------------------------------------

// grid (rows, 2 * n_kv), one warp: token r's K row (y < n_kv) or V row of KV head y % n_kv,
// quantized into slot slots[r].
template <typename T>
__device__ __forceinline__ void kv_write_i8_body(const T* k, int ldk, const T* v, int ldv,
                                                 const int* slots, signed char* pool,
                                                 i64 block_stride, i64 layer_off, i64 scale_off,
                                                 int n_kv, int hd, int bs) {
    const int r = blockIdx.x;
    const bool is_k = (int)blockIdx.y < n_kv;
    const int kvh = is_k ? blockIdx.y : blockIdx.y - n_kv;
    const int lane = threadIdx.x & 31;
    const T* x = is_k ? k + (i64)r * ldk + (i64)kvh * hd : v + (i64)r * ldv + (i64)kvh * hd;
    float vals[8];
    for (int i = 0; i < 8; ++i) {
        const int e = lane + 32 * i;
        vals[i] = e < hd ? to_f32(x[e]) : 0.0f;
    }
    const KvI8Slot at = kv_i8_slot(pool, block_stride, layer_off, scale_off, slots[r], kvh, n_kv,
                                   hd, bs);
    if (is_k) {
        kv_i8_store_row(vals, hd, at.k, bs, at.ks);
    } else {
        kv_i8_store_row(vals, hd, at.v, 1, at.vs);
    }
}

#define KV_WRITE_I8(T, S)                                                                          \
    extern "C" __global__ void kv_write_i8_##S(const T* k, int ldk, const T* v, int ldv,          \
                                               const int* slots, signed char* pool,                \
                                               i64 block_stride, i64 layer_off, i64 scale_off,     \
                                               int n_kv, int hd, int bs) {                         \
        kv_write_i8_body<T>(k, ldk, v, ldv, slots, pool, block_stride, layer_off, scale_off,      \
                            n_kv, hd, bs);                                                         \
    }
NPU_FOR_EACH_ACT(KV_WRITE_I8)

// grid (rows, n_heads + 2 * n_kv), one warp: `rope` and `kv_write_i8` of one step in one launch
// (`qkv` rows: n_heads query heads, n_kv key heads, n_kv value heads, hd values each). A query
// head's pairs are rotated in place as `rope` does (lane l: pairs l + 32i); a key head's too,
// and its row as stored (rounded to T), with its unrotated values, is quantized into the cache
// as `kv_write_i8` would quantize it after `rope`; a value head is quantized as it is.
template <typename T>
__device__ __forceinline__ void rope_kv_write_i8_body(
    T* qkv, int ld, int n_heads, int n_kv, int hd, int dims, int halves, float theta_scale,
    float freq_scale, const int* pos, const float* factors, const int* slots, signed char* pool,
    i64 block_stride, i64 layer_off, i64 scale_off, int bs) {
    const int r = blockIdx.x;
    const int h = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const int half = dims >> 1;
    T* hp = qkv + (i64)r * ld + (i64)h * hd;
    if (h >= n_heads + n_kv) { // a value head
        const int kvh = h - n_heads - n_kv;
        float vals[8];
        for (int i = 0; i < 8; ++i) {
            const int e = lane + 32 * i;
            vals[i] = e < hd ? to_f32(hp[e]) : 0.0f;
        }
        const KvI8Slot at = kv_i8_slot(pool, block_stride, layer_off, scale_off, slots[r], kvh,
                                       n_kv, hd, bs);
        kv_i8_store_row(vals, hd, at.v, 1, at.vs);
        return;
    }
    // Lane l rotates pairs l + 32i (i < 4: dims <= 256) and keeps their values as stored.
    float ya[4];
    float yb[4];
    int ia[4];
    int ib[4];
    float amax = 0.0f;
    for (int i = 0; i < 4; ++i) {
        const int p = lane + 32 * i;
        ia[i] = -1;
        ib[i] = -1;
        ya[i] = 0.0f;
        yb[i] = 0.0f;
        if (p < half) {
            const int a = halves ? p : 2 * p;
            const int b = halves ? p + half : 2 * p + 1;
            float y0;
            float y1;
            rope_rotate(to_f32(hp[a]), to_f32(hp[b]), p, (u32)pos[r], theta_scale, freq_scale,
                        factors, &y0, &y1);
            const T t0 = from_f32<T>(y0);
            const T t1 = from_f32<T>(y1);
            hp[a] = t0;
            hp[b] = t1;
            ia[i] = a;
            ib[i] = b;
            ya[i] = to_f32(t0);
            yb[i] = to_f32(t1);
            amax = fmaxf(amax, fmaxf(fabsf(ya[i]), fabsf(yb[i])));
        }
    }
    if (h < n_heads) {
        return; // a query head: rotated, nothing cached (uniform in the block)
    }
    // A key head: the unrotated values dims.. (lane l: dims + l + 32i), then the whole row.
    float rest[8];
    for (int i = 0; i < 8; ++i) {
        const int d = dims + lane + 32 * i;
        rest[i] = d < hd ? to_f32(hp[d]) : 0.0f;
        if (d < hd) {
            amax = fmaxf(amax, fabsf(rest[i]));
        }
    }
    amax = warp_max(amax);
    const u16 sb = kv_i8_scale(amax);
    const float s = f16_bits_to_f32(sb);
    const KvI8Slot at = kv_i8_slot(pool, block_stride, layer_off, scale_off, slots[r],
                                   h - n_heads, n_kv, hd, bs);
    for (int i = 0; i < 4; ++i) {
        if (ia[i] >= 0) {
            at.k[(i64)ia[i] * bs] = sb == 0 ? (signed char)0 : kv_i8_q(ya[i], s);
            at.k[(i64)ib[i] * bs] = sb == 0 ? (signed char)0 : kv_i8_q(yb[i], s);
        }
    }
    for (int i = 0; i < 8; ++i) {
        const int d = dims + lane + 32 * i;
        if (d < hd) {
            at.k[(i64)d * bs] = sb == 0 ? (signed char)0 : kv_i8_q(rest[i], s);
        }
    }
    if (lane == 0) {
        *at.ks = sb;
    }
}

#define ROPE_KV_WRITE_I8(T, S)                                                                     \
    extern "C" __global__ void rope_kv_write_i8_##S(                                               \
        T* qkv, int ld, int n_heads, int n_kv, int hd, int dims, int halves, float theta_scale,    \
        float freq_scale, const int* pos, const float* factors, const int* slots,                  \
        signed char* pool, i64 block_stride, i64 layer_off, i64 scale_off, int bs) {               \
        rope_kv_write_i8_body<T>(qkv, ld, n_heads, n_kv, hd, dims, halves, theta_scale,           \
                                 freq_scale, pos, factors, slots, pool, block_stride, layer_off,   \
                                 scale_off, bs);                                                   \
    }
NPU_FOR_EACH_ACT(ROPE_KV_WRITE_I8)

// ---- paged attention over the int8 pool ---------------------------------------------------------
//
// attention.cu's kernel (grid, work items, splits, windows, online softmax, outputs: read its
// note) with the tiles loaded as int8: a tile's K values transposed ([head_dim][32 positions]),
// its V values ([32 positions][head_dim]) and its 32 K and V scales go to shared memory as they
// are stored, and each warp dequantizes in registers: a score is (q . k_int8) * k_scale * scale,
// an output sum_t (p_t * v_scale_t) * v_int8_t, as the CPU backend's int8 attention computes
// them. Positions a block does not load read as 0 with scale 0.
template <typename T>
__device__ __forceinline__ void attention_i8_body(
    const T* q, int ldq, T* out, int ldo, const signed char* pool, i64 block_stride,
    i64 layer_off, i64 scale_off, const int* items, int qt, const int* seq_info,
    const int* block_tables, int max_blocks, int n_heads, int n_kv, int hd, int bs, float scale,
    int window, int n_splits, int tiles_per_split, float* partial, signed char* xq, u32* xs) {
    const int group = n_heads / n_kv;
    const int item = blockIdx.x;
    const int kvh = blockIdx.y;
    const int split = blockIdx.z;
    const int seq = items[2 * item];
    const int tok0 = items[2 * item + 1];
    const int q_row0 = seq_info[3 * seq];
    const int n_q = seq_info[3 * seq + 1];
    const int start = seq_info[3 * seq + 2];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int n_warps = blockDim.x >> 5;
    const int tok = tok0 + warp / group;
    const int head = kvh * group + warp % group;
    const bool active = tok < n_q; // uniform in the warp
    const i64 row = (i64)q_row0 + tok;
    const int ctx = start + tok + 1;
    const int lo = window > 0 ? max(0, ctx - window) : 0;
    const int block_lo = window > 0 ? max(0, start + tok0 + 1 - window) : 0;
    const int last_tok = min(tok0 + qt, n_q) - 1;
    const int block_ctx = start + last_tok + 1;
    const int n_tiles = (block_ctx + ATT_TILE - 1) / ATT_TILE;
    const int t_begin = block_lo / ATT_TILE + split * tiles_per_split;
    const int t_end = min(n_tiles, t_begin + tiles_per_split);
    const int half_hd = hd >> 1;

    // Shared: K and V scales (32 each), every warp's query, then the K and V values.
    float* ksc = (float*)DYN_SMEM;
    float* vsc = ksc + ATT_TILE;
    float* qs_all = vsc + ATT_TILE;
    float* qs = qs_all + warp * hd;
    signed char* kq = (signed char*)(qs_all + n_warps * hd);
    signed char* vq = kq + ATT_TILE * hd;

    if (active) {
        for (int d = lane; d < hd; d += 32) {
            qs[d] = to_f32(q[row * ldq + (i64)head * hd + d]);
        }
    }
    float m = NEG_INF;
    float l = 0.0f;
    float acc[2 * ATT_MAX_WORDS];
    for (int i = 0; i < 2 * ATT_MAX_WORDS; ++i) {
        acc[i] = 0.0f;
    }
    const int* bt = block_tables + (i64)seq * max_blocks;
    const i64 k_head = layer_off + (i64)kvh * hd * bs;
    const i64 v_head = layer_off + (i64)n_kv * hd * bs + (i64)kvh * bs * hd;
    const i64 ks_head = scale_off + 2 * (i64)kvh * bs;
    const i64 vs_head = ks_head + 2 * (i64)n_kv * bs;

    for (int tile = t_begin; tile < t_end; ++tile) {
        const int p0 = tile * ATT_TILE;
        __syncthreads(); // the previous tile's readers are done (and q is in place)
        // K: thread w loads position p0 + w % 32 of dimension w / 32 (a block's positions of
        // one dimension are contiguous); V: position p0 + w / hd, dimension w % hd.
        for (int w = threadIdx.x; w < ATT_TILE * hd; w += blockDim.x) {
            const int j = w & (ATT_TILE - 1);
            const int d = w >> 5;
            const int p = p0 + j;
            signed char kv = 0;
            if (p >= block_lo && p < block_ctx) {
                kv = pool[(i64)bt[p / bs] * block_stride + k_head + (i64)d * bs + p % bs];
            }
            kq[d * ATT_TILE + j] = kv;
            const int jv = w / hd;
            const int dv = w - jv * hd;
            const int pv = p0 + jv;
            signed char vv = 0;
            if (pv >= block_lo && pv < block_ctx) {
                vv = pool[(i64)bt[pv / bs] * block_stride + v_head + (i64)(pv % bs) * hd + dv];
            }
            vq[w] = vv;
        }
        if (threadIdx.x < ATT_TILE) {
            const int p = p0 + threadIdx.x;
            float s_k = 0.0f;
            float s_v = 0.0f;
            if (p >= block_lo && p < block_ctx) {
                const signed char* blk = pool + (i64)bt[p / bs] * block_stride;
                s_k = f16_bits_to_f32(*(const u16*)(blk + ks_head + 2 * (p % bs)));
                s_v = f16_bits_to_f32(*(const u16*)(blk + vs_head + 2 * (p % bs)));
            }
            ksc[threadIdx.x] = s_k;
            vsc[threadIdx.x] = s_v;
        }
        __syncthreads();
        if (active && p0 < ctx && p0 + ATT_TILE > lo) { // the tile holds a position it sees
            const int p = p0 + lane;
            const bool seen = p >= lo && p < ctx;
            float s = NEG_INF;
            if (seen) {
                float dot = 0.0f;
                for (int d = 0; d < hd; ++d) {
                    dot = fmaf(qs[d], (float)kq[d * ATT_TILE + lane], dot);
                }
                s = dot * ksc[lane] * scale;
            }
            const float m_new = fmaxf(m, warp_max(s));
            const float pj = seen ? expf(s - m_new) : 0.0f;
            const float alpha = expf(m - m_new);
            l = l * alpha + warp_sum(pj);
            for (int i = 0; i < 2 * ATT_MAX_WORDS; ++i) {
                acc[i] *= alpha;
            }
            for (int j = 0; j < ATT_TILE; ++j) {
                const float pv = __shfl_sync(FULL_MASK, pj, j) * vsc[j];
                const signed char* vr = vq + j * hd;
                for (int i = 0; i < ATT_MAX_WORDS; ++i) {
                    const int c = lane + 32 * i;
                    if (c < half_hd) {
                        acc[2 * i] = fmaf(pv, (float)vr[2 * c], acc[2 * i]);
                        acc[2 * i + 1] = fmaf(pv, (float)vr[2 * c + 1], acc[2 * i + 1]);
                    }
                }
            }
            m = m_new;
        }
    }
    if (!active) {
        return;
    }
    attention_finish<T>(acc, m, l, row, head, split, n_heads, hd, n_splits, out, ldo, partial, xq,
                        xs);
}

#define ATTENTION_I8(T, S)                                                                         \
    extern "C" __global__ void __launch_bounds__(ATT_MAX_THREADS) attention_i8_##S(                \
        const T* q, int ldq, T* out, int ldo, const signed char* pool, i64 block_stride,           \
        i64 layer_off, i64 scale_off, const int* items, int qt, const int* seq_info,               \
        const int* block_tables, int max_blocks, int n_heads, int n_kv, int hd, int bs,            \
        float scale, int window, int n_splits, int tiles_per_split, float* partial,                \
        signed char* xq, u32* xs) {                                                                \
        attention_i8_body<T>(q, ldq, out, ldo, pool, block_stride, layer_off, scale_off, items,   \
                             qt, seq_info, block_tables, max_blocks, n_heads, n_kv, hd, bs,        \
                             scale, window, n_splits, tiles_per_split, partial, xq, xs);           \
    }
NPU_FOR_EACH_ACT(ATTENTION_I8)

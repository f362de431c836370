// The paged KV pool and attention over it.
//
// Pool layout (f16): [block][layer][K, V][kv_head][block_pos][head_dim]. One block's K and V for
// every layer are contiguous (a block moves with one copy), and one KV head's slice of a block is
// a contiguous [block_size][head_dim] tile, so attention reads it with straight, coalesced loads.
// `layer_off` is the element offset of a layer's K inside a block; its V follows
// n_kv * block_size * head_dim elements later.

// ---- KV write ----------------------------------------------------------------------------------

// grid (rows): token r's K and V rows go to slot slots[r] (block slot / bs, position slot % bs).
template <typename T>
__device__ __forceinline__ void kv_write_body(const T* k, int ldk, const T* v, int ldv,
                                              const int* slots, u16* pool, i64 block_stride,
                                              i64 layer_off, int n_kv, int hd, int bs) {
    const int r = blockIdx.x;
    const int slot = slots[r];
    const i64 head_elems = (i64)bs * hd;
    const i64 base = (i64)(slot / bs) * block_stride + layer_off + (i64)(slot % bs) * hd;
    const i64 v_off = (i64)n_kv * head_elems;
    for (int e = threadIdx.x; e < n_kv * hd; e += blockDim.x) {
        const i64 at = base + (i64)(e / hd) * head_elems + e % hd;
        pool[at] = f32_to_f16_bits(to_f32(k[(i64)r * ldk + e]));
        pool[at + v_off] = f32_to_f16_bits(to_f32(v[(i64)r * ldv + e]));
    }
}

#define KV_WRITE(T, S)                                                                             \
    extern "C" __global__ void kv_write_##S(const T* k, int ldk, const T* v, int ldv,             \
                                            const int* slots, u16* pool, i64 block_stride,         \
                                            i64 layer_off, int n_kv, int hd, int bs) {             \
        kv_write_body<T>(k, ldk, v, ldv, slots, pool, block_stride, layer_off, n_kv, hd, bs);     \
    }
NPU_FOR_EACH_ACT(KV_WRITE)

// grid (rows, ceil(n / blockDim)), n = heads * dims/2 + n_kv * (hd - dims) + n_kv * hd: `rope` and
// `kv_write` of one step in one launch. `qkv` rows hold n_heads query heads, n_kv key heads, then
// n_kv value heads (hd values each). Index j < heads * dims/2 rotates pair j in place as `rope`
// does (rope_rotate), and a key head's pair also goes to the cache, rounded to f16 from the value
// as stored; the next n_kv * (hd - dims) indices copy the keys' unrotated values, the last
// n_kv * hd the values, to the cache as `kv_write` writes them.
template <typename T>
__device__ __forceinline__ void rope_kv_write_body(T* qkv, int ld, int n_heads, int n_kv, int hd,
                                                   int dims, int halves, float theta_scale,
                                                   float freq_scale, const int* pos,
                                                   const float* factors, const int* slots,
                                                   u16* pool, i64 block_stride, i64 layer_off,
                                                   int bs) {
    const int r = blockIdx.x;
    const int half = dims >> 1;
    const int n_rot = (n_heads + n_kv) * half;
    const int per = hd - dims;
    const int n_pass = n_kv * per;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    const int slot = slots[r];
    const i64 head_elems = (i64)bs * hd;
    const i64 base = (i64)(slot / bs) * block_stride + layer_off + (i64)(slot % bs) * hd;
    T* row = qkv + (i64)r * ld;
    if (j < n_rot) {
        const int h = j / half;
        const int i = j - h * half;
        const int a = halves ? i : 2 * i;
        const int b = halves ? i + half : 2 * i + 1;
        T* hp = row + (i64)h * hd;
        float y0;
        float y1;
        rope_rotate(to_f32(hp[a]), to_f32(hp[b]), i, (u32)pos[r], theta_scale, freq_scale,
                    factors, &y0, &y1);
        const T t0 = from_f32<T>(y0);
        const T t1 = from_f32<T>(y1);
        hp[a] = t0;
        hp[b] = t1;
        if (h >= n_heads) {
            const i64 at = base + (i64)(h - n_heads) * head_elems;
            pool[at + a] = f32_to_f16_bits(to_f32(t0));
            pool[at + b] = f32_to_f16_bits(to_f32(t1));
        }
    } else if (j < n_rot + n_pass) {
        const int e = j - n_rot;
        const int kh = e / per;
        const int d = dims + (e - kh * per);
        pool[base + (i64)kh * head_elems + d] =
            f32_to_f16_bits(to_f32(row[(i64)(n_heads + kh) * hd + d]));
    } else if (j < n_rot + n_pass + n_kv * hd) {
        const int e = j - n_rot - n_pass;
        pool[base + (i64)n_kv * head_elems + (i64)(e / hd) * head_elems + e % hd] =
            f32_to_f16_bits(to_f32(row[(i64)(n_heads + n_kv) * hd + e]));
    }
}

#define ROPE_KV_WRITE(T, S)                                                                        \
    extern "C" __global__ void rope_kv_write_##S(                                                  \
        T* qkv, int ld, int n_heads, int n_kv, int hd, int dims, int halves, float theta_scale,    \
        float freq_scale, const int* pos, const float* factors, const int* slots, u16* pool,       \
        i64 block_stride, i64 layer_off, int bs) {                                                 \
        rope_kv_write_body<T>(qkv, ld, n_heads, n_kv, hd, dims, halves, theta_scale, freq_scale,  \
                              pos, factors, slots, pool, block_stride, layer_off, bs);             \
    }
NPU_FOR_EACH_ACT(ROPE_KV_WRITE)

// One query or key head `hp` (its values as stored) rotated in place by the block, pair i as
// `rope_kv_write` rotates it, and with `key` its rotated pairs and unrotated rest written to the
// cache head at `at` as f16 of the stored values. `norm_rope_kv_write` and the Q/K/V GEMV that
// folds the rope in (matmul.cu) call it after a barrier.
template <typename T>
__device__ __forceinline__ void rope_head_to_cache(T* hp, bool key, int hd, int dims, int halves,
                                                   float theta_scale, float freq_scale, u32 pos,
                                                   const float* factors, u16* at) {
    const int half = dims >> 1;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int a = halves ? i : 2 * i;
        const int b = halves ? i + half : 2 * i + 1;
        float y0;
        float y1;
        rope_rotate(to_f32(hp[a]), to_f32(hp[b]), i, pos, theta_scale, freq_scale, factors, &y0,
                    &y1);
        const T t0 = from_f32<T>(y0);
        const T t1 = from_f32<T>(y1);
        hp[a] = t0;
        hp[b] = t1;
        if (key) {
            at[a] = f32_to_f16_bits(to_f32(t0));
            at[b] = f32_to_f16_bits(to_f32(t1));
        }
    }
    if (key) {
        for (int d = dims + threadIdx.x; d < hd; d += blockDim.x) {
            at[d] = f32_to_f16_bits(to_f32(hp[d]));
        }
    }
}

// grid (rows, n_heads + 2 * n_kv), blockDim as `rms_norm_heads` has for a head of hd: the per-head
// Q and K norms (Qwen3's, Gemma 3's), `rope` and `kv_write` of one step in one launch. Block
// (r, h) of a query or key head normalises the head in place as `rms_norm_heads` does (the same
// loop and block sum, so the same bits; qw for query heads, kw for key heads), then, after the
// barrier, rotates its pairs from the values as stored, as `rope_kv_write` does, and a key head
// writes its rotated pairs and unrotated rest to the cache; a value head's block copies it to the
// cache. Pairs and the unrotated rest are disjoint, so no thread reads another's rotated value.
template <typename T>
__device__ __forceinline__ void norm_rope_kv_write_body(
    T* qkv, int ld, int n_heads, int n_kv, int hd, int dims, int halves, float theta_scale,
    float freq_scale, const int* pos, const float* factors, const void* qw, int qwdt,
    const void* kw, int kwdt, float eps, const int* slots, u16* pool, i64 block_stride,
    i64 layer_off, int bs) {
    __shared__ float red[32];
    const int r = blockIdx.x;
    const int h = blockIdx.y;
    const int slot = slots[r];
    const i64 head_elems = (i64)bs * hd;
    const i64 base = (i64)(slot / bs) * block_stride + layer_off + (i64)(slot % bs) * hd;
    T* hp = qkv + (i64)r * ld + (i64)h * hd;
    if (h >= n_heads + n_kv) {
        const i64 at = base + (i64)(h - n_heads) * head_elems;
        for (int c = threadIdx.x; c < hd; c += blockDim.x) {
            pool[at + c] = f32_to_f16_bits(to_f32(hp[c]));
        }
        return;
    }
    const bool key = h >= n_heads;
    const void* w = key ? kw : qw;
    const int wdt = key ? kwdt : qwdt;
    float s = 0.0f;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        const float v = to_f32(hp[c]);
        s = fmaf(v, v, s);
    }
    s = block_sum(s, red);
    const float scale = 1.0f / sqrtf(s / (float)hd + eps);
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        hp[c] = from_f32<T>(__fmul_rn(__fmul_rn(to_f32(hp[c]), scale), load_dt(w, wdt, c)));
    }
    __syncthreads();
    u16* at = key ? pool + base + (i64)(h - n_heads) * head_elems : pool;
    rope_head_to_cache<T>(hp, key, hd, dims, halves, theta_scale, freq_scale, (u32)pos[r], factors,
                          at);
}

#define NORM_ROPE_KV_WRITE(T, S)                                                                   \
    extern "C" __global__ void norm_rope_kv_write_##S(                                             \
        T* qkv, int ld, int n_heads, int n_kv, int hd, int dims, int halves, float theta_scale,    \
        float freq_scale, const int* pos, const float* factors, const void* qw, int qwdt,          \
        const void* kw, int kwdt, float eps, const int* slots, u16* pool, i64 block_stride,        \
        i64 layer_off, int bs) {                                                                   \
        norm_rope_kv_write_body<T>(qkv, ld, n_heads, n_kv, hd, dims, halves, theta_scale,          \
                                   freq_scale, pos, factors, qw, qwdt, kw, kwdt, eps, slots, pool, \
                                   block_stride, layer_off, bs);                                   \
    }
NPU_FOR_EACH_ACT(NORM_ROPE_KV_WRITE)

// ---- paged attention -----------------------------------------------------------------------------
//
// Flash-decoding style: grid (work items, kv heads, context splits). A work item is up to `qt`
// consecutive query tokens of one sequence (items[2i] = sequence, items[2i+1] = first token); the
// block holds qt * group warps, one per (token, query head of the KV head's group), so the
// group's heads and the item's tokens share every K/V tile the block loads into shared memory.
// Each warp keeps an online softmax (running max m, sum l, output accumulator) over 32-position
// tiles; lane j scores position p0 + j, and lanes own pairs of output dimensions.
//
// Causality: token t of a sequence (position start + t) sees positions 0..=start + t. Decode tokens
// (n_q = 1) and prefill chunks (n_q > 1) of different sequences run in the same launch. With a
// sliding window (`window` > 0; 0: none) it sees start + t + 1 - window ..= start + t only: the
// block starts at the tile holding the first position its first token sees, never loads (nor
// reads the block table for) a position before it, and each warp masks what lies before its own
// window.
//
// With one split the block writes normalised outputs; with several, split s covers tiles
// [first + s * tiles_per_split, first + (s + 1) * tiles_per_split), first being the block's first
// tile, and writes (m, l, acc) to `partial` ([row][head][split][hd + 2] f32), merged by
// attention_combine. A split past the block's last tile writes m = -inf, l = 0.
//
// With `xq` (not null; hd a multiple of 32), whichever kernel writes the normalised output also
// writes its 8-bit form for the output projection (q8_store_block, as `quantize_q8` would).

#define ATT_TILE 32
#define ATT_MAX_HD 256
#define ATT_MAX_WORDS (ATT_MAX_HD / 64)
// Blocks have at most 16 warps (groups of at most 16 query heads per KV head), so the compiler
// may give each thread up to 128 registers.
#define ATT_MAX_THREADS 512

// The end of an attention warp (attention.cu and attention_i8.cu): with one split, its
// normalised output (and, with `xq`, its 8-bit form for the output projection); with several,
// its (m, l, acc) for attention_combine. `acc` holds the lane's pairs of output dimensions.
template <typename T>
__device__ __forceinline__ void attention_finish(const float* acc, float m, float l, i64 row,
                                                 int head, int split, int n_heads, int hd,
                                                 int n_splits, T* out, int ldo, float* partial,
                                                 signed char* xq, u32* xs) {
    const int lane = threadIdx.x & 31;
    const int half_hd = hd >> 1;
    if (n_splits == 1) {
        const float inv = 1.0f / l;
        T* o = out + row * ldo + (i64)head * hd;
        for (int i = 0; i < ATT_MAX_WORDS; ++i) {
            const int c = lane + 32 * i;
            T a = from_f32<T>(0.0f);
            T b = a;
            if (c < half_hd) {
                a = from_f32<T>(acc[2 * i] * inv);
                b = from_f32<T>(acc[2 * i + 1] * inv);
                o[2 * c] = a;
                o[2 * c + 1] = b;
            }
            if (xq) {
                // The 8-bit form of the stored values (hd a multiple of 32): lane L of the
                // warp takes element 64i + 32h + L of the head, held by lane 16h + L/2.
                for (int h = 0; h < 2; ++h) {
                    if (64 * i + 32 * h < hd) {
                        const int from = 16 * h + (lane >> 1);
                        const float va = __shfl_sync(FULL_MASK, to_f32(a), from);
                        const float vb = __shfl_sync(FULL_MASK, to_f32(b), from);
                        q8_store_block((lane & 1) ? vb : va, row, n_heads * hd,
                                       (head * hd + 64 * i + 32 * h) >> 5, xq, xs);
                    }
                }
            }
        }
    } else {
        float* pp = partial + ((row * n_heads + head) * n_splits + split) * (i64)(hd + 2);
        if (lane == 0) {
            pp[0] = m;
            pp[1] = l;
        }
        for (int i = 0; i < ATT_MAX_WORDS; ++i) {
            const int c = lane + 32 * i;
            if (c < half_hd) {
                pp[2 + 2 * c] = acc[2 * i];
                pp[3 + 2 * c] = acc[2 * i + 1];
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ void attention_body(
    const T* q, int ldq, T* out, int ldo, const u16* pool, i64 block_stride, i64 layer_off,
    const int* items, int qt, const int* seq_info, const int* block_tables, int max_blocks,
    int n_heads, int n_kv, int hd, int bs, float scale, int window, int n_splits,
    int tiles_per_split, float* partial, signed char* xq, u32* xs) {
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
    const int tok = tok0 + warp / group;
    const int head = kvh * group + warp % group;
    const bool active = tok < n_q; // uniform in the warp
    const i64 row = (i64)q_row0 + tok;
    const int ctx = start + tok + 1;
    // The first position this warp's token sees, and the first any token of the block sees.
    const int lo = window > 0 ? max(0, ctx - window) : 0;
    const int block_lo = window > 0 ? max(0, start + tok0 + 1 - window) : 0;
    const int last_tok = min(tok0 + qt, n_q) - 1;
    const int block_ctx = start + last_tok + 1;
    const int n_tiles = (block_ctx + ATT_TILE - 1) / ATT_TILE;
    const int t_begin = block_lo / ATT_TILE + split * tiles_per_split;
    const int t_end = min(n_tiles, t_begin + tiles_per_split);
    const int half_hd = hd >> 1;
    const int words = half_hd + 1; // padded shared row: conflict-free column reads

    u32* ks = (u32*)DYN_SMEM;
    u32* vs = ks + ATT_TILE * words;
    float* qs = (float*)(vs + ATT_TILE * words) + warp * hd;

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
    const i64 head_off = layer_off + (i64)kvh * bs * hd;
    const i64 v_off = (i64)n_kv * bs * hd;

    for (int tile = t_begin; tile < t_end; ++tile) {
        const int p0 = tile * ATT_TILE;
        __syncthreads(); // the previous tile's readers are done (and q is in place)
        for (int w = threadIdx.x; w < ATT_TILE * half_hd; w += blockDim.x) {
            const int j = w / half_hd;
            const int c = w - j * half_hd;
            const int p = p0 + j;
            u32 kw = 0;
            u32 vw = 0;
            if (p >= block_lo && p < block_ctx) {
                const i64 at = (i64)bt[p / bs] * block_stride + head_off + (i64)(p % bs) * hd + 2 * c;
                kw = *(const u32*)(pool + at);
                vw = *(const u32*)(pool + at + v_off);
            }
            ks[j * words + c] = kw;
            vs[j * words + c] = vw;
        }
        __syncthreads();
        if (active && p0 < ctx && p0 + ATT_TILE > lo) { // the tile holds a position it sees
            const int p = p0 + lane;
            const bool seen = p >= lo && p < ctx;
            float s = NEG_INF;
            if (seen) {
                float dot = 0.0f;
                const u32* kr = ks + lane * words;
                for (int c = 0; c < half_hd; ++c) {
                    const u32 kw = kr[c];
                    dot = fmaf(qs[2 * c], lo_f16(kw), dot);
                    dot = fmaf(qs[2 * c + 1], hi_f16(kw), dot);
                }
                s = dot * scale;
            }
            const float m_new = fmaxf(m, warp_max(s));
            const float pj = seen ? expf(s - m_new) : 0.0f;
            const float alpha = expf(m - m_new);
            l = l * alpha + warp_sum(pj);
            for (int i = 0; i < 2 * ATT_MAX_WORDS; ++i) {
                acc[i] *= alpha;
            }
            for (int j = 0; j < ATT_TILE; ++j) {
                const float pb = __shfl_sync(FULL_MASK, pj, j);
                const u32* vr = vs + j * words;
                for (int i = 0; i < ATT_MAX_WORDS; ++i) {
                    const int c = lane + 32 * i;
                    if (c < half_hd) {
                        const u32 vw = vr[c];
                        acc[2 * i] = fmaf(pb, lo_f16(vw), acc[2 * i]);
                        acc[2 * i + 1] = fmaf(pb, hi_f16(vw), acc[2 * i + 1]);
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

#define ATTENTION(T, S)                                                                            \
    extern "C" __global__ void __launch_bounds__(ATT_MAX_THREADS) attention_##S(                   \
        const T* q, int ldq, T* out, int ldo, const u16* pool, i64 block_stride, i64 layer_off,   \
        const int* items, int qt, const int* seq_info, const int* block_tables, int max_blocks,    \
        int n_heads, int n_kv, int hd, int bs, float scale, int window, int n_splits,              \
        int tiles_per_split, float* partial, signed char* xq, u32* xs) {                           \
        attention_body<T>(q, ldq, out, ldo, pool, block_stride, layer_off, items, qt, seq_info,   \
                          block_tables, max_blocks, n_heads, n_kv, hd, bs, scale, window,         \
                          n_splits, tiles_per_split, partial, xq, xs);                             \
    }
NPU_FOR_EACH_ACT(ATTENTION)

// grid (rows, heads): merges the splits of one (row, head): out = sum_s e^(m_s - M) acc_s /
// sum_s e^(m_s - M) l_s. Split 0 always holds the row's first visible position (a split covers
// at least 4 tiles, and the block's tokens' windows start at most qt - 1 < 32 positions apart),
// so M is finite; splits that saw nothing (m = -inf) are left out.
template <typename T>
__device__ __forceinline__ void attention_combine_body(const float* partial, int n_splits,
                                                       int n_heads, int hd, T* out, int ldo,
                                                       signed char* xq, u32* xs) {
    const i64 row = blockIdx.x;
    const int head = blockIdx.y;
    const float* pp = partial + (row * n_heads + head) * n_splits * (i64)(hd + 2);
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
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float num = 0.0f;
        for (int s = 0; s < n_splits; ++s) {
            const float ms = pp[s * (hd + 2)];
            if (ms != NEG_INF) {
                num += pp[s * (hd + 2) + 2 + d] * expf(ms - mx);
            }
        }
        const T v = from_f32<T>(num / den);
        out[row * ldo + (i64)head * hd + d] = v;
        if (xq) { // hd a multiple of 32 and blockDim.x of 32: whole blocks per warp
            q8_store_block(to_f32(v), row, n_heads * hd, (head * hd + d) >> 5, xq, xs);
        }
    }
}

#define ATTENTION_COMBINE(T, S)                                                                    \
    extern "C" __global__ void attention_combine_##S(const float* partial, int n_splits,          \
                                                     int n_heads, int hd, T* out, int ldo,         \
                                                     signed char* xq, u32* xs) {                   \
        attention_combine_body<T>(partial, n_splits, n_heads, hd, out, ldo, xq, xs);              \
    }
NPU_FOR_EACH_ACT(ATTENTION_COMBINE)

// The element-wise and row-wise ops of a step: embedding lookup (dequantized from the file's
// format), RMS normalisation (of whole rows, or of each head in place), rotary embedding (with
// optional per-pair frequency factors), SwiGLU and GELU-gated activations, row scaling, residual
// and bias adds, row gathers and copies, and the per-row argmax. They follow the CPU reference's
// arithmetic (rms_norm: 1 / sqrt(mean + eps) in f32; rope: the angle recurrence theta *=
// theta_scale; products kept unfused where the reference rounds them apart).

// ---- embedding ---------------------------------------------------------------------------------

// Element e of a table row stored in ggml format `ty`.
__device__ __forceinline__ float dequant_elem(const u8* row, int ty, int e) {
    switch (ty) {
    case GGML_F32:
        return ((const float*)row)[e];
    case GGML_F16:
        return f16_bits_to_f32(((const u16*)row)[e]);
    case GGML_BF16:
        return bf16_bits_to_f32(((const u16*)row)[e]);
    case GGML_Q8_0: {
        const u8* b = row + (e >> 5) * 34;
        const float d = f16_bits_to_f32(*(const u16*)b);
        return __fmul_rn((float)(signed char)b[2 + (e & 31)], d);
    }
    case GGML_Q4_0: {
        const u8* b = row + (e >> 5) * 18;
        const float d = f16_bits_to_f32(*(const u16*)b);
        const int j = e & 31;
        const int q = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
        return __fmul_rn((float)(q - 8), d);
    }
    case GGML_Q4_1: {
        const u8* b = row + (e >> 5) * 20;
        const float d = f16_bits_to_f32(*(const u16*)b);
        const float m = f16_bits_to_f32(*(const u16*)(b + 2));
        const int j = e & 31;
        const int q = j < 16 ? (b[4 + j] & 15) : (b[4 + j - 16] >> 4);
        return __fadd_rn(__fmul_rn((float)q, d), m);
    }
    default:
        return 0.0f;
    }
}

// grid (ceil(dim / blockDim), rows): out row r = table row tokens[r].
template <typename T>
__device__ __forceinline__ void embed_body(const u8* table, int ty, i64 row_bytes, int dim,
                                           const int* tokens, T* out, int ldo) {
    const int r = blockIdx.y;
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < dim) {
        const u8* row = table + (i64)tokens[r] * row_bytes;
        out[(i64)r * ldo + e] = from_f32<T>(dequant_elem(row, ty, e));
    }
}

#define EMBED(T, S)                                                                                \
    extern "C" __global__ void embed_##S(const u8* table, int ty, i64 row_bytes, int dim,         \
                                         const int* tokens, T* out, int ldo) {                     \
        embed_body<T>(table, ty, row_bytes, dim, tokens, out, ldo);                               \
    }
NPU_FOR_EACH_ACT(EMBED)

// ---- RMS norm ----------------------------------------------------------------------------------

// The second pass of both norms: out[r] = x[r] * scale * w, and with `xq` (not null) the row
// quantized to 8 bits as it is stored (q8_store_block; `cols` a multiple of 32, so each warp
// holds whole blocks of 32 and the loop's bound is the same for all its lanes).
// `o` may be null (a folded GEMV's blocks other than its first: matmul.cu); `qr` is the row's
// index in xq and xs.
template <typename T>
__device__ __forceinline__ void rms_scale_row(const T* xr, const void* w, int wdt, float scale,
                                              int cols, T* o, i64 qr, signed char* xq, u32* xs) {
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const T v = from_f32<T>(__fmul_rn(__fmul_rn(to_f32(xr[c]), scale), load_dt(w, wdt, c)));
        if (o) {
            o[c] = v;
        }
        if (xq) {
            q8_store_block(to_f32(v), qr, cols, c >> 5, xq, xs);
        }
    }
}

// The norm's factor of row `xr`: 1 / sqrt(mean(x^2) + eps), the sum of squares taken by the
// block's threads (each over columns threadIdx.x, + blockDim.x, ...) and then `block_sum`. The
// block's size fixes the bits: `rms_norm`, `add_rms_norm` and the GEMVs that fold the norm in
// (matmul.cu) all run it with `row_threads(cols, 256)` threads. Every thread must call it.
template <typename T>
__device__ __forceinline__ float rms_row_scale(const T* xr, int cols, float eps, float* red) {
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = to_f32(xr[c]);
        s = fmaf(v, v, s);
    }
    s = block_sum(s, red);
    return 1.0f / sqrtf(s / (float)cols + eps);
}

// grid (rows): out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w; with `xq`, also the 8-bit
// activations the next quantized matrix product reads (no `quantize_q8` launch then).
template <typename T>
__device__ __forceinline__ void rms_norm_body(const T* x, int ldx, const void* w, int wdt,
                                              float eps, int cols, T* out, int ldo,
                                              signed char* xq, u32* xs) {
    __shared__ float red[32];
    const T* xr = x + (i64)blockIdx.x * ldx;
    const float scale = rms_row_scale<T>(xr, cols, eps, red);
    rms_scale_row<T>(xr, w, wdt, scale, cols, out + (i64)blockIdx.x * ldo, blockIdx.x, xq, xs);
}

#define RMS_NORM(T, S)                                                                             \
    extern "C" __global__ void rms_norm_##S(const T* x, int ldx, const void* w, int wdt,          \
                                            float eps, int cols, T* out, int ldo, signed char* xq, \
                                            u32* xs) {                                             \
        rms_norm_body<T>(x, ldx, w, wdt, eps, cols, out, ldo, xq, xs);                            \
    }
NPU_FOR_EACH_ACT(RMS_NORM)

// grid (rows): the residual add and the next norm in one pass over the row: x[r] += y[r] (rounded
// to T as `add` rounds it), then out[r] = rms_norm(x[r]) * w as `rms_norm` computes it from the
// stored sum, and with `xq` its 8-bit activations. Each thread reads back only the values it
// wrote, after the block's sum; `out` may be `y` (each thread reads its y values before the
// barrier and writes the same columns after it).
template <typename T>
__device__ __forceinline__ void add_rms_norm_body(T* x, int ldx, const T* y, int ldy,
                                                  const void* w, int wdt, float eps, int cols,
                                                  T* out, int ldo, signed char* xq, u32* xs) {
    __shared__ float red[32];
    T* xr = x + (i64)blockIdx.x * ldx;
    const T* yr = y + (i64)blockIdx.x * ldy;
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const T sum = from_f32<T>(to_f32(xr[c]) + to_f32(yr[c]));
        xr[c] = sum;
        const float v = to_f32(sum);
        s = fmaf(v, v, s);
    }
    s = block_sum(s, red);
    const float scale = 1.0f / sqrtf(s / (float)cols + eps);
    rms_scale_row<T>(xr, w, wdt, scale, cols, out + (i64)blockIdx.x * ldo, blockIdx.x, xq, xs);
}

#define ADD_RMS_NORM(T, S)                                                                         \
    extern "C" __global__ void add_rms_norm_##S(T* x, int ldx, const T* y, int ldy, const void* w, \
                                                int wdt, float eps, int cols, T* out, int ldo,     \
                                                signed char* xq, u32* xs) {                        \
        add_rms_norm_body<T>(x, ldx, y, ldy, w, wdt, eps, cols, out, ldo, xq, xs);                \
    }
NPU_FOR_EACH_ACT(ADD_RMS_NORM)

// grid (heads, rows): head h of row r (the `hd` values from column h * hd) normalised in place,
// each head with the same `hd` weights: x * (1 / sqrt(mean(x^2) + eps)) * w (Qwen3's and Gemma 3's
// per-head Q and K norms). Each thread rewrites only the values it read, after the block's sum.
template <typename T>
__device__ __forceinline__ void rms_norm_heads_body(T* x, int ldx, int hd, const void* w, int wdt,
                                                    float eps) {
    __shared__ float red[32];
    T* xh = x + (i64)blockIdx.y * ldx + (i64)blockIdx.x * hd;
    float s = 0.0f;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        const float v = to_f32(xh[c]);
        s = fmaf(v, v, s);
    }
    s = block_sum(s, red);
    const float scale = 1.0f / sqrtf(s / (float)hd + eps);
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        xh[c] = from_f32<T>(__fmul_rn(__fmul_rn(to_f32(xh[c]), scale), load_dt(w, wdt, c)));
    }
}

#define RMS_NORM_HEADS(T, S)                                                                       \
    extern "C" __global__ void rms_norm_heads_##S(T* x, int ldx, int hd, const void* w, int wdt,  \
                                                  float eps) {                                     \
        rms_norm_heads_body<T>(x, ldx, hd, w, wdt, eps);                                          \
    }
NPU_FOR_EACH_ACT(RMS_NORM_HEADS)

// ---- rotary embedding ----------------------------------------------------------------------------

// grid (rows, ceil(heads * dims/2 / blockDim)): rotates `heads` heads of `hd` values of row r in
// place at position pos[r], one thread per (head, pair): pair i is (2i, 2i+1) when `halves` is 0
// (interleaved), (i, i + dims/2) when 1. The angle of pair i is freq_scale * pos * theta_scale^i,
// the power taken by repeated multiplication as ggml does; with a factor table (`factors`, dims/2
// values; null: none) pos * theta_scale^i is divided by factors[i] first (Llama 3's rope_freqs).
// theta_scale = base^(-2/dims) comes with each call, so layers with different bases (Gemma 3's
// local and global layers) share the kernel. Each (head, pair) computes its angle the same way,
// so the split over threads changes no bit.
// Pair i of a head at position `pos` rotated: (x0, x1) -> (y0, y1) (the angle as above).
__device__ __forceinline__ void rope_rotate(float x0, float x1, int i, u32 pos, float theta_scale,
                                            float freq_scale, const float* factors, float* y0,
                                            float* y1) {
    float theta = (float)pos;
    for (int k = 0; k < i; ++k) {
        theta = __fmul_rn(theta, theta_scale);
    }
    const float e = factors ? __fdiv_rn(theta, factors[i]) : theta;
    const float t = __fmul_rn(freq_scale, e);
    const float c = cosf(t);
    const float s = sinf(t);
    *y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    *y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

template <typename T>
__device__ __forceinline__ void rope_body(T* qk, int ld, int heads, int hd, int dims, int halves,
                                          float theta_scale, float freq_scale, const int* pos,
                                          const float* factors) {
    const int r = blockIdx.x;
    const int half_dims = dims >> 1;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= heads * half_dims) {
        return;
    }
    const int h = j / half_dims;
    const int i = j - h * half_dims;
    const int a = halves ? i : 2 * i;
    const int b = halves ? i + half_dims : 2 * i + 1;
    T* hp = qk + (i64)r * ld + (i64)h * hd;
    float y0;
    float y1;
    rope_rotate(to_f32(hp[a]), to_f32(hp[b]), i, (u32)pos[r], theta_scale, freq_scale, factors,
                &y0, &y1);
    hp[a] = from_f32<T>(y0);
    hp[b] = from_f32<T>(y1);
}

#define ROPE(T, S)                                                                                 \
    extern "C" __global__ void rope_##S(T* qk, int ld, int heads, int hd, int dims, int halves,   \
                                        float theta_scale, float freq_scale, const int* pos,       \
                                        const float* factors) {                                    \
        rope_body<T>(qk, ld, heads, hd, dims, halves, theta_scale, freq_scale, pos, factors);     \
    }
NPU_FOR_EACH_ACT(ROPE)

// ---- SwiGLU, GELU gate, scaling, adds, copies --------------------------------------------------
// All: grid (ceil(cols / blockDim), rows), one element per thread.

// With `xq` (not null; `cols` a multiple of 32 and blockDim.x of 32, so a warp is all in or all
// out of the row), out's row is also quantized to 8 bits as stored for the next matrix product.
// silu(g) * u as stored: the one formula of `swiglu` and the gate/up GEMV that folds it in.
template <typename T> __device__ __forceinline__ T swiglu_value(float g, float u) {
    return from_f32<T>(__fmul_rn(g / (1.0f + expf(-g)), u));
}

template <typename T>
__device__ __forceinline__ void swiglu_body(const T* gate, int ldg, const T* up, int ldu, T* out,
                                            int ldo, int cols, signed char* xq, u32* xs) {
    const int r = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < cols) {
        const T v = swiglu_value<T>(to_f32(gate[(i64)r * ldg + c]), to_f32(up[(i64)r * ldu + c]));
        out[(i64)r * ldo + c] = v;
        if (xq) {
            q8_store_block(to_f32(v), r, cols, c >> 5, xq, xs);
        }
    }
}

#define SWIGLU(T, S)                                                                               \
    extern "C" __global__ void swiglu_##S(const T* gate, int ldg, const T* up, int ldu, T* out,   \
                                          int ldo, int cols, signed char* xq, u32* xs) {           \
        swiglu_body<T>(gate, ldg, up, ldu, out, ldo, cols, xq, xs);                               \
    }
NPU_FOR_EACH_ACT(SWIGLU)

// out = gelu_tanh(gate) * up with the values of ggml's f16 GELU table, which llama.cpp's CPU
// path reads: 0 at or below -10, the gate itself at or above 10, else the table's value at the
// gate rounded to f16. The table (65,536 f16 values: gelu_tanh of every f16, computed in f32 and
// rounded to f16) is built on the host and uploaded once, so the device's values are the host's
// bit for bit: a device tanhf may differ from the host's by an ulp or two, enough to move the
// f16 rounding one step.
template <typename T>
__device__ __forceinline__ void geglu_body(const T* gate, int ldg, const T* up, int ldu, T* out,
                                           int ldo, int cols, const u16* table) {
    const int r = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < cols) {
        const float g = to_f32(gate[(i64)r * ldg + c]);
        const float u = to_f32(up[(i64)r * ldu + c]);
        float a;
        if (g <= -10.0f) {
            a = 0.0f;
        } else if (g >= 10.0f) {
            a = g;
        } else {
            a = f16_bits_to_f32(table[f32_to_f16_bits(g)]);
        }
        out[(i64)r * ldo + c] = from_f32<T>(__fmul_rn(a, u));
    }
}

#define GEGLU(T, S)                                                                                \
    extern "C" __global__ void geglu_##S(const T* gate, int ldg, const T* up, int ldu, T* out,    \
                                         int ldo, int cols, const u16* table) {                    \
        geglu_body<T>(gate, ldg, up, ldu, out, ldo, cols, table);                                 \
    }
NPU_FOR_EACH_ACT(GEGLU)

// x *= s (Gemma's embedding scale).
template <typename T> __device__ __forceinline__ void scale_body(T* x, int ldx, int cols, float s) {
    const int r = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < cols) {
        T* p = x + (i64)r * ldx + c;
        *p = from_f32<T>(__fmul_rn(to_f32(*p), s));
    }
}

#define SCALE(T, S)                                                                                \
    extern "C" __global__ void scale_##S(T* x, int ldx, int cols, float s) {                      \
        scale_body<T>(x, ldx, cols, s);                                                           \
    }
NPU_FOR_EACH_ACT(SCALE)

template <typename T>
__device__ __forceinline__ void add_body(T* x, int ldx, const T* y, int ldy, int cols) {
    const int r = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < cols) {
        T* p = x + (i64)r * ldx + c;
        *p = from_f32<T>(to_f32(*p) + to_f32(y[(i64)r * ldy + c]));
    }
}

#define ADD(T, S)                                                                                  \
    extern "C" __global__ void add_##S(T* x, int ldx, const T* y, int ldy, int cols) {            \
        add_body<T>(x, ldx, y, ldy, cols);                                                        \
    }
NPU_FOR_EACH_ACT(ADD)

template <typename T>
__device__ __forceinline__ void add_bias_body(T* x, int ldx, const void* bias, int bdt, int cols) {
    const int r = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < cols) {
        T* p = x + (i64)r * ldx + c;
        *p = from_f32<T>(to_f32(*p) + load_dt(bias, bdt, c));
    }
}

#define ADD_BIAS(T, S)                                                                             \
    extern "C" __global__ void add_bias_##S(T* x, int ldx, const void* bias, int bdt, int cols) { \
        add_bias_body<T>(x, ldx, bias, bdt, cols);                                                \
    }
NPU_FOR_EACH_ACT(ADD_BIAS)

// out row r = x row idx[r]; with idx null, out row r = x row r (a strided copy).
template <typename T>
__device__ __forceinline__ void gather_rows_body(const T* x, int ldx, const int* idx, int cols,
                                                 T* out, int ldo) {
    const int r = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < cols) {
        const i64 src = idx ? (i64)idx[r] : (i64)r;
        out[(i64)r * ldo + c] = x[src * ldx + c];
    }
}

#define GATHER_ROWS(T, S)                                                                          \
    extern "C" __global__ void gather_rows_##S(const T* x, int ldx, const int* idx, int cols,     \
                                               T* out, int ldo) {                                  \
        gather_rows_body<T>(x, ldx, idx, cols, out, ldo);                                         \
    }
NPU_FOR_EACH_ACT(GATHER_ROWS)

// ---- argmax ----------------------------------------------------------------------------------

// True when (v, i) beats (bv, bi): larger, or equal and earlier; bi < 0 is "nothing yet".
__device__ __forceinline__ bool argmax_better(float v, int i, float bv, int bi) {
    return bi < 0 || (i >= 0 && (v > bv || (v == bv && i < bi)));
}

// grid (rows): out element r (of a window with `out_cols` columns, rows `ldo` apart) = index of
// the largest value of x row r, the first on ties; NaN counts as -inf.
template <typename T>
__device__ __forceinline__ void argmax_body(const T* x, int ldx, int cols, int* out, int ldo,
                                            int out_cols) {
    __shared__ float red_v[32];
    __shared__ int red_i[32];
    const int r = blockIdx.x;
    const T* xr = x + (i64)r * ldx;
    float bv = NEG_INF;
    int bi = -1;
    const int step = blockDim.x;
    int c = threadIdx.x;
    // Four loads in flight per thread; the result does not depend on the order in which
    // (value, index) pairs are seen, argmax_better being a total order.
    for (; c + 3 * step < cols; c += 4 * step) {
        const float v4[4] = {to_f32(xr[c]), to_f32(xr[c + step]), to_f32(xr[c + 2 * step]),
                             to_f32(xr[c + 3 * step])};
        for (int u = 0; u < 4; ++u) {
            const float v = v4[u] != v4[u] ? NEG_INF : v4[u];
            if (argmax_better(v, c + u * step, bv, bi)) {
                bv = v;
                bi = c + u * step;
            }
        }
    }
    for (; c < cols; c += step) {
        float v = to_f32(xr[c]);
        if (v != v) {
            v = NEG_INF;
        }
        if (argmax_better(v, c, bv, bi)) {
            bv = v;
            bi = c;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (argmax_better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        red_v[warp] = bv;
        red_i[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int n_warps = blockDim.x >> 5;
        bv = lane < n_warps ? red_v[lane] : NEG_INF;
        bi = lane < n_warps ? red_i[lane] : -1;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (argmax_better(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            out[(i64)(r / out_cols) * ldo + r % out_cols] = bi < 0 ? 0 : bi;
        }
    }
}

#define ARGMAX(T, S)                                                                               \
    extern "C" __global__ void argmax_##S(const T* x, int ldx, int cols, int* out, int ldo,       \
                                          int out_cols) {                                          \
        argmax_body<T>(x, ldx, cols, out, ldo, out_cols);                                         \
    }
NPU_FOR_EACH_ACT(ARGMAX)

// ---- log-probability of the argmax -----------------------------------------------------------

// A logit as the sampler reads it: NaN as -inf, +inf as the largest finite float.
__device__ __forceinline__ float sanitized_logit(float v) {
    return v != v ? NEG_INF : fminf(v, 3.402823466e38f);
}

// Max over the whole block; every thread gets it (the pattern of block_sum).
__device__ __forceinline__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) {
        red[warp] = v;
    }
    __syncthreads();
    float t = lane < n_warps ? red[lane] : NEG_INF;
    t = warp_max(t);
    __syncthreads();
    return t;
}

// grid (rows): out element r (f32, of a window with `out_cols` columns, rows `ldo` apart) = the
// log-probability of row r's largest value, -ln(sum_c exp(x_c - max)) over the values read as
// the sampler reads them (sanitized_logit), summed in f32; a row with nothing finite is uniform:
// -ln(cols). With argmax it answers a greedy step without reading logits back.
template <typename T>
__device__ __forceinline__ void argmax_logprob_body(const T* x, int ldx, int cols, float* out,
                                                    int ldo, int out_cols) {
    __shared__ float red[32];
    const int r = blockIdx.x;
    const T* xr = x + (i64)r * ldx;
    const int step = blockDim.x;
    float m = NEG_INF;
    int c = threadIdx.x;
    for (; c + 3 * step < cols; c += 4 * step) {  // four loads in flight; max is order-free
        const float a0 = sanitized_logit(to_f32(xr[c]));
        const float a1 = sanitized_logit(to_f32(xr[c + step]));
        const float a2 = sanitized_logit(to_f32(xr[c + 2 * step]));
        const float a3 = sanitized_logit(to_f32(xr[c + 3 * step]));
        m = fmaxf(fmaxf(fmaxf(fmaxf(m, a0), a1), a2), a3);
    }
    for (; c < cols; c += step) {
        m = fmaxf(m, sanitized_logit(to_f32(xr[c])));
    }
    m = block_max(m, red);
    float s = 0.0f;
    if (m != NEG_INF) {
        // Four loads in flight, added in the order of the plain strided loop.
        c = threadIdx.x;
        for (; c + 3 * step < cols; c += 4 * step) {
            const float e0 = expf(sanitized_logit(to_f32(xr[c])) - m);
            const float e1 = expf(sanitized_logit(to_f32(xr[c + step])) - m);
            const float e2 = expf(sanitized_logit(to_f32(xr[c + 2 * step])) - m);
            const float e3 = expf(sanitized_logit(to_f32(xr[c + 3 * step])) - m);
            s += e0;
            s += e1;
            s += e2;
            s += e3;
        }
        for (; c < cols; c += step) {
            s += expf(sanitized_logit(to_f32(xr[c])) - m);
        }
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) {
        out[(i64)(r / out_cols) * ldo + r % out_cols] =
            m == NEG_INF ? -logf((float)cols) : -logf(s);
    }
}

#define ARGMAX_LOGPROB(T, S)                                                                       \
    extern "C" __global__ void argmax_logprob_##S(const T* x, int ldx, int cols, float* out,      \
                                                  int ldo, int out_cols) {                         \
        argmax_logprob_body<T>(x, ldx, cols, out, ldo, out_cols);                                 \
    }
NPU_FOR_EACH_ACT(ARGMAX_LOGPROB)

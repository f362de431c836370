// Shared by every kernel source: element types and their conversions, the runtime-typed loads
// of small weight vectors, and warp / block reductions.
//
// Written for NVRTC without any CUDA header (no cuda_fp16.h): f16 and bf16 are plain 16-bit
// structs converted with PTX `cvt` (f16) or bit arithmetic (bf16). The same sources compile as
// C++ against emulation/cuda_shim.h (NPU_EMULATION defined), which runs them on a CPU.
//
// Conventions: every kernel is `extern "C"` and instantiated per activation type with a suffix
// (_f32, _f16, _bf16); tensors arrive as a pointer to their first element plus a row stride in
// elements; accumulation is always in f32.

typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

struct f16 {
    u16 bits;
};
struct bf16 {
    u16 bits;
};

// Runtime element-type codes (weight vectors): match `DType` on the Rust side.
#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2

// ggml type ids of the tables `embed` reads.
#define GGML_F32 0
#define GGML_F16 1
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q8_0 8
#define GGML_BF16 30

#define NEG_INF (-__int_as_float(0x7f800000))
#define FULL_MASK 0xffffffffu

#ifndef NPU_EMULATION
extern __shared__ __align__(16) unsigned char npu_dyn_smem[];
#define DYN_SMEM npu_dyn_smem
#else
#define DYN_SMEM (npu_emu_dyn_smem())
#endif

__device__ __forceinline__ float f16_bits_to_f32(u16 h) {
#ifdef NPU_EMULATION
    return npu_emu_f16_to_f32(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
#ifdef NPU_EMULATION
    return npu_emu_f32_to_f16(f);
#else
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

__device__ __forceinline__ float bf16_bits_to_f32(u16 b) {
    return __uint_as_float(((u32)b) << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ u16 f32_to_bf16_bits(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(f16 v) { return f16_bits_to_f32(v.bits); }
__device__ __forceinline__ float to_f32(bf16 v) { return bf16_bits_to_f32(v.bits); }

template <typename T> struct FromF32;
template <> struct FromF32<float> {
    static __device__ __forceinline__ float conv(float v) { return v; }
};
template <> struct FromF32<f16> {
    static __device__ __forceinline__ f16 conv(float v) {
        f16 r;
        r.bits = f32_to_f16_bits(v);
        return r;
    }
};
template <> struct FromF32<bf16> {
    static __device__ __forceinline__ bf16 conv(float v) {
        bf16 r;
        r.bits = f32_to_bf16_bits(v);
        return r;
    }
};
template <typename T> __device__ __forceinline__ T from_f32(float v) { return FromF32<T>::conv(v); }

// Element i of a vector whose type is only known at run time (norm weights, biases).
__device__ __forceinline__ float load_dt(const void* p, int dt, i64 i) {
    if (dt == DT_F32) {
        return ((const float*)p)[i];
    }
    u16 b = ((const u16*)p)[i];
    return dt == DT_F16 ? f16_bits_to_f32(b) : bf16_bits_to_f32(b);
}

// The two f16 values packed in a 32-bit word (low half first, as memory holds them).
__device__ __forceinline__ float lo_f16(u32 w) { return f16_bits_to_f32((u16)(w & 0xffffu)); }
__device__ __forceinline__ float hi_f16(u32 w) { return f16_bits_to_f32((u16)(w >> 16)); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(FULL_MASK, v, o);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    }
    return v;
}

// Sums each of 8 values over the warp in 9 shuffles (not 40): lane l ends with the total of
// value (l >> 2) & 7. Each step sends the half of its values its partner keeps.
__device__ __forceinline__ float warp_sum8(float* v) {
    const int lane = threadIdx.x & 31;
    for (int i = 0; i < 4; ++i) {
        const bool up = (lane & 16) != 0;
        const float send = up ? v[i] : v[i + 4];
        const float keep = up ? v[i + 4] : v[i];
        v[i] = keep + __shfl_xor_sync(FULL_MASK, send, 16);
    }
    for (int i = 0; i < 2; ++i) {
        const bool up = (lane & 8) != 0;
        const float send = up ? v[i] : v[i + 2];
        const float keep = up ? v[i + 2] : v[i];
        v[i] = keep + __shfl_xor_sync(FULL_MASK, send, 8);
    }
    {
        const bool up = (lane & 4) != 0;
        const float send = up ? v[0] : v[1];
        const float keep = up ? v[1] : v[0];
        v[0] = keep + __shfl_xor_sync(FULL_MASK, send, 4);
    }
    v[0] += __shfl_xor_sync(FULL_MASK, v[0], 2);
    v[0] += __shfl_xor_sync(FULL_MASK, v[0], 1);
    return v[0];
}

// Sum over the whole block; every thread gets the total. `blockDim.x` is a multiple of 32 (at
// most 1024) and every thread of the block calls it. `red` is 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) {
        red[warp] = v;
    }
    __syncthreads();
    float t = lane < n_warps ? red[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}

// ---- 8-bit activation blocks ---------------------------------------------------------------------
// One warp quantizes block `b` (32 values, lane l holding value l as the producer stored it) of
// activation row `r` for the quantized matrix products (matmul.cu): xq holds rows x k int8 values,
// xs per block 4 words (d and d * sum(q) as f32 bits, each rounded through f16; the integer sum;
// 0), with d = amax / 127, as ggml's q8_1 blocks. The standalone `quantize_q8` kernel and the
// producers that fold it in (rms_norm, add_rms_norm, swiglu) all call this, so their bytes agree.
// Every lane of the warp must call it.
__device__ __forceinline__ void q8_store_block(float v, i64 r, int k, int b, signed char* xq,
                                               u32* xs) {
    const int lane = threadIdx.x & 31;
    const int nb = k >> 5;
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

#define NPU_FOR_EACH_ACT(X) X(float, f32) X(f16, f16) X(bf16, bf16)

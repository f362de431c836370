// CPU emulation of the CUDA device-code subset the kernels use, so the same .cu sources compile
// as C++ and run on a CPU in tests. It is an emulation, not a GPU: it checks the kernels'
// arithmetic, indexing and synchronisation, not their speed or the real hardware.
//
// Execution model (emulation/runtime.cpp): the blocks of a grid run one after another; the
// threads of a block run as cooperative coroutines on one OS thread, switching only at
// __syncthreads() and warp shuffles. That makes `__shared__` variables plain statics, and lets
// the scheduler be strict: a barrier some threads of the block never reach, a shuffle whose
// participants disagree on the mask, or one that reads a lane outside the mask is an error, not
// a hang or a silent wrong answer.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define NPU_EMULATION 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// Blocks run one at a time on one OS thread: a static is exactly one block's shared variable.
#define __shared__ static

struct npu_dim3 {
    unsigned x, y, z;
};

struct uint2 {
    unsigned x, y;
};
struct uint4 {
    unsigned x, y, z, w;
};
struct float2 {
    float x, y;
};
struct float4 {
    float x, y, z, w;
};

namespace npu_emu {
const npu_dim3& thread_idx();
extern npu_dim3 block_idx;
extern npu_dim3 block_dim;
extern npu_dim3 grid_dim;
void syncthreads();
// mode: 0 = xor, 1 = indexed lane, 2 = down.
uint32_t shfl(uint32_t mask, uint32_t value, int arg, int mode, int width);
unsigned char* dyn_smem();
// cp.async of `bytes` (4, 8 or 16) from global to shared memory: copied at once (the kernel's
// commit/wait are no-ops here, its barrier still orders the copy for the other threads); a size
// or an address the PTX ISA refuses (not a multiple of the size) fails the launch.
void cp_async(void* dst, const void* src, unsigned bytes);
} // namespace npu_emu

#define threadIdx (npu_emu::thread_idx())
#define blockIdx (npu_emu::block_idx)
#define blockDim (npu_emu::block_dim)
#define gridDim (npu_emu::grid_dim)

inline void __syncthreads() { npu_emu::syncthreads(); }
inline unsigned char* npu_emu_dyn_smem() { return npu_emu::dyn_smem(); }

inline float __int_as_float(int v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline float __uint_as_float(unsigned v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline int __float_as_int(float f) {
    int v;
    std::memcpy(&v, &f, 4);
    return v;
}
inline unsigned __float_as_uint(float f) {
    unsigned v;
    std::memcpy(&v, &f, 4);
    return v;
}

// Round-to-nearest products, sums and quotients, never fused (the build uses -ffp-contract=off).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

template <typename T> inline T __ldg(const T* p) { return *p; }

// Atomics and fences. A block's threads switch only at __syncthreads() and shuffles, and blocks
// run one after another, so a read-modify-write here is atomic as on the device; a kernel that
// waits on another block of its grid hangs the emulation as it may hang a GPU (no such waits).
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    const unsigned old = *p;
    *p = old + v;
    return old;
}
inline int atomicAdd(int* p, int v) {
    const int old = *p;
    *p = old + v;
    return old;
}
inline float atomicAdd(float* p, float v) {
    const float old = *p;
    *p = old + v;
    return old;
}
// Wrapping increment: old >= limit stores 0, as CUDA's atomicInc.
inline unsigned atomicInc(unsigned* p, unsigned limit) {
    const unsigned old = *p;
    *p = old >= limit ? 0u : old + 1u;
    return old;
}
inline void __threadfence() {}

// Four signed 8-bit products summed into c.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) {
        c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    }
    return c;
}

inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask, int width = 32) {
    return __uint_as_float(npu_emu::shfl(mask, __float_as_uint(v), lane_mask, 0, width));
}
inline int __shfl_xor_sync(unsigned mask, int v, int lane_mask, int width = 32) {
    return (int)npu_emu::shfl(mask, (uint32_t)v, lane_mask, 0, width);
}
inline float __shfl_sync(unsigned mask, float v, int lane, int width = 32) {
    return __uint_as_float(npu_emu::shfl(mask, __float_as_uint(v), lane, 1, width));
}
inline int __shfl_sync(unsigned mask, int v, int lane, int width = 32) {
    return (int)npu_emu::shfl(mask, (uint32_t)v, lane, 1, width);
}
inline float __shfl_down_sync(unsigned mask, float v, int delta, int width = 32) {
    return __uint_as_float(npu_emu::shfl(mask, __float_as_uint(v), delta, 2, width));
}

// IEEE binary16 conversions (round to nearest even), as the PTX cvt instructions do.
inline float npu_emu_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            const float f = (float)man * 5.9604644775390625e-8f; // man * 2^-24, exact
            bits = sign | __float_as_uint(f);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    return __uint_as_float(bits);
}

inline uint16_t npu_emu_f32_to_f16(float f) {
    const uint32_t x = __float_as_uint(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) {
        return sign | 0x7e00u; // NaN
    }
    if (ax >= 0x477ff000u) {
        return sign | 0x7c00u; // at least 65520: infinity
    }
    if (ax < 0x38800000u) { // below 2^-14: subnormal or zero, in units of 2^-24
        const float scaled = __uint_as_float(ax) * 16777216.0f;
        return sign | (uint16_t)nearbyintf(scaled);
    }
    uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) {
        h += 1;
    }
    return sign | (uint16_t)h;
}

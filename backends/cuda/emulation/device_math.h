// The device's single-precision math functions, as far as the emulation can know them: the CUDA
// Programming Guide bounds their error (expf, sinf, cosf, tanhf: 2 ulp; logf: 1 ulp) but does
// not promise the host C library's results. So the emulation moves each result of the host's
// function by one ulp, up, down or not at all, chosen by a hash of the argument's bits: a kernel
// (or a test) that depends on the device's transcendentals agreeing with the host's bit for bit
// fails here as it could on a GPU. Included by the kernel program only (not by the runtime).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

inline float npu_emu_ulp_moved(float x, float r) {
    if (!std::isfinite(r) || r == 0.0f) {
        return r;
    }
    uint32_t h;
    std::memcpy(&h, &x, 4);
    h *= 0x9e3779b1u;
    h ^= h >> 15;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    switch (h % 3u) {
    case 0:
        return r;
    case 1:
        return std::nextafter(r, INFINITY);
    default:
        return std::nextafter(r, -INFINITY);
    }
}

inline float npu_emu_expf(float x) { return npu_emu_ulp_moved(x, ::expf(x)); }
inline float npu_emu_logf(float x) { return npu_emu_ulp_moved(x, ::logf(x)); }
inline float npu_emu_sinf(float x) { return npu_emu_ulp_moved(x, ::sinf(x)); }
inline float npu_emu_cosf(float x) { return npu_emu_ulp_moved(x, ::cosf(x)); }
inline float npu_emu_tanhf(float x) { return npu_emu_ulp_moved(x, ::tanhf(x)); }

#define expf npu_emu_expf
#define logf npu_emu_logf
#define sinf npu_emu_sinf
#define cosf npu_emu_cosf
#define tanhf npu_emu_tanhf

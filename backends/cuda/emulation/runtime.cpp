// The emulation's execution engine: runs one kernel launch (grid of blocks, block of threads)
// on the calling OS thread. Each block's threads are ucontext coroutines; a thread runs until it
// reaches __syncthreads(), a warp shuffle, or its end, and the scheduler releases a barrier only
// when every thread of the block is waiting at it, and a shuffle only when every lane its mask
// names is waiting at it with the same mask. Anything else is reported as an error of the launch
// (what real hardware would leave undefined or hang on).

#include "cuda_shim.h"

#include <cstdio>
#include <string>
#include <ucontext.h>
#include <vector>

namespace npu_emu {

enum class State { Runnable, AtBarrier, AtShuffle, Done };

struct Thread {
    ucontext_t ctx;
    std::vector<char> stack;
    State state = State::Done;
    npu_dim3 tid{0, 0, 0};
    uint32_t shfl_mask = 0;
    uint32_t shfl_value = 0;
    uint32_t shfl_result = 0;
    int shfl_src = 0;
};

static const size_t STACK_BYTES = 128 * 1024;

static std::vector<Thread> threads;
static int n_threads = 0;
static int current = -1;
static ucontext_t scheduler;
static void (*body_fn)(void*) = nullptr;
static void* body_arg = nullptr;
static std::vector<unsigned char> dynamic_smem;
static std::string error;

npu_dim3 block_idx{0, 0, 0};
npu_dim3 block_dim{1, 1, 1};
npu_dim3 grid_dim{1, 1, 1};

const npu_dim3& thread_idx() { return threads[current].tid; }

unsigned char* dyn_smem() { return dynamic_smem.empty() ? nullptr : dynamic_smem.data(); }

static void yield_to_scheduler() { swapcontext(&threads[current].ctx, &scheduler); }

void syncthreads() {
    threads[current].state = State::AtBarrier;
    yield_to_scheduler();
}

uint32_t shfl(uint32_t mask, uint32_t value, int arg, int mode, int width) {
    Thread& t = threads[current];
    const int lane = current & 31;
    if (width != 32) {
        error = "shuffle with a width other than 32 (not used by these kernels)";
    }
    int src = lane;
    if (mode == 0) {
        src = lane ^ (arg & 31);
    } else if (mode == 1) {
        src = arg & 31;
    } else {
        src = lane + arg < 32 ? lane + arg : lane;
    }
    t.shfl_mask = mask;
    t.shfl_value = value;
    t.shfl_src = src;
    t.state = State::AtShuffle;
    yield_to_scheduler();
    return threads[current].shfl_result;
}

static void thread_entry() {
    body_fn(body_arg);
    threads[current].state = State::Done;
}

static bool fail(const std::string& what) {
    char where[160];
    std::snprintf(where, sizeof where, " (block %u,%u,%u of grid %u,%u,%u; block of %u,%u,%u)",
                  block_idx.x, block_idx.y, block_idx.z, grid_dim.x, grid_dim.y, grid_dim.z,
                  block_dim.x, block_dim.y, block_dim.z);
    error = what + where;
    return false;
}

// Releases the shuffles that are complete; false (with `error`) on a malformed one.
static bool release_shuffles(bool& released) {
    const int n_warps = (n_threads + 31) / 32;
    for (int w = 0; w < n_warps; ++w) {
        int first = -1;
        for (int l = 0; l < 32 && w * 32 + l < n_threads; ++l) {
            if (threads[w * 32 + l].state == State::AtShuffle) {
                first = w * 32 + l;
                break;
            }
        }
        if (first < 0) {
            continue;
        }
        const uint32_t mask = threads[first].shfl_mask;
        for (int l = 0; l < 32; ++l) {
            const int i = w * 32 + l;
            const bool named = (mask >> l) & 1u;
            if (i >= n_threads) {
                if (named) {
                    return fail("a shuffle mask names lane " + std::to_string(l) +
                                " beyond the block's threads");
                }
                continue;
            }
            const Thread& t = threads[i];
            if (t.state == State::AtShuffle && t.shfl_mask != mask) {
                return fail("lanes of warp " + std::to_string(w) +
                            " shuffle with different masks");
            }
            if (named && t.state != State::AtShuffle) {
                return fail("lane " + std::to_string(l) + " of warp " + std::to_string(w) +
                            " is named by a shuffle mask but " +
                            (t.state == State::Done ? "has exited" : "waits at __syncthreads"));
            }
            if (!named && t.state == State::AtShuffle) {
                return fail("lane " + std::to_string(l) + " of warp " + std::to_string(w) +
                            " shuffles without being in the mask");
            }
        }
        for (int l = 0; l < 32; ++l) {
            if (!((mask >> l) & 1u)) {
                continue;
            }
            Thread& t = threads[w * 32 + l];
            if (!((mask >> t.shfl_src) & 1u)) {
                return fail("lane " + std::to_string(l) + " reads lane " +
                            std::to_string(t.shfl_src) + " outside the shuffle mask");
            }
            t.shfl_result = threads[w * 32 + t.shfl_src].shfl_value;
        }
        for (int l = 0; l < 32; ++l) {
            if ((mask >> l) & 1u) {
                threads[w * 32 + l].state = State::Runnable;
            }
        }
        released = true;
    }
    return true;
}

static bool run_block() {
    for (int i = 0; i < n_threads; ++i) {
        Thread& t = threads[i];
        getcontext(&t.ctx);
        t.ctx.uc_stack.ss_sp = t.stack.data();
        t.ctx.uc_stack.ss_size = t.stack.size();
        t.ctx.uc_link = &scheduler;
        makecontext(&t.ctx, thread_entry, 0);
        t.state = State::Runnable;
    }
    for (;;) {
        for (int i = 0; i < n_threads; ++i) {
            if (threads[i].state == State::Runnable) {
                current = i;
                swapcontext(&scheduler, &threads[i].ctx);
                if (!error.empty()) {
                    return fail(error);
                }
            }
        }
        bool released = false;
        if (!release_shuffles(released)) {
            return false;
        }
        if (released) {
            continue;
        }
        int done = 0;
        int waiting = 0;
        for (int i = 0; i < n_threads; ++i) {
            done += threads[i].state == State::Done;
            waiting += threads[i].state == State::AtBarrier;
        }
        if (done == n_threads) {
            return true;
        }
        if (waiting == n_threads) {
            for (int i = 0; i < n_threads; ++i) {
                threads[i].state = State::Runnable;
            }
            continue;
        }
        return fail("__syncthreads reached by " + std::to_string(waiting) + " of " +
                    std::to_string(n_threads) + " threads (" + std::to_string(done) +
                    " exited, the rest wait at a shuffle)");
    }
}

// Runs `body(arg)` as every thread of every block; 0 on success, else 1 with `err` filled.
int run_grid(const unsigned* g, const unsigned* b, unsigned smem, void (*body)(void*), void* arg,
             char* err, size_t err_len) {
    error.clear();
    const unsigned long long n = (unsigned long long)b[0] * b[1] * b[2];
    if (n == 0 || n > 1024 || b[2] > 64 || g[0] == 0 || g[1] == 0 || g[2] == 0 ||
        g[1] > 65535 || g[2] > 65535) {
        std::snprintf(err, err_len,
                      "invalid launch configuration: grid %u,%u,%u block %u,%u,%u "
                      "(CUDA_ERROR_INVALID_VALUE)",
                      g[0], g[1], g[2], b[0], b[1], b[2]);
        return 1;
    }
    n_threads = (int)n;
    if ((int)threads.size() < n_threads) {
        const size_t old = threads.size();
        threads.resize(n_threads);
        for (size_t i = old; i < threads.size(); ++i) {
            threads[i].stack.resize(STACK_BYTES);
        }
    }
    for (int i = 0; i < n_threads; ++i) {
        threads[i].tid = npu_dim3{(unsigned)i % b[0], ((unsigned)i / b[0]) % b[1],
                                  (unsigned)i / (b[0] * b[1])};
    }
    body_fn = body;
    body_arg = arg;
    block_dim = npu_dim3{b[0], b[1], b[2]};
    grid_dim = npu_dim3{g[0], g[1], g[2]};
    for (unsigned z = 0; z < g[2]; ++z) {
        for (unsigned y = 0; y < g[1]; ++y) {
            for (unsigned x = 0; x < g[0]; ++x) {
                block_idx = npu_dim3{x, y, z};
                // Uninitialised shared memory reads as NaN (all bits set), never as zeros.
                dynamic_smem.assign(smem, 0xff);
                if (!run_block()) {
                    std::snprintf(err, err_len, "%s", error.c_str());
                    return 1;
                }
            }
        }
    }
    return 0;
}

} // namespace npu_emu

// cublasGemmEx (transa = T, transb = N, alpha 1, beta 0, f32 accumulation) on the host, for
// arguments the caller has checked: C[i + j ldc] = sum_l A[l + i lda] * B[l + j ldb].
// Element types: 0 = f32, 1 = f16, 2 = bf16.
static float load_elem(const void* p, size_t i, int ty) {
    if (ty == 0) {
        return ((const float*)p)[i];
    }
    const uint16_t b = ((const uint16_t*)p)[i];
    return ty == 1 ? npu_emu_f16_to_f32(b) : __uint_as_float(((uint32_t)b) << 16);
}

static void store_elem(void* p, size_t i, int ty, float v) {
    if (ty == 0) {
        ((float*)p)[i] = v;
    } else if (ty == 1) {
        ((uint16_t*)p)[i] = npu_emu_f32_to_f16(v);
    } else {
        uint32_t u = __float_as_uint(v);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            ((uint16_t*)p)[i] = (uint16_t)((u >> 16) | 0x40u);
        } else {
            u += 0x7fffu + ((u >> 16) & 1u);
            ((uint16_t*)p)[i] = (uint16_t)(u >> 16);
        }
    }
}

extern "C" void npu_emu_gemm(size_t m, size_t n, size_t k, const void* a, size_t lda,
                             const void* b, size_t ldb, void* c, size_t ldc, int ab_type,
                             int c_type) {
    std::vector<float> col(k);
    std::vector<float> arow(k);
    for (size_t j = 0; j < n; ++j) {
        for (size_t l = 0; l < k; ++l) {
            col[l] = load_elem(b, l + j * ldb, ab_type);
        }
        for (size_t i = 0; i < m; ++i) {
            float acc = 0.0f;
            if (ab_type == 0) {
                const float* ar = (const float*)a + i * lda;
                for (size_t l = 0; l < k; ++l) {
                    acc += ar[l] * col[l];
                }
            } else {
                for (size_t l = 0; l < k; ++l) {
                    arow[l] = load_elem(a, l + i * lda, ab_type);
                }
                for (size_t l = 0; l < k; ++l) {
                    acc += arow[l] * col[l];
                }
            }
            store_elem(c, i + j * ldc, c_type, acc);
        }
    }
}

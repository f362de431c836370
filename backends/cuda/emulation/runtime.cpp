// The emulation's execution engine: runs one kernel launch (grid of blocks, block of threads)
// on the calling OS thread. Each block's threads are coroutines (a small stack switch on x86-64,
// ucontext elsewhere); a thread runs until it
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
    void* sp = nullptr;
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
static void* scheduler_sp = nullptr;
static void (*body_fn)(void*) = nullptr;
static void* body_arg = nullptr;
static std::vector<unsigned char> dynamic_smem;
static std::string error;

npu_dim3 block_idx{0, 0, 0};
npu_dim3 block_dim{1, 1, 1};
npu_dim3 grid_dim{1, 1, 1};

const npu_dim3& thread_idx() { return threads[current].tid; }

unsigned char* dyn_smem() { return dynamic_smem.empty() ? nullptr : dynamic_smem.data(); }

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save, and
// resumes the stack `next` (saved the same way). The floating-point control state (MXCSR, x87
// control word) is not switched: no kernel changes it, so every thread shares the caller's.
extern "C" void npu_emu_switch(void** save, void* next);
asm(R"(
    .text
    .globl npu_emu_switch
    .type npu_emu_switch, @function
npu_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size npu_emu_switch, .-npu_emu_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");
#define NPU_EMU_FAST_SWITCH 1
#endif

// Suspends thread `from` and runs thread `to`.
static void switch_between(int from, int to) {
    current = to;
#ifdef NPU_EMU_FAST_SWITCH
    npu_emu_switch(&threads[from].sp, threads[to].sp);
#else
    swapcontext(&threads[from].ctx, &threads[to].ctx);
#endif
}

static void yield_to_scheduler() {
#ifdef NPU_EMU_FAST_SWITCH
    npu_emu_switch(&threads[current].sp, scheduler_sp);
#else
    swapcontext(&threads[current].ctx, &scheduler);
#endif
}

// Passes control to the next runnable thread after the current one below `end`, else back to the
// scheduler (which releases barriers and shuffles once every participant waits).
static void pass_on(int end) {
    for (int j = current + 1; j < end && j < n_threads; ++j) {
        if (threads[j].state == State::Runnable) {
            switch_between(current, j);
            return;
        }
    }
    yield_to_scheduler();
}

void cp_async(void* dst, const void* src, unsigned bytes) {
    if (bytes != 4 && bytes != 8 && bytes != 16) {
        error = "cp.async of " + std::to_string(bytes) + " bytes (the PTX ISA allows 4, 8, 16)";
        return;
    }
    if (((uintptr_t)dst | (uintptr_t)src) % bytes != 0) {
        error = "cp.async of " + std::to_string(bytes) +
                " bytes between addresses not aligned to the size";
        return;
    }
    std::memcpy(dst, src, bytes);
}

void syncthreads() {
    threads[current].state = State::AtBarrier;
    pass_on(n_threads);
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
    // The next lane of the warp runs to the same shuffle; the last returns to the scheduler,
    // which completes the exchange.
    pass_on(((current >> 5) + 1) << 5);
    return threads[current].shfl_result;
}

static void thread_entry() {
    body_fn(body_arg);
    threads[current].state = State::Done;
#ifdef NPU_EMU_FAST_SWITCH
    npu_emu_switch(&threads[current].sp, scheduler_sp);
    __builtin_unreachable();
#endif
}

// Prepares thread i to start at thread_entry on its own stack.
static void start_thread(int i) {
    Thread& t = threads[i];
#ifdef NPU_EMU_FAST_SWITCH
    uintptr_t top = ((uintptr_t)(t.stack.data() + t.stack.size())) & ~(uintptr_t)15;
    uint64_t* sp = (uint64_t*)top;
    *--sp = 0;                          // where thread_entry's return address would be
    *--sp = (uint64_t)&thread_entry;    // popped by npu_emu_switch's ret
    for (int r = 0; r < 6; ++r) {
        *--sp = 0;                      // rbp, rbx, r12-r15
    }
    t.sp = sp;
#else
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack.data();
    t.ctx.uc_stack.ss_size = t.stack.size();
    t.ctx.uc_link = &scheduler;
    makecontext(&t.ctx, thread_entry, 0);
#endif
    t.state = State::Runnable;
}

static void resume_thread(int i) {
    current = i;
#ifdef NPU_EMU_FAST_SWITCH
    npu_emu_switch(&scheduler_sp, threads[i].sp);
#else
    swapcontext(&scheduler, &threads[i].ctx);
#endif
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
        start_thread(i);
    }
    for (;;) {
        for (int i = 0; i < n_threads; ++i) {
            if (threads[i].state == State::Runnable) {
                resume_thread(i);
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
    std::vector<float> cols(n * k);
    for (size_t j = 0; j < n; ++j) {
        for (size_t l = 0; l < k; ++l) {
            cols[j * k + l] = load_elem(b, l + j * ldb, ab_type);
        }
    }
    std::vector<float> arow(k);
    for (size_t i = 0; i < m; ++i) {
        for (size_t l = 0; l < k; ++l) {
            arow[l] = load_elem(a, l + i * lda, ab_type);
        }
        for (size_t j = 0; j < n; ++j) {
            const float* col = cols.data() + j * k;
            float acc = 0.0f;
            for (size_t l = 0; l < k; ++l) {
                acc += arow[l] * col[l];
            }
            store_elem(c, i + j * ldc, c_type, acc);
        }
    }
}

// ---- LoRA: one adapter group's rows, out[r] += scale * B (A x[r]) -----------------------------
//
// grid (rows of the group), LORA_THREADS threads; the host launches once per adapter group of a
// step (the engine's runs of rows on one adapter), never per token. Shrink: u[k] = scale *
// (A_k . x[r]) with the CPU backend's sixteen partial sums (lane j of a 16-thread team sums the
// products of elements j, j+16, ... of the whole 16-element chunks; one thread adds the sixteen
// in order, then the tail in order), kept in shared memory. Expand: each thread owns output
// columns and adds u[k] * Bt[k][c] for k in order, as the CPU does. Every product and sum is
// rounded on its own (no fused multiply-add), so f32 activations give the CPU backend's bits;
// f16/bf16 rows are widened to f32 and the result rounded once to the activation type.
// A and Bt are f32 or bf16 (`wdt`, DT_* codes), as the adapter pool uploads them.

#define LORA_THREADS 256
#define LORA_MAX_RANK 256

template <typename T>
__device__ __forceinline__ void lora_body(const T* x, int ldx, T* out, int ldo, const void* a,
                                          const void* bt, int wdt, int n_in, int n_out, int rank,
                                          float scale) {
    __shared__ float part[LORA_THREADS];
    __shared__ float u[LORA_MAX_RANK];
    const T* xr = x + (i64)blockIdx.x * ldx;
    T* orow = out + (i64)blockIdx.x * ldo;
    const int lane = threadIdx.x & 15;
    const int team = threadIdx.x >> 4;
    const int teams = blockDim.x >> 4;
    const int full = n_in & ~15;
    for (int k0 = 0; k0 < rank; k0 += teams) {
        const int k = k0 + team;
        float acc = 0.0f;
        if (k < rank) {
            for (int i = lane; i < full; i += 16) {
                acc = __fadd_rn(acc, __fmul_rn(load_dt(a, wdt, (i64)k * n_in + i), to_f32(xr[i])));
            }
        }
        part[threadIdx.x] = acc;
        __syncthreads();
        if (lane == 0 && k < rank) {
            float s = 0.0f;
            for (int j = 0; j < 16; j++) {
                s = __fadd_rn(s, part[threadIdx.x + j]);
            }
            for (int i = full; i < n_in; i++) {
                s = __fadd_rn(s, __fmul_rn(load_dt(a, wdt, (i64)k * n_in + i), to_f32(xr[i])));
            }
            u[k] = __fmul_rn(scale, s);
        }
        __syncthreads();
    }
    for (int c = threadIdx.x; c < n_out; c += blockDim.x) {
        float d = to_f32(orow[c]);
        for (int k = 0; k < rank; k++) {
            d = __fadd_rn(d, __fmul_rn(u[k], load_dt(bt, wdt, (i64)k * n_out + c)));
        }
        orow[c] = from_f32<T>(d);
    }
}

#define LORA(T, S)                                                                                 \
    extern "C" __global__ void lora_##S(const T* x, int ldx, T* out, int ldo, const void* a,      \
                                        const void* bt, int wdt, int n_in, int n_out, int rank,    \
                                        float scale) {                                             \
        lora_body<T>(x, ldx, out, ldo, a, bt, wdt, n_in, n_out, rank, scale);                      \
    }
NPU_FOR_EACH_ACT(LORA)

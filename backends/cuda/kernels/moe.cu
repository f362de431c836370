// ---- mixture-of-experts: routing, grouping and the weighted sum back in token order ----------
//
// The experts' FFNs run as grouped matmuls (moe_matmul.cu) over the rows routed to each expert,
// gathered into contiguous groups by gather_rows with the plan moe_plan makes on the device from
// the routed ids (nothing is read back).

// grid (rows), one thread a row: the softmax of logits row r (exp in f32 after the row's max is
// subtracted, the sum in double, then each value times the sum's f32 inverse: the CPU backend's
// route_row), then the k most probable experts in descending order, ties to the lower index:
// ids[r][j] and their probabilities w[r][j], divided by their sum (at least 2^-14, as ggml
// clamps it) when `normalize`.
template <typename T>
__device__ __forceinline__ void moe_route_body(const T* x, int ldx, int ne, int k, int normalize,
                                               int* ids, int ldi, float* w, int ldw) {
    if (threadIdx.x != 0) {
        return;
    }
    const i64 r = blockIdx.x;
    const T* row = x + r * ldx;
    float mx = NEG_INF;
    for (int i = 0; i < ne; i++) {
        mx = fmaxf(mx, to_f32(row[i]));
    }
    double sum = 0.0;
    for (int i = 0; i < ne; i++) {
        sum += (double)expf(to_f32(row[i]) - mx);
    }
    const float inv = (float)(1.0 / sum);
    // The j-th pick is the largest probability ordered after the (j-1)-th: smaller, or equal
    // with a higher index.
    float pv = 0.0f;
    int pi = -1;
    float s = 0.0f;
    for (int j = 0; j < k; j++) {
        float bv = 0.0f;
        int bi = -1;
        for (int i = 0; i < ne; i++) {
            const float p = __fmul_rn(expf(to_f32(row[i]) - mx), inv);
            const bool after = pi < 0 || p < pv || (p == pv && i > pi);
            if (after && (bi < 0 || p > bv)) {
                bv = p;
                bi = i;
            }
        }
        ids[r * ldi + j] = bi;
        w[r * ldw + j] = bv;
        s = __fadd_rn(s, bv);
        pv = bv;
        pi = bi;
    }
    if (normalize) {
        s = fmaxf(s, 6.103515625e-5f);
        for (int j = 0; j < k; j++) {
            w[r * ldw + j] = __fdiv_rn(w[r * ldw + j], s);
        }
    }
}

#define MOE_ROUTE(T, S)                                                                            \
    extern "C" __global__ void moe_route_##S(const T* x, int ldx, int ne, int k, int normalize,   \
                                             int* ids, int ldi, float* w, int ldw) {               \
        moe_route_body<T>(x, ldx, ne, k, normalize, ids, ldi, w, ldw);                            \
    }
NPU_FOR_EACH_ACT(MOE_ROUTE)

// grid (1), one block (a multiple of 32 threads): the grouping of the t x k routed ids (rows
// `ldi` apart) over `ne` experts, as npu_backend::moe::ExpertGroups plans it on the host:
// offsets[e] = the first grouped row of expert e (offsets[ne] = t * k), rows[g] = the token of
// grouped row g (expert by expert, each in token order), pos[r * k + j] = the grouped row of
// token r's slot j. Thread e (striding by the block) counts and then places expert e's slots, so
// the result does not depend on scheduling. An id outside [0, ne) is placed nowhere:
// pos = -1 (moe_combine skips it), and the rows it would have taken are left out of every group.
template <typename T>
__device__ __forceinline__ void moe_plan_body(const int* ids, int ldi, int t, int k, int ne,
                                              int* offsets, int* rows, int* pos) {
    const int n = t * k;
    for (int e = threadIdx.x; e < ne; e += blockDim.x) {
        int c = 0;
        for (int i = 0; i < n; i++) {
            c += ids[(i64)(i / k) * ldi + i % k] == e;
        }
        offsets[e + 1] = c;
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        rows[i] = 0; // grouped rows past offsets[ne] (ids out of range) gather token 0
        const int e = ids[(i64)(i / k) * ldi + i % k];
        if (e < 0 || e >= ne) {
            pos[i] = -1;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        offsets[0] = 0;
        for (int e = 0; e < ne; e++) {
            offsets[e + 1] += offsets[e];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < ne; e += blockDim.x) {
        int g = offsets[e];
        for (int i = 0; i < n; i++) {
            if (ids[(i64)(i / k) * ldi + i % k] == e) {
                rows[g] = i / k;
                pos[i] = g;
                g++;
            }
        }
    }
}

// The plan reads no activations; it is instantiated per activation type like every op.
#define MOE_PLAN(T, S)                                                                             \
    extern "C" __global__ void moe_plan_##S(const int* ids, int ldi, int t, int k, int ne,        \
                                            int* offsets, int* rows, int* pos) {                   \
        moe_plan_body<T>(ids, ldi, t, k, ne, offsets, rows, pos);                                 \
    }
NPU_FOR_EACH_ACT(MOE_PLAN)

// grid (column blocks, rows): out[r][c] = sum over j < k of w[r][j] * y[pos[r * k + j]][c], the
// terms added in j order in f32 (the first one stored, as the CPU backend does); a slot with
// pos < 0 (an id moe_plan placed nowhere) adds nothing.
template <typename T>
__device__ __forceinline__ void moe_combine_body(const T* y, int ldy, const int* pos,
                                                 const float* w, int ldw, int k, T* out, int ldo,
                                                 int cols) {
    const i64 r = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) {
        return;
    }
    float acc = 0.0f;
    bool first = true;
    for (int j = 0; j < k; j++) {
        const int p = pos[r * k + j];
        if (p < 0) {
            continue;
        }
        const float v = __fmul_rn(to_f32(y[(i64)p * ldy + c]), w[r * ldw + j]);
        acc = first ? v : __fadd_rn(acc, v);
        first = false;
    }
    out[r * ldo + c] = from_f32<T>(acc);
}

#define MOE_COMBINE(T, S)                                                                          \
    extern "C" __global__ void moe_combine_##S(const T* y, int ldy, const int* pos,               \
                                               const float* w, int ldw, int k, T* out, int ldo,    \
                                               int cols) {                                         \
        moe_combine_body<T>(y, ldy, pos, w, ldw, k, out, ldo, cols);                              \
    }
NPU_FOR_EACH_ACT(MOE_COMBINE)

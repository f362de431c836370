#!/usr/bin/env bash
# Golden bytes of llama.cpp's reference quantizers for gguf/src/quantize/tests.rs: builds a small
# C harness against ggml/src/ggml-quants.c of the llama.cpp that scripts/llama-cpp-ref.sh unpacks,
# feeds it the test's deterministic rows and prints, per type, the SHA-256 of all output bytes and
# the hex of the explicit rows.
#
#   scripts/quant-golden.sh            # needs cc; writes nothing in the repository
#
# Compiled as ggml-base is (-O2, no -march, so no FMA contraction on x86-64; -DNDEBUG as a release
# build); -ffp-contract=off makes that explicit on CPUs where FMA is baseline (aarch64), whose
# llama.cpp builds may contract and then differ in the last bit.
# Env: LLAMA_CPP_REF, LLAMA_CPP_PY_VERSION as in llama-cpp-ref.sh; WORK (default /tmp/quant-golden).
set -euo pipefail
ver=${LLAMA_CPP_PY_VERSION:-0.3.36}
root=${LLAMA_CPP_REF:-$HOME/.cache/llama-cpp-ref}
src=$root/llama_cpp_python-$ver/vendor/llama.cpp/ggml
[ -f "$src/src/ggml-quants.c" ] || { echo "quant-golden.sh: no $src/src/ggml-quants.c (run scripts/llama-cpp-ref.sh first)" >&2; exit 1; }
work=${WORK:-/tmp/quant-golden}
mkdir -p "$work"
cat > "$work/harness.c" <<'C'
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-quants.h"

/* Stubs for the ggml.c symbols ggml-quants.c references but the reference quantizers never call. */
void ggml_abort(const char * file, int line, const char * fmt, ...) { fprintf(stderr, "abort %s:%d\n", file, line); abort(); }
void ggml_log_internal(enum ggml_log_level level, const char * fmt, ...) { (void) level; (void) fmt; }

/* The test's input stream (gguf/src/quantize/tests.rs `golden_rows`): splitmix64. */
static uint64_t st;
static uint64_t next(void) {
    uint64_t z = (st += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
/* Uniform in [-1, 1), exactly representable. */
static float uni(void) { return (float) (next() >> 40) / 8388608.0f - 1.0f; }
static float pow2(int e) { float s = 1.0f; while (e > 0) { s *= 2.0f; e--; } while (e < 0) { s *= 0.5f; e++; } return s; }

enum { ROWS = 4096, COLS = 256 };

static void fill(int r, float * x) {
    int kind = r % 12;
    float s = pow2((int) (next() % 41) - 20);
    for (int i = 0; i < COLS; i++) x[i] = 0.0f;
    switch (kind) {
    case 0: for (int i = 0; i < COLS; i++) x[i] = (uni() + uni()) * s; break;
    case 1: for (int i = 0; i < COLS; i++) x[i] = uni() * 1e-30f; break;
    case 2: for (int i = 0; i < COLS; i++) x[i] = uni() * 6e4f; break;
    case 3: break; /* all zero */
    case 4: { for (int i = 0; i < COLS; i++) x[i] = uni() * 0.01f * s;
              int at = (int) (next() % COLS); x[at] = (uni() < 0 ? -50.0f : 50.0f) * s; } break;
    case 5: for (int i = 0; i < COLS; i++) { float u = uni(); x[i] = -(u < 0 ? -u : u) * s; } break;
    case 6: for (int i = 0; i < COLS; i++) { float u = uni(); x[i] = (u < 0 ? -u : u) * s; } break;
    case 7: for (int b = 0; b < COLS / 32; b++) { float bs = pow2((int) (next() % 41) - 30);
              for (int i = 0; i < 32; i++) x[b * 32 + i] = uni() * bs; } break;
    case 8: { float c = uni() * s; for (int i = 0; i < COLS; i++) x[i] = c; } break;
    case 9: for (int i = 0; i < COLS; i++) x[i] = (float) ((int) (next() % 16) - 8) * 0.125f * s; break;
    case 10: for (int i = 0; i < COLS; i++) if (next() % 8 == 0) x[i] = uni() * s; break;
    case 11: { float t = (r % 24 == 11) ? 1e-40f : 1e20f;
              for (int i = 0; i < COLS; i++) x[i] = uni() * t; } break;
    }
}

static void hex(const uint8_t * b, size_t n) { for (size_t i = 0; i < n; i++) printf("%02x", b[i]); printf("\n"); }

int main(int argc, char ** argv) {
    const char * dir = argc > 1 ? argv[1] : ".";
    st = 0x5155414E54474F4Cull; /* "QUANTGOL" */
    float * x = malloc(sizeof(float) * ROWS * COLS);
    for (int r = 0; r < ROWS; r++) fill(r, x + (size_t) r * COLS);
    char path[4096];
    snprintf(path, sizeof path, "%s/input.f32", dir);
    FILE * f = fopen(path, "wb"); fwrite(x, sizeof(float), (size_t) ROWS * COLS, f); fclose(f);
    struct { const char * name; enum ggml_type t; } types[] = {
        {"q8_0", GGML_TYPE_Q8_0}, {"q4_0", GGML_TYPE_Q4_0}, {"q4_k", GGML_TYPE_Q4_K},
        {"q5_k", GGML_TYPE_Q5_K}, {"q6_k", GGML_TYPE_Q6_K},
    };
    /* The explicit row: x_i = ((37 i) mod 101 - 50) / 64 + i / 512. */
    float e[COLS];
    for (int i = 0; i < COLS; i++) e[i] = (float) ((37 * i) % 101 - 50) / 64.0f + (float) i / 512.0f;
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        size_t rb = ggml_row_size(types[k].t, COLS);
        uint8_t * out = malloc(rb * ROWS);
        for (int r = 0; r < ROWS; r++) {
            const float * xr = x + (size_t) r * COLS;
            uint8_t * o = out + rb * r;
            switch (types[k].t) {
            case GGML_TYPE_Q8_0: quantize_row_q8_0_ref(xr, (block_q8_0 *) o, COLS); break;
            case GGML_TYPE_Q4_0: quantize_row_q4_0_ref(xr, (block_q4_0 *) o, COLS); break;
            case GGML_TYPE_Q4_K: quantize_row_q4_K_ref(xr, (block_q4_K *) o, COLS); break;
            case GGML_TYPE_Q5_K: quantize_row_q5_K_ref(xr, (block_q5_K *) o, COLS); break;
            case GGML_TYPE_Q6_K: quantize_row_q6_K_ref(xr, (block_q6_K *) o, COLS); break;
            default: abort();
            }
        }
        snprintf(path, sizeof path, "%s/%s.bin", dir, types[k].name);
        f = fopen(path, "wb"); fwrite(out, 1, rb * ROWS, f); fclose(f);
        uint8_t one[256];
        switch (types[k].t) {
        case GGML_TYPE_Q8_0: quantize_row_q8_0_ref(e, (block_q8_0 *) one, 32); hex(one, 34); break;
        case GGML_TYPE_Q4_0: quantize_row_q4_0_ref(e, (block_q4_0 *) one, 32); hex(one, 18); break;
        case GGML_TYPE_Q4_K: quantize_row_q4_K_ref(e, (block_q4_K *) one, 256); hex(one, 144); break;
        case GGML_TYPE_Q5_K: quantize_row_q5_K_ref(e, (block_q5_K *) one, 256); hex(one, 176); break;
        case GGML_TYPE_Q6_K: quantize_row_q6_K_ref(e, (block_q6_K *) one, 256); hex(one, 210); break;
        default: abort();
        }
        free(out);
    }
    free(x);
    return 0;
}
C
# ggml_row_size comes from ggml.c, which is too big to link stand-alone: a local one.
cat > "$work/rowsize.c" <<'C'
#include <stdlib.h>
#include "ggml.h"
size_t ggml_row_size(enum ggml_type t, int64_t n) {
    switch (t) {
    case GGML_TYPE_Q8_0: return (size_t) n / 32 * 34;
    case GGML_TYPE_Q4_0: return (size_t) n / 32 * 18;
    case GGML_TYPE_Q4_K: return (size_t) n / 256 * 144;
    case GGML_TYPE_Q5_K: return (size_t) n / 256 * 176;
    case GGML_TYPE_Q6_K: return (size_t) n / 256 * 210;
    default: return 0;
    }
}
/* Referenced by ggml_validate_row_data, which the harness never calls. */
size_t ggml_type_size(enum ggml_type t) { (void) t; abort(); }
const char * ggml_type_name(enum ggml_type t) { (void) t; abort(); }
C
flags="-O2 -ffp-contract=off -DNDEBUG -I$src/include -I$src/src"
cc $flags -c "$src/src/ggml-quants.c" -o "$work/ggml-quants.o"
cc $flags "$work/harness.c" "$work/rowsize.c" "$work/ggml-quants.o" -lm -o "$work/harness" 2> "$work/link.log" || {
  cat "$work/link.log" >&2; exit 1; }
"$work/harness" "$work" > "$work/explicit.txt"
for t in q8_0 q4_0 q4_k q5_k q6_k; do
  printf '%s sha256 %s\n' "$t" "$(sha256sum "$work/$t.bin" | cut -d' ' -f1)"
done
printf 'input sha256 %s\n' "$(sha256sum "$work/input.f32" | cut -d' ' -f1)"
paste -d' ' <(printf '%s\n' q8_0 q4_0 q4_k q5_k q6_k) "$work/explicit.txt" | sed 's/^/explicit /'

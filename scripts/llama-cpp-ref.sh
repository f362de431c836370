#!/usr/bin/env bash
# llama.cpp as the same-run reference of the speed figures: prints the bin directory of a CPU
# build holding llama-bench, llama-batched-bench, llama-server, llama-quantize and
# llama-perplexity (building it first when absent; everything else goes to stderr).
#
#   scripts/llama-cpp-ref.sh            # -> .../vendor/llama.cpp/build/bin
#
# Source: the llama.cpp that the PyPI sdist of llama-cpp-python vendors, fetched with
# `pip download` (pinned: LLAMA_CPP_PY_VERSION, default 0.3.36, the reference of every figure in
# docs/performance.md since 2026-11-24). Release build, -DGGML_NATIVE=ON (this CPU's instruction
# sets), no curl. About 10 minutes on 2 cores the first time, then cached.
# On a CPU that lists amx_tile it is built without AMX (separate folder build-noamx):
# llama.cpp 0.3.36 built with -march=native died with SIGILL in its AMX tile code on such virtual
# machines (2026-11-25); LLAMA_CPP_AMX=1 keeps AMX.
#
# Env: LLAMA_CPP_BIN     a bin directory that already has the five tools: printed as is, nothing
#                        built (e.g. LLAMA_CPP_BIN=$(cat /tmp/llama_bin.txt))
#      LLAMA_CPP_REF     cache directory (default ~/.cache/llama-cpp-ref, shared with gpu-kit.sh)
#      LLAMA_CPP_PY_VERSION, LLAMA_CPP_AMX as above; JOBS (default nproc)
set -euo pipefail

tools="llama-bench llama-batched-bench llama-server llama-quantize llama-perplexity"
has_all() { local t; for t in $tools; do [ -x "$1/$t" ] || return 1; done; }

if [ -n "${LLAMA_CPP_BIN:-}" ]; then
  has_all "$LLAMA_CPP_BIN" || { echo "llama-cpp-ref.sh: LLAMA_CPP_BIN=$LLAMA_CPP_BIN lacks one of: $tools" >&2; exit 1; }
  echo "$LLAMA_CPP_BIN"
  exit 0
fi

ver=${LLAMA_CPP_PY_VERSION:-0.3.36}
root=${LLAMA_CPP_REF:-$HOME/.cache/llama-cpp-ref}
src=$root/llama_cpp_python-$ver/vendor/llama.cpp
build=build
flags=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null && [ "${LLAMA_CPP_AMX:-0}" != 1 ]; then
  build=build-noamx
  # Explicit -mno-* win over what -march=native turns on, whatever their order.
  flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  echo "llama-cpp-ref.sh: this CPU lists amx_tile; building without AMX (LLAMA_CPP_AMX=1 keeps it)" >&2
fi
bin=$src/$build/bin
if has_all "$bin"; then
  echo "$bin"
  exit 0
fi

mkdir -p "$root"
if [ ! -f "$src/CMakeLists.txt" ]; then
  echo "llama-cpp-ref.sh: fetching llama-cpp-python==$ver (sdist) from PyPI" >&2
  # --no-binary names this package only: its build requirements may still come as wheels.
  python3 -m pip download --quiet --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==$ver" -d "$root" >&2
  tar -xzf "$root/llama_cpp_python-$ver.tar.gz" -C "$root"
  [ -f "$src/CMakeLists.txt" ] || { echo "llama-cpp-ref.sh: no vendor/llama.cpp in the sdist" >&2; exit 1; }
fi
command -v cmake >/dev/null || { echo "llama-cpp-ref.sh: needs cmake (apt-get install cmake)" >&2; exit 1; }

log=$root/build-$ver-$build.log
echo "llama-cpp-ref.sh: building $tools in $src/$build (log: $log)" >&2
if ! (cd "$src" &&
      cmake -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" &&
      cmake --build "$build" -j"${JOBS:-$(nproc)}" --target $tools) >"$log" 2>&1; then
  echo "llama-cpp-ref.sh: build failed, last lines of $log:" >&2
  tail -20 "$log" >&2
  exit 1
fi
has_all "$bin" || { echo "llama-cpp-ref.sh: built, but $bin lacks one of: $tools" >&2; exit 1; }
echo "$bin"

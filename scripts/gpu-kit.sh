#!/usr/bin/env bash
# Builds, on this machine, everything a GPU check needs into one folder under 64 MiB
# (default target/gpu-kit, ignored by git), for a GPU machine that has no Rust toolchain and no
# network (see docs/devices.md, "Checking on a GPU"):
#   bin/npu-serving      the release binary with --features cuda, stripped
#   bin/gpu_conformance  the CUDA backend's conformance test binary, stripped
#   bin/gpu_kit_tool     the kit's helper (tokenizer donor, 1B/8B-shaped random models, the
#                        CPU-vs-GPU agreement line, the bench table, the GEMV-alone bench
#                        `gemv-bench`), stripped
#   models/donor-tokenizer.gguf  the default model's tokenizer without its weights (the
#                        models are made on the GPU machine: `npu-serving synth-model`)
#   refs/family_*.jsonl  llama.cpp's greedy tokens on those models (agent/tests/data)
#   llama.cpp-src.tar.gz a pruned llama.cpp source tree (ggml CPU + CUDA, llama, common,
#                        llama-bench, llama-batched-bench, llama-server without its web UI)
#                        for a CUDA build on the GPU machine
#   MANIFEST.txt, RUN.txt what is in it, and the command to run
# Then the GPU machine runs scripts/gpu-check.sh (one call of about 5 minutes on an H100).
#
#   scripts/gpu-kit.sh [--emulation] [--out DIR]
#     --emulation  also bin/npu-serving-emulation (--features cuda-emulation), for a dry run of
#                  scripts/gpu-check.sh on a machine without a GPU (`--dry-run`)
# Env: LLAMA_CPP_SRC (a llama.cpp source tree; default the llama-cpp-python 0.3.36 sdist's under
# ~/.cache/llama-cpp-ref, fetched with pip when absent), CARGO_BUILD_JOBS as usual.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

kit=target/gpu-kit
emulation=0
while [ $# -gt 0 ]; do
  case "$1" in
    --emulation) emulation=1 ;;
    --out) kit=$2; shift ;;
    *) echo "usage: scripts/gpu-kit.sh [--emulation] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
limit=$((64 * 1024 * 1024))
rm -rf "$kit"
mkdir -p "$kit/bin" "$kit/models" "$kit/refs"
say() { echo "gpu-kit: $*" >&2; }

say "release binary with --features cuda"
cargo build --release --features cuda --bin npu-serving
strip -o "$kit/bin/npu-serving" target/release/npu-serving

say "the conformance test binary and the kit's helper"
conf=$(cargo test --release -p npu-backend-cuda --test gpu_conformance --no-run \
         --message-format=json 2>/dev/null |
       python3 -c 'import json,sys
for l in sys.stdin:
    try: m = json.loads(l)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu_conformance" and m.get("executable"):
        print(m["executable"])' | tail -1)
[ -x "$conf" ] || { say "could not find the gpu_conformance test binary"; exit 1; }
strip -o "$kit/bin/gpu_conformance" "$conf"
cargo build --release -p npu-backend-cuda --example gpu_kit_tool
strip -o "$kit/bin/gpu_kit_tool" target/release/examples/gpu_kit_tool

if [ $emulation = 1 ]; then
  say "the emulation binary (--features cuda-emulation), for dry runs"
  cargo build --release --features cuda-emulation --bin npu-serving
  strip -o "$kit/bin/npu-serving-emulation" target/release/npu-serving
  # Leave target/release/npu-serving as the plain cuda build.
  cargo build --release --features cuda --bin npu-serving
fi

say "tokenizer donor and llama.cpp's references"
# The default model's tokenizer (the model is fetched into the cache when absent).
"$kit/bin/gpu_kit_tool" donor --from default --out "$kit/models/donor-tokenizer.gguf" >&2
cp agent/tests/data/family_*.jsonl "$kit/refs/"

say "pruned llama.cpp source"
src=${LLAMA_CPP_SRC:-$HOME/.cache/llama-cpp-ref/llama_cpp_python-0.3.36/vendor/llama.cpp}
if [ ! -f "$src/CMakeLists.txt" ]; then
  mkdir -p "$HOME/.cache/llama-cpp-ref"
  (cd "$HOME/.cache/llama-cpp-ref" &&
    python3 -m pip download -q --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d . &&
    tar xzf llama_cpp_python-0.3.36.tar.gz)
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
dst=$stage/llama.cpp
mkdir -p "$dst/ggml/src" "$dst/tools"
for p in CMakeLists.txt LICENSE cmake common include src vendor licenses; do
  [ -e "$src/$p" ] && cp -r "$src/$p" "$dst/"
done
for p in CMakeLists.txt cmake include; do cp -r "$src/ggml/$p" "$dst/ggml/"; done
find "$src/ggml/src" -maxdepth 1 -type f -exec cp {} "$dst/ggml/src/" \;
cp -r "$src/ggml/src/ggml-cpu" "$src/ggml/src/ggml-cuda" "$dst/ggml/src/"
cp -r "$src/tools/llama-bench" "$src/tools/batched-bench" "$dst/tools/"
# llama-server: its sources (not its tests, benchmarks or docs), the multimodal library it links
# (mtmd: its sources; not its sample media), and the web UI's CMake glue alone: the UI's assets
# are not in the source tree (npm or a download makes them), and built with LLAMA_BUILD_UI=OFF and
# LLAMA_USE_PREBUILT_UI=OFF the server embeds none (an empty table; the API is the same).
mkdir -p "$dst/tools/server" "$dst/tools/mtmd" "$dst/tools/ui" "$dst/scripts"
find "$src/tools/server" -maxdepth 1 -type f \( -name '*.cpp' -o -name '*.h' -o -name CMakeLists.txt \) \
  -exec cp {} "$dst/tools/server/" \;
find "$src/tools/mtmd" -maxdepth 1 -type f \( -name '*.cpp' -o -name '*.h' -o -name CMakeLists.txt \) \
  -exec cp {} "$dst/tools/mtmd/" \;
cp -r "$src/tools/mtmd/models" "$src/tools/mtmd/debug" "$dst/tools/mtmd/"
for p in CMakeLists.txt sources.cmake ui.cpp.in ui.h.in; do cp "$src/tools/ui/$p" "$dst/tools/ui/"; done
cp "$src/scripts/ui-assets.cmake" "$dst/scripts/"
cat >"$dst/tools/CMakeLists.txt" <<'EOF'
# Pruned by scripts/gpu-kit.sh: the two benchmarks and llama-server (with mtmd and the UI glue).
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(batched-bench)
add_subdirectory(llama-bench)
add_subdirectory(mtmd)
add_subdirectory(ui)
add_subdirectory(server)
EOF
(cd "$src" && git rev-parse --short HEAD 2>/dev/null || grep -m1 -o 'LLAMA_BUILD_NUMBER[^)]*' CMakeLists.txt || true) \
  >"$dst/KIT_SOURCE" 2>/dev/null
echo "$src" >>"$dst/KIT_SOURCE"
tar -C "$stage" -czf "$kit/llama.cpp-src.tar.gz" llama.cpp

commit=$(git rev-parse --short HEAD)
{
  echo "npu-serving GPU check kit, commit $commit$(git diff --quiet HEAD -- . 2>/dev/null || echo ' (with uncommitted changes)'), built $(date -u +%Y-%m-%dT%H:%MZ) on $(uname -m)"
  echo "llama.cpp source: $src"
  echo
  (cd "$kit" && find . -type f -printf '%s\t%p\n' | sort -k2)
} >"$kit/MANIFEST.txt"
cat >"$kit/RUN.txt" <<EOF
On a GPU machine, with this folder carried (the device tool's \`run\`: carry ["$kit"]), one call
(about 5 minutes on an H100, llama.cpp's CUDA build included):

  timeout 585 scripts/gpu-check.sh --kit $kit --part all --budget 510 --out /tmp/gc; cp /tmp/gc/report.md \$OUT/

or two (the machine is given back after a short idle time, so back to back):

  scripts/gpu-check.sh --kit $kit --part 1     # conformance, fidelity, memcheck, models, llama.cpp build
  scripts/gpu-check.sh --kit $kit --part 2     # bench-model vs llama.cpp, then the served check

Each writes \$OUT/report.md and \$OUT/logs/ (a device call brings back only a few files: tar the
logs into one).
Dry run here (no GPU, over the CUDA emulation; needs --emulation when building the kit):
  scripts/gpu-check.sh --kit $kit --dry-run --out /tmp/gpu-check-dry
EOF

size=$(du -sb "$kit" | cut -f1)
say "$kit: $((size / 1024 / 1024)) MiB"
(cd "$kit" && du -ab . | sort -n | tail -8) >&2
if [ "$size" -ge "$limit" ]; then
  say "the kit is over 64 MiB: it cannot be carried to the GPU machine"
  exit 1
fi
echo "$kit"

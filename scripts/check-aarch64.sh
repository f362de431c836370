#!/usr/bin/env bash
# The aarch64 step of the test suite (Ascend hosts are Kunpeng, aarch64): cross-builds the whole
# workspace for aarch64-unknown-linux-gnu with Debian's rustc-web (which ships the aarch64
# standard library), then runs the instruction-set check under qemu-user: every NEON kernel (baseline
# and dot-product) against the scalar one, bit for bit, after a self-test that corrupts SIMD results
# on purpose and requires the check to fail. qemu-user cannot run threads, so the check runs on one
# thread. This is emulation on x86: it checks NEON arithmetic, not speed or Arm hardware.
#
# Needs root (or sudo) the first time, to install the toolchain from Debian; later runs find it
# installed and skip apt. The build goes to target/aarch64 so it never clobbers the host build.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=aarch64-unknown-linux-gnu
PACKAGES=(rustc-web libstd-rust-web-dev:arm64 gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)

missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    SUDO=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || { echo "installing ${missing[*]} needs root" >&2; exit 1; }
        SUDO=(sudo)
    fi
    echo "installing the aarch64 toolchain: ${missing[*]}"
    dpkg --print-foreign-architectures | grep -qx arm64 || "${SUDO[@]}" dpkg --add-architecture arm64
    "${SUDO[@]}" apt-get update -q
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Debian's rustc for the target (rustup's may lack the aarch64 standard library); the same flags
# every time, so builds are reused between runs.
export RUSTC=/usr/bin/rustc
export CARGO_TARGET_DIR="$PWD/target/aarch64"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-D warnings"
"$RUSTC" --version

# Every crate and binary of the workspace compiles and links for aarch64 (an unoptimised build
# without debug info: the quickest full build; warnings are errors).
start=$SECONDS
CARGO_PROFILE_DEV_DEBUG=0 cargo build --workspace --target "$TARGET"
echo "aarch64 workspace build: $((SECONDS - start)) s"

# The check, optimised (as the kernels ship), run through qemu by cargo's target runner.
start=$SECONDS
CARGO_PROFILE_RELEASE_DEBUG=0 cargo test --release --target "$TARGET" -p npu-backend-cpu \
    --features fault-injection --test isa_check
echo "aarch64 NEON check (build, and run under qemu): $((SECONDS - start)) s"

#!/usr/bin/env bash
# Builds the strict CPU emulation of CANN's ACL/aclnn subset (crate emulators/ascend, release)
# and lays it out like a CANN install; prints that directory, to be used as ASCEND_HOME_PATH:
#
#   ASCEND_HOME_PATH=$(scripts/ascend-emulator.sh) target/release/npu-serving generate --device ascend ...
#
# It is an emulation for CI and development without an NPU, never a product: nothing here runs on
# Ascend hardware. Layout: lib64/libascendcl.so (the emulation), lib64/libnnopbase.so,
# lib64/libopapi.so, lib64/libopapi_transformer.so and lib64/libhccl.so (links to the same file, so
# every name shares one state; HCCL's communicators work across processes through /dev/shm), opp/ (the operator package directory, empty: operators need
# ASCEND_OPP_PATH to name it, which set_env.sh exports and the backend sets when only
# ASCEND_HOME_PATH is given), version.cfg and runtime/version.info (the emulated CANN version,
# 8.3.RC1 unless ASCEND_EMULATOR_CANN_VERSION says otherwise) and set_env.sh. Build output goes to
# stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-$PWD/target}"
cargo build --release --quiet -p ascend-emulator --lib >&2
version="${ASCEND_EMULATOR_CANN_VERSION:-8.3.RC1}"
out="$target_dir/ascend-emulator"

mkdir -p "$target_dir"
exec 9>"$target_dir/.ascend-emulator.lock"
flock 9
mkdir -p "$out/lib64" "$out/runtime" "$out/opp"
if ! cmp -s "$target_dir/release/libascendcl.so" "$out/lib64/libascendcl.so"; then
    cp "$target_dir/release/libascendcl.so" "$out/lib64/libascendcl.so.tmp"
    mv -f "$out/lib64/libascendcl.so.tmp" "$out/lib64/libascendcl.so"
fi
for name in libnnopbase.so libopapi.so libopapi_transformer.so libhccl.so; do
    ln -sfn libascendcl.so "$out/lib64/$name"
done
printf 'runtime_running_version=[0.0.0:%s]\nopp_running_version=[0.0.0:%s]\n' "$version" "$version" > "$out/version.cfg"
printf 'Version=0.0.0\nversion_dir=%s\n' "$version" > "$out/runtime/version.info"
cat > "$out/set_env.sh" <<ENV
# Emulation of CANN for npu-serving's CI (not CANN, not for production).
export ASCEND_HOME_PATH="$out"
export ASCEND_TOOLKIT_HOME="$out"
export ASCEND_OPP_PATH="$out/opp"
export ASCEND_AICPU_PATH="$out"
export LD_LIBRARY_PATH="$out/lib64\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
ENV
cat > "$out/EMULATION.txt" <<TXT
This directory is a strict CPU emulation of the subset of CANN's ACL runtime and aclnn operator
API that npu-serving calls, built from emulators/ascend for CI. It is not CANN and runs nothing on
an Ascend NPU.
TXT
echo "$out"

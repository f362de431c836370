#!/usr/bin/env bash
# Installs the npu-serving binary with `cargo install` (into ~/.cargo/bin, or $CARGO_INSTALL_ROOT/bin),
# from this checkout, with the locked dependency versions. Arguments go to cargo install, e.g.
#
#   scripts/install.sh                          # CPU backend only (the default build)
#   scripts/install.sh --features cuda,ascend   # with the CUDA and Ascend backends (no CUDA or CANN needed to build)
#   scripts/install.sh --root /opt/npu-serving  # into /opt/npu-serving/bin
#
# The build reuses this checkout's target/ directory. The installed binary finds its agents by
# itself (it re-runs its own executable), but `serve` reads configs/smollm2-cpu.yaml relative to the
# current directory unless --config names a file: outside the checkout pass --config PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo install --locked --path . "$@"

bin_dir="${CARGO_INSTALL_ROOT:-${CARGO_HOME:-$HOME/.cargo}}/bin"
prev=
for arg in "$@"; do
    case "$arg" in
    --root=*) bin_dir="${arg#--root=}/bin" ;;
    *) [ "$prev" = --root ] && bin_dir="$arg/bin" ;;
    esac
    prev="$arg"
done
echo "installed: $bin_dir/npu-serving"
case ":$PATH:" in
*":$bin_dir:"*) ;;
*) echo "note: $bin_dir is not on PATH; add it, or run $bin_dir/npu-serving" ;;
esac

#!/usr/bin/env bash
# The AMX check: what only a CPU with AMX tiles (`lscpu` flags amx_tile, amx_int8) can tell.
# Run it the first time a session lands on such a machine; it takes about 15 minutes on 2 cores.
# Writes $OUT/report.md and $OUT/logs/.
#
#   scripts/amx-check.sh [--out DIR] [--model FILE]... [--dry-run]
#
#   1. The machine (model name, AMX flags, threads), then the tile tests on the real tiles: every
#      packed format's AMX kernel bit for bit against the scalar kernel (`kernels::matmul::tests`:
#      on the strict tile emulation everywhere, and on the tiles themselves where AMX exists) and
#      the conformance suite (its "cpu amx" case).
#   2. The crossover: `kernel_speed` (one thread, weights in cache, best of many runs) for every
#      packed format at 16, 32, 64, 128 and 512 rows x 2048 x 2048, with the tiles and with
#      `NPU_SERVING_AMX=0` (AVX-512 VNNI); the row count from which the tiles win is what
#      `amx::TILE_ROWS` (the smallest job the tiles take today: one 16-row tile) should become.
#      Then both threads at 512 x 2048 x 2048 and 512 x 8192 x 2048 (weights from memory).
#   3. Prefill in the model: `npu-serving bench-model --skip-long --batches 1` with the tiles and
#      without, on the 1B-shaped random Q4_0 model (made here with the GPU kit's helper,
#      `gpu_kit_tool shaped --shape 1b`) and on every --model file: prefill 128 / 512 tok/s,
#      the 512-token prefill's GOP/s, the AMX int8 and VNNI peaks and the fraction of the best.
#
# --dry-run: on a machine without AMX, checks this script (everything runs with the tiles
# absent: the tile tests run on the emulation only, both columns are VNNI). Without --dry-run a
# CPU without AMX is refused (exit 2). Exit status 1 when a test failed.
set -uo pipefail
cd "$(dirname "$0")/.."

out=${OUT:-target/amx-check-out}
dry=0
models=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift ;;
    --model) models+=("$2"); shift ;;
    --dry-run) dry=1 ;;
    *) echo "usage: scripts/amx-check.sh [--out DIR] [--model FILE]... [--dry-run]" >&2; exit 2 ;;
  esac
  shift
done
for m in "${models[@]}"; do
  [ -f "$m" ] || { echo "amx-check: --model $m: no such file" >&2; exit 2; }
done
flags=$(grep -m1 '^flags' /proc/cpuinfo)
has_amx=0
[[ " $flags " == *" amx_int8 "* && " $flags " == *" amx_tile "* ]] && has_amx=1
if [ $has_amx = 0 ] && [ $dry = 0 ]; then
  echo "amx-check: this CPU has no AMX int8 tiles (no amx_tile/amx_int8 in /proc/cpuinfo);" \
    "--dry-run checks the script here" >&2
  exit 2
fi
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
logs=$out/logs
work=${AMX_CHECK_WORK:-$PWD/target/amx-check-work}
mkdir -p "$work"
fails=0
say() { echo "amx-check: $*" >&2; }
report=$out/report.md

# ---- 1. the machine and the tile tests ---------------------------------------------------------
model_name=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
amx_flags=$(echo "$flags" | tr ' ' '\n' | grep '^amx' | tr '\n' ' ')
{
  echo "# AMX check, $(date -u +%Y-%m-%d) (commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
  echo
  [ $dry = 1 ] && echo "**Dry run on a CPU without AMX: the tile columns are the VNNI kernels.**" && echo
  echo "- CPU: $model_name, $(nproc) threads; AMX flags: ${amx_flags:-none}"
  echo
  echo "## Tile tests"
  echo
} >"$report"
say "building"
cargo build --release --bin npu-serving >"$logs/build.log" 2>&1 || { say "build failed (logs/build.log)"; exit 1; }
bin=$PWD/target/release/npu-serving
run_test() { # name, log, command...
  local name=$1 log=$2
  shift 2
  if "$@" >"$logs/$log" 2>&1; then
    echo "- $name: passed ($(grep -h -o '[0-9]* passed' "$logs/$log" | awk '{s+=$1} END {print s}') tests)" >>"$report"
  else
    echo "- **FAIL** $name (logs/$log)" >>"$report"
    fails=$((fails + 1))
  fi
}
say "tile tests"
run_test "packed matmul kernels, AMX on the tiles and on the emulation (kernels::matmul::tests)" \
  matmul-tests.log cargo test --release -p npu-backend-cpu --lib kernels::matmul::tests
run_test "conformance suite (cpu amx case included)" conformance.log \
  cargo test --release -p npu-agent --test conformance -- --nocapture
grep -h "cpu amx" "$logs/conformance.log" | sed 's/^/  - /' | head -3 >>"$report"

# ---- 2. the crossover --------------------------------------------------------------------------
say "kernel speed, one thread"
shapes=16x2048x2048,32x2048x2048,64x2048x2048,128x2048x2048,512x2048x2048
speed() { # log, threads, shapes, AMX setting
  KSHAPES=$3 KTHREADS=$2 NPU_SERVING_AMX=$4 cargo test --release -p npu-backend-cpu --lib \
    kernel_speed -- --ignored --nocapture >"$logs/$1" 2>&1
}
speed speed-tiles.log 1 "$shapes" 1
speed speed-vnni.log 1 "$shapes" 0
speed speed2-tiles.log 2 512x2048x2048,512x8192x2048 1
speed speed2-vnni.log 2 512x2048x2048,512x8192x2048 0
table() { # tiles log, vnni log: one row per format, one column per shape
  python3 - "$1" "$2" <<'EOF'
import re, sys
def read(path):
    got = {}
    for line in open(path):
        m = re.match(r'\S+ (\S+) (\d+x\d+x\d+): ([\d.]+) GOP/s', line.strip())
        if m:
            got[(m[1], m[2])] = float(m[3])
    return got
tiles, vnni = read(sys.argv[1]), read(sys.argv[2])
shapes = sorted({s for _, s in tiles}, key=lambda s: [int(x) for x in s.split('x')])
fmts = list(dict.fromkeys(f for f, _ in tiles))
print('| format | ' + ' | '.join(shapes) + ' | tiles win from |')
print('|---|' + '---|' * (len(shapes) + 1))
for f in fmts:
    cells, win = [], None
    for s in shapes:
        t, v = tiles.get((f, s)), vnni.get((f, s))
        if t is None or v is None:
            cells.append('—')
            continue
        cells.append(f'{t:.0f} / {v:.0f} ({t / v:.2f}×)')
        if t > v * 1.10 and win is None:
            win = s.split('x')[0] + ' rows'
        elif t <= v * 1.10:
            win = None
    print(f'| {f} | ' + ' | '.join(cells) + f' | {win or "never"} |')
EOF
}
{
  echo
  echo "## Crossover (\`kernel_speed\`, GOP/s, tiles / VNNI (ratio), rows x n x k)"
  echo
  echo "One thread, weights in cache; \"tiles win from\": the smallest row count from which the tiles are"
  echo "more than 10% faster at every larger count measured."
  echo
  table "$logs/speed-tiles.log" "$logs/speed-vnni.log"
  echo
  echo "Both threads (512 x 8192 x 2048: weights from memory):"
  echo
  table "$logs/speed2-tiles.log" "$logs/speed2-vnni.log"
} >>"$report" 2>>"$logs/table.log" || fails=$((fails + 1))

# ---- 3. prefill in the model -------------------------------------------------------------------
say "models"
shaped=$work/random-1b-q4_0.gguf
if [ ! -f "$shaped" ]; then
  cargo build --release -p npu-backend-cuda --example gpu_kit_tool >"$logs/build-tool.log" 2>&1 &&
    target/release/examples/gpu_kit_tool donor --from default --out "$work/donor.gguf" >"$logs/models.log" 2>&1 &&
    target/release/examples/gpu_kit_tool shaped --shape 1b --donor "$work/donor.gguf" --out "$shaped" >>"$logs/models.log" 2>&1 ||
    { say "could not make the 1B-shaped model (logs/models.log)"; rm -f "$shaped"; }
fi
[ -f "$shaped" ] && models=("$shaped" "${models[@]}")
{
  echo
  echo "## Prefill in the model (\`bench-model --skip-long --batches 1 --decode-steps 8\`)"
  echo
  echo "| model | tiles | prefill 128 tok/s | prefill 512 tok/s | 512: GOP/s | AMX int8 peak | VNNI peak | of the best |"
  echo "|---|---|---|---|---|---|---|---|"
} >>"$report"
for m in "${models[@]}"; do
  name=$(basename "$m")
  for amx in 1 0; do
    log=$logs/bench-$name-amx$amx.json
    if NPU_SERVING_AMX=$amx "$bin" bench-model --model "$m" --skip-long --batches 1 --decode-steps 8 --json \
      >"$log" 2>"$logs/bench-$name-amx$amx.err"; then
      python3 - "$log" "$name" "$amx" >>"$report" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
f = lambda k, p=0: '—' if d.get(k) is None else f'{d[k]:,.{p}f}'
amx, vnni, gops = d.get('amx_int8_peak_gop_s'), d.get('vnni_peak_gop_s'), d.get('prefill_gop_s')
best = max(x for x in (amx, vnni, 1e-9) if x is not None)
frac = '—' if gops is None else f'{100 * gops / best:.0f}%'
print(f"| {sys.argv[2]} | {'on' if sys.argv[3] == '1' else 'off (NPU_SERVING_AMX=0)'} | "
      f"{f('prefill_tok_s_128', 1)} | {f('prefill_tok_s_512', 1)} | {f('prefill_gop_s')} | "
      f"{f('amx_int8_peak_gop_s')} | {f('vnni_peak_gop_s')} | {frac} |")
EOF
    else
      echo "| $name | $amx | **FAIL** (logs/bench-$name-amx$amx.err) | | | | | |" >>"$report"
      fails=$((fails + 1))
    fi
  done
done
{
  echo
  echo "Where the crossover above differs from 16 rows, set \`amx::TILE_ROWS\`'s use in"
  echo "\`kernels/matmul/mod.rs\` (\`packed_job\`) to it; quote these tables with the model name above."
} >>"$report"
say "report: $report ($fails failures)"
[ $fails = 0 ]

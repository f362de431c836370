#!/usr/bin/env bash
# The speed matrix of docs/performance.md: scripts/compare-engine.sh (ours and llama.cpp back to
# back, per file) over model sizes and weight formats, RUNS passes over all the files back to back;
# then per file and cell (prefill 512, decode batch 1, decode batch 32) the median ratio ours /
# llama.cpp with each run's ratio in brackets, and the medians of both sides' tok/s.
#
#   scripts/compare-matrix.sh NPU_SERVING_BIN         (run it on a quiet machine)
#
# The files (made once into DIR, default ~/.cache/npu-serving-matrix):
#   the default model, SmolLM2-135M-Instruct Q4_1, as fetched;
#   smol-Q4_0 / smol-Q8_0 / smol-Q4_K_M: llama-quantize --allow-requantize of the default model;
#   llama1b-Q4_0 / llama1b-Q4_K_M, llama3b-Q4_0 / llama3b-Q4_K_M: scripts/synth-bench-model.sh.
# Env: RUNS (passes, default 1; the tables in docs/performance.md are RUNS=3), MATRIX_MODELS
#      (space-separated GGUF paths instead of the list above; `default` names the default model),
#      DIR, THREADS, REPS, LLAMA_CPP_BIN (passed on); PREPARE_ONLY=1 makes the files, prints
#      their paths and stops (to make them before a quiet window). Each pass appends its JSON lines to
#      DIR/matrix-<date>.jsonl. About 16 minutes a pass on a 2-core Zen 5, plus making the files
#      once.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:?usage: scripts/compare-matrix.sh NPU_SERVING_BIN}
runs=${RUNS:-1}
dir=${DIR:-$HOME/.cache/npu-serving-matrix}
export DIR=$dir
mkdir -p "$dir"
default=$(ls "${NPU_SERVING_CACHE:-$HOME/.cache/npu-serving}"/models/SmolLM2-135M-Instruct*.gguf 2>/dev/null | head -1)
[ -f "$default" ] || { echo "compare-matrix.sh: no default model: run \`npu-serving generate\` once to fetch it" >&2; exit 2; }
lb=$("$here/llama-cpp-ref.sh")
export LLAMA_CPP_BIN=$lb

if [ -n "${MATRIX_MODELS:-}" ]; then
  models=()
  for f in $MATRIX_MODELS; do [ "$f" = default ] && models+=("$default") || models+=("$f"); done
else
  for t in Q4_0 Q8_0 Q4_K_M; do
    [ -f "$dir/smol-$t.gguf" ] ||
      "$lb/llama-quantize" --allow-requantize "$default" "$dir/smol-$t.gguf" "$t" >"$dir/quantize-smol-$t.log" 2>&1 ||
      { echo "compare-matrix.sh: llama-quantize $t failed ($dir/quantize-smol-$t.log)" >&2; exit 1; }
  done
  models=("$default" "$dir/smol-Q4_0.gguf" "$dir/smol-Q8_0.gguf" "$dir/smol-Q4_K_M.gguf")
  for shape in 1b 3b; do
    made=$("$here/synth-bench-model.sh" "$shape" Q4_0 Q4_K_M)
    mapfile -t -O ${#models[@]} models <<<"$made"
  done
fi
for f in "${models[@]}"; do [ -f "$f" ] || { echo "compare-matrix.sh: no file $f" >&2; exit 2; }; done
if [ "${PREPARE_ONLY:-0}" = 1 ]; then printf '%s\n' "${models[@]}"; exit 0; fi

out=$dir/matrix-$(date -u +%Y%m%d-%H%M%S).jsonl
echo "compare-matrix.sh: ${#models[@]} files x $runs run(s); results in $out" >&2
for run in $(seq "$runs"); do
  for f in "${models[@]}"; do
    if line=$("$here/compare-engine.sh" "$bin" "$f" | tail -1); then
      echo "{\"run\": $run, \"file\": \"$(basename "$f")\", \"r\": $line}" | tee -a "$out"
    else
      echo "{\"run\": $run, \"file\": \"$(basename "$f")\", \"r\": null}" | tee -a "$out"
    fi
  done
done

python3 - "$out" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    rows.setdefault(d["file"], []).append(d["r"])
cells = (("prefill_ratio", "ours_prefill512", "llama_pp512"),
         ("decode_b1_ratio", "ours_decode_b1", "llama_tg128"),
         ("decode_b32_ratio", "ours_decode_b32", "llama_best_batched"))
med = lambda xs: statistics.median(xs) if xs else float("nan")
rate = lambda x: f"{x:.0f}" if x >= 100 else f"{x:.1f}"
print("\n| file | prefill 512 | decode, batch 1 | decode, batch 32 | ours (tok/s) | llama.cpp (tok/s) |")
print("|---|---|---|---|---|---|")
for f, rs in rows.items():
    ok = [r for r in rs if r]
    if not ok:
        print(f"| {f} | failed | | | | |")
        continue
    out = [f]
    for ratio, _, _ in cells:
        xs = [r[ratio] for r in ok]
        runs = " / ".join(f"{x:.2f}" for x in xs)
        out.append(f"{med(xs):.2f}" + (f" ({runs})" if len(xs) > 1 else ""))
    for side in (1, 2):
        out.append(" / ".join(rate(med([r[c[side]] for r in ok])) for c in cells))
    print("| " + " | ".join(out) + " |")
print("\nratios ours / llama.cpp, the median of the runs (each run in brackets); tok/s: medians, "
      "prefill 512 / batch 1 / batch 32")
PY

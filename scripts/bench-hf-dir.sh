#!/usr/bin/env bash
# A bf16 Hugging Face directory quantized at load against the same model as a GGUF file: load
# time, peak memory, and bench-model's speed, same machine, same run.
#
#   scripts/bench-hf-dir.sh [SHAPE] [FORMAT]     (default: 1b q4_k)
#
# SHAPE as scripts/synth-bench-model.sh (1b: Llama 3.2 1B's shape; tiny: seconds). The F16 file
# that script makes is written as a bf16 directory (`npu-serving synth-model --from F16 --hf-dir`)
# and quantized by llama.cpp's `llama-quantize --pure` into the GGUF twin of what
# `npu_serving.quantize: FORMAT` makes (every matrix in FORMAT, norms f32), then:
#   1. `npu-serving bench-model --model DIR --quantize FORMAT` and `--model TWIN.gguf`, each under
#      /usr/bin/time -v (peak resident memory), alternately ROUNDS times (default 2), the best
#      rate of each side per measure (a 2-core machine's noise only ever slows a run down);
#   2. the load: seconds from the log line "loaded the model, its float weight matrices quantized
#      at load", and the peak resident memory of the directory's run over the GGUF's (the GGUF's
#      run holds the same weights; the bound is 1.25x).
# Env: DIR (work folder, default ~/.cache/npu-serving-matrix), THREADS (default 0: all cores),
#      BIN (default target/release/npu-serving, built when absent).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
shape=${1:-1b}
format=${2:-q4_k}
case $format in
  q4_k) qtype=Q4_K ;;
  q8_0) qtype=Q8_0 ;;
  q4_0) qtype=Q4_0 ;;
  *) echo "bench-hf-dir.sh: FORMAT is q4_k, q8_0 or q4_0 (got $format)" >&2; exit 2 ;;
esac
dir=${DIR:-$HOME/.cache/npu-serving-matrix}
bin=${BIN:-$here/../target/release/npu-serving}
[ -x "$bin" ] || (cd "$here/.." && cargo build --release --bin npu-serving)
f16=$(DIR=$dir "$here/synth-bench-model.sh" "$shape" F16)
lb=$("$here/llama-cpp-ref.sh")
twin=$dir/llama$shape-$qtype-pure.gguf
if [ ! -f "$twin" ]; then
  "$lb/llama-quantize" --pure "$f16" "$twin.part" "$qtype" >"$dir/quantize-pure-$shape-$qtype.log" 2>&1
  mv "$twin.part" "$twin"
fi
hf=$dir/llama$shape-bf16-hf
if [ ! -f "$hf/config.json" ]; then
  "$bin" synth-model --from "$f16" --hf-dir "$hf.part" --hf-dtype bf16 --max-shard-bytes 1000000000
  rm -rf "$hf" && mv "$hf.part" "$hf"
fi
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
echo "directory $(du -sh "$hf" | cut -f1) bf16; GGUF twin $(du -h "$twin" | cut -f1) $qtype (--pure)"
run() { # label, then bench-model arguments
  local label=$1; shift
  local log=$dir/bench-hf-$shape-$label.log
  /usr/bin/time -v "$bin" bench-model --json --skip-long --threads "${THREADS:-0}" "$@" \
    >"$dir/bench-hf-$shape-$label.json" 2>"$log"
  cat "$dir/bench-hf-$shape-$label.json" >>"$dir/bench-hf-$shape-$label.all.jsonl"
  local rss_kb
  rss_kb=$(sed -n 's/.*Maximum resident set size (kbytes): //p' "$log")
  local load_s
  load_s=$(grep -o 'seconds=[0-9.]*' "$log" | head -1 | cut -d= -f2 || true)
  echo "$label $rss_kb ${load_s:-na}"
}
rm -f "$dir/bench-hf-$shape-dir.all.jsonl" "$dir/bench-hf-$shape-gguf.all.jsonl"
for _ in $(seq "${ROUNDS:-2}"); do
  read -r _ rss_dir load_dir < <(run dir --model "$hf" --quantize "$format")
  read -r _ rss_gguf _ < <(run gguf --model "$twin")
done
python3 - "$dir/bench-hf-$shape-dir.all.jsonl" "$dir/bench-hf-$shape-gguf.all.jsonl" "$rss_dir" "$rss_gguf" "$load_dir" "$hf" <<'PY'
import json, os, sys
def best(path):
    runs = [json.loads(l) for l in open(path) if l.strip()]
    out = dict(runs[0])
    for r in runs[1:]:
        for k, v in r.items():
            if isinstance(v, (int, float)) and "tok_s" in k:
                out[k] = max(out[k], v)
    return out
d, g = best(sys.argv[1]), best(sys.argv[2])
rss_dir, rss_gguf, load_s, hf = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
size = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf) if f.endswith(".safetensors"))
def rows(r, prefix=""):
    out = {}
    for k, v in r.items():
        if isinstance(v, (int, float)) and ("tok_s" in k or k.endswith("_tps")):
            out[prefix + k] = v
        elif isinstance(v, dict):
            out.update(rows(v, prefix + k + "."))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                if isinstance(x, dict):
                    tag = x.get("batch", x.get("prompt", i))
                    out.update(rows(x, f"{prefix}{k}[{tag}]."))
    return out
a, b = rows(d), rows(g)
print(f"{'measure':<40} {'directory':>12} {'GGUF':>12} {'ratio':>7}")
for k in sorted(set(a) & set(b)):
    print(f"{k:<40} {a[k]:>12.1f} {b[k]:>12.1f} {a[k] / b[k]:>7.3f}")
print(f"peak RSS: directory {rss_dir / 1024:.0f} MiB, GGUF {rss_gguf / 1024:.0f} MiB, ratio {rss_dir / rss_gguf:.3f} (bound 1.25)")
if load_s != "na":
    print(f"load with quantize: {float(load_s):.1f} s for {size / 1e9:.2f} GB of bf16 ({size / 1e6 / float(load_s):.0f} MB/s)")
PY

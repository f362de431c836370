#!/usr/bin/env bash
# The engine against llama.cpp on one GGUF file, both in the same run, back to back (run it on a
# quiet machine: the ratio is the figure, the absolute rates move between runs and machines).
#
#   scripts/compare-engine.sh NPU_SERVING_BIN [MODEL.gguf]      (default model: the cached default)
#
# llama.cpp (scripts/llama-cpp-ref.sh's build), then ours, THREADS threads each:
#   llama-bench -m MODEL -p 512 -n 128 -r REPS -t THREADS -o json          -> pp512, tg128
#   llama-batched-bench -m MODEL -c 16384 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 8,32 -t THREADS -fa on
#                                                   -> its best batched decode (max S_TG over 8, 32)
#   NPU_SERVING_BIN bench-model --model MODEL --threads THREADS --skip-long --json
#                                                   -> prefill 512, decode batch 1, decode batch 32
# Ratios ours / llama.cpp: prefill 512 / pp512, batch 1 / tg128, batch 32 / best batched.
# Prints both sides' rates, then one JSON line (the last line) with the rates, the ratios and the
# run's facts (CPU, threads, date, llama.cpp's build, and the commit of this checkout: the
# binary does not carry its own, so build it from a clean checkout and name that commit).
# Env: THREADS (default: nproc), REPS (llama-bench repetitions, default 3), LLAMA_CPP_BIN.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:?usage: scripts/compare-engine.sh NPU_SERVING_BIN [MODEL.gguf]}
[ -x "$bin" ] || { echo "compare-engine.sh: $bin is not an executable" >&2; exit 2; }
m=${2:-$(ls "${NPU_SERVING_CACHE:-$HOME/.cache/npu-serving}"/models/SmolLM2-135M-Instruct*.gguf 2>/dev/null | head -1)}
[ -f "$m" ] || { echo "compare-engine.sh: no model: pass a GGUF path, or run \`npu-serving generate\` once to fetch the default" >&2; exit 2; }
threads=${THREADS:-$(nproc)}
reps=${REPS:-3}
lb=$("$here/llama-cpp-ref.sh")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "compare-engine.sh: $(basename "$m"), $threads threads" >&2
"$lb/llama-bench" -m "$m" -p 512 -n 128 -r "$reps" -t "$threads" -o json >"$tmp/bench.json" 2>"$tmp/bench.err" ||
  { tail -5 "$tmp/bench.err" >&2; echo "compare-engine.sh: llama-bench failed" >&2; exit 1; }
# Flash attention: `-fa on` since llama.cpp took a value for it; a bare `-fa` before (0.3.16).
batched() { "$lb/llama-batched-bench" -m "$m" -c 16384 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 8,32 \
  -t "$threads" "$@" >"$tmp/batched.txt" 2>"$tmp/batched.err"; }
batched -fa on || batched -fa ||
  { tail -5 "$tmp/batched.err" >&2; echo "compare-engine.sh: llama-batched-bench failed" >&2; exit 1; }
"$bin" bench-model --model "$m" --threads "$threads" --skip-long --json >"$tmp/ours.json" 2>"$tmp/ours.err" ||
  { tail -5 "$tmp/ours.err" >&2; echo "compare-engine.sh: bench-model failed" >&2; exit 1; }

cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
commit=$(git -C "$here/.." rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$here/.." diff --quiet HEAD -- 2>/dev/null || commit="$commit (checkout has uncommitted changes)"
python3 - "$tmp" "$m" "$threads" "$cpu" "$commit" <<'PY'
import json, sys, time
tmp, model, threads, cpu, commit = sys.argv[1:]
bench = json.load(open(f"{tmp}/bench.json"))
ref = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in bench}
# llama-batched-bench's table: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
s_tg = []
for line in open(f"{tmp}/batched.txt"):
    cols = [c.strip() for c in line.split("|")]
    if len(cols) >= 10 and cols[1] == "128" and cols[2] == "128":
        s_tg.append(float(cols[8]))
if not s_tg:
    sys.exit("compare-engine.sh: no rows in llama-batched-bench's output")
ours = json.loads(open(f"{tmp}/ours.json").read().strip().splitlines()[-1])
r = {
    "model": model.rsplit("/", 1)[-1],
    "ours_prefill512": round(ours["prefill_tok_s_512"], 1), "llama_pp512": round(ref[(512, 0)], 1),
    "ours_decode_b1": round(ours["decode_tok_s_b1"], 1), "llama_tg128": round(ref[(0, 128)], 1),
    "ours_decode_b32": round(ours["decode_tok_s_b32"], 1), "llama_best_batched": round(max(s_tg), 1),
}
r["prefill_ratio"] = round(r["ours_prefill512"] / r["llama_pp512"], 2)
r["decode_b1_ratio"] = round(r["ours_decode_b1"] / r["llama_tg128"], 2)
r["decode_b32_ratio"] = round(r["ours_decode_b32"] / r["llama_best_batched"], 2)
r.update(threads=int(threads), backend=ours.get("backend"), cpu=cpu,
         date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), checkout=commit,
         llama_cpp=f"{bench[0].get('build_commit', '?')} (build {bench[0].get('build_number', '?')})")
print(f"{'':22}{'ours':>10}{'llama.cpp':>11}{'ratio':>8}", file=sys.stderr)
for name, o, l, q in (("prefill 512", "ours_prefill512", "llama_pp512", "prefill_ratio"),
                      ("decode, batch 1", "ours_decode_b1", "llama_tg128", "decode_b1_ratio"),
                      ("decode, batch 32", "ours_decode_b32", "llama_best_batched", "decode_b32_ratio")):
    print(f"{name:22}{r[o]:>10}{r[l]:>11}{r[q]:>8}", file=sys.stderr)
print(json.dumps(r))
PY

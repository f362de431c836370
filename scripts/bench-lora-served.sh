#!/usr/bin/env bash
# Multi-LoRA through the real server: output tokens/s of STREAMS concurrent streams on the base
# model against the same streams spread over 8 random rank-16 adapters, same server, same run
# (the issue's bar: adapters at least 70% of the base model alone).
#
#   scripts/bench-lora-served.sh [NPU_SERVING_BIN] [STREAMS=32] [ROUNDS=3] [MAX_TOKENS=48]
#
# The adapters are the ones `bench-model --lora-adapters 8` times at the engine level (every
# projection, bf16, written by `bench-model --lora-write-to`). One server (the default config and
# model, with the 8 adapters listed, max_loras 8) serves both phases; a warm-up request on each
# adapter first (the agent reads an adapter when a request first needs it), then the phases
# alternate, base then adapters, ROUNDS times. Each phase is 8 load generators (`npu-serving bench`, OpenAI
# completions, streaming, greedy, ignore_eos, 32-token prompts, MAX_TOKENS tokens) of STREAMS/8
# closed-loop streams each, two requests per stream, started together: in the adapter phase
# generator k names adapter k. Prompts differ between generators and rounds; a round's two
# phases send the same prompts (the prefix cache never shares KV between the base model and an
# adapter). A phase's figure: its output tokens (all generators) over the
# longest generator's duration. Prints each phase, then one JSON line (the last): the best and
# the median of each, and the ratios adapters / base. Logs and results: $LOGS (default a
# temporary folder, printed). Run it on a quiet machine; it takes a few minutes on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
bin=${1:-$root/target/release/npu-serving}
streams=${2:-32}
rounds=${3:-3}
max_tokens=${4:-48}
adapters=8
usage="usage: scripts/bench-lora-served.sh [NPU_SERVING_BIN] [STREAMS] [ROUNDS] [MAX_TOKENS]"
[ -x "$bin" ] || { echo "$usage (no binary at $bin: cargo build --release)" >&2; exit 2; }
[ $((streams % adapters)) -eq 0 ] && [ "$streams" -gt 0 ] \
  || { echo "bench-lora-served.sh: STREAMS must be a multiple of $adapters" >&2; exit 2; }
per=$((streams / adapters))
logs=${LOGS:-$(mktemp -d)}
mkdir -p "$logs"
pid=

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
stop() { [ -z "$pid" ] || { kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true; pid=; }; }
trap stop EXIT

# The adapters, and the default config with them listed (npu_serving is its last section).
"$bin" bench-model --lora-adapters "$adapters" --lora-rank 16 --lora-write-to "$logs/adapters" \
  >"$logs/adapters.txt" 2>"$logs/adapters.log"
cfg_in="$root/configs/smollm2-cpu.yaml"
last=$(awk '/^[a-z_]+:/ { k = $1 } END { print k }' "$cfg_in")
[ "$last" = "npu_serving:" ] \
  || { echo "bench-lora-served.sh: $cfg_in no longer ends with npu_serving" >&2; exit 1; }
cfg="$logs/config.yaml"
{
  cat "$cfg_in"
  echo "    max_loras: $adapters"
  echo "    max_lora_rank: 16"
  echo "    lora_adapters:"
  for a in $(seq 0 $((adapters - 1))); do
    echo "      - {name: ad$a, path: '$logs/adapters/adapter$a'}"
  done
} >"$cfg"
model_name=$(awk -F"'" '/model_name:/ { print $2; exit }' "$cfg_in")

port=$(free_port)
"$bin" serve --config "$cfg" --host 127.0.0.1 --port "$port" >"$logs/server.log" 2>&1 &
pid=$!
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || { echo "bench-lora-served.sh: server exited: $(tail -3 "$logs/server.log")" >&2; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$port/health" >/dev/null \
  || { echo "bench-lora-served.sh: server not ready ($logs/server.log)" >&2; exit 1; }
for name in "$model_name" $(seq -f 'ad%g' 0 $((adapters - 1))); do
  curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$name\", \"prompt\": \"Hi\", \"max_tokens\": 2}" >/dev/null \
    || { echo "bench-lora-served.sh: warm-up on $name failed ($logs/server.log)" >&2; exit 1; }
done
echo "bench-lora-served.sh: $streams streams, $adapters adapters of rank 16, $rounds rounds, $max_tokens tokens a request; logs in $logs" >&2

# One phase: `mode` base or lora, round r; prints "tokens seconds failed".
phase() {
  local mode=$1 r=$2 k name out pids=()
  for k in $(seq 0 $((adapters - 1))); do
    name=$model_name
    [ "$mode" = lora ] && name=ad$k
    out="$logs/r$r-$mode-$k"
    "$bin" bench --api openai --port "$port" --served-model-name "$name" -X 1000 \
      --num-requests $((per * 2)) --max-concurrency "$per" --input-len fixed:32 \
      --output-len fixed:"$max_tokens" --ignore-eos --seed $((r * 100 + k)) \
      --no-progress --no-plots -O "$out" >"$out.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { echo "bench-lora-served.sh: a load generator failed ($logs/r$r-$mode-*.log)" >&2; exit 1; }; done
  python3 - "$logs" "r$r-$mode" <<'PY'
import glob, json, sys
tokens = seconds = failed = 0
for path in glob.glob(f"{sys.argv[1]}/{sys.argv[2]}-*/summary_*.json"):
    s = json.load(open(path))
    tokens += s["total_output_tokens"]
    seconds = max(seconds, s["duration_s"])
    failed += s["failed"]
print(tokens, seconds, failed)
PY
}

base=() lora=()
for r in $(seq 1 "$rounds"); do
  for mode in base lora; do
    read -r tokens seconds failed < <(phase "$mode" "$r")
    rate=$(python3 -c "print(round($tokens / $seconds, 1))")
    echo "round $r $mode: $tokens output tokens in $seconds s: $rate tok/s ($failed failed)"
    [ "$failed" -eq 0 ] || { echo "bench-lora-served.sh: $failed requests failed ($logs)" >&2; exit 1; }
    if [ "$mode" = base ]; then base+=("$rate"); else lora+=("$rate"); fi
  done
done
stop
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$root" diff --quiet HEAD -- 2>/dev/null || commit="$commit (checkout has uncommitted changes)"
python3 - "${base[*]}" "${lora[*]}" "$streams" "$max_tokens" "$commit" <<'PY'
import json, statistics, sys
b = [float(x) for x in sys.argv[1].split()]
l = [float(x) for x in sys.argv[2].split()]
print(json.dumps({
    "streams": int(sys.argv[3]), "adapters": 8, "rank": 16, "max_tokens": int(sys.argv[4]),
    "base_tok_s": b, "lora_tok_s": l,
    "best_ratio": round(max(l) / max(b), 3),
    "median_ratio": round(statistics.median(l) / statistics.median(b), 3),
    "per_round_ratio": [round(y / x, 3) for x, y in zip(b, l)],
    "commit": sys.argv[5]}))
PY

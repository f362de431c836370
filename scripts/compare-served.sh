#!/usr/bin/env bash
# Served comparison: the same closed-loop load against llama-server and against our server, one
# after the other on the same model file (run it on a quiet machine).
#
#   scripts/compare-served.sh NPU_SERVING_BIN CONFIG.yaml [CONCURRENCY=32] [REQUESTS=64] [MODEL.gguf]
#
# The load (scripts/served-load.py): REQUESTS streaming /v1/completions at CONCURRENCY at a time,
# distinct prompts of about 100-300 tokens, 128 greedy tokens each with ignore_eos.
# llama-server runs at its best setting here: one slot per stream (-np CONCURRENCY, 1024 tokens of
# context each), flash attention, THREADS threads; ours is `NPU_SERVING_BIN serve --config CONFIG
# --model MODEL` (threads from the config). Model: default the cached default model.
# Prints both summaries, then one JSON line (the last) with the output tokens/s ratio ours /
# llama-server, both TTFT p50/p99 and how many requests each served. Servers' logs: $LOGS
# (default a temporary folder, printed).
# Env: THREADS (llama-server's, default nproc), LLAMA_CPP_BIN, LOGS.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
usage="usage: scripts/compare-served.sh NPU_SERVING_BIN CONFIG.yaml [CONCURRENCY] [REQUESTS] [MODEL.gguf]"
bin=${1:?$usage}
cfg=${2:?$usage}
conc=${3:-32}
n=${4:-64}
m=${5:-$(ls "${NPU_SERVING_CACHE:-$HOME/.cache/npu-serving}"/models/SmolLM2-135M-Instruct*.gguf 2>/dev/null | head -1)}
[ -x "$bin" ] && [ -f "$cfg" ] || { echo "$usage" >&2; exit 2; }
[ -f "$m" ] || { echo "compare-served.sh: no model: pass a GGUF path, or run \`npu-serving generate\` once" >&2; exit 2; }
threads=${THREADS:-$(nproc)}
lb=$("$here/llama-cpp-ref.sh")
logs=${LOGS:-$(mktemp -d)}
mkdir -p "$logs"
pid=

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
stop() { [ -z "$pid" ] || { kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true; pid=; }; }
trap stop EXIT
wait_ready() { # port log
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || { echo "compare-served.sh: server exited: $(tail -3 "$2")" >&2; return 1; }
    sleep 1
  done
  echo "compare-served.sh: server not ready after 300 s ($2)" >&2
  return 1
}

echo "compare-served.sh: $(basename "$m"), $conc streams, $n requests; logs in $logs" >&2
port=$(free_port)
llama_server() {
  "$lb/llama-server" -m "$m" -t "$threads" -c $((conc * 1024)) -np "$conc" "$@" \
    --host 127.0.0.1 --port "$port" >"$logs/llama-server.log" 2>&1 &
  pid=$!
}
# Flash attention: `-fa on` since llama.cpp took a value for it; a bare `-fa` before (0.3.16).
llama_server -fa on
if ! wait_ready "$port" "$logs/llama-server.log" 2>/dev/null; then
  stop
  llama_server -fa
  wait_ready "$port" "$logs/llama-server.log"
fi
theirs=$(python3 "$here/served-load.py" --port "$port" --concurrency "$conc" --requests "$n" --tag L)
stop

port=$(free_port)
"$bin" serve --config "$cfg" --model "$m" --host 127.0.0.1 --port "$port" >"$logs/ours.log" 2>&1 &
pid=$!
wait_ready "$port" "$logs/ours.log"
ours=$(python3 "$here/served-load.py" --port "$port" --concurrency "$conc" --requests "$n" --tag O)
stop

echo "llama-server: $theirs"
echo "ours:         $ours"
commit=$(git -C "$here/.." rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$here/.." diff --quiet HEAD -- 2>/dev/null || commit="$commit (checkout has uncommitted changes)"
python3 - "$theirs" "$ours" "$(basename "$m")" "$commit" <<'PY'
import json, sys, time
t, o = json.loads(sys.argv[1]), json.loads(sys.argv[2])
r = {"model": sys.argv[3], "concurrency": o["concurrency"], "requests": o["requests"],
     "output_tok_s_ours": o.get("output_tok_s"), "output_tok_s_llama": t.get("output_tok_s"),
     "output_tok_s_ratio": round(o["output_tok_s"] / t["output_tok_s"], 2)
         if o.get("output_tok_s") and t.get("output_tok_s") else None,
     "ttft_p50_ours": o.get("ttft_p50"), "ttft_p50_llama": t.get("ttft_p50"),
     "ttft_p99_ours": o.get("ttft_p99"), "ttft_p99_llama": t.get("ttft_p99"),
     "ok_ours": o["ok"], "ok_llama": t["ok"],
     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "checkout": sys.argv[4]}
print(json.dumps(r))
PY

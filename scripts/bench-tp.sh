#!/usr/bin/env bash
# Tensor parallelism against its alternatives on this machine, with the bundled load generator:
#   tp1: one agent, two threads (npu_serving.tensor_parallel_size 1)
#   tp2: two agents, one thread each, as the two ranks of one model (tensor_parallel_size 2)
#   dp2: two agents, one thread each, two copies of the model (least-loaded routing)
# Each config serves the same closed-loop load (`npu-serving bench`: --num-requests requests of
# --input-len prompt tokens and --output-len greedy tokens, at most --max-concurrency at once);
# the configs take turns for ROUNDS rounds so that each meets the machine at several moments.
# Prints one line per run (output tok/s, TPOT median) and, for tp2, each rank's time in
# collectives (all-reduces and the logit gather) as a share of its forwards, and of that the
# time spent waiting at the barriers for the other rank (from the agents' exit log lines).
#
# Usage: scripts/bench-tp.sh [model.gguf]   (env: ROUNDS=3 REQUESTS=64 CONC=32 IN=128 OUT=128)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/npu-serving}
MODEL=${1:-}
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-64}
CONC=${CONC:-32}
IN=${IN:-128}
OUT=${OUT:-128}
DIR=$(mktemp -d /tmp/npu-bench-tp.XXXXXX)
trap 'rm -rf "$DIR"' EXIT

config() { # name agents tp threads
  cat >"$DIR/$1.yaml" <<EOF
model_config:
  model_name: 'SmolLM2-135M-Instruct'
  seq_length: 1024
  decode_batch_size: 32
  prefill_batch_size: 16
serving_config:
  agent_ports: [$(seq -s, 1 "$2" | sed 's/[0-9]\+/0/g')]
pa_config:
  num_blocks: 1024
  block_size: 16
npu_serving:
  threads_per_agent: $4
  tensor_parallel_size: $3
  max_tokens_per_step: 256
EOF
  if [ -n "$MODEL" ]; then echo "  model_file: '$MODEL'" >>"$DIR/$1.yaml"; fi
}
config tp1 1 1 2
config tp2 2 2 1
config dp2 2 1 1

run() { # name round
  local log="$DIR/$1-$2.log" port
  "$BIN" serve --config "$DIR/$1.yaml" --port 0 >"$DIR/$1.out" 2>"$log" &
  local pid=$!
  for _ in $(seq 600); do
    port=$(sed -n 's/^listening on .*:\([0-9]*\)$/\1/p' "$DIR/$1.out" 2>/dev/null || true)
    [ -n "$port" ] && break
    sleep 0.1
  done
  "$BIN" bench -P "$port" --num-requests "$REQUESTS" --max-concurrency "$CONC" -X 1000 \
    --input-len "$IN" --output-len "$OUT" --ignore-eos --no-plots --no-progress \
    -O "$DIR/out-$1-$2" >"$DIR/bench-$1-$2.txt" 2>&1
  kill -INT "$pid"
  wait "$pid" || true
  local tput tpot
  tput=$(awk '/Output throughput/ {print $4}' "$DIR/bench-$1-$2.txt")
  tpot=$(awk '/^TPOT/ {print $3}' "$DIR/bench-$1-$2.txt")
  printf '%s round %s: output %s tok/s, TPOT median %s ms, load average %s\n' \
    "$1" "$2" "$tput" "$tpot" "$(cut -d' ' -f1 /proc/loadavg)"
  if [ "$1" = tp2 ]; then
    grep -h 'time in collectives' "$log" | sed 's/.*rank=\([0-9]\).*collective_share=\([0-9.]*\).*/  rank \1: collectives \2 of its forward time/'
    grep -h 'waiting at the group' "$log" | sed 's/.*rank=\([0-9]\) rounds=\([0-9]*\) waited_s=\([0-9.]*\).*/  rank \1: \2 collective rounds, \3 s of them waiting for the other rank/'
    grep -h 'time in collectives' "$log" | sed 's/.*rank=\([0-9]\).*forward_s=\([0-9.]*\).*collective_s=\([0-9.]*\).*/  rank \1: forwards \2 s, collectives \3 s/'
  fi
}

echo "model: ${MODEL:-the default model}; $REQUESTS requests, $IN prompt + $OUT output tokens, $CONC at once"
for r in $(seq "$ROUNDS"); do
  for c in tp1 tp2 dp2; do run "$c" "$r"; done
done

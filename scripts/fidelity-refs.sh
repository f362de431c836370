#!/usr/bin/env bash
# llama.cpp references for the fidelity sweep (npu_gguf::synth::sweep): for every model of the
# grid (or the ones named), `npu-serving synth-model --variant` writes the tiny random-weight GGUF,
# llama-server runs greedy decoding with its top-2 log-probabilities on three prompts (one longer
# than gemma3's sliding window), and agent/tests/data/fidelity_sweep.jsonl gets a line per
# (model, prompt): the prompt ids, llama.cpp's tokens, its top-1/top-2 logit gap at each step, and
# the file's sha256 so agent/tests/fidelity_sweep.rs can regenerate the identical model.
#   scripts/fidelity-refs.sh [VARIANT...]     (default: every variant; named ones replace theirs)
# llama.cpp runs with flash attention off: its CPU flash-attention kernel accumulates V in an f16
# register as it goes (VKQ16 in ggml-cpu's ops.cpp), which moves logits by up to ~0.3 at large
# attention scores; with it off the softmax is computed whole and V multiplied in f32 sums, which
# is what the engine computes. The script also counts where llama.cpp with flash attention on
# disagrees with itself off at decided steps (printed, not recorded).
# The Q8_0 models are checked to hold exactly the bytes llama-quantize makes of the same values;
# the Q4_K ones are the generator's own min/max fit (a valid Q4_K file that both engines run).
# Env: LLAMA_CPP_BIN (a llama.cpp build's bin dir; default: scripts/llama-cpp-ref.sh builds one),
#      DONOR (tokenizer donor GGUF; default: the default model), PORT (default 18941),
#      THREADS (default nproc), OUT (default agent/tests/data/fidelity_sweep.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-agent/tests/data/fidelity_sweep.jsonl}

if [ -z "${LLAMA_CPP_BIN:-}" ]; then
    [ -x scripts/llama-cpp-ref.sh ] || { echo "set LLAMA_CPP_BIN to a llama.cpp bin dir" >&2; exit 1; }
    LLAMA_CPP_BIN=$(scripts/llama-cpp-ref.sh)
fi
bin=$LLAMA_CPP_BIN
[ -x "$bin/llama-server" ] || { echo "no llama-server in $bin" >&2; exit 1; }
cargo build --release --bin npu-serving >&2
npu=$root/target/release/npu-serving
donor_args=()
[ -n "${DONOR:-}" ] && donor_args=(--tokenizer-from "$DONOR")
port=${PORT:-18941}
threads=${THREADS:-$(nproc)}
version=$("$bin/llama-server" --version 2>&1 | grep -m1 '^version' || echo unknown)

variants=("$@")
[ ${#variants[@]} -gt 0 ] || mapfile -t variants < <("$npu" synth-model --list-variants)

tmp=$(mktemp -d)
server=
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

start_server() { # model fa
  "$bin/llama-server" -m "$1" --host 127.0.0.1 --port "$port" -c 1024 -np 1 -t "$threads" \
      --no-warmup -fa "$2" >"$tmp/server.log" 2>&1 &
  server=$!
  for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
    kill -0 "$server" 2>/dev/null || { cat "$tmp/server.log" >&2; exit 1; }
    sleep 0.25
  done
  echo "llama-server did not start" >&2; exit 1
}
stop_server() { kill "$server"; wait "$server" 2>/dev/null || true; server=; }

: >"$tmp/new.jsonl"
for v in "${variants[@]}"; do
  model=$tmp/$v.gguf
  sha=$("$npu" synth-model --variant "$v" "${donor_args[@]}" "$model" | cut -d' ' -f1)
  if [[ $v == *_q8_0 ]]; then
    # The generator's Q8_0 is llama-quantize's: the same values in f32, quantized by it, give
    # the same tensor bytes (checked with gguf-py from the llama.cpp sources beside the build).
    "$npu" synth-model --variant "$v" --type f32 "${donor_args[@]}" "$tmp/f32.gguf" >/dev/null
    "$bin/llama-quantize" --pure "$tmp/f32.gguf" "$tmp/lq.gguf" Q8_0 >/dev/null 2>&1
    PYTHONPATH="$bin/../../gguf-py" python3 - "$model" "$tmp/lq.gguf" <<'PY'
import sys
import gguf
import numpy as np
a, b = ({t.name: t for t in gguf.GGUFReader(p).tensors} for p in sys.argv[1:3])
bad = [n for n in a if a[n].tensor_type != b[n].tensor_type
       or not np.array_equal(np.asarray(a[n].data).view(np.uint8),
                             np.asarray(b[n].data).view(np.uint8))]
assert not bad, f"{sys.argv[1]}: tensors differ from llama-quantize's Q8_0: {bad}"
PY
    rm -f "$tmp/f32.gguf" "$tmp/lq.gguf"
  fi
  for fa in off on; do
    start_server "$model" "$fa"
    VARIANT=$v SHA=$sha VERSION="$version" PORT=$port FA=$fa \
      python3 scripts/fidelity_refs_run.py >"$tmp/$v.$fa.jsonl"
    stop_server
  done
  cat "$tmp/$v.off.jsonl" >>"$tmp/new.jsonl"
  python3 - "$tmp/$v.off.jsonl" "$tmp/$v.on.jsonl" <<'PY' >&2
import json, sys
off = [json.loads(l) for l in open(sys.argv[1])]
on = [json.loads(l) for l in open(sys.argv[2])]
decided = sum(g >= 0.15 for r in off for g in r["top1_top2_logit_gap"])
same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(off, on))
print(f'{off[0]["variant"]}: {decided} decided steps of {sum(len(r["output_ids"]) for r in off)};'
      f' flash attention on gives the same tokens on {same}/{len(off)} prompts')
PY
done

# Keep the lines of the variants not rerun, in the sweep's order.
python3 - "$out" "$tmp/new.jsonl" "${variants[@]}" <<'PY'
import json, os, sys
out, new, rerun = sys.argv[1], sys.argv[2], set(sys.argv[3:])
old = [json.loads(l) for l in open(out)] if os.path.exists(out) else []
lines = [r for r in old if r["variant"] not in rerun] + [json.loads(l) for l in open(new)]
with open(out, "w") as f:
    for r in lines:
        f.write(json.dumps(r, separators=(",", ":")) + "\n")
print(f"{out}: {len(lines)} lines", file=sys.stderr)
PY

#!/usr/bin/env bash
# llama.cpp's own 8-bit KV cache (`-ctk q8_0 -ctv q8_0`, one f16 scale per 32 values) measured the
# way agent/tests/fidelity_sweep.rs measures our int8 cache: every fidelity-sweep model but the
# latent-attention ones, teacher-forced on the references' tokens (agent/tests/data/
# fidelity_sweep.jsonl, made with llama.cpp's f16 cache), counting at how many decided steps
# (reference gap >= 0.15) the top-1 is the reference's token. The same count is made with the f16
# cache under flash attention (which q8_0 V requires), so what the 8-bit cache costs is the
# difference between the two columns.
#   scripts/int8-kv-llama-cpp.sh [VARIANT...]   (default: every variant)
# Env: LLAMA_CPP_BIN, NPU_SERVING_BIN (a built npu-serving; default: cargo builds one), DONOR, PORT (default 18951), THREADS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
refs=agent/tests/data/fidelity_sweep.jsonl
if [ -z "${LLAMA_CPP_BIN:-}" ]; then LLAMA_CPP_BIN=$(scripts/llama-cpp-ref.sh); fi
bin=$LLAMA_CPP_BIN
if [ -z "${NPU_SERVING_BIN:-}" ]; then cargo build --release --bin npu-serving >&2; fi
npu=${NPU_SERVING_BIN:-$PWD/target/release/npu-serving}
donor_args=()
[ -n "${DONOR:-}" ] && donor_args=(--tokenizer-from "$DONOR")
port=${PORT:-18951}
threads=${THREADS:-$(nproc)}
variants=("$@")
[ ${#variants[@]} -gt 0 ] || mapfile -t variants < <("$npu" synth-model --list-variants | grep -v '^deepseek2')
tmp=$(mktemp -d)
server=
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
start_server() { # model cache-type
  "$bin/llama-server" -m "$1" --host 127.0.0.1 --port "$port" -c 1024 -np 1 -t "$threads" \
      --no-warmup -fa on -ctk "$2" -ctv "$2" >"$tmp/server.log" 2>&1 &
  server=$!
  for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
    kill -0 "$server" 2>/dev/null || { cat "$tmp/server.log" >&2; exit 1; }
    sleep 0.25
  done
  echo "llama-server did not start" >&2; exit 1
}
stop_server() { kill "$server"; wait "$server" 2>/dev/null || true; server=; }
for v in "${variants[@]}"; do
  model=$tmp/$v.gguf
  "$npu" synth-model --variant "$v" "${donor_args[@]}" "$model" >/dev/null
  for ct in f16 q8_0; do
    start_server "$model" "$ct"
    VARIANT=$v CACHE=$ct PORT=$port REFS=$refs python3 - <<'PY' >>"$tmp/counts.jsonl"
import json, os, requests
url = f"http://127.0.0.1:{os.environ['PORT']}"
decided = same = 0
for line in open(os.environ["REFS"]):
    r = json.loads(line)
    if r["variant"] != os.environ["VARIANT"]:
        continue
    for s, (tok, gap) in enumerate(zip(r["output_ids"], r["top1_top2_logit_gap"])):
        if gap < 0.15:
            continue
        out = requests.post(f"{url}/completion", json={
            "prompt": r["prompt_ids"] + r["output_ids"][:s], "n_predict": 1, "temperature": 0,
            "n_probs": 1, "cache_prompt": True, "return_tokens": True, "ignore_eos": True}).json()
        decided += 1
        same += int(out["completion_probabilities"][0]["top_logprobs"][0]["id"] == tok)
print(json.dumps({"variant": os.environ["VARIANT"], "cache": os.environ["CACHE"],
                  "decided": decided, "same": same}))
PY
    stop_server
  done
  tail -n 2 "$tmp/counts.jsonl" >&2
done
python3 - "$tmp/counts.jsonl" <<'PY'
import collections, json, sys
t = collections.defaultdict(lambda: [0, 0, 0])  # (family, cache) -> decided, same
rows = [json.loads(l) for l in open(sys.argv[1])]
fam = lambda v: v.split("_")[0]
for r in rows:
    k = (fam(r["variant"]), r["cache"])
    t[k][0] += r["decided"]; t[k][1] += r["same"]
print("family     f16 cache (fa on)        q8_0 cache")
for f in sorted({k[0] for k in t}):
    a, b = t[(f, "f16")], t[(f, "q8_0")]
    print(f"{f:<10} {a[1]}/{a[0]} ({100*a[1]/max(a[0],1):.1f}%)   {b[1]}/{b[0]} ({100*b[1]/max(b[0],1):.1f}%)")
for c in ("f16", "q8_0"):
    d = sum(v[0] for k, v in t.items() if k[1] == c); s = sum(v[1] for k, v in t.items() if k[1] == c)
    print(f"all {c}: {s}/{d} ({100*s/max(d,1):.2f}%)")
PY

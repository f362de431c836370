#!/usr/bin/env bash
# llama.cpp greedy references for the model families whose real weights cannot be fetched here:
# for each family, `npu-serving synth-model` writes a tiny random-weight GGUF (llama.cpp's
# conventions, the default model's tokenizer), llama-server runs greedy decoding on a few prompts
# (one longer than gemma3's sliding window), and agent/tests/data/family_<family>.jsonl records
# what it did, with the synth parameters and the file's sha256 so agent/tests/family_refs.rs can
# regenerate the identical model and compare the engine with it.
#   scripts/family-refs.sh [FAMILY...]      (default: every family)
# Env: LLAMA_CPP_BIN (a llama.cpp build's bin dir with llama-server; default: the one
#      scripts/llama-cpp-ref.sh builds),
#      DONOR (tokenizer donor GGUF; default: the default model, fetched when absent),
#      PORT (llama-server port, default 18931), THREADS (default: nproc),
#      SEED_OVERRIDE (one seed for every family named, to try seeds), OUT_DIR (default
#      agent/tests/data).
# mistral is not among the families: llama.cpp has no "mistral" architecture (Mistral 7B converts
# to "llama"), so it has no reference to give.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# The seed of each family: chosen so that most greedy steps are clearly decided (the first
# top-1/top-2 gap below 0.15 comes late) in llama.cpp.
declare -A SEED=([llama]=2 [llama3]=3 [qwen2]=1 [qwen3]=2 [qwen3moe]=1 [gemma3]=3 [deepseek2]=3)
TYPE=f32
families=("$@")
[ ${#families[@]} -gt 0 ] || families=(llama llama3 qwen2 qwen3 qwen3moe gemma3 deepseek2)

bin=${LLAMA_CPP_BIN:-$(scripts/llama-cpp-ref.sh)}
[ -x "$bin/llama-server" ] || { echo "no llama-server in $bin" >&2; exit 1; }
cargo build --release --bin npu-serving >&2
npu=$root/target/release/npu-serving
donor_args=()
[ -n "${DONOR:-}" ] && donor_args=(--tokenizer-from "$DONOR")
donor_name=$(basename "${DONOR:-SmolLM2-135M-Instruct.Q4_1.gguf}")
port=${PORT:-18931}
threads=${THREADS:-$(nproc)}
version=$("$bin/llama-server" --version 2>&1 | grep -m1 '^version' || echo unknown)

tmp=$(mktemp -d)
server=
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

for fam in "${families[@]}"; do
  seed=${SEED_OVERRIDE:-${SEED[$fam]:?"unknown family $fam"}}
  model=$tmp/$fam.gguf
  sha=$("$npu" synth-model --arch "$fam" --seed "$seed" --type "$TYPE" "${donor_args[@]}" "$model" | cut -d' ' -f1)
  "$bin/llama-server" -m "$model" --host 127.0.0.1 --port "$port" -c 1024 -np 1 -t "$threads" \
      --no-warmup >"$tmp/server-$fam.log" 2>&1 &
  server=$!
  for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 "$server" 2>/dev/null || { cat "$tmp/server-$fam.log" >&2; exit 1; }
    sleep 0.5
  done
  out=${OUT_DIR:-agent/tests/data}/family_$fam.jsonl
  FAM=$fam SEED_=$seed TYPE=$TYPE SHA=$sha DONOR_NAME=$donor_name VERSION="$version" \
    PORT=$port python3 - >"$out" <<'EOF'
import json, os, requests

url = f"http://127.0.0.1:{os.environ['PORT']}"
prompts = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who repaired every clock in the valley. One winter morning a stranger arrived "
    "with a broken pocket watch and a strange request:",
]
N = 32
for prompt in prompts:
    ids = requests.post(f"{url}/tokenize", json={"content": prompt, "add_special": True,
                                                  "parse_special": True}).json()["tokens"]
    r = requests.post(f"{url}/completion", json={
        "prompt": ids, "n_predict": N, "temperature": 0, "n_probs": 2, "ignore_eos": True,
        "cache_prompt": False, "stream": False, "return_tokens": True}).json()
    out_ids = r["tokens"]
    assert len(out_ids) == N, f"{prompt!r}: {len(out_ids)} tokens"
    # llama-server gives no probabilities for a token that ends inside a UTF-8 character (the
    # synthetic models make those unlikely): such a step has no known gap and counts as a tie.
    steps = iter(r["completion_probabilities"])
    s = next(steps, None)
    gaps, second = [], []
    for t in out_ids:
        if s is None or s["id"] != t:
            gaps.append(0.0); second.append(None)
            continue
        top = s["top_logprobs"]
        second.append(top[1]["id"])
        # ignore_eos bans end-of-generation tokens after the logits are read: where one of them
        # was the raw top-1, the pick is not the top-1, so the step counts as a tie too.
        gaps.append(round(top[0]["logprob"] - top[1]["logprob"], 5) if top[0]["id"] == t
                    else 0.0)
        s = next(steps, None)
    assert s is None, f"{prompt!r}: probabilities of tokens not generated"
    tie = next((i for i, g in enumerate(gaps) if g < 0.15), None)
    print(json.dumps({
        "prompt": prompt, "prompt_ids": ids, "output_ids": out_ids, "output_text": r["content"],
        "top1_top2_logit_gap": gaps, "second_best_ids": second,
        "first_near_tie": tie, "first_step_gap_below_0.15": tie,
        "tool": "llama-server /completion temperature 0, n_probs 2 (full-softmax logprobs), "
                "ignore_eos, prompt as /tokenize ids (add_special)",
        "commit": os.environ["VERSION"],
        "arch": os.environ["FAM"], "seed": int(os.environ["SEED_"]),
        "weight_type": os.environ["TYPE"], "donor": os.environ["DONOR_NAME"],
        "model_sha256": os.environ["SHA"],
    }))
EOF
  kill "$server"; wait "$server" 2>/dev/null || true; server=
  python3 -c "
import json,sys
for l in open('$out'):
    r=json.loads(l); g=r['top1_top2_logit_gap']
    print('$fam', len(r['prompt_ids']), 'prompt tokens; first near-tie', r['first_near_tie'],
          '; steps below 0.15:', sum(x<0.15 for x in g), '; min gap %.3f' % min(g))
" >&2
done

#!/usr/bin/env bash
# llama.cpp references for the Hugging Face twins of the fidelity sweep's float models: for every
# F32/F16 variant (or the ones named) `npu-serving synth-model --variant V --hf-dir DIR` writes
# the sweep GGUF and its twin (config.json, safetensors, tokenizer files; f32 weights), llama.cpp's
# convert_hf_to_gguf.py converts the twin back (--outtype f32 or f16, the variant's own type),
# scripts/hf_refs_check.py compares the converted file's tensors with the sweep GGUF's (type,
# dims, bytes; the metadata keys that differ), and llama-server records greedy decoding on the
# converted file exactly as scripts/fidelity-refs.sh does (scripts/fidelity_refs_run.py, flash
# attention off). agent/tests/data/hf_sweep.jsonl gets a line per (variant, prompt): the
# fidelity-sweep fields plus "twin" (how it was converted and what the comparison found).
# Variants whose twin cannot be written (Llama 3 with arbitrary rotary factors: config.json has no
# form for them) are listed as skipped, with the reason.
#   scripts/hf-refs.sh [VARIANT...]     (default: every F32/F16 variant; named ones replace theirs)
# The converter needs torch, transformers, sentencepiece, safetensors and numpy: they are
# installed from PyPI into a virtual environment (HF_REFS_VENV, default
# ~/.cache/npu-serving/hf-refs-venv) the first time. Plain `pip install torch` brings the CUDA
# build with its nvidia-* wheels (about 3 GB); it runs on the CPU all the same.
# Env: LLAMA_CPP_BIN (a llama.cpp build's bin dir; default: scripts/llama-cpp-ref.sh builds one;
#      its sources, with convert_hf_to_gguf.py and gguf-py, are two levels up), DONOR, PORT
#      (default 18943), THREADS, HF_REFS_VENV, OUT (default agent/tests/data/hf_sweep.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-agent/tests/data/hf_sweep.jsonl}

if [ -z "${LLAMA_CPP_BIN:-}" ]; then
    [ -x scripts/llama-cpp-ref.sh ] || { echo "set LLAMA_CPP_BIN to a llama.cpp bin dir" >&2; exit 1; }
    LLAMA_CPP_BIN=$(scripts/llama-cpp-ref.sh)
fi
bin=$(cd "$LLAMA_CPP_BIN" && pwd)
src=$(cd "$bin/../.." && pwd)
[ -x "$bin/llama-server" ] || { echo "no llama-server in $bin" >&2; exit 1; }
[ -f "$src/convert_hf_to_gguf.py" ] || { echo "no convert_hf_to_gguf.py in $src" >&2; exit 1; }

venv=${HF_REFS_VENV:-$HOME/.cache/npu-serving/hf-refs-venv}
py=$venv/bin/python
if ! "$py" -c 'import torch, transformers, sentencepiece, safetensors, numpy, requests' 2>/dev/null; then
    echo "installing the converter's packages into $venv" >&2
    python3 -m venv "$venv"
    # transformers as llama.cpp's requirements-convert_legacy_llama.txt pins it.
    "$venv/bin/pip" install -q torch "transformers==4.57.6" sentencepiece safetensors \
        "numpy~=2.2.6" "protobuf>=4.21.0,<5.0.0" requests >&2
fi
export PYTHONPATH="$src/gguf-py${PYTHONPATH:+:$PYTHONPATH}"

cargo build --release --bin npu-serving >&2
npu=$root/target/release/npu-serving
donor_args=()
[ -n "${DONOR:-}" ] && donor_args=(--tokenizer-from "$DONOR")
port=${PORT:-18943}
threads=${THREADS:-$(nproc)}
version=$("$bin/llama-server" --version 2>&1 | grep -m1 '^version' || echo unknown)

variants=("$@")
[ ${#variants[@]} -gt 0 ] || mapfile -t variants < <("$npu" synth-model --list-variants | grep -E '_(f32|f16)$')

tmp=$(mktemp -d)
server=
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

start_server() { # model
  "$bin/llama-server" -m "$1" --host 127.0.0.1 --port "$port" -c 1024 -np 1 -t "$threads" \
      --no-warmup -fa off >"$tmp/server.log" 2>&1 &
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
  case $v in
    *_f32) outtype=f32 ;;
    *_f16) outtype=f16 ;;
    *) echo "$v: not a float variant (its twin would be its dequantized values), skipped" >&2; continue ;;
  esac
  model=$tmp/$v.gguf
  twin=$tmp/$v.hf
  if ! "$npu" synth-model --variant "$v" "${donor_args[@]}" --hf-dir "$twin" "$model" \
      >"$tmp/synth.out" 2>"$tmp/synth.err"; then
    echo "$v: skipped, no twin: $(tail -1 "$tmp/synth.err")" >&2
    continue
  fi
  sha=$(head -1 "$tmp/synth.out" | cut -d' ' -f1)
  conv=$tmp/$v.converted.gguf
  "$py" "$src/convert_hf_to_gguf.py" "$twin" --outtype "$outtype" --outfile "$conv" \
      >"$tmp/convert.log" 2>&1 || { cat "$tmp/convert.log" >&2; exit 1; }
  conv_sha=$(sha256sum "$conv" | cut -d' ' -f1)
  "$py" scripts/hf_refs_check.py "$model" "$conv" >"$tmp/check.json" \
      || { echo "$v: the converted tensors differ unexpectedly: $(cat "$tmp/check.json")" >&2; exit 1; }
  start_server "$conv"
  VARIANT=$v SHA=$sha VERSION="$version" PORT=$port FA=off \
    "$py" scripts/fidelity_refs_run.py >"$tmp/$v.jsonl"
  stop_server
  TWIN_OUTTYPE=$outtype CONV_SHA=$conv_sha "$py" - "$tmp/$v.jsonl" "$tmp/check.json" \
      "$root/agent/tests/data/fidelity_sweep.jsonl" >>"$tmp/new.jsonl" <<'PY'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
check = json.load(open(sys.argv[2]))
gguf_refs = {}
if os.path.exists(sys.argv[3]):
    for l in open(sys.argv[3]):
        r = json.loads(l)
        gguf_refs[(r["variant"], r["prompt"])] = r["output_ids"]
same = 0
for r in rows:
    ref = gguf_refs.get((r["variant"], r["prompt"]))
    same += ref == r["output_ids"]
    r["tool"] += "; on the GGUF convert_hf_to_gguf.py made of the twin"
    r["twin"] = {
        "written_by": "npu-serving synth-model --variant V --hf-dir DIR (f32 weights)",
        "converted_with": f"convert_hf_to_gguf.py --outtype {os.environ['TWIN_OUTTYPE']}",
        "converted_gguf_sha256": os.environ["CONV_SHA"],
        "tokenizer_pre": check["tokenizer_pre"],
        "tensors": check["tensors"],
        "tensors_equal_to_sweep_gguf": check["tensors_equal"],
        "tensors_differing": check["tensors_differing"],
        "tensor_data_sha256_sweep": check["tensor_data_sha256_original"],
        "tensor_data_sha256_converted": check["tensor_data_sha256_converted"],
        "metadata_only_in_converted": check["metadata_only_in_converted"],
        "metadata_only_in_sweep": check["metadata_only_in_original"],
        "metadata_changed": check["metadata_changed"],
        "same_tokens_as_fidelity_sweep_jsonl": ref == r["output_ids"] if ref else None,
    }
    print(json.dumps(r, separators=(",", ":")))
print(f'{rows[0]["variant"]}: {check["tensors_equal"]}/{check["tensors"]} tensors equal to the '
      f'sweep GGUF ({", ".join(check["tensors_differing"]) or "none differ"}); pre '
      f'{check["tokenizer_pre"]}; same tokens as fidelity_sweep.jsonl on {same}/{len(rows)} '
      'prompts', file=sys.stderr)
PY
  rm -rf "$twin" "$model" "$conv"
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

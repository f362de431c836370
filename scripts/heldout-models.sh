#!/usr/bin/env bash
# Held-out check of the mixture-of-experts families against llama.cpp with models the project's
# generator did not make: transformers' own Qwen3-MoE, DeepSeek-V3 and DeepSeek-V2 classes build
# random models (scripts/heldout_models.py), llama.cpp's convert_hf_to_gguf.py converts them
# (f32), llama-quantize makes F16, Q8_0 and Q4_K_M, llama-server records greedy references
# (flash attention off, scripts/fidelity_refs_run.py), and `npu-serving score` on each device
# named is compared at the decided steps (scripts/heldout_compare.py). The Hugging Face
# directories themselves are loaded by `npu-serving generate` and compared with transformers' own
# greedy decoding of them (scripts/heldout_hf_dirs.py).
#   scripts/heldout-models.sh [DEVICE...]     (default: cpu; cuda and ascend need a binary built
#                                              with those features, run on their emulations here)
# The converter's packages come from the virtual environment scripts/hf-refs.sh makes
# (HF_REFS_VENV). Env: LLAMA_CPP_BIN, NPU_SERVING_BIN (default: cargo builds one with the device
# features the devices named need), HELDOUT_DIR (default ~/.cache/npu-serving/heldout), PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
devices=("$@")
[ ${#devices[@]} -gt 0 ] || devices=(cpu)
[ -n "${LLAMA_CPP_BIN:-}" ] || LLAMA_CPP_BIN=$(scripts/llama-cpp-ref.sh)
bin=$(cd "$LLAMA_CPP_BIN" && pwd)
src=$(cd "$bin/../.." && pwd)
venv=${HF_REFS_VENV:-$HOME/.cache/npu-serving/hf-refs-venv}
py=$venv/bin/python
if ! "$py" -c 'import torch, transformers, safetensors, numpy, requests' 2>/dev/null; then
    echo "installing the converter's packages into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch "transformers==4.57.6" sentencepiece safetensors \
        "numpy~=2.2.6" "protobuf>=4.21.0,<5.0.0" requests >&2
fi
features=()
for d in "${devices[@]}"; do case $d in cuda|ascend) features+=("$d");; esac; done
if [ -z "${NPU_SERVING_BIN:-}" ]; then
    f=$(IFS=,; echo "${features[*]:-}")
    cargo build --release --bin npu-serving ${f:+--features "$f"} >&2
fi
npu=${NPU_SERVING_BIN:-$root/target/release/npu-serving}
for d in "${devices[@]}"; do
    case $d in
        cuda) export NPU_SERVING_CUDA_EMULATION=${NPU_SERVING_CUDA_EMULATION:-1};;
        ascend) [ -n "${ASCEND_HOME_PATH:-}" ] || export ASCEND_HOME_PATH=$(scripts/ascend-emulator.sh);;
    esac
done
dir=${HELDOUT_DIR:-$HOME/.cache/npu-serving/heldout}
mkdir -p "$dir"
port=${PORT:-18963}
"$npu" synth-model --variant qwen3moe_hd32_gqa4_base1e6_untied_f32 --hf-dir "$dir/tokenizer" \
    "$dir/tokenizer.gguf" >/dev/null
"$py" scripts/heldout_models.py "$dir" "$dir/tokenizer" >&2
models=()
for m in qwen3moe deepseek_v3 deepseek_v2; do
    PYTHONPATH="$src/gguf-py" "$py" "$src/convert_hf_to_gguf.py" "$dir/$m" --outtype f32 \
        --outfile "$dir/$m-f32.gguf" >/dev/null 2>&1
    models+=("$dir/$m-f32.gguf")
    for t in F16 Q8_0 Q4_K_M; do
        lower=$(echo "$t" | tr 'A-Z' 'a-z')
        "$bin/llama-quantize" "$dir/$m-f32.gguf" "$dir/$m-$lower.gguf" "$t" >/dev/null 2>&1
        models+=("$dir/$m-$lower.gguf")
    done
done
for m in "${models[@]}"; do
    "$bin/llama-server" -m "$m" --host 127.0.0.1 --port "$port" -c 1024 -np 1 -t "$(nproc)" \
        --no-warmup -fa off >"$dir/server.log" 2>&1 &
    server=$!
    for _ in $(seq 240); do curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; sleep 0.25; done
    VARIANT=$(basename "$m" .gguf) SHA=- VERSION=- PORT=$port FA=off \
        python3 scripts/fidelity_refs_run.py >"${m%.gguf}.refs.jsonl"
    kill "$server"; wait "$server" 2>/dev/null || true
done
status=0
# The directories themselves, loaded by us, against transformers' own greedy tokens.
"$py" scripts/heldout_hf_dirs.py "$npu" "$dir" qwen3moe deepseek_v3 deepseek_v2 || status=1
for d in "${devices[@]}"; do
    python3 scripts/heldout_compare.py "$npu" "$d" "${models[@]}" || status=1
done
exit $status

#!/usr/bin/env bash
# The random-weight Llama-shaped models of the speed figures (docs/performance.md), at realistic
# sizes, in the weight formats asked for; prints the path of each file (made once, then reused).
#
#   scripts/synth-bench-model.sh SHAPE [TYPE...]      (default types: Q4_0 Q4_K_M)
#
# SHAPE: 1b   hidden 2048 x 16 layers, 32 heads / 8 KV heads, ff 8192 (Llama 3.2 1B's shape)
#        3b   hidden 3072 x 28 layers, 24 heads / 8 KV heads, ff 8192 (Llama 3.2 3B's shape)
#        tiny hidden 256 x 2 layers, 4 / 2 heads, ff 512 (to check this script in seconds)
#        moe  Qwen3-MoE, Qwen3-30B-A3B's layer at half width: hidden 1024 x 8 layers, 16 heads /
#             2 KV heads of 128, 128 experts (8 used) of 384 (30B-A3B: 2048, 32/4 of 128, 128 of 768)
# TYPE:  any llama-quantize type (Q4_0, Q4_K_M, Q8_0, IQ4_XS, ...), or F16 (the unquantized file).
# Files: $DIR/llama<SHAPE>-<TYPE>.gguf (moe: qwen3moe-a3b-half-<TYPE>.gguf), DIR default
#        ~/.cache/npu-serving-matrix.
#
# `npu-serving synth-model` makes only the tiny fidelity-test shapes, so the F16 file is written by
# scripts/synth-bench-model.py (gguf-py from the llama.cpp sources that scripts/llama-cpp-ref.sh
# unpacked; the default model's tokenizer; N(0, 0.02) weights, seed 7), then quantized with that
# build's llama-quantize, as llama.cpp's users make their files. The values do not matter to speed.
# Env: DIR, DONOR (tokenizer donor, default the cached default model), LLAMA_CPP_BIN (see
#      llama-cpp-ref.sh), GGUF_PY (a gguf-py folder, default <llama.cpp>/gguf-py), KEEP_F16=1.
# Sizes: 1b is 2.3 GB in F16 (0.7 GB Q4_0), 3b 6.2 GB (1.8 GB Q4_0); a minute or two each on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
shape=${1:?usage: scripts/synth-bench-model.sh 1b|3b|moe|tiny [TYPE...]}
shift
types=("$@")
[ ${#types[@]} -gt 0 ] || types=(Q4_0 Q4_K_M)
case $shape in
  1b) dims=(--hidden 2048 --layers 16 --heads 32 --kv-heads 8 --ff 8192) ;;
  3b) dims=(--hidden 3072 --layers 28 --heads 24 --kv-heads 8 --ff 8192) ;;
  tiny) dims=(--hidden 256 --layers 2 --heads 4 --kv-heads 2 --ff 512) ;;
  moe) dims=(--arch qwen3moe --hidden 1024 --layers 8 --heads 16 --kv-heads 2 --head-dim 128
             --experts 128 --experts-used 8 --expert-ff 384) ;;
  *) echo "synth-bench-model.sh: unknown shape $shape (1b, 3b, moe or tiny)" >&2; exit 2 ;;
esac
stem=llama$shape
[ "$shape" = moe ] && stem=qwen3moe-a3b-half
dir=${DIR:-$HOME/.cache/npu-serving-matrix}
mkdir -p "$dir"

todo=()
for t in "${types[@]}"; do [ -f "$dir/$stem-$t.gguf" ] || todo+=("$t"); done
if [ ${#todo[@]} -eq 0 ]; then
  for t in "${types[@]}"; do echo "$dir/$stem-$t.gguf"; done
  exit 0
fi

lb=$("$here/llama-cpp-ref.sh")
donor=${DONOR:-$(ls "${NPU_SERVING_CACHE:-$HOME/.cache/npu-serving}"/models/SmolLM2-135M-Instruct*.gguf 2>/dev/null | head -1)}
[ -f "$donor" ] || { echo "synth-bench-model.sh: no tokenizer donor: run \`npu-serving generate\` once (fetches the default model) or set DONOR" >&2; exit 1; }
gp=${GGUF_PY:-$lb/../../gguf-py}
if [ -d "$gp/gguf" ]; then
  export PYTHONPATH="$gp${PYTHONPATH:+:$PYTHONPATH}"
elif ! python3 -c 'import gguf' 2>/dev/null; then
  echo "synth-bench-model.sh: no gguf-py at $gp: set GGUF_PY to llama.cpp's gguf-py folder" >&2
  exit 1
fi

f16=$dir/$stem-F16.gguf
made_f16=0
if [ ! -f "$f16" ]; then
  python3 "$here/synth-bench-model.py" "$donor" "$f16.part" "${dims[@]}" && mv "$f16.part" "$f16"
  made_f16=1
fi
for t in "${todo[@]}"; do
  [ "$t" = F16 ] && continue
  out=$dir/$stem-$t.gguf
  "$lb/llama-quantize" "$f16" "$out.part" "$t" >"$dir/quantize-$stem-$t.log" 2>&1 ||
    { echo "synth-bench-model.sh: llama-quantize $t failed: see $dir/quantize-$stem-$t.log" >&2; exit 1; }
  mv "$out.part" "$out"
done
keep=${KEEP_F16:-0}
for t in "${types[@]}"; do [ "$t" = F16 ] && keep=1; done
[ "$keep" = 1 ] || [ "$made_f16" = 0 ] || rm -f "$f16"
for t in "${types[@]}"; do echo "$dir/$stem-$t.gguf"; done

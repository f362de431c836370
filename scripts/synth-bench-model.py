#!/usr/bin/env python3
"""A random-weight Llama- or Qwen3-MoE-architecture GGUF of a realistic size, in F16, for speed
figures.

    synth-bench-model.py DONOR.gguf OUT.gguf --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --ff 8192
    synth-bench-model.py DONOR.gguf OUT.gguf --arch qwen3moe --hidden 1024 --layers 8 --heads 16 \
        --kv-heads 2 --head-dim 128 --experts 128 --experts-used 8 --expert-ff 384

Run by scripts/synth-bench-model.sh (which then makes Q4_0, Q4_K_M, ... with llama-quantize);
needs gguf-py (PYTHONPATH=<llama.cpp>/gguf-py) and numpy. The tokenizer (every `tokenizer.*`
key) comes from DONOR, so both engines tokenize as they do for the donor; the weights are
N(0, 0.02) from a fixed seed, the norms ones. Speed does not depend on the values; what the
model says is meaningless. Tensors are generated and written one at a time, so memory stays
near the largest tensor (the 49,152-row embedding), not the file's size.
"""
import argparse
import sys

import numpy as np
import gguf

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("donor")
p.add_argument("out")
p.add_argument("--hidden", type=int, required=True)
p.add_argument("--layers", type=int, required=True)
p.add_argument("--heads", type=int, required=True)
p.add_argument("--kv-heads", type=int, required=True)
p.add_argument("--ff", type=int, default=0, help="dense FFN width (llama)")
p.add_argument("--arch", choices=["llama", "qwen3moe"], default="llama")
p.add_argument("--head-dim", type=int, default=0, help="default: hidden / heads")
p.add_argument("--experts", type=int, default=0)
p.add_argument("--experts-used", type=int, default=0)
p.add_argument("--expert-ff", type=int, default=0)
p.add_argument("--context", type=int, default=8192)
p.add_argument("--rope-base", type=float, default=500000.0)
p.add_argument("--seed", type=int, default=7)
a = p.parse_args()
moe = a.arch == "qwen3moe"
if a.heads % a.kv_heads or (not a.head_dim and a.hidden % a.heads):
    sys.exit("heads must be a multiple of kv-heads, and hidden of heads (or give --head-dim)")
if moe and not (a.experts and a.experts_used and a.expert_ff):
    sys.exit("qwen3moe needs --experts, --experts-used and --expert-ff")
if not moe and not a.ff:
    sys.exit("llama needs --ff")
head_dim = a.head_dim or a.hidden // a.heads
q_dim = a.heads * head_dim
kv_dim = a.kv_heads * head_dim

donor = gguf.GGUFReader(a.donor)
w = gguf.GGUFWriter(a.out, a.arch)

# The donor's tokenizer, value for value (strings copied as bytes).
vocab = None
for f in donor.fields.values():
    if not f.name.startswith("tokenizer.") or not f.types:
        continue
    kind = f.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        sub = f.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            vals = [bytes(f.parts[i]) for i in f.data]
        else:
            vals = [f.parts[i].tolist()[0] for i in f.data]
        w.add_key_value(f.name, vals, kind, sub_type=sub)
        if f.name == "tokenizer.ggml.tokens":
            vocab = len(vals)
    elif kind == gguf.GGUFValueType.STRING:
        w.add_key_value(f.name, bytes(f.parts[f.data[0]]), kind)
    else:
        w.add_key_value(f.name, f.parts[f.data[0]].tolist()[0], kind)
if vocab is None:
    sys.exit(f"{a.donor} has no tokenizer.ggml.tokens")

w.add_name(f"synthetic-{a.arch}-{a.hidden}x{a.layers}")
w.add_context_length(a.context)
w.add_embedding_length(a.hidden)
w.add_block_count(a.layers)
w.add_head_count(a.heads)
w.add_head_count_kv(a.kv_heads)
if moe:
    # As convert_hf_to_gguf.py writes Qwen3-MoE: head width keys, experts, no dense width.
    w.add_feed_forward_length(a.ff or a.expert_ff * a.experts_used)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(a.experts)
    w.add_expert_used_count(a.experts_used)
    w.add_expert_feed_forward_length(a.expert_ff)
    w.add_rope_freq_base(1000000.0 if a.rope_base == 500000.0 else a.rope_base)
    w.add_layer_norm_rms_eps(1e-6)
else:
    w.add_feed_forward_length(a.ff)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(a.rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

# (name, numpy shape: rows first, as GGUF lists them innermost first, dtype, kind)
plan = [("token_embd.weight", (vocab, a.hidden), np.float16, "rand")]
for i in range(a.layers):
    b = f"blk.{i}."
    plan += [
        (b + "attn_norm.weight", (a.hidden,), np.float32, "ones"),
        (b + "attn_q.weight", (q_dim, a.hidden), np.float16, "rand"),
        (b + "attn_k.weight", (kv_dim, a.hidden), np.float16, "rand"),
        (b + "attn_v.weight", (kv_dim, a.hidden), np.float16, "rand"),
        (b + "attn_output.weight", (a.hidden, q_dim), np.float16, "rand"),
        (b + "ffn_norm.weight", (a.hidden,), np.float32, "ones"),
    ]
    if moe:
        e, eff = a.experts, a.expert_ff
        plan += [
            (b + "attn_q_norm.weight", (head_dim,), np.float32, "ones"),
            (b + "attn_k_norm.weight", (head_dim,), np.float32, "ones"),
            # The router stays F32, as the converter writes it (llama-quantize leaves it).
            (b + "ffn_gate_inp.weight", (e, a.hidden), np.float32, "rand"),
            (b + "ffn_gate_exps.weight", (e, eff, a.hidden), np.float16, "rand"),
            (b + "ffn_up_exps.weight", (e, eff, a.hidden), np.float16, "rand"),
            (b + "ffn_down_exps.weight", (e, a.hidden, eff), np.float16, "rand"),
        ]
    else:
        plan += [
            (b + "ffn_gate.weight", (a.ff, a.hidden), np.float16, "rand"),
            (b + "ffn_up.weight", (a.ff, a.hidden), np.float16, "rand"),
            (b + "ffn_down.weight", (a.hidden, a.ff), np.float16, "rand"),
        ]
plan += [("output_norm.weight", (a.hidden,), np.float32, "ones"),
         ("output.weight", (vocab, a.hidden), np.float16, "rand")]

for name, shape, dt, _ in plan:
    w.add_tensor_info(name, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_ti_data_to_file()
rng = np.random.default_rng(a.seed)
params = 0
for name, shape, dt, kind in plan:
    if kind == "ones":
        t = np.ones(shape, dtype=dt)
    else:
        t = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dt)
    params += t.size
    w.write_tensor_data(t)
w.close()
ffn = f"{a.experts} experts ({a.experts_used} used) of {a.expert_ff}" if moe else f"ff {a.ff}"
print(f"{a.out}: {params / 1e9:.2f} B parameters, {a.arch}, hidden {a.hidden} x {a.layers} "
      f"layers, {a.heads}/{a.kv_heads} heads of {head_dim}, {ffn}, vocab {vocab}", file=sys.stderr)

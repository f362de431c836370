"""Held-out mixture-of-experts models made by transformers' own model classes (not the project's
generator): a Qwen3-MoE, a DeepSeek-V3 (low-rank query, sigmoid scores with the correction bias,
group-limited top-k, routed scale, a shared expert, a dense first layer, YaRN) and a DeepSeek-V2
(softmax scores, plain top-k, two shared experts, no YaRN). Weights are drawn from a seeded normal
scaled by 1/sqrt(fan-in) (norms uniform in [0.6, 1.4], biases ~0.3), so that most greedy steps are
decided. Each is saved with save_pretrained beside the tokenizer files of TOKENIZER_DIR.
    python heldout_models.py OUT_DIR TOKENIZER_DIR"""
import math
import os
import shutil
import sys

import torch
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                          DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

out_dir, tok_dir = sys.argv[1], sys.argv[2]
common = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-6,
              max_position_embeddings=4096, tie_word_embeddings=False)
MODELS = {
    "qwen3moe": (11, Qwen3MoeForCausalLM, Qwen3MoeConfig(
        hidden_size=192, intermediate_size=256, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=48, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=64, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        rope_theta=1e6, **common)),
    "deepseek_v3": (12, DeepseekV3ForCausalLM, DeepseekV3Config(
        hidden_size=256, intermediate_size=384, moe_intermediate_size=64, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, n_shared_experts=1, norm_topk_prob=True, rope_theta=10000.0,
        # DeepSeek-V3's own config.json says so; transformers' class always scores by sigmoid
        # but does not write the key, and the converter takes a file without it as softmax.
        scoring_func="sigmoid", topk_method="noaux_tc",
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        **common)),
    # llama.cpp reads q_lora_rank for every deepseek2 file but DeepSeek-V2-Lite's 27 layers, so
    # this small V2 has a low-rank query too.
    "deepseek_v2": (13, DeepseekV2ForCausalLM, DeepseekV2Config(
        hidden_size=192, intermediate_size=320, moe_intermediate_size=48, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
        kv_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=48,
        n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1, topk_method="greedy",
        routed_scaling_factor=1.0, n_shared_experts=2, norm_topk_prob=False,
        scoring_func="softmax", rope_theta=10000.0, **common)),
}


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point():
                continue
            if p.dim() == 1:
                if "norm" in name:
                    p.copy_(0.6 + 0.8 * torch.rand(p.shape, generator=g))
                else:  # the correction bias, any other vector
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                std = 1.0 if "embed" in name else (3.0 if "lm_head" in name else 1.0) / math.sqrt(fan_in)
                p.copy_(std * torch.randn(p.shape, generator=g))


for name, (seed, cls, config) in MODELS.items():
    torch.manual_seed(seed)
    model = cls(config)
    randomize(model, seed)
    out = os.path.join(out_dir, name)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(tok_dir, f), out)
    print(out)

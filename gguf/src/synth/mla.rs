//! The deepseek2 parts of a synthetic model: its metadata beyond the shared keys and its
//! layers (latent attention; the dense FFN or the experts with the shared ones), in the
//! converter's names and shapes.

use super::{uniform_for_std, values, Builder, Shape, SynthMla};
use crate::{GgmlType, MetaValue};

/// deepseek2's metadata beyond the shared keys, as `convert_hf_to_gguf.py` writes it.
pub(super) fn mla_meta(b: &mut Builder, arch: &str, s: &Shape, m: SynthMla, vocab: usize) {
    let u32v = |x: usize| MetaValue::U32(x as u32);
    let k = |key: &str| format!("{arch}.{key}");
    let x = s.moe_extras;
    b.meta(&k("leading_dense_block_count"), u32v(x.dense_lead));
    b.meta(&k("vocab_size"), u32v(vocab));
    // Written even when 0 (a full query projection): llama.cpp requires the key of every
    // deepseek2 file but its "lite" layer counts.
    b.meta(&k("attention.q_lora_rank"), u32v(m.q_lora_rank));
    b.meta(&k("attention.kv_lora_rank"), u32v(m.kv_lora_rank));
    b.meta(&k("attention.key_length"), u32v(m.kv_lora_rank + m.qk_rope));
    b.meta(&k("attention.value_length"), u32v(m.kv_lora_rank));
    b.meta(&k("attention.key_length_mla"), u32v(m.qk_nope + m.qk_rope));
    b.meta(&k("attention.value_length_mla"), u32v(m.v_head_dim));
    b.meta(&k("expert_shared_count"), u32v(x.shared_experts));
    if x.weights_scale != 1.0 {
        b.meta(&k("expert_weights_scale"), MetaValue::F32(x.weights_scale));
    }
    b.meta(&k("expert_weights_norm"), MetaValue::Bool(true));
    b.meta(
        &k("expert_gating_func"),
        u32v(if x.sigmoid { 2 } else { 1 }),
    );
    if x.groups.0 > 1 {
        b.meta(&k("expert_group_count"), u32v(x.groups.0));
        b.meta(&k("expert_group_used_count"), u32v(x.groups.1));
    }
    b.meta(&k("rope.dimension_count"), u32v(m.qk_rope));
    if let Some(y) = s.yarn {
        b.meta(&k("rope.scaling.type"), MetaValue::String("yarn".into()));
        b.meta(&k("rope.scaling.factor"), MetaValue::F32(y.factor));
        b.meta(
            &k("rope.scaling.original_context_length"),
            u32v(y.original_context),
        );
        b.meta(
            &k("rope.scaling.yarn_log_multiplier"),
            MetaValue::F32(y.log_multiplier),
        );
    }
}

/// One deepseek2 layer: latent attention, then the dense FFN (leading layers) or the experts
/// with the shared expert.
pub(super) fn mla_layer(b: &mut Builder, s: &Shape, m: SynthMla, i: usize) {
    let n = |t: &str| format!("blk.{i}.{t}");
    let inv_sqrt = |n: usize| 1.0 / (n as f32).sqrt();
    let (h, heads) = (s.hidden, s.heads);
    let qk = m.qk_nope + m.qk_rope;
    let x = s.moe_extras;
    b.f32(&n("attn_norm.weight"), &[h], 1.0, 0.2);
    if m.q_lora_rank > 0 {
        b.matrix(&n("attn_q_a.weight"), &[h, m.q_lora_rank], inv_sqrt(h));
        b.f32(&n("attn_q_a_norm.weight"), &[m.q_lora_rank], 1.0, 0.2);
        b.matrix(
            &n("attn_q_b.weight"),
            &[m.q_lora_rank, heads * qk],
            1.5 * inv_sqrt(m.q_lora_rank),
        );
    } else {
        b.matrix(&n("attn_q.weight"), &[h, heads * qk], 1.5 * inv_sqrt(h));
    }
    b.matrix(
        &n("attn_kv_a_mqa.weight"),
        &[h, m.kv_lora_rank + m.qk_rope],
        1.5 * inv_sqrt(h),
    );
    b.f32(&n("attn_kv_a_norm.weight"), &[m.kv_lora_rank], 1.0, 0.2);
    b.matrix(
        &n("attn_k_b.weight"),
        &[m.qk_nope, m.kv_lora_rank, heads],
        1.5 * inv_sqrt(m.kv_lora_rank),
    );
    b.matrix(
        &n("attn_v_b.weight"),
        &[m.kv_lora_rank, m.v_head_dim, heads],
        inv_sqrt(m.kv_lora_rank),
    );
    let vd = heads * m.v_head_dim;
    b.matrix(
        &n("attn_output.weight"),
        &[vd, h],
        s.out_gain * inv_sqrt(vd),
    );
    b.f32(&n("ffn_norm.weight"), &[h], 1.0, 0.2);
    if i < x.dense_lead {
        b.matrix(&n("ffn_gate.weight"), &[h, s.ff], inv_sqrt(h));
        b.matrix(&n("ffn_up.weight"), &[h, s.ff], inv_sqrt(h));
        b.matrix(
            &n("ffn_down.weight"),
            &[s.ff, h],
            s.out_gain * inv_sqrt(s.ff),
        );
        return;
    }
    let (e, eff) = (s.experts, s.expert_ff);
    let name = n("ffn_gate_inp.weight");
    let v = values(
        b.seed,
        &name,
        h * e,
        0.0,
        uniform_for_std(2.0 * inv_sqrt(h)),
    );
    b.tensor(&name, GgmlType::F32, &[h, e], &v);
    if x.selection_bias {
        b.f32(&n("exp_probs_b.bias"), &[e], 0.0, 0.3);
    }
    b.matrix(&n("ffn_gate_exps.weight"), &[h, eff, e], inv_sqrt(h));
    b.matrix(&n("ffn_up_exps.weight"), &[h, eff, e], inv_sqrt(h));
    b.matrix(
        &n("ffn_down_exps.weight"),
        &[eff, h, e],
        s.out_gain * inv_sqrt(eff),
    );
    if x.shared_experts > 0 {
        let sff = eff * x.shared_experts;
        b.matrix(&n("ffn_gate_shexp.weight"), &[h, sff], inv_sqrt(h));
        b.matrix(&n("ffn_up_shexp.weight"), &[h, sff], inv_sqrt(h));
        b.matrix(
            &n("ffn_down_shexp.weight"),
            &[sff, h],
            s.out_gain * inv_sqrt(sff),
        );
    }
}

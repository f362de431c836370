//! What a model's family needs of a backend beyond the Llama step (`npu_backend::Capability`),
//! and the refusal, before any weight is read, of a model its backend cannot run.

use npu_backend::{Backend, Capability, DType};
use npu_model::FfnAct;

use super::{ModelConfig, ModelError};

/// What the model's family needs of a backend beyond the Llama step.
pub fn required_capabilities(cfg: &ModelConfig) -> Vec<Capability> {
    let mut need = Vec::new();
    if cfg.qk_norm {
        need.push(Capability::HeadNorm);
    }
    if cfg.ffn_act == FfnAct::GeluTanh {
        need.push(Capability::GeluGate);
    }
    if cfg.embed_scale.is_some() {
        need.push(Capability::ScaleRows);
    }
    if cfg.has_sliding_window() {
        need.push(Capability::SlidingWindow);
    }
    if cfg.layers.iter().any(|l| l.rope.factors.is_some()) {
        need.push(Capability::RopeFactors);
    }
    if cfg.layers.iter().any(|l| l.rope != cfg.rope) {
        need.push(Capability::PerLayerRope);
    }
    if let Some(m) = cfg.moe {
        need.push(Capability::Moe);
        if !m.plain_softmax() {
            need.push(Capability::ScoredRouting);
        }
    }
    if cfg.mla.is_some() {
        need.push(Capability::LatentAttention);
    }
    need
}

/// Refuses, before any weight is read, a model whose family needs what the backend lacks.
pub(super) fn check_capabilities<B: Backend>(
    cfg: &ModelConfig,
    backend: &B,
) -> Result<(), ModelError> {
    if cfg.wide_activations && backend.act_dtype() == DType::F16 {
        return Err(ModelError::Unsupported(format!(
            "architecture {:?} has hidden states beyond f16's range (65504), and the {} backend \
             computes activations in f16; run it on a backend with f32 or bf16 activations",
            cfg.arch.name(),
            backend.kind().name()
        )));
    }
    let missing: Vec<&str> = required_capabilities(cfg)
        .into_iter()
        .filter(|&c| !backend.supports(c))
        .map(Capability::name)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(ModelError::Unsupported(format!(
        "architecture {:?} needs {}, which the {} backend does not have yet",
        cfg.arch.name(),
        missing.join(", "),
        backend.kind().name()
    )))
}

/// Refuses, before any weight is read, a rank of whole experts
/// (`npu_serving.moe_tensor_parallel: whole_experts`) on a backend without `moe_ffn_held`.
pub(super) fn check_expert_split<B: Backend>(
    cfg: &ModelConfig,
    shard: &npu_model::shard::RankShard,
    backend: &B,
) -> Result<(), ModelError> {
    let all = cfg.moe.map_or(0, |m| m.n_experts);
    if shard.experts.len() == all || backend.supports(Capability::HeldExperts) {
        return Ok(());
    }
    Err(ModelError::Unsupported(format!(
        "npu_serving.moe_tensor_parallel: {} needs {}, which the {} backend does not have yet \
         (share_each_expert splits each expert's columns instead)",
        shard.expert_split.name(),
        Capability::HeldExperts.name(),
        backend.kind().name()
    )))
}

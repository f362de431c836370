//! Tensor-parallel sharding of a model (`npu_serving.tensor_parallel_size`), Megatron style:
//! which attention heads, FFN columns, expert columns and vocabulary rows each rank of a group
//! of `size` ranks computes, and why a model cannot be split so.
//!
//! - Attention is split in whole KV groups (a KV head and the query heads that read it), as
//!   evenly as the groups go (ranks differ by at most one group). Where there are fewer KV heads
//!   than ranks, KV heads are replicated as vLLM does: `size` must then be a multiple of the KV
//!   heads, and each KV head's query heads must split evenly over the ranks that share it.
//! - The dense FFN (and each expert's FFN) is split in whole quantization blocks of its down
//!   projection (the row-parallel matrix, cut along its input columns), as evenly as they go.
//! - Routed experts are split one of two ways (`ExpertSplit`, `npu_serving.moe_tensor_parallel`):
//!   each rank its share of every expert's columns (as the dense FFN), or whole experts per rank
//!   (rank r holds a contiguous, balanced range of them and runs only the routed slots that
//!   fall in it). Either way the ranks' partial sums meet in the FFN's all-reduce; the shared
//!   experts are column-split in both.
//! - The attention output projection (row-parallel) is cut at the heads' columns, which must
//!   fall on its quantization blocks.
//! - The output head is split by vocabulary rows: `vocab_chunk` rows per rank, the last rank's
//!   padded when the vocabulary does not divide.
//!
//! Everything else (norms, embeddings, the MoE router) is replicated.

use std::ops::Range;

use thiserror::Error;

use super::ModelConfig;
use npu_gguf::GgmlType;

use crate::Checkpoint;

/// What one rank of a tensor-parallel group computes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankShard {
    pub rank: usize,
    pub size: usize,
    /// Query heads of this rank.
    pub q_heads: Range<usize>,
    /// KV heads this rank computes and caches (shared with other ranks when replicated).
    pub kv_heads: Range<usize>,
    /// Columns of the dense FFN (empty for a model without one).
    pub ff: Range<usize>,
    /// Columns of each expert's FFN (empty without experts; all of them with whole experts).
    pub expert_ff: Range<usize>,
    /// How the routed experts are split over the ranks.
    pub expert_split: ExpertSplit,
    /// The routed experts this rank holds (all of them unless the split is by whole experts;
    /// empty without experts).
    pub experts: Range<usize>,
    /// Columns of the shared experts' FFN (empty without them).
    pub shared_ff: Range<usize>,
    /// Rows of the output head (vocabulary entries) this rank computes logits for.
    pub vocab: Range<usize>,
    /// Every rank's logit width (the last rank's `vocab` may be shorter: its columns beyond it
    /// are padding).
    pub vocab_chunk: usize,
}

impl RankShard {
    /// The whole model on one rank.
    pub fn whole(cfg: &ModelConfig) -> Self {
        Self {
            rank: 0,
            size: 1,
            q_heads: 0..cfg.n_heads,
            kv_heads: 0..cfg.n_kv_heads,
            ff: 0..cfg.ff,
            expert_ff: 0..cfg.moe.map_or(0, |m| m.expert_ff),
            expert_split: ExpertSplit::ShareEachExpert,
            experts: 0..cfg.moe.map_or(0, |m| m.n_experts),
            shared_ff: 0..cfg.moe.map_or(0, |m| m.shared_ff),
            vocab: 0..cfg.vocab,
            vocab_chunk: cfg.vocab,
        }
    }

    /// The model as this rank sees it: its heads, FFN and expert widths (the vocabulary stays
    /// the model's; the head's rows are `vocab`).
    pub fn local_config(&self, cfg: &ModelConfig) -> ModelConfig {
        let mut local = cfg.clone();
        local.n_heads = self.q_heads.len();
        local.n_kv_heads = self.kv_heads.len();
        local.ff = self.ff.len();
        if let Some(m) = local.moe.as_mut() {
            m.expert_ff = self.expert_ff.len();
            m.shared_ff = self.shared_ff.len();
        }
        local
    }

    /// Whether this rank holds a part, not the whole model.
    pub fn is_split(&self) -> bool {
        self.size > 1
    }
}

/// How a tensor-parallel group splits the routed experts of an MoE model
/// (`npu_serving.moe_tensor_parallel`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ExpertSplit {
    /// Every rank holds its share of every expert's FFN columns, as the dense FFN is split.
    #[default]
    ShareEachExpert,
    /// Every rank holds a contiguous range of whole experts and runs only the routed slots
    /// that fall in it.
    WholeExperts,
}

impl ExpertSplit {
    pub const NAMES: &'static str = "share_each_expert or whole_experts";

    pub fn name(self) -> &'static str {
        match self {
            Self::ShareEachExpert => "share_each_expert",
            Self::WholeExperts => "whole_experts",
        }
    }

    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "share_each_expert" => Some(Self::ShareEachExpert),
            "whole_experts" => Some(Self::WholeExperts),
            _ => None,
        }
    }
}

/// Why a model cannot be split over `size` ranks.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("the model's {dimension} cannot be split over {size} ranks: {detail}")]
pub struct ShardError {
    pub size: usize,
    /// The dimension that does not divide ("attention heads", "KV heads", "FFN width", ...).
    pub dimension: &'static str,
    pub detail: String,
}

/// `units` split over `size` ranks as evenly as they go: rank `r` gets `[r*units/size,
/// (r+1)*units/size)` (earlier ranks get the smaller parts).
fn balanced(units: usize, size: usize, rank: usize) -> Range<usize> {
    (rank * units / size)..((rank + 1) * units / size)
}

/// The tensor types a row-parallel cut must respect: the type of `name` in every layer.
fn layer_types(f: Option<&Checkpoint>, cfg: &ModelConfig, name: &str) -> Vec<GgmlType> {
    let Some(f) = f else {
        return Vec::new();
    };
    let mut types: Vec<GgmlType> = (0..cfg.n_layers)
        .filter_map(|i| f.tensor_info(&format!("blk.{i}.{name}")).map(|t| t.ty))
        .collect();
    types.sort_by_key(|t| t.id());
    types.dedup();
    types
}

/// The smallest column count every type in `types` has whole blocks of.
fn block_unit(types: &[GgmlType]) -> usize {
    types.iter().fold(1, |acc, t| lcm(acc, t.block_len()))
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

fn type_names(types: &[GgmlType]) -> String {
    let names: Vec<&str> = types.iter().map(|t| t.name()).collect();
    names.join("/")
}

/// A column range of a row-parallel FFN: `width` columns of `matrix` (whose layers have
/// `types`) in whole blocks over `size` ranks.
fn ffn_columns(
    width: usize,
    types: &[GgmlType],
    size: usize,
    rank: usize,
    dimension: &'static str,
    matrix: &str,
) -> Result<Range<usize>, ShardError> {
    if width == 0 {
        return Ok(0..0);
    }
    let unit = block_unit(types);
    if !width.is_multiple_of(unit) {
        return Err(ShardError {
            size,
            dimension,
            detail: format!(
                "its {width} columns are not whole {unit}-column blocks of {matrix} ({})",
                type_names(types)
            ),
        });
    }
    let units = width / unit;
    if units < size {
        return Err(ShardError {
            size,
            dimension,
            detail: format!(
                "{width} columns are {units} quantization blocks of {unit} columns of {matrix} \
                 ({}), fewer than the ranks",
                type_names(types)
            ),
        });
    }
    let r = balanced(units, size, rank);
    Ok(r.start * unit..r.end * unit)
}

/// The shard of `rank` in a group of `size`, checked against the tensor types of `f` (the
/// row-parallel cuts must fall on quantization blocks); without a file only the shapes are
/// checked.
pub fn shard(
    cfg: &ModelConfig,
    f: Option<&Checkpoint>,
    size: usize,
    rank: usize,
) -> Result<RankShard, ShardError> {
    shard_split(cfg, f, size, rank, ExpertSplit::ShareEachExpert)
}

/// `shard` with the routed experts split as `split` says (a model without experts splits the
/// same either way).
pub fn shard_split(
    cfg: &ModelConfig,
    f: Option<&Checkpoint>,
    size: usize,
    rank: usize,
    split: ExpertSplit,
) -> Result<RankShard, ShardError> {
    if size == 0 || rank >= size {
        return Err(ShardError {
            size,
            dimension: "ranks",
            detail: format!("rank {rank} of a group of {size}"),
        });
    }
    if size == 1 {
        return Ok(RankShard {
            expert_split: split,
            ..RankShard::whole(cfg)
        });
    }
    // Latent attention has one KV "head", the latent, which every rank caches whole; each rank
    // takes its share of the query heads (and their up-projections), whose values fill
    // `v_head_dim` columns of the output projection each.
    let (nh, nkv) = (cfg.n_heads, cfg.n_kv_heads);
    let hd = cfg.mla.map_or(cfg.head_dim, |m| m.v_head_dim);
    let group = nh / nkv;
    let (q_heads, kv_heads) = if nkv >= size {
        let kv = balanced(nkv, size, rank);
        (kv.start * group..kv.end * group, kv)
    } else {
        if !size.is_multiple_of(nkv) {
            return Err(ShardError {
                size,
                dimension: "KV heads",
                detail: format!(
                    "{nkv} KV heads are fewer than the ranks, and replicating them needs a \
                     number of ranks that is a multiple of {nkv}"
                ),
            });
        }
        let share = size / nkv;
        if !group.is_multiple_of(share) {
            return Err(ShardError {
                size,
                dimension: "attention heads",
                detail: format!(
                    "{nh} attention heads ({group} per KV head) do not split evenly over the \
                     {share} ranks that share each of the {nkv} KV heads"
                ),
            });
        }
        let per = nh / size;
        let kv = rank / share;
        (rank * per..(rank + 1) * per, kv..kv + 1)
    };
    // The attention output is row-parallel: its cut (at the rank's first query column) must
    // fall on its blocks.
    let wo_types = layer_types(f, cfg, "attn_output.weight");
    let unit = block_unit(&wo_types);
    for r in 0..size {
        let cut = if nkv >= size {
            balanced(nkv, size, r).start * group * hd
        } else {
            r * (nh / size) * hd
        };
        if !cut.is_multiple_of(unit) {
            return Err(ShardError {
                size,
                dimension: "attention heads",
                detail: format!(
                    "rank {r}'s heads start at column {cut} of attn_output, which is not on its \
                     {unit}-column quantization blocks ({})",
                    type_names(&wo_types)
                ),
            });
        }
    }
    let ff = ffn_columns(
        cfg.ff,
        &layer_types(f, cfg, "ffn_down.weight"),
        size,
        rank,
        "FFN width",
        "ffn_down",
    )?;
    let (expert_ff, experts) = match cfg.moe {
        None => (0..0, 0..0),
        Some(m) if split == ExpertSplit::WholeExperts => {
            if m.n_experts < size {
                return Err(ShardError {
                    size,
                    dimension: "routed experts",
                    detail: format!(
                        "{} experts are fewer than the ranks (whole experts per rank; \
                         share_each_expert splits each expert's columns instead)",
                        m.n_experts
                    ),
                });
            }
            (0..m.expert_ff, balanced(m.n_experts, size, rank))
        }
        Some(m) => (
            ffn_columns(
                m.expert_ff,
                &layer_types(f, cfg, "ffn_down_exps.weight"),
                size,
                rank,
                "expert FFN width",
                "ffn_down_exps",
            )?,
            0..m.n_experts,
        ),
    };
    let shared_ff = match cfg.moe {
        Some(m) if m.shared_ff > 0 => ffn_columns(
            m.shared_ff,
            &layer_types(f, cfg, "ffn_down_shexp.weight"),
            size,
            rank,
            "shared experts' FFN width",
            "ffn_down_shexp",
        )?,
        _ => 0..0,
    };
    let chunk = cfg.vocab.div_ceil(size);
    let vocab = (rank * chunk).min(cfg.vocab)..((rank + 1) * chunk).min(cfg.vocab);
    if vocab.is_empty() {
        return Err(ShardError {
            size,
            dimension: "vocabulary",
            detail: format!("{} entries leave rank {rank} no rows", cfg.vocab),
        });
    }
    Ok(RankShard {
        rank,
        size,
        q_heads,
        kv_heads,
        ff,
        expert_ff,
        expert_split: split,
        experts,
        shared_ff,
        vocab,
        vocab_chunk: chunk,
    })
}

/// Checks that every rank of a group of `size` has a shard.
pub fn check(cfg: &ModelConfig, f: Option<&Checkpoint>, size: usize) -> Result<(), ShardError> {
    for rank in 0..size {
        shard(cfg, f, size, rank)?;
    }
    Ok(())
}

/// The group sizes from 1 to `up_to` the model can be split over.
pub fn workable_sizes(cfg: &ModelConfig, f: Option<&Checkpoint>, up_to: usize) -> Vec<usize> {
    (1..=up_to).filter(|&s| check(cfg, f, s).is_ok()).collect()
}

/// Whether the split over `size` ranks gives some ranks more heads or columns than others.
pub fn is_uneven(cfg: &ModelConfig, f: Option<&Checkpoint>, size: usize) -> bool {
    let shards: Vec<RankShard> = (0..size)
        .filter_map(|r| shard(cfg, f, size, r).ok())
        .collect();
    shards.windows(2).any(|w| {
        w[0].q_heads.len() != w[1].q_heads.len()
            || w[0].ff.len() != w[1].ff.len()
            || w[0].expert_ff.len() != w[1].expert_ff.len()
            || w[0].experts.len() != w[1].experts.len()
    })
}

#[cfg(test)]
mod tests {
    use super::super::{Arch, FfnAct, LayerSpec, MoeSpec, Rope, RopeStyle};
    use super::*;

    fn cfg(nh: usize, nkv: usize, hd: usize, ff: usize, vocab: usize) -> ModelConfig {
        let rope = Rope::plain(RopeStyle::Halves, hd, 10000.0, 1.0);
        ModelConfig {
            arch: Arch::Llama,
            name: "t".into(),
            n_layers: 2,
            hidden: nh * hd,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            ff,
            vocab,
            context_length: 128,
            rms_eps: 1e-5,
            rope,
            qkv_bias: false,
            qk_norm: false,
            post_norms: false,
            embed_scale: None,
            ffn_act: FfnAct::Silu,
            attn_scale: 1.0,
            layers: vec![LayerSpec { rope, window: None }; 2],
            moe: None,
            mla: None,
            wide_activations: false,
        }
    }

    #[test]
    fn one_rank_is_the_whole_model() {
        let c = cfg(9, 3, 64, 1536, 49152);
        assert_eq!(shard(&c, None, 1, 0).unwrap(), RankShard::whole(&c));
        assert!(!RankShard::whole(&c).is_split());
    }

    #[test]
    fn smollm2_splits_in_whole_kv_groups() {
        // SmolLM2-135M: 9 heads over 3 KV heads; two ranks get one and two groups.
        let c = cfg(9, 3, 64, 1536, 49152);
        let a = shard(&c, None, 2, 0).unwrap();
        let b = shard(&c, None, 2, 1).unwrap();
        assert_eq!((a.q_heads.clone(), a.kv_heads.clone()), (0..3, 0..1));
        assert_eq!((b.q_heads.clone(), b.kv_heads.clone()), (3..9, 1..3));
        assert_eq!((a.ff.clone(), b.ff.clone()), (0..768, 768..1536));
        assert_eq!((a.vocab.clone(), b.vocab.clone()), (0..24576, 24576..49152));
        assert!(is_uneven(&c, None, 2));
        let l = b.local_config(&c);
        assert_eq!((l.n_heads, l.n_kv_heads, l.ff), (6, 2, 768));
        // Four ranks cannot share three KV heads.
        let e = shard(&c, None, 4, 0).unwrap_err();
        assert_eq!(e.dimension, "KV heads");
        assert_eq!(workable_sizes(&c, None, 8), vec![1, 2, 3]);
    }

    #[test]
    fn fewer_kv_heads_than_ranks_are_replicated() {
        // Gemma 3 270M: 4 heads, 1 KV head of 256.
        let c = cfg(4, 1, 256, 2048, 262144);
        for r in 0..2 {
            let s = shard(&c, None, 2, r).unwrap();
            assert_eq!(s.q_heads, r * 2..r * 2 + 2);
            assert_eq!(s.kv_heads, 0..1);
        }
        let s = shard(&c, None, 4, 3).unwrap();
        assert_eq!((s.q_heads, s.kv_heads), (3..4, 0..1));
        let e = shard(&c, None, 3, 0).unwrap_err();
        assert_eq!(e.dimension, "attention heads");
        assert!(e.to_string().contains("4 attention heads"), "{e}");
    }

    #[test]
    fn ffn_and_vocabulary_splits() {
        let c = cfg(8, 8, 64, 96, 10);
        // Without a file the blocks are single columns: 96 columns over 5 ranks.
        let widths: Vec<usize> = (0..5)
            .map(|r| shard(&c, None, 5, r).unwrap().ff.len())
            .collect();
        assert_eq!(widths.iter().sum::<usize>(), 96);
        assert!(widths.iter().all(|&w| w == 19 || w == 20), "{widths:?}");
        // 10 vocabulary rows over 4 ranks: chunks of 3, the last rank padded.
        let last = shard(&c, None, 4, 3).unwrap();
        assert_eq!((last.vocab, last.vocab_chunk), (9..10, 3));
        let e = check(&cfg(8, 8, 64, 96, 3), None, 8).unwrap_err();
        assert_eq!(e.dimension, "vocabulary");
        // Blocks of 256 over 96 columns cannot be cut at all.
        let e = ffn_columns(96, &[GgmlType::Q4K], 2, 0, "FFN width", "ffn_down").unwrap_err();
        assert!(e.to_string().contains("not whole 256-column blocks"), "{e}");
        let e = ffn_columns(512, &[GgmlType::Q4K], 3, 0, "FFN width", "ffn_down").unwrap_err();
        assert!(e.to_string().contains("2 quantization blocks"), "{e}");
        let r = ffn_columns(
            1024,
            &[GgmlType::Q4K, GgmlType::Q8_0],
            2,
            1,
            "FFN width",
            "d",
        );
        assert_eq!(r.unwrap(), 512..1024);
    }

    #[test]
    fn latent_attention_splits_its_heads_and_keeps_the_latent_whole() {
        // deepseek2-like: 8 heads over one latent row of 64 + 16, values of 32 per head.
        let mut c = cfg(8, 1, 80, 128, 100);
        c.mla = Some(crate::MlaSpec {
            q_lora_rank: 32,
            kv_lora_rank: 64,
            qk_nope: 32,
            qk_rope: 16,
            v_head_dim: 32,
        });
        c.moe = Some(MoeSpec {
            shared_ff: 64,
            dense_lead: 1,
            ..MoeSpec::softmax_top_k(8, 2, 32)
        });
        let s = shard(&c, None, 2, 1).unwrap();
        assert_eq!((s.q_heads.clone(), s.kv_heads.clone()), (4..8, 0..1));
        assert_eq!((s.ff.clone(), s.expert_ff.clone()), (64..128, 16..32));
        assert_eq!(s.shared_ff, 32..64);
        let l = s.local_config(&c);
        assert_eq!((l.n_heads, l.n_kv_heads, l.head_dim), (4, 1, 80));
        assert_eq!(l.moe.unwrap().shared_ff, 32);
        // Heads that do not divide over the ranks are refused.
        assert!(shard(&c, None, 3, 0).is_err());
    }

    #[test]
    fn experts_split_their_width() {
        let mut c = cfg(4, 2, 64, 0, 100);
        c.moe = Some(MoeSpec::softmax_top_k(8, 2, 64));
        let s = shard(&c, None, 2, 1).unwrap();
        assert_eq!((s.ff.clone(), s.expert_ff.clone()), (0..0, 32..64));
        assert_eq!(s.local_config(&c).moe.unwrap().expert_ff, 32);
        assert_eq!(s.experts, 0..8);
    }

    #[test]
    fn whole_experts_split_the_experts_not_their_width() {
        let mut c = cfg(4, 2, 64, 0, 100);
        c.moe = Some(MoeSpec {
            shared_ff: 64,
            ..MoeSpec::softmax_top_k(7, 2, 64)
        });
        let whole = ExpertSplit::WholeExperts;
        let held: Vec<_> = (0..2)
            .map(|r| shard_split(&c, None, 2, r, whole).unwrap())
            .collect();
        assert_eq!(
            (held[0].experts.clone(), held[1].experts.clone()),
            (0..3, 3..7)
        );
        for s in &held {
            assert_eq!(s.expert_ff, 0..64);
            assert_eq!(s.expert_split, whole);
            // The shared experts stay column-split.
            assert_eq!(s.shared_ff.len(), 32);
            let m = s.local_config(&c).moe.unwrap();
            assert_eq!((m.n_experts, m.expert_ff), (7, 64));
        }
        let mut wide = cfg(8, 8, 64, 0, 100);
        wide.moe = c.moe;
        let e = shard_split(&wide, None, 8, 0, whole).unwrap_err();
        assert_eq!(e.dimension, "routed experts");
        assert!(e.to_string().contains("7 experts are fewer"), "{e}");
        // A model without experts splits the same either way.
        let d = cfg(4, 2, 64, 128, 100);
        let (a, b) = (
            shard_split(&d, None, 2, 1, whole).unwrap(),
            shard(&d, None, 2, 1).unwrap(),
        );
        assert_eq!((a.ff, a.experts), (b.ff, b.experts));
        for n in ["share_each_expert", "whole_experts"] {
            assert_eq!(ExpertSplit::from_name(n).unwrap().name(), n);
        }
        assert_eq!(ExpertSplit::from_name("whole"), None);
    }
}

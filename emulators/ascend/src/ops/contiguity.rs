//! Which tensor arguments must be contiguous, per operator, as the "非连续Tensor" (non-contiguous
//! tensor) column of each aclnn page marks them. CANN's first phase refuses a non-contiguous
//! tensor where that column says × with ACLNN_ERR_PARAM_INVALID (the entry points named here do
//! no ViewCopy of their own), so the emulation refuses it as well, before it reads any data.
//!
//! Arguments not listed are read and written through their strides (the pages mark them √).
//! Sources, by operator:
//! - FusedInferAttentionScoreV2 (ops-transformer `attention/fused_infer_attention_score/docs/
//!   aclnnFusedInferAttentionScoreV2.md`): query, key, value, pseShiftOptional and
//!   attenMaskOptional are ×. attentionOut's column is left blank on the page; the V2 entry point
//!   forwards to the kernel without a ViewCopy of the result, so the emulation asks for a
//!   contiguous one as well (a dense write from its base address is what the kernel does).
//! - RotaryPositionEmbedding (`posembedding/rotary_position_embedding/docs/
//!   aclnnRotaryPositionEmbedding.md`): out is × (x, cos and sin are √).
//! - SwiGlu (ops-nn `activation/swi_glu/docs/aclnnSwiGlu.md`): x and out are ×.
//! - ScatterPaKvCache (`attention/scatter_pa_kv_cache/docs/aclnnScatterPaKvCache.md`): with
//!   scatterMode null or "None" the new key and value are documented as "uncompressed and
//!   contiguous" (the non-contiguous case is the "Nct" mode with explicit strides), and the
//!   caches are ×; the operator's validator checks key/value itself, the caches are listed here.
//! - WeightQuantBatchMatmulV2 (ops-nn `matmul/weight_quant_batch_matmul_v2/docs/
//!   aclnnWeightQuantBatchMatmulV2.md`): x, weight, antiquantScale and antiquantOffset accept a
//!   non-contiguous tensor only as the transpose of a contiguous one; y is ×.
//! - MoeGatingTopKSoftmaxV2 (ops-transformer `moe/moe_gating_top_k_softmax_v2/docs/
//!   aclnnMoeGatingTopKSoftmaxV2.md`): yOut, expertIdxOut and softmaxResultOutOptional are ×.
//! - MoeFinalizeRoutingV2 (`moe/moe_finalize_routing_v2/docs/aclnnMoeFinalizeRoutingV2.md`): out
//!   is × (every input √).
//! - MoeInitRoutingV2 (`moe/moe_init_routing_v2/docs/aclnnMoeInitRoutingV2.md`): x and expertIdx
//!   are √; expandedXOut, expandedRowIdxOut, expertTokensCountOrCumsumOut and
//!   expertTokensBeforeCapacityOut are ×.
//! - MoeGatingTopK (`moe/moe_gating_top_k/docs/aclnnMoeGatingTopK.md`): x and biasOptional are
//!   √; the outputs' column is "-" (left blank), and the emulation asks for them contiguous, as
//!   MoeGatingTopKSoftmaxV2's.

use super::invalid;
use crate::state::Fail;
use crate::view::View;

/// What an argument's layout must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Dense row-major.
    Contiguous,
    /// Dense row-major, or the transpose (last two axes swapped) of a dense row-major tensor.
    ContiguousOrTransposed,
}

/// The table: operator name, then each constrained argument with its rule.
const TABLE: &[(&str, &[(&str, Rule)])] = &[
    (
        "aclnnFusedInferAttentionScoreV2",
        &[
            ("query", Rule::Contiguous),
            ("key", Rule::Contiguous),
            ("value", Rule::Contiguous),
            ("pseShiftOptional", Rule::Contiguous),
            ("attenMaskOptional", Rule::Contiguous),
            ("attentionOut", Rule::Contiguous),
        ],
    ),
    ("aclnnRotaryPositionEmbedding", &[("out", Rule::Contiguous)]),
    (
        "aclnnSwiGlu",
        &[("x", Rule::Contiguous), ("out", Rule::Contiguous)],
    ),
    (
        "aclnnScatterPaKvCache",
        &[
            ("keyCacheRef", Rule::Contiguous),
            ("valueCacheRef", Rule::Contiguous),
        ],
    ),
    (
        "aclnnWeightQuantBatchMatmulV2",
        &[
            ("x", Rule::ContiguousOrTransposed),
            ("weight", Rule::ContiguousOrTransposed),
            ("antiquantScale", Rule::ContiguousOrTransposed),
            ("antiquantOffsetOptional", Rule::ContiguousOrTransposed),
            ("y", Rule::Contiguous),
        ],
    ),
    (
        "aclnnMoeGatingTopKSoftmaxV2",
        &[
            ("yOut", Rule::Contiguous),
            ("expertIdxOut", Rule::Contiguous),
            ("softmaxResultOutOptional", Rule::Contiguous),
        ],
    ),
    ("aclnnMoeFinalizeRoutingV2", &[("out", Rule::Contiguous)]),
    (
        "aclnnMoeInitRoutingV2",
        &[
            ("expandedXOut", Rule::Contiguous),
            ("expandedRowIdxOut", Rule::Contiguous),
            ("expertTokensCountOrCumsumOut", Rule::Contiguous),
            ("expertTokensBeforeCapacityOut", Rule::Contiguous),
        ],
    ),
    (
        "aclnnMoeGatingTopK",
        &[
            ("yOut", Rule::Contiguous),
            ("expertIdxOut", Rule::Contiguous),
            ("outOut", Rule::Contiguous),
        ],
    ),
];

/// The rule for argument `arg` of `op`, if the table constrains it.
pub fn rule(op: &str, arg: &str) -> Option<Rule> {
    TABLE
        .iter()
        .find(|(o, _)| *o == op)
        .and_then(|(_, args)| args.iter().find(|(a, _)| *a == arg))
        .map(|(_, r)| *r)
}

/// Whether `v` is the transpose (last two axes swapped) of a dense row-major tensor.
pub fn is_transposed(v: &View) -> bool {
    let r = v.rank();
    if r < 2 {
        return false;
    }
    let mut t = v.clone();
    t.dims.swap(r - 1, r - 2);
    t.strides.swap(r - 1, r - 2);
    t.is_contiguous()
}

/// Whether `v` satisfies `rule`.
pub fn satisfies(v: &View, rule: Rule) -> bool {
    match rule {
        Rule::Contiguous => v.is_contiguous(),
        Rule::ContiguousOrTransposed => v.is_contiguous() || is_transposed(v),
    }
}

/// Refuses (ACLNN_ERR_PARAM_INVALID) the first argument of `args` that breaks `op`'s row of the
/// table; arguments the table does not name pass.
pub fn check(op: &str, args: &[(&str, &View)]) -> Result<(), Fail> {
    for (name, v) in args {
        let Some(r) = rule(op, name) else { continue };
        if !satisfies(v, r) {
            let what = match r {
                Rule::Contiguous => "does not support non-contiguous tensors",
                Rule::ContiguousOrTransposed => {
                    "supports a non-contiguous tensor only as a transposed one"
                }
            };
            return invalid(
                op,
                format!(
                    "{name} {:?} with strides {:?} is not contiguous; the operator's documentation says {name} {what}",
                    v.dims, v.strides
                ),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use npu_ffi::types::ACLNN_ERR_PARAM_INVALID;

    fn view(dims: &[i64], strides: &[i64]) -> View {
        View {
            dims: dims.to_vec(),
            strides: strides.to_vec(),
            offset: 0,
            dtype: crate::view::DType::F16,
            format: npu_ffi::types::ACL_FORMAT_ND,
            storage_dims: vec![1 << 20],
            addr: 0,
        }
    }

    #[test]
    fn the_documented_arguments_are_constrained_and_others_are_not() {
        assert_eq!(
            rule("aclnnFusedInferAttentionScoreV2", "query"),
            Some(Rule::Contiguous)
        );
        assert_eq!(
            rule("aclnnRotaryPositionEmbedding", "out"),
            Some(Rule::Contiguous)
        );
        assert_eq!(rule("aclnnRotaryPositionEmbedding", "x"), None);
        assert_eq!(rule("aclnnSwiGlu", "x"), Some(Rule::Contiguous));
        assert_eq!(rule("aclnnRmsNorm", "x"), None);
        assert_eq!(rule("aclnnEmbedding", "weight"), None);
    }

    #[test]
    fn a_row_strided_query_is_refused_and_a_dense_one_passes() {
        // (B, 1, H) rows of a fused QKV buffer (H = 64, row width 128): refused.
        let strided = view(&[3, 1, 64], &[128, 128, 1]);
        let e = check("aclnnFusedInferAttentionScoreV2", &[("query", &strided)]).unwrap_err();
        assert_eq!(e.code, ACLNN_ERR_PARAM_INVALID);
        assert!(e.msg.contains("query"), "{}", e.msg);
        // The same rows gathered densely; a size-1 axis's stride does not matter.
        let dense = view(&[3, 1, 64], &[64, 7, 1]);
        check("aclnnFusedInferAttentionScoreV2", &[("query", &dense)]).unwrap();
        // RotaryPositionEmbedding's x may be strided, its out may not.
        check("aclnnRotaryPositionEmbedding", &[("x", &strided)]).unwrap();
        assert!(check("aclnnRotaryPositionEmbedding", &[("out", &strided)]).is_err());
    }

    #[test]
    fn transposed_is_accepted_only_where_the_page_allows_it() {
        let t = view(&[64, 32], &[1, 64]);
        assert!(is_transposed(&t));
        check("aclnnWeightQuantBatchMatmulV2", &[("weight", &t)]).unwrap();
        assert!(check("aclnnWeightQuantBatchMatmulV2", &[("y", &t)]).is_err());
        assert!(check("aclnnSwiGlu", &[("out", &t)]).is_err());
        let rows = view(&[4, 32], &[96, 1]);
        assert!(check("aclnnWeightQuantBatchMatmulV2", &[("x", &rows)]).is_err());
    }
}

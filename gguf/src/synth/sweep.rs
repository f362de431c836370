//! The fidelity sweep: a grid of tiny random-weight models over every family, chosen so that
//! each dimension llama.cpp's maths branches on is covered by some file: head_dim 32, 64 and
//! 128; grouped-query ratios 1, 2, 4 and 8; Q/K/V biases of standard deviation 0, 0.5 and 2
//! (Qwen2); rope frequency factors none, formula-shaped and arbitrary (Llama 3); rope bases
//! 1e4 to 1e6; tied and untied output; F32, F16, Q8_0 and Q4_K weights. Each variant is named
//! after what it covers; `scripts/fidelity-refs.sh` runs every one in llama.cpp and
//! `agent/tests/fidelity_sweep.rs` checks the engine against what it recorded.

use super::{Family, RopeFactors, Shape};
use crate::GgmlType;

/// The output-projection gain of quantized models: smaller than the float models' 2.5, so that
/// the network damps the rounding of its 8-bit activations instead of amplifying it. At 2.5,
/// llama.cpp's CPU build with and without its repacked Q4_K kernels (which differ only in the
/// order of float sums) itself disagreed at 4-5% of decided steps of a Q4_K model, and the
/// engine's misses were of the same size and number.
const QUANTIZED_OUT_GAIN: f32 = 1.0;

/// The logit spread of quantized models, over the float models' (a standard deviation near 100):
/// near 10, as real models' logits. The rounding of 8-bit activations moves logits in proportion
/// to their size, so at the float models' spread it alone moved decided steps (gaps of 0.7 to 3).
const QUANTIZED_LOGIT_SCALE: f32 = 0.1;

/// One model of the sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct Variant {
    pub name: String,
    pub family: Family,
    pub shape: Shape,
    pub seed: u64,
    pub ty: GgmlType,
}

/// What a row of the grid sets (the rest is the family's own shape).
struct Row {
    family: Family,
    head_dim: usize,
    heads: usize,
    kv_heads: usize,
    hidden: usize,
    /// Dense FFN width, or one expert's for Qwen3-MoE.
    ff: usize,
    rope_base: f32,
    tied: bool,
    /// Standard deviation of the Q/K/V biases (Qwen2 only).
    bias_std: f32,
    factors: RopeFactors,
    ty: GgmlType,
}

fn rows() -> Vec<Row> {
    use Family::*;
    use GgmlType::{F16, F32, Q4K, Q8_0};
    use RopeFactors::{Arbitrary, Formula, None as NoFactors};
    let r = |family, head_dim, heads, kv_heads, hidden, ff, rope_base, tied, ty| Row {
        family,
        head_dim,
        heads,
        kv_heads,
        hidden,
        ff,
        rope_base,
        tied,
        bias_std: 0.0,
        factors: NoFactors,
        ty,
    };
    let with_factors = |row: Row, factors| Row { factors, ..row };
    let with_bias = |row: Row, bias_std| Row { bias_std, ..row };
    vec![
        r(Llama, 32, 4, 4, 128, 256, 1e4, false, F32),
        r(Llama, 64, 4, 1, 256, 512, 1e5, true, F16),
        r(Llama, 128, 8, 1, 256, 512, 1e6, false, Q8_0),
        r(Llama, 64, 4, 2, 256, 512, 5e5, false, Q4K),
        with_factors(r(Llama3, 64, 4, 1, 256, 512, 5e5, true, F32), Formula),
        with_factors(r(Llama3, 32, 8, 1, 256, 512, 1e6, true, F16), Arbitrary),
        with_factors(r(Llama3, 128, 2, 2, 256, 512, 1e4, false, Q8_0), Arbitrary),
        with_factors(r(Llama3, 64, 4, 1, 256, 512, 5e5, true, Q4K), Arbitrary),
        with_factors(r(Llama3, 32, 4, 2, 128, 256, 1e5, false, F32), Arbitrary),
        with_bias(r(Qwen2, 32, 4, 1, 128, 256, 1e6, false, F32), 0.0),
        with_bias(r(Qwen2, 64, 4, 1, 256, 512, 1e6, true, F16), 0.5),
        with_bias(r(Qwen2, 128, 2, 2, 256, 512, 1e5, false, F32), 2.0),
        with_bias(r(Qwen2, 32, 8, 1, 256, 512, 1e4, false, Q8_0), 2.0),
        with_bias(r(Qwen2, 64, 4, 2, 256, 512, 1e6, true, Q4K), 0.5),
        r(Qwen3, 64, 4, 1, 128, 256, 1e6, true, F32),
        r(Qwen3, 128, 8, 1, 256, 512, 1e4, false, F16),
        r(Qwen3, 32, 4, 4, 128, 256, 1e5, true, Q8_0),
        r(Qwen3, 64, 4, 2, 256, 512, 1e6, false, Q4K),
        r(Qwen3Moe, 32, 4, 1, 128, 128, 1e6, false, F32),
        r(Qwen3Moe, 64, 8, 1, 256, 128, 1e4, true, F16),
        r(Qwen3Moe, 128, 2, 2, 256, 128, 1e5, false, Q8_0),
        r(Qwen3Moe, 64, 4, 1, 256, 256, 1e6, false, Q4K),
        r(Gemma3, 64, 4, 1, 128, 256, 1e6, true, F32),
        r(Gemma3, 128, 2, 2, 256, 512, 1e4, false, F16),
        r(Gemma3, 32, 8, 1, 256, 512, 1e5, true, Q8_0),
        r(Gemma3, 64, 4, 2, 256, 512, 1e6, true, Q4K),
    ]
}

fn type_name(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::Q8_0 => "q8_0",
        _ => "q4_k",
    }
}

impl Row {
    fn variant(&self) -> Variant {
        let base = self.family.shape();
        let moe = self.family == Family::Qwen3Moe;
        let quantized = !matches!(self.ty, GgmlType::F32 | GgmlType::F16);
        let shape = Shape {
            hidden: self.hidden,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            ff: if moe { base.ff } else { self.ff },
            expert_ff: if moe { self.ff } else { 0 },
            rope_base: self.rope_base,
            tied: self.tied,
            qkv_bias: self.family == Family::Qwen2,
            // Uniform values of this standard deviation.
            bias_half_width: self.bias_std * 3f32.sqrt(),
            rope_factors: self.factors,
            out_gain: if quantized {
                QUANTIZED_OUT_GAIN
            } else {
                base.out_gain
            },
            logit_scale: if quantized {
                QUANTIZED_LOGIT_SCALE
            } else {
                1.0
            },
            ..base
        };
        let mut name = format!(
            "{}_hd{}_gqa{}",
            self.family.name(),
            self.head_dim,
            self.heads / self.kv_heads
        );
        if self.family == Family::Qwen2 {
            name += &format!("_bias{}", self.bias_std);
        }
        match self.factors {
            RopeFactors::None => {}
            RopeFactors::Formula => name += "_formula",
            RopeFactors::Arbitrary => name += "_arbitrary",
        }
        name += &format!(
            "_base{:.0e}_{}_{}",
            self.rope_base,
            if self.tied { "tied" } else { "untied" },
            type_name(self.ty)
        );
        Variant {
            name,
            family: self.family,
            shape,
            seed: 1,
            ty: self.ty,
        }
    }
}

/// The deepseek2 models: latent attention with and without the query's low-rank pair, latent
/// ranks from 32 to 128 (below heads * key width), rope parts of 16 to 64, softmax and sigmoid
/// gating, with and without the selection bias, group-limited routing (2 of 4 groups, 3 of 4),
/// routed scales, shared experts (1 or 2), dense leading layers, YaRN with llama.cpp's
/// DeepSeek-V3 and V2 multipliers and without it; F32, F16 and two Q8_0 files (the
/// up-projections are too narrow for Q4_K's 256-value blocks, and the 99% bar of quantized
/// steps needs more than one file's worth of them).
fn deepseek2_variants() -> Vec<Variant> {
    use super::{MoeExtras, SynthMla, SynthYarn};
    let base = Family::Deepseek2.shape();
    let mla = |q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head_dim| SynthMla {
        q_lora_rank,
        kv_lora_rank,
        qk_nope,
        qk_rope,
        v_head_dim,
    };
    let v = |name: &str, ty, shape: Shape| Variant {
        name: name.to_string(),
        family: Family::Deepseek2,
        shape: Shape {
            head_dim: shape.mla.map_or(0, |m| m.kv_lora_rank + m.qk_rope),
            ..shape
        },
        seed: 1,
        ty,
    };
    vec![
        v(
            "deepseek2_lite_softmax_shared2_untied_f16",
            GgmlType::F16,
            Shape {
                hidden: 128,
                layers: 2,
                heads: 4,
                ff: 256,
                experts: 4,
                experts_used: 2,
                expert_ff: 64,
                mla: Some(mla(0, 128, 64, 32, 64)),
                moe_extras: MoeExtras {
                    shared_experts: 2,
                    ..MoeExtras::NONE
                },
                yarn: None,
                context_length: 4096,
                ..base
            },
        ),
        v(
            "deepseek2_v3_groups2of4_bias_yarn8_tied_q8_0",
            GgmlType::Q8_0,
            Shape {
                hidden: 128,
                layers: 3,
                heads: 8,
                ff: 256,
                expert_ff: 64,
                tied: true,
                mla: Some(mla(64, 64, 32, 32, 32)),
                yarn: Some(SynthYarn {
                    factor: 8.0,
                    original_context: 128,
                    log_multiplier: 0.1,
                }),
                context_length: 1024,
                out_gain: QUANTIZED_OUT_GAIN,
                logit_scale: QUANTIZED_LOGIT_SCALE,
                ..base
            },
        ),
        v(
            "deepseek2_softmax_groups3of4_scale_yarn2_v2mul_f32",
            GgmlType::F32,
            Shape {
                hidden: 256,
                layers: 2,
                heads: 2,
                ff: 256,
                expert_ff: 64,
                mla: Some(mla(32, 64, 128, 64, 128)),
                // llama.cpp's deepseek2 needs the shared experts' tensors in every MoE layer.
                moe_extras: MoeExtras {
                    shared_experts: 1,
                    dense_lead: 0,
                    groups: (4, 3),
                    sigmoid: false,
                    selection_bias: false,
                    weights_scale: 1.5,
                },
                yarn: Some(SynthYarn {
                    factor: 2.0,
                    original_context: 256,
                    log_multiplier: 0.0707,
                }),
                context_length: 512,
                ..base
            },
        ),
        v(
            "deepseek2_lite_sigmoid_groups2of4_untied_q8_0",
            GgmlType::Q8_0,
            Shape {
                hidden: 128,
                layers: 2,
                heads: 4,
                ff: 256,
                expert_ff: 64,
                mla: Some(mla(0, 128, 64, 32, 64)),
                yarn: None,
                context_length: 4096,
                out_gain: QUANTIZED_OUT_GAIN,
                logit_scale: QUANTIZED_LOGIT_SCALE,
                ..base
            },
        ),
        v(
            "deepseek2_sigmoid_bias_nogroups_tied_f16",
            GgmlType::F16,
            Shape {
                heads: 4,
                tied: true,
                mla: Some(mla(32, 32, 32, 16, 32)),
                moe_extras: MoeExtras {
                    groups: (0, 0),
                    ..base.moe_extras
                },
                yarn: None,
                context_length: 4096,
                ..base
            },
        ),
    ]
}

/// Every model of the sweep, in a fixed order.
pub fn variants() -> Vec<Variant> {
    let mut all: Vec<Variant> = rows().iter().map(Row::variant).collect();
    all.extend(deepseek2_variants());
    all
}

/// The sweep's model called `name`.
pub fn variant(name: &str) -> Option<Variant> {
    variants().into_iter().find(|v| v.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_covers_every_value_it_names() {
        let v = variants();
        let names: std::collections::HashSet<&str> = v.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names.len(), v.len(), "variant names are unique");
        for hd in [32, 64, 128] {
            assert!(v.iter().any(|x| x.shape.head_dim == hd), "head_dim {hd}");
        }
        for g in [1, 4, 8] {
            assert!(
                v.iter().any(|x| x.shape.heads / x.shape.kv_heads == g),
                "gqa {g}"
            );
        }
        for f in Family::ALL {
            let of: Vec<&Variant> = v.iter().filter(|x| x.family == f).collect();
            assert!(of.len() >= 4, "{}: {} variants", f.name(), of.len());
            for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4K] {
                // deepseek2's up-projections are narrower than one Q4_K block.
                if f == Family::Deepseek2 && ty == GgmlType::Q4K {
                    continue;
                }
                assert!(of.iter().any(|x| x.ty == ty), "{} {}", f.name(), ty.name());
            }
            for tied in [true, false] {
                assert!(of.iter().any(|x| x.shape.tied == tied), "{}", f.name());
            }
        }
        for w in [0.0f32, 0.5, 2.0] {
            let hw = w * 3f32.sqrt();
            assert!(v
                .iter()
                .any(|x| x.shape.qkv_bias && x.shape.bias_half_width == hw));
        }
        for r in [
            RopeFactors::None,
            RopeFactors::Formula,
            RopeFactors::Arbitrary,
        ] {
            assert!(v.iter().any(|x| x.shape.rope_factors == r), "{r:?}");
        }
        for base in [1e4f32, 1e5, 1e6] {
            assert!(v.iter().any(|x| x.shape.rope_base == base));
        }
    }
}

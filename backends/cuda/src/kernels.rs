//! The CUDA C kernel sources (compiled at run time by NVRTC, or as C++ by the emulation) and the
//! table of kernel entry points: every instantiation's name and its index, which both the real
//! device and the emulation load in this order.

use npu_backend::DType;

/// The kernel sources, concatenated in this order into one program.
pub const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("elementwise.cu", include_str!("../kernels/elementwise.cu")),
    ("moe.cu", include_str!("../kernels/moe.cu")),
    ("mla.cu", include_str!("../kernels/mla.cu")),
    ("attention.cu", include_str!("../kernels/attention.cu")),
    (
        "attention_i8.cu",
        include_str!("../kernels/attention_i8.cu"),
    ),
    ("matmul.cu", include_str!("../kernels/matmul.cu")),
    ("matmul_k.cu", include_str!("../kernels/matmul_k.cu")),
    ("gemm_tiled.cu", include_str!("../kernels/gemm_tiled.cu")),
    (
        "gemm_tiled_k.cu",
        include_str!("../kernels/gemm_tiled_k.cu"),
    ),
    (
        "attention_out.cu",
        include_str!("../kernels/attention_out.cu"),
    ),
    ("moe_matmul.cu", include_str!("../kernels/moe_matmul.cu")),
    ("lora.cu", include_str!("../kernels/lora.cu")),
    ("ffn_fused.cu", include_str!("../kernels/ffn_fused.cu")),
];

/// The whole program, with `#line` markers so compiler messages name the original file.
pub fn program_source() -> String {
    let mut s = String::new();
    for (name, text) in SOURCES {
        s.push_str(&format!("#line 1 \"{name}\"\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// Ops instantiated once per activation type (`{name}_{f32,f16,bf16}`). `ALL` lists them in
/// declaration order (a kernel's index is computed from the discriminant).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Embed,
    RmsNorm,
    Rope,
    Swiglu,
    Add,
    AddBias,
    GatherRows,
    Argmax,
    KvWrite,
    Attention,
    AttentionCombine,
    QuantizeQ8,
    ArgmaxLogprob,
    RmsNormHeads,
    Geglu,
    Scale,
    MoeRoute,
    MoeCombine,
    MoePlan,
    MoeRouteScored,
    KvWriteLatent,
    AttentionLatent,
    AddRmsNorm,
    RopeKvWrite,
    KvWriteI8,
    RopeKvWriteI8,
    AttentionI8,
    NormRopeKvWrite,
    Lora,
    QuantizeQ8K,
}

impl Op {
    pub const ALL: [Op; 30] = [
        Op::Embed,
        Op::RmsNorm,
        Op::Rope,
        Op::Swiglu,
        Op::Add,
        Op::AddBias,
        Op::GatherRows,
        Op::Argmax,
        Op::KvWrite,
        Op::Attention,
        Op::AttentionCombine,
        Op::QuantizeQ8,
        Op::ArgmaxLogprob,
        Op::RmsNormHeads,
        Op::Geglu,
        Op::Scale,
        Op::MoeRoute,
        Op::MoeCombine,
        Op::MoePlan,
        Op::MoeRouteScored,
        Op::KvWriteLatent,
        Op::AttentionLatent,
        Op::AddRmsNorm,
        Op::RopeKvWrite,
        Op::KvWriteI8,
        Op::RopeKvWriteI8,
        Op::AttentionI8,
        Op::NormRopeKvWrite,
        Op::Lora,
        Op::QuantizeQ8K,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Op::Embed => "embed",
            Op::RmsNorm => "rms_norm",
            Op::Rope => "rope",
            Op::Swiglu => "swiglu",
            Op::Add => "add",
            Op::AddBias => "add_bias",
            Op::GatherRows => "gather_rows",
            Op::Argmax => "argmax",
            Op::KvWrite => "kv_write",
            Op::Attention => "attention",
            Op::AttentionCombine => "attention_combine",
            Op::QuantizeQ8 => "quantize_q8",
            Op::ArgmaxLogprob => "argmax_logprob",
            Op::RmsNormHeads => "rms_norm_heads",
            Op::Geglu => "geglu",
            Op::Scale => "scale",
            Op::MoeRoute => "moe_route",
            Op::MoeCombine => "moe_combine",
            Op::MoePlan => "moe_plan",
            Op::MoeRouteScored => "moe_route_scored",
            Op::KvWriteLatent => "kv_write_latent",
            Op::AttentionLatent => "attention_latent",
            Op::AddRmsNorm => "add_rms_norm",
            Op::RopeKvWrite => "rope_kv_write",
            Op::KvWriteI8 => "kv_write_i8",
            Op::RopeKvWriteI8 => "rope_kv_write_i8",
            Op::AttentionI8 => "attention_i8",
            Op::NormRopeKvWrite => "norm_rope_kv_write",
            Op::Lora => "lora",
            Op::QuantizeQ8K => "quantize_q8k",
        }
    }
}

/// Weight formats the matrix kernels read (codes `WF_*` in matmul.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl WeightFormat {
    pub const ALL: [WeightFormat; 4] = [
        WeightFormat::F16,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q8_0,
    ];
    /// The name part of its kernels.
    pub fn kernel_name(self) -> &'static str {
        match self {
            WeightFormat::F16 => "f16w",
            WeightFormat::Q4_0 => "q4_0",
            WeightFormat::Q4_1 => "q4_1",
            WeightFormat::Q8_0 => "q8_0",
        }
    }
    fn index(self) -> usize {
        self as usize
    }
}

/// Activation rows a GEMV launch handles: 1, or up to 8.
pub const GEMV_ROWS: [usize; 2] = [1, 8];

/// Activation dtypes kernels are instantiated for, in suffix order.
const ACTS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// The kernel-name suffix of an activation dtype; `None` for I32.
pub fn act_suffix(dt: DType) -> Option<&'static str> {
    match dt {
        DType::F32 => Some("f32"),
        DType::F16 => Some("f16"),
        DType::BF16 => Some("bf16"),
        DType::I32 => None,
    }
}

fn act_index(dt: DType) -> usize {
    match dt {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::I32 => unreachable!("no kernel takes i32 activations"),
    }
}

/// Index of an op's kernel for activation dtype `dt` (a float dtype).
pub fn op_kernel(op: Op, dt: DType) -> usize {
    op as usize * ACTS.len() + act_index(dt)
}

const GEMV_BASE: usize = Op::ALL.len() * ACTS.len();
const DEQUANT_BASE: usize = GEMV_BASE + WeightFormat::ALL.len() * GEMV_ROWS.len() * ACTS.len();

/// Index of the GEMV kernel for `fmt` handling up to `GEMV_ROWS[rows_variant]` rows.
pub fn gemv_kernel(fmt: WeightFormat, rows_variant: usize, dt: DType) -> usize {
    GEMV_BASE + (fmt.index() * GEMV_ROWS.len() + rows_variant) * ACTS.len() + act_index(dt)
}

/// Index of the kernel that dequantizes a `fmt` matrix to `dt`.
pub fn dequant_kernel(fmt: WeightFormat, dt: DType) -> usize {
    DEQUANT_BASE + fmt.index() * ACTS.len() + act_index(dt)
}

const GEMM_BASE: usize = DEQUANT_BASE + WeightFormat::ALL.len() * ACTS.len();

/// The quantized formats the int8 tensor-core GEMM takes (not F16).
pub const GEMM_FORMATS: [WeightFormat; 3] =
    [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0];

/// Index of the int8 tensor-core GEMM for `fmt` (a quantized format: `None` for F16).
pub fn gemm_kernel(fmt: WeightFormat, dt: DType) -> Option<usize> {
    let f = GEMM_FORMATS.iter().position(|&g| g == fmt)?;
    Some(GEMM_BASE + f * ACTS.len() + act_index(dt))
}

const GEMM_TILED_BASE: usize = GEMM_BASE + GEMM_FORMATS.len() * ACTS.len();

/// Index of the int8 tensor-core GEMM tiled through shared memory (`gemm_tiled_*`,
/// kernels/gemm_tiled.cu) for `fmt` (a quantized format: `None` for F16).
pub fn gemm_tiled_kernel(fmt: WeightFormat, dt: DType) -> Option<usize> {
    let f = GEMM_FORMATS.iter().position(|&g| g == fmt)?;
    Some(GEMM_TILED_BASE + f * ACTS.len() + act_index(dt))
}

const GEMM_TILED_K_BASE: usize = GEMM_TILED_BASE + GEMM_FORMATS.len() * ACTS.len();

/// Index of the int8 tensor-core GEMM tiled through shared memory for packed K-quants
/// (`gemm_tiled_q4_k_*`, `gemm_tiled_q6_k_*`, kernels/gemm_tiled_k.cu): `q6` picks Q6_K.
pub fn gemm_tiled_k_kernel(q6: bool, dt: DType) -> usize {
    GEMM_TILED_K_BASE + usize::from(q6) * ACTS.len() + act_index(dt)
}

const MOE_MM_BASE: usize = GEMM_TILED_K_BASE + 2 * ACTS.len();

/// The weights a grouped MoE matmul (`moe_mm_*`, kernels/moe_matmul.cu) reads: a packed format,
/// or dense rows in the activation dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeWeights {
    Packed(WeightFormat),
    Dense,
}

impl MoeWeights {
    /// In kernel order.
    pub const ALL: [MoeWeights; 5] = [
        MoeWeights::Packed(WeightFormat::F16),
        MoeWeights::Packed(WeightFormat::Q4_0),
        MoeWeights::Packed(WeightFormat::Q4_1),
        MoeWeights::Packed(WeightFormat::Q8_0),
        MoeWeights::Dense,
    ];
    fn kernel_name(self) -> &'static str {
        match self {
            MoeWeights::Packed(f) => f.kernel_name(),
            MoeWeights::Dense => "dense",
        }
    }
    fn index(self) -> usize {
        match self {
            MoeWeights::Packed(f) => f.index(),
            MoeWeights::Dense => WeightFormat::ALL.len(),
        }
    }
}

/// Index of the grouped MoE matmul over `w` weights with `dt` activations.
pub fn moe_mm_kernel(w: MoeWeights, dt: DType) -> usize {
    MOE_MM_BASE + w.index() * ACTS.len() + act_index(dt)
}

const FOLD_BASE: usize = MOE_MM_BASE + MoeWeights::ALL.len() * ACTS.len();

/// Index of the GEMV with its neighbours folded in (`gemv_fold_*`, kernels/matmul.cu) for `fmt`
/// (a quantized format: `None` for F16) handling up to `GEMV_ROWS[rows_variant]` rows.
pub fn gemv_fold_kernel(fmt: WeightFormat, rows_variant: usize, dt: DType) -> Option<usize> {
    let f = GEMM_FORMATS.iter().position(|&g| g == fmt)?;
    Some(FOLD_BASE + (f * GEMV_ROWS.len() + rows_variant) * ACTS.len() + act_index(dt))
}

/// Kernels of the one-launch feed-forward block (`ffn_fused_*`, kernels/ffn_fused.cu).
const FFN_COUNT: usize = GEMM_FORMATS.len() * GEMV_ROWS.len() * ACTS.len();

/// Index of the one-launch feed-forward block (`ffn_fused_*`, kernels/ffn_fused.cu) for a
/// gate/up matrix of `fmt` (a quantized format: `None` for F16) and up to
/// `GEMV_ROWS[rows_variant]` rows. Found by name once (`ffn_fused_indices`), so their place at
/// the end of `kernel_names` needs no base constant.
pub fn ffn_fused_kernel(fmt: WeightFormat, rows_variant: usize, dt: DType) -> Option<usize> {
    let f = GEMM_FORMATS.iter().position(|&g| g == fmt)?;
    let i = (f * GEMV_ROWS.len() + rows_variant) * ACTS.len() + act_index(dt);
    ffn_fused_indices().get(i).copied()
}

/// The `ffn_fused_*` kernels' indices, in `ffn_fused_kernel`'s order.
fn ffn_fused_indices() -> &'static [usize] {
    static IDX: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();
    IDX.get_or_init(|| {
        let names = kernel_names();
        let mut idx = Vec::with_capacity(FFN_COUNT);
        for fmt in GEMM_FORMATS {
            for r in GEMV_ROWS {
                for dt in ACTS {
                    let n = ffn_fused_name(fmt, r, dt);
                    idx.extend(names.iter().position(|m| *m == n));
                }
            }
        }
        idx
    })
}

fn ffn_fused_name(fmt: WeightFormat, rows: usize, dt: DType) -> String {
    let s = act_suffix(dt).unwrap_or("f32");
    format!("ffn_fused_{}_r{rows}_{s}", fmt.kernel_name())
}

const ATTN_OUT_BASE: usize = FOLD_BASE + GEMM_FORMATS.len() * GEMV_ROWS.len() * ACTS.len();

/// Index of decode attention with the output projection and residual add folded in
/// (`attention_out_*`, kernels/attention_out.cu) for `fmt` (a quantized format: `None` for F16).
pub fn attention_out_kernel(fmt: WeightFormat, dt: DType) -> Option<usize> {
    let f = GEMM_FORMATS.iter().position(|&g| g == fmt)?;
    Some(ATTN_OUT_BASE + f * ACTS.len() + act_index(dt))
}

const Q4K_BASE: usize = ATTN_OUT_BASE + GEMM_FORMATS.len() * ACTS.len();

/// Index of the packed Q4_K GEMV (`gemv_q4_k_*`, kernels/matmul_k.cu) handling up to
/// `GEMV_ROWS[rows_variant]` rows.
pub fn gemv_q4k_kernel(rows_variant: usize, dt: DType) -> usize {
    Q4K_BASE + rows_variant * ACTS.len() + act_index(dt)
}

const Q6K_BASE: usize = Q4K_BASE + GEMV_ROWS.len() * ACTS.len();

/// Index of the packed Q6_K GEMV (`gemv_q6_k_*`, kernels/matmul_k.cu) handling up to
/// `GEMV_ROWS[rows_variant]` rows.
pub fn gemv_q6k_kernel(rows_variant: usize, dt: DType) -> usize {
    Q6K_BASE + rows_variant * ACTS.len() + act_index(dt)
}

const GEMV_WIDE_BASE: usize = Q6K_BASE + GEMV_ROWS.len() * ACTS.len();

/// Index of the wide GEMV (`gemv_wide_*`, kernels/matmul.cu: several weight loads in flight per
/// lane, `gemv_*`'s bits) for `fmt` (a quantized format: `None` for F16) handling up to
/// `GEMV_ROWS[rows_variant]` rows.
pub fn gemv_wide_kernel(fmt: WeightFormat, rows_variant: usize, dt: DType) -> Option<usize> {
    let f = GEMM_FORMATS.iter().position(|&g| g == fmt)?;
    Some(GEMV_WIDE_BASE + (f * GEMV_ROWS.len() + rows_variant) * ACTS.len() + act_index(dt))
}

/// Kernel `i`'s name (`kernel_names()[i]`, built once): the launch path names the kernel of
/// every launch for fault messages, and must not rebuild the list each time.
pub fn kernel_name(i: usize) -> &'static str {
    static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    NAMES
        .get_or_init(kernel_names)
        .get(i)
        .map_or("(unknown kernel)", String::as_str)
}

/// Every kernel's name, at its index.
pub fn kernel_names() -> Vec<String> {
    let mut names = Vec::new();
    for op in Op::ALL {
        for dt in ACTS {
            names.push(format!("{}_{}", op.name(), act_suffix(dt).unwrap()));
        }
    }
    for fmt in WeightFormat::ALL {
        for r in GEMV_ROWS {
            for dt in ACTS {
                names.push(format!(
                    "gemv_{}_r{r}_{}",
                    fmt.kernel_name(),
                    act_suffix(dt).unwrap()
                ));
            }
        }
    }
    for fmt in WeightFormat::ALL {
        for dt in ACTS {
            names.push(format!(
                "dequant_{}_{}",
                fmt.kernel_name(),
                act_suffix(dt).unwrap()
            ));
        }
    }
    for fmt in GEMM_FORMATS {
        for dt in ACTS {
            names.push(format!(
                "gemm_{}_{}",
                fmt.kernel_name(),
                act_suffix(dt).unwrap()
            ));
        }
    }
    for fmt in GEMM_FORMATS {
        for dt in ACTS {
            names.push(format!(
                "gemm_tiled_{}_{}",
                fmt.kernel_name(),
                act_suffix(dt).unwrap()
            ));
        }
    }
    for stem in ["q4_k", "q6_k"] {
        for dt in ACTS {
            names.push(format!("gemm_tiled_{stem}_{}", act_suffix(dt).unwrap()));
        }
    }
    for w in MoeWeights::ALL {
        for dt in ACTS {
            names.push(format!(
                "moe_mm_{}_{}",
                w.kernel_name(),
                act_suffix(dt).unwrap()
            ));
        }
    }
    for fmt in GEMM_FORMATS {
        for r in GEMV_ROWS {
            for dt in ACTS {
                names.push(format!(
                    "gemv_fold_{}_r{r}_{}",
                    fmt.kernel_name(),
                    act_suffix(dt).unwrap()
                ));
            }
        }
    }
    for fmt in GEMM_FORMATS {
        for dt in ACTS {
            names.push(format!(
                "attention_out_{}_{}",
                fmt.kernel_name(),
                act_suffix(dt).unwrap()
            ));
        }
    }
    for r in GEMV_ROWS {
        for dt in ACTS {
            names.push(format!("gemv_q4_k_r{r}_{}", act_suffix(dt).unwrap()));
        }
    }
    for r in GEMV_ROWS {
        for dt in ACTS {
            names.push(format!("gemv_q6_k_r{r}_{}", act_suffix(dt).unwrap()));
        }
    }
    for fmt in GEMM_FORMATS {
        for r in GEMV_ROWS {
            for dt in ACTS {
                names.push(format!(
                    "gemv_wide_{}_r{r}_{}",
                    fmt.kernel_name(),
                    act_suffix(dt).unwrap()
                ));
            }
        }
    }
    // Last: looked up by name (`ffn_fused_kernel`), so kernels indexed by a base constant go
    // before these.
    for fmt in GEMM_FORMATS {
        for r in GEMV_ROWS {
            for dt in ACTS {
                names.push(ffn_fused_name(fmt, r, dt));
            }
        }
    }
    names
}

/// Kernels that may need more than the default 48 KiB of dynamic shared memory.
pub fn large_smem_kernels() -> Vec<usize> {
    let folds = (FOLD_BASE..FOLD_BASE + GEMM_FORMATS.len() * GEMV_ROWS.len() * ACTS.len())
        .chain(ATTN_OUT_BASE..ATTN_OUT_BASE + GEMM_FORMATS.len() * ACTS.len())
        .collect::<Vec<_>>();
    [Op::Attention, Op::AttentionLatent, Op::AttentionI8]
        .into_iter()
        .flat_map(|op| ACTS.iter().map(move |&dt| op_kernel(op, dt)))
        .chain(folds)
        .chain(ffn_fused_indices().iter().copied())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_match_the_name_table() {
        for (i, op) in Op::ALL.into_iter().enumerate() {
            assert_eq!(op as usize, i, "{} out of order in Op::ALL", op.name());
        }
        let names = kernel_names();
        assert_eq!(names[op_kernel(Op::Rope, DType::BF16)], "rope_bf16");
        assert_eq!(
            names[op_kernel(Op::AttentionCombine, DType::F32)],
            "attention_combine_f32"
        );
        assert_eq!(
            names[gemv_kernel(WeightFormat::Q4_1, 1, DType::F16)],
            "gemv_q4_1_r8_f16"
        );
        assert_eq!(
            names[dequant_kernel(WeightFormat::Q8_0, DType::BF16)],
            "dequant_q8_0_bf16"
        );
        assert_eq!(
            names[op_kernel(Op::RmsNormHeads, DType::F16)],
            "rms_norm_heads_f16"
        );
        assert_eq!(names[op_kernel(Op::Scale, DType::BF16)], "scale_bf16");
        assert_eq!(
            names[gemm_kernel(WeightFormat::Q8_0, DType::F16).unwrap()],
            "gemm_q8_0_f16"
        );
        assert_eq!(gemm_kernel(WeightFormat::F16, DType::F32), None);
        assert_eq!(
            names[gemm_tiled_kernel(WeightFormat::Q4_1, DType::BF16).unwrap()],
            "gemm_tiled_q4_1_bf16"
        );
        assert_eq!(
            names[gemm_tiled_k_kernel(true, DType::F16)],
            "gemm_tiled_q6_k_f16"
        );
        assert_eq!(
            names[gemm_tiled_k_kernel(false, DType::F32)],
            "gemm_tiled_q4_k_f32"
        );
        assert_eq!(gemm_tiled_kernel(WeightFormat::F16, DType::F32), None);
        assert_eq!(
            names[moe_mm_kernel(MoeWeights::Packed(WeightFormat::Q4_1), DType::F16)],
            "moe_mm_q4_1_f16"
        );
        assert_eq!(
            names[moe_mm_kernel(MoeWeights::Dense, DType::BF16)],
            "moe_mm_dense_bf16"
        );
        assert_eq!(names[op_kernel(Op::MoePlan, DType::F32)], "moe_plan_f32");
        assert_eq!(
            names[op_kernel(Op::AttentionLatent, DType::BF16)],
            "attention_latent_bf16"
        );
        assert_eq!(
            names[gemv_fold_kernel(WeightFormat::Q4_0, 1, DType::BF16).unwrap()],
            "gemv_fold_q4_0_r8_bf16"
        );
        assert_eq!(gemv_fold_kernel(WeightFormat::F16, 0, DType::F32), None);
        assert_eq!(
            names[ffn_fused_kernel(WeightFormat::Q8_0, 0, DType::F16).unwrap()],
            "ffn_fused_q8_0_r1_f16"
        );
        assert_eq!(ffn_fused_indices().len(), FFN_COUNT);
        assert_eq!(
            names[attention_out_kernel(WeightFormat::Q4_1, DType::F16).unwrap()],
            "attention_out_q4_1_f16"
        );
        assert_eq!(attention_out_kernel(WeightFormat::F16, DType::F32), None);
        assert_eq!(names[gemv_q4k_kernel(1, DType::BF16)], "gemv_q4_k_r8_bf16");
        assert_eq!(names[gemv_q4k_kernel(0, DType::F32)], "gemv_q4_k_r1_f32");
        assert_eq!(names[gemv_q6k_kernel(1, DType::F16)], "gemv_q6_k_r8_f16");
        assert_eq!(
            names[gemv_wide_kernel(WeightFormat::Q4_1, 1, DType::BF16).unwrap()],
            "gemv_wide_q4_1_r8_bf16"
        );
        assert_eq!(gemv_wide_kernel(WeightFormat::F16, 0, DType::F32), None);
        assert_eq!(names.len(), FOLD_BASE + 18 + 9 + 12 + 18 + FFN_COUNT);
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len(), "kernel names are unique");
    }

    #[test]
    fn every_kernel_is_defined_in_the_sources() {
        let src = program_source();
        // Each name is made by one instantiation macro; check the macro's stem is there.
        for op in Op::ALL {
            assert!(
                src.contains(&format!(" {}_##S(", op.name())),
                "{}",
                op.name()
            );
        }
        assert!(src.contains("void gemv_##FS##_r##R##_##S("));
        assert!(src.contains("void dequant_##FS##_##S("));
        assert!(src.contains("void gemm_##FS##_##S("));
        assert!(src.contains("gemm_tiled_##FS##_##S("));
        assert!(src.contains("void moe_mm_##FS##_##S("));
        assert!(src.contains("void gemv_fold_##FS##_r##R##_##S("));
        assert!(src.contains(" attention_out_##FS##_##S("));
        assert!(src.contains("void ffn_fused_##FS##_r##R##_##S("));
        assert!(src.contains("void gemv_q4_k_r##R##_##S("));
        assert!(src.contains("void gemv_q6_k_r##R##_##S("));
        assert!(src.contains("void gemv_wide_##FS##_r##R##_##S("));
    }
}

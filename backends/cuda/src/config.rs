//! Settings of the CUDA backend, with their environment overrides (read once, when the agent
//! builds the backend): activation dtype, matmul strategy, kernel cache and library directories.

use std::path::PathBuf;

use npu_backend::DType;

/// How weight matrices are kept and multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulMode {
    /// Weights stay quantized on the device (Q4_0, Q4_1, Q8_0 repacked; F16 as is; other types
    /// dequantized to F16 at load) and multiply 8-bit quantized activations with integer dot
    /// products, for every step size: ggml's arithmetic, so greedy tokens follow llama.cpp's.
    Quantized,
    /// As `Quantized` for steps of at most `gemv_max_rows` token rows; larger steps dequantize
    /// each matrix into a scratch buffer and run cuBLAS (faster long prefills, exact products:
    /// tokens can differ from llama.cpp's where its top two logits are close).
    Auto,
    /// Every matrix dequantized once at load to the activation dtype; cuBLAS for every product
    /// (the same arithmetic caveat as `Auto`, and 2-4x the weight memory).
    Dequantized,
}

impl MatmulMode {
    pub fn name(self) -> &'static str {
        match self {
            MatmulMode::Quantized => "quantized",
            MatmulMode::Auto => "auto",
            MatmulMode::Dequantized => "dequantized",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "quantized" | "gemv" => MatmulMode::Quantized,
            "auto" => MatmulMode::Auto,
            "dequantized" | "cublas" => MatmulMode::Dequantized,
            _ => return None,
        })
    }
}

/// How K-quant matrices are kept on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KQuants {
    /// Dequantized to F16 at load (about 3.6x Q4_K's bytes).
    F16,
    /// Q4_K and Q6_K matrices keep the file's bytes (Q6_K's blocks split into quants, scales
    /// and d) and run the packed GEMVs (`gemv_q4_k_*`, `gemv_q6_k_*`, kernels/matmul_k.cu) and
    /// the tiled K-quant GEMM on activations quantized as Q8_K (256 values a scale, as the
    /// references' llama.cpp CPU build); the other K-quants, and K-quant experts of MoE layers,
    /// stay F16. The default: on an H200 (docs/gpu-checks/2026-11-29-h200.md) an 8B-shaped
    /// Q4_K_M llama decoded 2.2x and prefilled 7.3x as fast as with F16 (measured with 32
    /// values a scale, before the Q8_K activations and the tiled GEMM).
    Packed,
}

/// Environment variable: `packed`, the default, keeps Q4_K and Q6_K matrices in the file's bytes;
/// `f16` dequantizes K-quants to F16 at load.
pub const ENV_KQUANTS: &str = "NPU_SERVING_CUDA_KQUANTS";
/// Environment variable: activation dtype (`f16`, `bf16`, `f32`).
pub const ENV_DTYPE: &str = "NPU_SERVING_CUDA_DTYPE";
/// Environment variable: matmul strategy (`quantized`, `auto`, `dequantized`).
pub const ENV_MATMUL: &str = "NPU_SERVING_CUDA_MATMUL";
/// Environment variable: most token rows a step may have for the GEMV kernels in `auto` mode.
pub const ENV_GEMV_MAX_ROWS: &str = "NPU_SERVING_CUDA_GEMV_MAX_ROWS";
/// Environment variable: `0` keeps steps of many token rows off the int8 tensor cores (the GEMV
/// kernels then take every step); `1`, the default, uses them on sm_80 and later.
pub const ENV_MMA: &str = "NPU_SERVING_CUDA_MMA";
/// Environment variable: `1` makes `CudaBackend::new` open the CPU emulation of the kernels
/// instead of a GPU, in builds where this crate has its `emulation` feature (test builds of the
/// crates that use it; a binary whose `npu-backend-cuda` dependency enables it): whole-model
/// checks of the kernels through the usual device path on machines without a GPU. Other builds
/// ignore it. Slow, and not a GPU.
/// Environment variable: `0` launches every op of a step on its own (no residual add folded into
/// the next RMS norm, no activation quantizer folded into the kernel producing a quantized
/// product's input); `1` folds those; `2`, the default, also folds the RMS norm, the residual add
/// and SwiGLU into the quantized GEMVs beside them (`fold`). The results are the same bit for bit.
/// `3` also folds rope and the KV write into the Q/K/V GEMV (bit for bit); `4` also runs a decode
/// layer's feed-forward block and its attention with the output projection as one launch each
/// (deterministic, not bit for bit: see `fold_ffn`, `fold_attn_out`).
pub const ENV_FUSE: &str = "NPU_SERVING_CUDA_FUSE";
pub const ENV_EMULATION: &str = "NPU_SERVING_CUDA_EMULATION";
/// Environment variable: the quantized GEMV kernels, `plain` (the default, `gemv_*`) or `wide`
/// (`gemv_wide_*`: several weight loads in flight per lane, the same bits; not yet measured on a
/// GPU). See `crate::matmul::GemvVariant`.
pub const ENV_GEMV: &str = "NPU_SERVING_CUDA_GEMV";

#[derive(Debug, Clone, PartialEq)]
pub struct CudaConfig {
    /// Activations are stored in this dtype (f32 by default, as ggml keeps them; f16 or bf16
    /// halve activation traffic but change greedy tokens against llama.cpp on the reference
    /// prompts); arithmetic accumulates in f32 either way.
    pub act_dtype: DType,
    pub matmul: MatmulMode,
    /// `Auto` mode: steps with at most this many token rows use the GEMV kernels.
    pub gemv_max_rows: usize,
    /// Quantized products of more than 8 token rows run on the int8 tensor cores (sm_80 and
    /// later), with the GEMV kernels' arithmetic bit for bit; `false` leaves them to the GEMV.
    pub int8_mma: bool,
    /// Fold a step's ops into fewer launches where the arithmetic stays bit for bit the same:
    /// `add_rms_norm` in one kernel, and 8-bit activations written by the kernel that produces
    /// a quantized product's input (no `quantize_q8` launch). `false`: one launch per op.
    pub fuse: bool,
    /// With `fuse`, also fold into the quantized GEMVs of a few token rows the RMS norm before
    /// them, the residual add after the output and down projections, and SwiGLU after the
    /// gate/up projection (`fold`; `NPU_SERVING_CUDA_FUSE=2`, the default).
    pub fold_gemv: bool,
    /// With `fold_gemv`, also fold rope and the KV write into the Q/K/V GEMV
    /// (`NPU_SERVING_CUDA_FUSE=3`; off by default). That launch runs one block per head (48 for
    /// Llama 3 8B), fewer blocks than a large GPU has SMs, so it may stream the Q/K/V weights
    /// slower than the GEMV with 32 rows a block it replaces; it stays opt-in until a GPU
    /// measures it against `2`.
    pub fold_rope: bool,
    /// With `fold_rope`, also run the whole feed-forward block of a decode layer (RMS norm,
    /// gate/up, SwiGLU, down, residual add) as one launch (`NPU_SERVING_CUDA_FUSE=4`; off by
    /// default): blocks split the intermediate dimension and the down projection's partial sums
    /// are added in a fixed order by the grid's last block, so results are deterministic but not
    /// bit for bit the separate launches'.
    pub fold_ffn: bool,
    /// With `fold_rope`, also run decode attention together with the output projection and the
    /// residual add as one launch (`NPU_SERVING_CUDA_FUSE=4`; off by default), partial sums
    /// over heads added in a fixed order by the grid's last block.
    pub fold_attn_out: bool,
    /// K-quant matrices: Q4_K/Q6_K packed (default) or F16 at load (`NPU_SERVING_CUDA_KQUANTS`).
    pub kquants: KQuants,
    /// Where compiled kernels are cached on disk (`None`: memory only).
    pub kernel_cache: Option<PathBuf>,
    /// Directories searched for the CUDA libraries when the loader does not find them by name.
    pub lib_dirs: Vec<PathBuf>,
}

impl Default for CudaConfig {
    /// f32 activations, quantized matmuls (GEMV up to 16 rows in `auto` mode), the default
    /// kernel cache and library directories.
    fn default() -> Self {
        Self {
            act_dtype: DType::F32,
            matmul: MatmulMode::Quantized,
            gemv_max_rows: 16,
            int8_mma: true,
            fuse: true,
            fold_gemv: true,
            fold_rope: false,
            fold_ffn: false,
            fold_attn_out: false,
            kquants: KQuants::Packed,
            kernel_cache: crate::nvrtc::default_cache_dir(),
            lib_dirs: crate::libs::default_search_dirs(),
        }
    }
}

impl CudaConfig {
    /// The defaults with `NPU_SERVING_CUDA_DTYPE`, `NPU_SERVING_CUDA_MATMUL`,
    /// `NPU_SERVING_CUDA_GEMV_MAX_ROWS`, `NPU_SERVING_CUDA_MMA`, `NPU_SERVING_CUDA_FUSE` and `NPU_SERVING_CUDA_KQUANTS` applied; a bad value is an error naming the variable.
    pub fn from_env() -> Result<Self, String> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As `from_env`, reading variables through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let mut c = Self::default();
        if let Some(v) = get(ENV_DTYPE) {
            c.act_dtype = match v.as_str() {
                "f16" => DType::F16,
                "bf16" => DType::BF16,
                "f32" => DType::F32,
                _ => return Err(format!("{ENV_DTYPE}={v:?}: expected f16, bf16 or f32")),
            };
        }
        if let Some(v) = get(ENV_MATMUL) {
            c.matmul = MatmulMode::parse(&v).ok_or_else(|| {
                format!("{ENV_MATMUL}={v:?}: expected quantized, auto or dequantized")
            })?;
        }
        if let Some(v) = get(ENV_GEMV_MAX_ROWS) {
            c.gemv_max_rows = v
                .parse()
                .map_err(|_| format!("{ENV_GEMV_MAX_ROWS}={v:?}: expected a number of rows"))?;
        }
        if let Some(v) = get(ENV_MMA) {
            c.int8_mma = match v.as_str() {
                "0" => false,
                "1" => true,
                _ => return Err(format!("{ENV_MMA}={v:?}: expected 0 or 1")),
            };
        }
        if let Some(v) = get(ENV_KQUANTS) {
            c.kquants = match v.as_str() {
                "f16" => KQuants::F16,
                "packed" => KQuants::Packed,
                _ => return Err(format!("{ENV_KQUANTS}={v:?}: expected f16 or packed")),
            };
        }
        if let Some(v) = get(ENV_FUSE) {
            let level = match v.as_str() {
                "0" => 0,
                "1" => 1,
                "2" => 2,
                "3" => 3,
                "4" => 4,
                _ => return Err(format!("{ENV_FUSE}={v:?}: expected 0, 1, 2, 3 or 4")),
            };
            c.fuse = level >= 1;
            c.fold_gemv = level >= 2;
            c.fold_rope = level >= 3;
            c.fold_ffn = level >= 4;
            c.fold_attn_out = level >= 4;
        }
        // Checked here so a bad value fails where the others do; the backend reads it when it
        // is made (`CudaBackend::gemv_variant`).
        crate::matmul::GemvVariant::from_vars(&get)?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_overrides_and_errors() {
        let c = CudaConfig::from_vars(|k| match k {
            ENV_DTYPE => Some("bf16".into()),
            ENV_MATMUL => Some("gemv".into()),
            ENV_GEMV_MAX_ROWS => Some("4".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(
            (c.act_dtype, c.matmul, c.gemv_max_rows),
            (DType::BF16, MatmulMode::Quantized, 4)
        );
        let e = CudaConfig::from_vars(|k| (k == ENV_DTYPE).then(|| "fp8".into())).unwrap_err();
        assert!(e.contains(ENV_DTYPE), "{e}");
        let e = CudaConfig::from_vars(|k| (k == ENV_MATMUL).then(|| "fast".into())).unwrap_err();
        assert!(e.contains(ENV_MATMUL), "{e}");
        let e = CudaConfig::from_vars(|k| (k == ENV_MMA).then(|| "yes".into())).unwrap_err();
        assert!(e.contains(ENV_MMA), "{e}");
        let off = CudaConfig::from_vars(|k| (k == ENV_MMA).then(|| "0".into())).unwrap();
        assert!(!off.int8_mma);
        let d = CudaConfig::from_vars(|_| None).unwrap();
        assert_eq!((d.act_dtype, d.matmul), (DType::F32, MatmulMode::Quantized));
        assert!(d.int8_mma && d.fuse);
        let e = CudaConfig::from_vars(|k| (k == ENV_FUSE).then(|| "no".into())).unwrap_err();
        assert!(e.contains(ENV_FUSE), "{e}");
        let off = CudaConfig::from_vars(|k| (k == ENV_FUSE).then(|| "0".into())).unwrap();
        assert!(!off.fuse && !off.fold_gemv);
        let one = CudaConfig::from_vars(|k| (k == ENV_FUSE).then(|| "1".into())).unwrap();
        assert!(one.fuse && !one.fold_gemv);
        assert!(d.fold_gemv && !d.fold_rope);
        let three = CudaConfig::from_vars(|k| (k == ENV_FUSE).then(|| "3".into())).unwrap();
        assert!(three.fuse && three.fold_gemv && three.fold_rope);
        assert!(!three.fold_ffn && !three.fold_attn_out && !d.fold_ffn);
        let four = CudaConfig::from_vars(|k| (k == ENV_FUSE).then(|| "4".into())).unwrap();
        assert!(four.fold_rope && four.fold_ffn && four.fold_attn_out);
        assert_eq!(d.kquants, KQuants::Packed);
        let f = CudaConfig::from_vars(|k| (k == ENV_KQUANTS).then(|| "f16".into())).unwrap();
        assert_eq!(f.kquants, KQuants::F16);
        let e = CudaConfig::from_vars(|k| (k == ENV_KQUANTS).then(|| "q4k".into())).unwrap_err();
        assert!(e.contains(ENV_KQUANTS), "{e}");
        let p = CudaConfig::from_vars(|k| (k == ENV_KQUANTS).then(|| "packed".into())).unwrap();
        assert_eq!(p.kquants, KQuants::Packed);
    }
}

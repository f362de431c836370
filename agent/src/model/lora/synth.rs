//! Random-weight LoRA adapters in PEFT's layout, for tests and benchmarks: `adapter_config.json`
//! and `adapter_model.safetensors` as PEFT's `save_pretrained` writes them (Hugging Face row
//! order, f32 or bf16), for a model of the given shape.

use std::path::Path;

use npu_hf::{write_file, Dtype, WriteTensor};
use npu_model::ModelConfig;

use super::adapter::Target;

/// What to draw.
#[derive(Debug, Clone)]
pub struct SynthAdapter {
    pub rank: usize,
    pub alpha: f32,
    pub use_rslora: bool,
    pub targets: Vec<Target>,
    pub seed: u64,
    /// Values of A are in `±a_range`, of B in `±b_range`.
    pub a_range: f32,
    pub b_range: f32,
    /// Written in bf16 (as PEFT saves a bf16 model's adapter) instead of f32.
    pub bf16: bool,
}

/// A splitmix64 stream of values in `[-1, 1)`.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Writes the adapter into `dir` (created when missing).
pub fn write_peft(dir: &Path, cfg: &ModelConfig, s: &SynthAdapter) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let modules: Vec<&str> = s.targets.iter().map(|t| t.peft_name()).collect();
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.name,
        "r": s.rank,
        "lora_alpha": s.alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "use_rslora": s.use_rslora,
        "use_dora": false,
        "fan_in_fan_out": false,
        "bias": "none",
        "modules_to_save": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": true
    });
    std::fs::write(
        dir.join("adapter_config.json"),
        serde_json::to_string_pretty(&config).expect("a JSON value"),
    )
    .map_err(|e| format!("writing adapter_config.json: {e}"))?;
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for il in 0..cfg.n_layers {
        for (ti, &t) in s.targets.iter().enumerate() {
            let (n_in, n_out) = t.dims(cfg);
            let parent = match t {
                Target::Q | Target::K | Target::V | Target::O => "self_attn",
                _ => "mlp",
            };
            let base = format!(
                "base_model.model.model.layers.{il}.{parent}.{}",
                t.peft_name()
            );
            let seed = s.seed.wrapping_mul(1_000_003) ^ ((il as u64) << 8 | ti as u64);
            let a: Vec<f32> = values(seed, s.rank * n_in)
                .iter()
                .map(|v| v * s.a_range)
                .collect();
            let b: Vec<f32> = values(seed ^ 0x5555, n_out * s.rank)
                .iter()
                .map(|v| v * s.b_range)
                .collect();
            let bytes = |v: &[f32]| -> Vec<u8> {
                if s.bf16 {
                    v.iter()
                        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                        .collect()
                } else {
                    v.iter().flat_map(|x| x.to_le_bytes()).collect()
                }
            };
            owned.push((
                format!("{base}.lora_A.weight"),
                vec![s.rank, n_in],
                bytes(&a),
            ));
            owned.push((
                format!("{base}.lora_B.weight"),
                vec![n_out, s.rank],
                bytes(&b),
            ));
        }
    }
    let views: Vec<WriteTensor> = owned
        .iter()
        .map(|(name, shape, data)| WriteTensor {
            name,
            dtype: if s.bf16 { Dtype::BF16 } else { Dtype::F32 },
            shape,
            data,
        })
        .collect();
    write_file(
        &dir.join("adapter_model.safetensors"),
        &views,
        &[("format", "pt")],
    )
    .map_err(|e| e.to_string())
}

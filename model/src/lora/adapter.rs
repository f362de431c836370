//! A LoRA adapter read from disk into host memory, checked against the base model it will run
//! on: PEFT's layout (a directory with `adapter_config.json` and `adapter_model.safetensors`).
//! Each targeted projection keeps its A (`rank x in`) and its B transposed (`rank x out`),
//! in the engine's row order: for Llama the query and key outputs are permuted per head as
//! `convert_hf_to_gguf.py` permutes the base weights, so an adapter trained on the Hugging Face
//! weights adds to the same rows.

use std::path::{Path, PathBuf};

use crate::{Arch, ModelConfig};
use half::{bf16, f16};
use npu_hf::Dtype;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum AdapterError {
    #[error("LoRA adapter {path}: {what}")]
    Bad { path: PathBuf, what: String },
    #[error("LoRA adapter {path}: {what} is not supported")]
    Unsupported { path: PathBuf, what: String },
}

/// A projection an adapter may target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The module name PEFT uses (`target_modules`).
    pub fn peft_name(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    fn from_peft(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.peft_name() == s)
    }

    /// The parent module in PEFT's tensor names.
    fn peft_parent(self) -> &'static str {
        match self {
            Target::Q | Target::K | Target::V | Target::O => "self_attn",
            _ => "mlp",
        }
    }

    /// (inputs, outputs) of the projection in `cfg`.
    pub fn dims(self, cfg: &ModelConfig) -> (usize, usize) {
        let (h, q, kv) = (
            cfg.hidden,
            cfg.n_heads * cfg.head_dim,
            cfg.n_kv_heads * cfg.head_dim,
        );
        match self {
            Target::Q => (h, q),
            Target::K | Target::V => (h, kv),
            Target::O => (q, h),
            Target::Gate | Target::Up => (h, cfg.ff),
            Target::Down => (cfg.ff, h),
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// One projection's low-rank pair, f32, engine row order.
#[derive(Debug, Clone, PartialEq)]
pub struct LowRank {
    /// `rank x in`.
    pub a: Vec<f32>,
    /// `rank x out` (B transposed).
    pub b_t: Vec<f32>,
}

/// An adapter in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostAdapter {
    pub path: PathBuf,
    pub rank: usize,
    pub alpha: f32,
    /// `alpha / rank`, or `alpha / sqrt(rank)` with `use_rslora`.
    pub scale: f32,
    /// Every tensor was stored in bf16: the backend may keep them so (widening is exact).
    pub all_bf16: bool,
    /// Per layer, per [`Target::index`].
    pub layers: Vec<[Option<LowRank>; 7]>,
}

impl HostAdapter {
    /// The projections it targets in at least one layer.
    pub fn targets(&self) -> Vec<Target> {
        Target::ALL
            .into_iter()
            .filter(|t| self.layers.iter().any(|l| l[t.index()].is_some()))
            .collect()
    }
}

/// Families whose projections adapters may target here: dense attention and a dense FFN.
pub fn check_family(cfg: &ModelConfig) -> Result<(), String> {
    if cfg.mla.is_some() || cfg.moe.is_some() {
        return Err(format!(
            "LoRA adapters on {} (latent attention or experts) are not built",
            cfg.arch.name()
        ));
    }
    Ok(())
}

/// Reads a PEFT adapter directory for the model `cfg`, refusing a rank above `max_rank`.
pub fn read_peft(
    dir: &Path,
    cfg: &ModelConfig,
    max_rank: usize,
) -> Result<HostAdapter, AdapterError> {
    let bad = |what: String| AdapterError::Bad {
        path: dir.to_path_buf(),
        what,
    };
    let unsupported = |what: String| AdapterError::Unsupported {
        path: dir.to_path_buf(),
        what,
    };
    check_family(cfg).map_err(unsupported)?;
    let config_path = dir.join("adapter_config.json");
    let text = std::fs::read(&config_path)
        .map_err(|e| bad(format!("reading {}: {e}", config_path.display())))?;
    let conf: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| bad(format!("adapter_config.json is not JSON: {e}")))?;
    let field = |k: &str| conf.get(k).filter(|v| !v.is_null());
    if let Some(t) = field("peft_type").and_then(|v| v.as_str()) {
        if t != "LORA" {
            return Err(unsupported(format!("peft_type {t:?} (only LORA)")));
        }
    }
    let rank = field("r")
        .and_then(|v| v.as_u64())
        .ok_or_else(|| bad("adapter_config.json has no integer `r`".into()))?
        as usize;
    if rank == 0 || rank > max_rank {
        return Err(bad(format!(
            "rank r = {rank} is outside 1..={max_rank} (max_lora_rank)"
        )));
    }
    let alpha = field("lora_alpha")
        .and_then(|v| v.as_f64())
        .ok_or_else(|| bad("adapter_config.json has no number `lora_alpha`".into()))?
        as f32;
    let rslora = field("use_rslora")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    for (key, refused) in [
        (
            "fan_in_fan_out",
            field("fan_in_fan_out").and_then(|v| v.as_bool()) == Some(true),
        ),
        (
            "use_dora",
            field("use_dora").and_then(|v| v.as_bool()) == Some(true),
        ),
        (
            "bias",
            field("bias")
                .and_then(|v| v.as_str())
                .is_some_and(|b| b != "none"),
        ),
        (
            "modules_to_save",
            field("modules_to_save")
                .and_then(|v| v.as_array())
                .is_some_and(|a| !a.is_empty()),
        ),
        (
            "rank_pattern",
            field("rank_pattern")
                .and_then(|v| v.as_object())
                .is_some_and(|a| !a.is_empty()),
        ),
        (
            "alpha_pattern",
            field("alpha_pattern")
                .and_then(|v| v.as_object())
                .is_some_and(|a| !a.is_empty()),
        ),
    ] {
        if refused {
            return Err(unsupported(format!(
                "adapter_config.json key {key:?} as set"
            )));
        }
    }
    let targets: Vec<Target> = match field("target_modules") {
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|v| {
                let s = v.as_str().unwrap_or_default();
                Target::from_peft(s).ok_or_else(|| unsupported(format!("target module {s:?}")))
            })
            .collect::<Result<_, _>>()?,
        Some(serde_json::Value::String(s)) => match Target::from_peft(s) {
            Some(t) => vec![t],
            None => return Err(unsupported(format!("target_modules as a pattern ({s:?})"))),
        },
        _ => return Err(bad("adapter_config.json has no `target_modules`".into())),
    };
    let scale = if rslora {
        alpha / (rank as f32).sqrt()
    } else {
        alpha / rank as f32
    };

    let st_path = dir.join("adapter_model.safetensors");
    let bytes = std::fs::read(&st_path).map_err(|e| {
        bad(format!(
            "reading {}: {e} (adapter_model.bin is not read: convert it to safetensors)",
            st_path.display()
        ))
    })?;
    let metas =
        npu_hf::parse("adapter_model.safetensors", &bytes, 0).map_err(|e| bad(e.to_string()))?;
    let mut layers: Vec<[Option<LowRank>; 7]> =
        (0..cfg.n_layers).map(|_| Default::default()).collect();
    // A and B of each (layer, target), paired.
    let mut halves: Vec<[[Option<Values>; 2]; 7]> =
        (0..cfg.n_layers).map(|_| Default::default()).collect();
    let all_bf16 = metas.iter().all(|m| m.dtype == Dtype::BF16);
    for m in &metas {
        let (il, target, half) =
            peft_name(&m.name).ok_or_else(|| unsupported(format!("tensor {:?}", m.name)))?;
        if il >= cfg.n_layers {
            return Err(bad(format!(
                "tensor {} is for layer {il}; the model has {}",
                m.name, cfg.n_layers
            )));
        }
        if !targets.contains(&target) {
            return Err(bad(format!(
                "tensor {} targets {}, which target_modules does not list",
                m.name,
                target.peft_name()
            )));
        }
        let values = to_f32(m.dtype, &bytes[m.start..m.end])
            .ok_or_else(|| unsupported(format!("tensor {} of dtype {}", m.name, m.dtype)))?;
        let slot = &mut halves[il][target.index()][half];
        if slot.is_some() {
            return Err(bad(format!("tensor {} twice", m.name)));
        }
        *slot = Some((values, m.shape.clone()));
    }
    let permute_heads = matches!(cfg.arch, Arch::Llama | Arch::Mistral);
    for (il, per_target) in halves.into_iter().enumerate() {
        for t in Target::ALL {
            let [a, b] = per_target[t.index()].clone();
            let name = |half: &str| {
                format!(
                    "base_model.model.model.layers.{il}.{}.{}.{half}.weight",
                    t.peft_parent(),
                    t.peft_name()
                )
            };
            let (a, b) = match (a, b) {
                (None, None) => continue,
                (Some(a), Some(b)) => (a, b),
                (None, Some(_)) => {
                    return Err(bad(format!("{} without its lora_A", name("lora_B"))))
                }
                (Some(_), None) => {
                    return Err(bad(format!("{} without its lora_B", name("lora_A"))))
                }
            };
            let (n_in, n_out) = t.dims(cfg);
            if a.1 != [rank, n_in] || b.1 != [n_out, rank] {
                return Err(bad(format!(
                    "{} is {:?} and {} is {:?}; rank {rank} on this model's {} needs [{rank}, \
                     {n_in}] and [{n_out}, {rank}]",
                    name("lora_A"),
                    a.1,
                    name("lora_B"),
                    b.1,
                    t.peft_name()
                )));
            }
            // B (out x rank) transposed to rank x out, in the engine's output row order.
            let heads = match t {
                Target::Q if permute_heads => Some(cfg.n_heads),
                Target::K if permute_heads => Some(cfg.n_kv_heads),
                _ => None,
            };
            let order: Vec<usize> = match heads {
                Some(h) => permuted_rows(n_out, h),
                None => (0..n_out).collect(),
            };
            let mut b_t = vec![0f32; rank * n_out];
            for (o, &src) in order.iter().enumerate() {
                for k in 0..rank {
                    b_t[k * n_out + o] = b.0[src * rank + k];
                }
            }
            layers[il][t.index()] = Some(LowRank { a: a.0, b_t });
        }
    }
    if layers.iter().all(|l| l.iter().all(Option::is_none)) {
        return Err(bad("adapter_model.safetensors holds no LoRA tensor".into()));
    }
    Ok(HostAdapter {
        path: dir.to_path_buf(),
        rank,
        alpha,
        scale,
        all_bf16,
        layers,
    })
}

/// A tensor's values (f32) and shape, as read.
type Values = (Vec<f32>, Vec<usize>);

/// `convert_hf_to_gguf.py`'s Llama permutation of a projection's output rows: engine row
/// `h*d + 2*i + j` is Hugging Face row `h*d + j*d/2 + i` (`d` rows a head). Returns, per engine
/// row, its Hugging Face row.
pub fn permuted_rows(rows: usize, heads: usize) -> Vec<usize> {
    let d = rows / heads.max(1);
    let mut out = Vec::with_capacity(rows);
    for h in 0..heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                out.push(h * d + j * (d / 2) + i);
            }
        }
    }
    out
}

/// (layer, target, 0 for A / 1 for B) of a PEFT tensor name.
fn peft_name(name: &str) -> Option<(usize, Target, usize)> {
    let rest = name.strip_prefix("base_model.model.model.layers.")?;
    let (il, rest) = rest.split_once('.')?;
    let il: usize = il.parse().ok()?;
    let (parent, rest) = rest.split_once('.')?;
    let (module, rest) = rest.split_once('.')?;
    let t = Target::from_peft(module).filter(|t| t.peft_parent() == parent)?;
    let half = match rest {
        "lora_A.weight" => 0,
        "lora_B.weight" => 1,
        _ => return None,
    };
    Some((il, t, half))
}

fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

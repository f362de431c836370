//! `npu_serving.lora_adapters`, `npu_serving.max_loras` and `npu_serving.max_lora_rank`:
//! LoRA adapters served beside the base model, as vLLM's `--lora-modules`, `--max-loras` and
//! `--max-lora-rank`. LoRA is on when either list or limit is given (`lora_adapters: []` turns
//! it on with adapters only loaded at run time). This module reads and checks the keys; the
//! adapters' files are read against the model at start (`crate::lora`).

use std::collections::BTreeSet;
use std::path::PathBuf;

use npu_protocol::MAX_LORA_PATH;
use serde_yaml::Value;

use super::error::ConfigError;
use super::reader::{describe, Section, Unknown};

/// Most adapter slots (the agent's limit).
pub const MAX_LORAS: u64 = 64;
/// Largest rank an adapter slot holds (the agent's limit).
pub const MAX_LORA_RANK: u64 = 256;

/// One adapter listed at start: the name requests give as `model`, and its files (a PEFT
/// directory or a GGUF LoRA file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraEntry {
    pub name: String,
    pub path: PathBuf,
}

/// The LoRA settings (present: LoRA is on).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraConfig {
    pub adapters: Vec<LoraEntry>,
    /// Adapters resident on each agent at once: as many distinct adapters run together.
    pub max_loras: u32,
    /// Largest adapter rank accepted (each slot is sized for it).
    pub max_lora_rank: u32,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            adapters: Vec::new(),
            max_loras: 1,
            max_lora_rank: 16,
        }
    }
}

const ENTRY_KEYS: &str = "a lora_adapters entry has `name` and `path` only";

pub(super) fn lora(s: &mut Section) -> Result<Option<LoraConfig>, ConfigError> {
    let list = s.raw("lora_adapters");
    let max_loras = s.u64("max_loras")?;
    let max_rank = s.u64("max_lora_rank")?;
    if list.is_none() && max_loras.is_none() && max_rank.is_none() {
        return Ok(None);
    }
    let mut c = LoraConfig::default();
    if let Some(m) = max_loras {
        if m == 0 || m > MAX_LORAS {
            return Err(ConfigError::not_allowed(
                &s.key_path("max_loras"),
                m,
                format!("1..={MAX_LORAS} (adapters resident on each agent at once)"),
            ));
        }
        c.max_loras = m as u32;
    }
    if let Some(r) = max_rank {
        if r == 0 || r > MAX_LORA_RANK {
            return Err(ConfigError::not_allowed(
                &s.key_path("max_lora_rank"),
                r,
                format!("1..={MAX_LORA_RANK} (the largest adapter rank accepted)"),
            ));
        }
        c.max_lora_rank = r as u32;
    }
    let Some(list) = list else {
        return Ok(Some(c));
    };
    let path = s.key_path("lora_adapters");
    let items = match list {
        Value::Sequence(items) => items.as_slice(),
        Value::Null => &[],
        other => {
            return Err(ConfigError::WrongType {
                path,
                expected: "a list of {name, path} entries",
                found: describe(other),
            })
        }
    };
    let mut names = BTreeSet::new();
    for (i, item) in items.iter().enumerate() {
        let mut e = Section::new(&format!("{path}[{i}]"), Some(item))?;
        let name = e.string("name")?.unwrap_or_default().trim().to_string();
        if name.is_empty() {
            return Err(ConfigError::Empty {
                path: e.key_path("name"),
                need: "the adapter's name (what requests give as `model`)",
            });
        }
        if !names.insert(name.clone()) {
            return Err(ConfigError::not_allowed(
                &e.key_path("name"),
                format!("{name:?}"),
                "a name no other entry has",
            ));
        }
        let p = e.string("path")?.unwrap_or_default().trim().to_string();
        if p.is_empty() {
            return Err(ConfigError::Empty {
                path: e.key_path("path"),
                need: "the adapter's PEFT directory or GGUF LoRA file",
            });
        }
        if p.len() > MAX_LORA_PATH {
            return Err(ConfigError::not_allowed(
                &e.key_path("path"),
                format!("a path of {} bytes", p.len()),
                format!("at most {MAX_LORA_PATH} bytes"),
            ));
        }
        e.finish(&mut Vec::new(), Unknown::Refuse(ENTRY_KEYS))?;
        c.adapters.push(LoraEntry {
            name,
            path: super::sections::expand_home(&p),
        });
    }
    Ok(Some(c))
}

/// What LoRA cannot be combined with yet, each refused naming its key.
pub(super) fn check_with(c: &super::NpuServingConfig) -> Result<(), ConfigError> {
    const ON: &str = "LoRA adapters (npu_serving.lora_adapters / max_loras / max_lora_rank)";
    if c.tensor_parallel_size > 1 {
        return Err(ConfigError::not_allowed(
            "npu_serving.tensor_parallel_size",
            c.tensor_parallel_size,
            format!("1 with {ON}: adapters are not split over tensor-parallel ranks yet"),
        ));
    }
    if super::roles::splits(&c.agent_roles) {
        return Err(ConfigError::not_allowed(
            "npu_serving.agent_roles",
            "a prefill/decode split",
            format!("every agent `both` with {ON}: a request's adapter is not handed over"),
        ));
    }
    if c.long_context.is_some() {
        return Err(ConfigError::not_allowed(
            "npu_serving.long_context",
            "set",
            format!("absent with {ON} (not built together)"),
        ));
    }
    if !c.models.entries.is_empty() {
        return Err(ConfigError::not_allowed(
            "npu_serving.models",
            "a list of models",
            format!("absent with {ON} (not built together)"),
        ));
    }
    Ok(())
}

/// `p` with a leading `~/` taken from `$HOME` (as config paths are).
pub fn expand_home_path(p: &str) -> PathBuf {
    super::sections::expand_home(p)
}

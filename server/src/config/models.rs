//! `npu_serving.models` and `npu_serving.max_resident_models`: one server serving several
//! models, each described by its own llm-serving YAML file, loaded on its first request and
//! unloaded (least recently used first) when more than `max_resident_models` would be resident.
//! This module only reads and checks the keys; `crate::models` runs them.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_yaml::Value;

use super::error::ConfigError;
use super::reader::{describe, Section, Unknown};

/// Most models one server may list.
pub const MAX_MODELS: usize = 64;

/// One served model: the name requests give as `model`, and its own config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelEntry {
    /// What a request's `model` field (or the llm-serving route's `{name}`) says to choose it.
    pub name: String,
    /// Its llm-serving YAML (model_config, pa_config, npu_serving.model_file, ...); a relative
    /// path is taken from the directory of the config that lists it.
    pub config: PathBuf,
}

/// The models of a multi-model server; `entries` empty: one model, as before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelsConfig {
    pub entries: Vec<ModelEntry>,
    /// How many models may be loaded at once; loading one more unloads the least recently used
    /// idle one first.
    pub max_resident: u32,
}

impl Default for ModelsConfig {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            max_resident: 1,
        }
    }
}

const ENTRY_KEYS: &str = "a models entry has `name` and `config` only";

pub(super) fn models(s: &mut Section, model_file_set: bool) -> Result<ModelsConfig, ConfigError> {
    let mut c = ModelsConfig::default();
    let max = s.u64("max_resident_models")?;
    let Some(list) = s.raw("models") else {
        if let Some(m) = max {
            return Err(ConfigError::not_allowed(
                &s.key_path("max_resident_models"),
                m,
                "absent unless npu_serving.models lists the models",
            ));
        }
        return Ok(c);
    };
    let path = s.key_path("models");
    let Value::Sequence(items) = list else {
        return Err(ConfigError::WrongType {
            path,
            expected: "a list of {name, config} entries",
            found: describe(list),
        });
    };
    if items.is_empty() {
        return Err(ConfigError::Empty {
            path,
            need: "at least one {name, config} entry",
        });
    }
    if items.len() > MAX_MODELS {
        return Err(ConfigError::not_allowed(
            &path,
            format!("{} entries", items.len()),
            format!("at most {MAX_MODELS} entries"),
        ));
    }
    if model_file_set {
        return Err(ConfigError::not_allowed(
            &s.key_path("model_file"),
            "set with npu_serving.models",
            "absent: each models entry's own config names its model file",
        ));
    }
    let mut names = BTreeSet::new();
    for (i, item) in items.iter().enumerate() {
        let mut e = Section::new(&format!("{path}[{i}]"), Some(item))?;
        let name = e.string("name")?.ok_or_else(|| ConfigError::Empty {
            path: e.key_path("name"),
            need: "the model's name (what requests give as `model`)",
        })?;
        let name = name.trim().to_string();
        if name.is_empty() {
            return Err(ConfigError::Empty {
                path: e.key_path("name"),
                need: "the model's name (what requests give as `model`)",
            });
        }
        if !names.insert(name.clone()) {
            return Err(ConfigError::not_allowed(
                &e.key_path("name"),
                format!("{name:?}"),
                "a name no other entry has",
            ));
        }
        let config = e.string("config")?.ok_or_else(|| ConfigError::Empty {
            path: e.key_path("config"),
            need: "the path of the model's own llm-serving YAML config",
        })?;
        if config.trim().is_empty() {
            return Err(ConfigError::Empty {
                path: e.key_path("config"),
                need: "the path of the model's own llm-serving YAML config",
            });
        }
        e.finish(&mut Vec::new(), Unknown::Refuse(ENTRY_KEYS))?;
        c.entries.push(ModelEntry {
            name,
            config: PathBuf::from(config.trim()),
        });
    }
    if let Some(m) = max {
        if m == 0 || m > c.entries.len() as u64 {
            return Err(ConfigError::not_allowed(
                &s.key_path("max_resident_models"),
                m,
                format!(
                    "1..={} (how many of the listed models may be loaded at once)",
                    c.entries.len()
                ),
            ));
        }
        c.max_resident = m as u32;
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use crate::config::ServerConfig;

    fn err(yaml: &str) -> String {
        ServerConfig::from_yaml_str(&format!("npu_serving:\n{yaml}"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn models_are_read_and_every_bad_key_is_named() {
        let c = ServerConfig::from_yaml_str("npu_serving: {}\n").unwrap();
        assert!(c.npu_serving.models.entries.is_empty());
        let c = ServerConfig::from_yaml_str(
            "npu_serving:\n  max_resident_models: 2\n  models:\n    - {name: a, config: a.yaml}\n    \
             - {name: b, config: /x/b.yaml}\n",
        )
        .unwrap();
        let m = &c.npu_serving.models;
        assert_eq!(m.max_resident, 2);
        assert_eq!(m.entries.len(), 2);
        assert_eq!(m.entries[1].name, "b");
        assert_eq!(m.entries[1].config, std::path::PathBuf::from("/x/b.yaml"));
        let one = "  models: [{name: a, config: a.yaml}]\n";
        for (yaml, key) in [
            ("  models: a.yaml\n", "npu_serving.models"),
            ("  models: []\n", "npu_serving.models"),
            (
                "  models: [{config: a.yaml}]\n",
                "npu_serving.models[0].name",
            ),
            ("  models: [{name: a}]\n", "npu_serving.models[0].config"),
            (
                "  models: [{name: a, config: a.yaml, modle: x}]\n",
                "npu_serving.models[0].modle",
            ),
            (
                "  models: [{name: a, config: a.yaml}, {name: a, config: b.yaml}]\n",
                "npu_serving.models[1].name",
            ),
            (
                "  max_resident_models: 1\n",
                "npu_serving.max_resident_models",
            ),
            (
                &format!("{one}  max_resident_models: 0\n"),
                "npu_serving.max_resident_models",
            ),
            (
                &format!("{one}  max_resident_models: 2\n"),
                "npu_serving.max_resident_models",
            ),
            (
                &format!("{one}  model_file: x.gguf\n"),
                "npu_serving.model_file",
            ),
        ] {
            let e = err(yaml);
            assert!(e.contains(key), "{yaml}: {e}");
        }
    }
}

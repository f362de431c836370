//! A typed walk over one YAML section (`serde_yaml::Value`): each getter marks its key as known,
//! turns wrong YAML types into errors naming the key's full path, and `finish` warns about keys
//! nobody asked for.

use std::collections::BTreeSet;

use serde_yaml::{Mapping, Value};

use super::error::{ConfigError, ConfigWarning};

/// Describes a YAML value for error messages: its type, and the value when it is short.
pub(crate) fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) if s.chars().count() <= 40 => format!("string {s:?}"),
        Value::String(_) => "a long string".into(),
        Value::Sequence(_) => "a list".into(),
        Value::Mapping(_) => "a mapping".into(),
        Value::Tagged(t) => format!("a value tagged {}", t.tag),
    }
}

fn key_name(k: &Value) -> String {
    match k {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => format!("{other:?}"),
    }
}

/// One mapping of the config (a top-level section, or a nested one such as `tokenizer`).
pub(crate) struct Section<'a> {
    path: String,
    map: Option<&'a Mapping>,
    used: BTreeSet<String>,
}

impl<'a> Section<'a> {
    /// `value` is the section's value (absent or null = empty section); it must be a mapping.
    pub(crate) fn new(path: &str, value: Option<&'a Value>) -> Result<Self, ConfigError> {
        let map = match value {
            None | Some(Value::Null) => None,
            Some(Value::Mapping(m)) => Some(m),
            Some(other) => {
                return Err(ConfigError::WrongType {
                    path: path.to_string(),
                    expected: "a mapping of keys",
                    found: describe(other),
                })
            }
        };
        Ok(Self {
            path: path.to_string(),
            map,
            used: BTreeSet::new(),
        })
    }

    pub(crate) fn key_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// The key's value (null counts as absent), marking the key as known.
    pub(crate) fn raw(&mut self, key: &str) -> Option<&'a Value> {
        self.used.insert(key.to_string());
        match self.map?.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    fn wrong(&self, key: &str, expected: &'static str, v: &Value) -> ConfigError {
        ConfigError::WrongType {
            path: self.key_path(key),
            expected,
            found: describe(v),
        }
    }

    pub(crate) fn u64(&mut self, key: &str) -> Result<Option<u64>, ConfigError> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64()),
            Some(v) => Err(self.wrong(key, "a non-negative integer", v)),
        }
    }

    pub(crate) fn f64(&mut self, key: &str) -> Result<Option<f64>, ConfigError> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(self.wrong(key, "a finite number", &Value::Number(n.clone()))),
            },
            Some(v) => Err(self.wrong(key, "a number", v)),
        }
    }

    /// A boolean; the strings "True"/"False"/"true"/"false" are accepted too.
    pub(crate) fn bool(&mut self, key: &str) -> Result<Option<bool>, ConfigError> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(Value::String(s)) if parse_bool_str(s).is_some() => Ok(parse_bool_str(s)),
            Some(v) => Err(self.wrong(key, "a boolean (true or false)", v)),
        }
    }

    pub(crate) fn string(&mut self, key: &str) -> Result<Option<String>, ConfigError> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.wrong(key, "a string", v)),
        }
    }

    /// An integer or a list of integers (llm-serving's bucket lists). An empty list is an error
    /// saying what is needed (`need`).
    pub(crate) fn u64_list(
        &mut self,
        key: &str,
        need: &'static str,
    ) -> Result<Option<Vec<u64>>, ConfigError> {
        let Some(v) = self.raw(key) else {
            return Ok(None);
        };
        let expected = "a non-negative integer or a list of them";
        match v {
            Value::Number(n) => match n.as_u64() {
                Some(x) => Ok(Some(vec![x])),
                None => Err(self.wrong(key, expected, v)),
            },
            Value::Sequence(items) => {
                if items.is_empty() {
                    return Err(ConfigError::Empty {
                        path: self.key_path(key),
                        need,
                    });
                }
                let mut out = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    match item {
                        Value::Number(n) if n.as_u64().is_some() => {
                            out.push(n.as_u64().unwrap_or(0))
                        }
                        other => {
                            return Err(ConfigError::WrongType {
                                path: format!("{}[{i}]", self.key_path(key)),
                                expected: "a non-negative integer",
                                found: describe(other),
                            })
                        }
                    }
                }
                Ok(Some(out))
            }
            other => Err(self.wrong(key, expected, other)),
        }
    }

    /// A nested mapping as its own section (absent = empty).
    pub(crate) fn section(&mut self, key: &str) -> Result<Section<'a>, ConfigError> {
        let path = self.key_path(key);
        Section::new(&path, self.raw(key))
    }

    /// A key that is accepted but has no effect: one warning when it is present.
    pub(crate) fn ignored(&mut self, key: &str, why: &str, warnings: &mut Vec<ConfigWarning>) {
        if self.raw(key).is_some() {
            warnings.push(ConfigWarning {
                path: self.key_path(key),
                message: format!("ignored: {why}"),
            });
        }
    }

    /// Warns about every key of the section that no getter asked for.
    pub(crate) fn finish(self, warnings: &mut Vec<ConfigWarning>) {
        let Some(map) = self.map else { return };
        for (k, _) in map {
            let name = key_name(k);
            if !self.used.contains(&name) {
                warnings.push(ConfigWarning {
                    path: self.key_path(&name),
                    message: "unknown key, ignored".into(),
                });
            }
        }
    }
}

/// "True"/"true"/"False"/"false" (what Python-made configs and requests write).
pub fn parse_bool_str(s: &str) -> Option<bool> {
    match s {
        "True" | "true" | "TRUE" => Some(true),
        "False" | "false" | "FALSE" => Some(false),
        _ => None,
    }
}

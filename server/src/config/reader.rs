//! A typed walk over one YAML section (`serde_yaml::Value`): each getter marks its key as known,
//! turns wrong YAML types into errors naming the key's full path, and `finish` warns about (or
//! refuses) keys nobody asked for, suggesting the known key closest to a misspelt one.

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

    /// Every key of the section that no getter asked for is warned about, or refused with
    /// `Unknown::Refuse`; either names the known key it most likely meant.
    pub(crate) fn finish(
        self,
        warnings: &mut Vec<ConfigWarning>,
        unknown: Unknown,
    ) -> Result<(), ConfigError> {
        let Some(map) = self.map else { return Ok(()) };
        for (k, _) in map {
            let name = key_name(k);
            if self.used.contains(&name) {
                continue;
            }
            let guess = closest(&name, self.used.iter().map(String::as_str));
            let did_you_mean = guess
                .map(|g| format!(" (did you mean {g}?)"))
                .unwrap_or_default();
            match unknown {
                Unknown::Warn => warnings.push(ConfigWarning {
                    path: self.key_path(&name),
                    message: format!("unknown key, ignored{did_you_mean}"),
                }),
                Unknown::Refuse(why) => {
                    return Err(ConfigError::UnknownKey {
                        path: self.key_path(&name),
                        hint: format!("{did_you_mean}; {why}"),
                    })
                }
            }
        }
        Ok(())
    }
}

/// What `Section::finish` does with a key nobody asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unknown {
    /// A warning (llm-serving's sections: configs written for it may carry more).
    Warn,
    /// An error; the text says why such keys are refused.
    Refuse(&'static str),
}

/// The candidate a misspelt `name` most likely meant: the closest by edit distance (adjacent
/// swaps count as one edit, case is ignored), if it is within a third of the name's length.
pub(crate) fn closest<'c>(
    name: &str,
    candidates: impl Iterator<Item = &'c str>,
) -> Option<&'c str> {
    let name_lc = name.to_lowercase();
    let limit = (name.chars().count() / 3).max(1);
    candidates
        .map(|c| (edit_distance(&name_lc, &c.to_lowercase()), c))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// Optimal-string-alignment distance: insertions, deletions, substitutions and swaps of two
/// adjacent characters each cost one.
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let w = b.len() + 1;
    let mut d = vec![0usize; (a.len() + 1) * w];
    for i in 0..=a.len() {
        d[i * w] = i;
    }
    for (j, cell) in d.iter_mut().enumerate().take(w) {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[(i - 1) * w + j] + 1)
                .min(d[i * w + j - 1] + 1)
                .min(d[(i - 1) * w + j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[(i - 2) * w + j - 2] + 1);
            }
            d[i * w + j] = v;
        }
    }
    d[a.len() * w + b.len()]
}

/// "True"/"true"/"False"/"false" (what Python-made configs and requests write).
pub fn parse_bool_str(s: &str) -> Option<bool> {
    match s {
        "True" | "true" | "TRUE" => Some(true),
        "False" | "false" | "FALSE" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance_counts_swaps_as_one_edit() {
        assert_eq!(edit_distance("prefix_cahce", "prefix_cache"), 1);
        assert_eq!(edit_distance("model_confg", "model_config"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
    }

    #[test]
    fn closest_suggests_only_near_names() {
        let known = ["model_config", "serving_config", "pa_config", "npu_serving"];
        assert_eq!(
            closest("model_confg", known.iter().copied()),
            Some("model_config")
        );
        assert_eq!(
            closest("NPU_Serving", known.iter().copied()),
            Some("npu_serving")
        );
        assert_eq!(closest("turbo", known.iter().copied()), None);
        assert_eq!(closest("x", ["y", "xy"].iter().copied()), Some("y"));
    }
}

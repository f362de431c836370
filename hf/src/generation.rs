//! `generation_config.json`: the sampling defaults a model's authors ship with it, which a
//! server applies to a request that does not set them (vLLM's `--generation-config auto`):
//! `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `max_new_tokens` (a
//! request's `max_tokens`), and the special token ids (`eos_token_id` may list several).
//!
//! `do_sample: false` is read as transformers reads it, greedy decoding: the config then comes
//! back with `temperature` `Some(0.0)` and no `top_p`, `top_k` or `min_p`, whatever the file says
//! of them (vLLM itself ignores `do_sample` and would apply a temperature written beside it; a
//! file saying both is self-contradictory, and its `do_sample` is the authors' stated intent).

use std::path::Path;

use serde_json::{Map, Value};

use crate::safetensors::kind;
use crate::HfError;

/// The file this module reads.
pub const FILE: &str = "generation_config.json";

/// A model's generation defaults; every field is `None` (or empty) when the file does not set it
/// (or sets it to `null`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    /// `eos_token_id`: one id or a list.
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    /// At least 0 (0 is greedy).
    pub temperature: Option<f32>,
    /// In (0, 1].
    pub top_p: Option<f32>,
    /// Positive; a file's 0 or -1 (off) is `None`.
    pub top_k: Option<u32>,
    /// In [0, 1].
    pub min_p: Option<f32>,
    /// Positive (1 is off).
    pub repetition_penalty: Option<f32>,
    /// At least 1.
    pub max_new_tokens: Option<u32>,
    pub do_sample: Option<bool>,
}

fn bad(key: &str, what: impl Into<String>) -> HfError {
    HfError::Generation {
        key: key.to_string(),
        what: what.into(),
    }
}

impl GenerationConfig {
    /// Reads the parsed `generation_config.json`. A value of the wrong type or out of range is
    /// an error naming its key; keys this type does not hold are ignored; `null` is absent.
    pub fn from_json(v: &Value) -> Result<Self, HfError> {
        let Some(obj) = v.as_object() else {
            return Err(bad(
                "(top level)",
                format!("the file holds {}, not an object", kind(v)),
            ));
        };
        let mut c = GenerationConfig {
            eos_token_ids: eos_ids(obj)?,
            bos_token_id: token_id(obj, "bos_token_id")?,
            pad_token_id: token_id(obj, "pad_token_id")?,
            temperature: float(obj, "temperature", |x| x >= 0.0, "at least 0")?,
            top_p: float(obj, "top_p", |x| x > 0.0 && x <= 1.0, "in (0, 1]")?,
            top_k: top_k(obj)?,
            min_p: float(obj, "min_p", |x| (0.0..=1.0).contains(&x), "in [0, 1]")?,
            repetition_penalty: float(obj, "repetition_penalty", |x| x > 0.0, "positive")?,
            max_new_tokens: match int(obj, "max_new_tokens")? {
                None => None,
                Some(n) if n >= 1 => Some(u32::try_from(n).unwrap_or(u32::MAX)),
                Some(n) => return Err(bad("max_new_tokens", format!("{n} must be at least 1"))),
            },
            do_sample: match get(obj, "do_sample") {
                None => None,
                Some(Value::Bool(b)) => Some(*b),
                Some(other) => {
                    return Err(bad(
                        "do_sample",
                        format!("{other} is {}, not a boolean", kind(other)),
                    ))
                }
            },
        };
        if c.do_sample == Some(false) {
            c.temperature = Some(0.0);
            c.top_p = None;
            c.top_k = None;
            c.min_p = None;
        }
        Ok(c)
    }

    /// Reads `dir/generation_config.json`: `None` when the file is absent.
    pub fn read(dir: &Path) -> Result<Option<Self>, HfError> {
        match crate::read_json(dir, FILE)? {
            None => Ok(None),
            Some(v) => Self::from_json(&v).map(Some),
        }
    }

    /// Whether the defaults ask for greedy decoding (`do_sample: false` or temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.do_sample == Some(false) || self.temperature == Some(0.0)
    }
}

/// The key's value, `null` read as absent.
fn get<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// An integer (a float with no fractional part, as some exporters write `2.0`, is accepted).
fn int(obj: &Map<String, Value>, key: &str) -> Result<Option<i64>, HfError> {
    let Some(v) = get(obj, key) else {
        return Ok(None);
    };
    as_int(v)
        .map(Some)
        .ok_or_else(|| bad(key, format!("{v} is {}, not an integer", kind(v))))
}

fn as_int(v: &Value) -> Option<i64> {
    if let Some(n) = v.as_i64() {
        return Some(n);
    }
    let f = v.as_f64()?;
    (f.fract() == 0.0 && f.abs() < 9.0e15).then_some(f as i64)
}

fn token_id(obj: &Map<String, Value>, key: &str) -> Result<Option<u32>, HfError> {
    match int(obj, key)? {
        None => Ok(None),
        Some(n) => u32::try_from(n)
            .map(Some)
            .map_err(|_| bad(key, format!("{n} is not a token id (0 to {})", u32::MAX))),
    }
}

fn eos_ids(obj: &Map<String, Value>) -> Result<Vec<u32>, HfError> {
    const KEY: &str = "eos_token_id";
    let Some(v) = get(obj, KEY) else {
        return Ok(Vec::new());
    };
    let one = |v: &Value| -> Result<u32, HfError> {
        let n = as_int(v).ok_or_else(|| bad(KEY, format!("{v} is {}, not a token id", kind(v))))?;
        u32::try_from(n).map_err(|_| bad(KEY, format!("{n} is not a token id (0 to {})", u32::MAX)))
    };
    let mut ids = match v {
        Value::Array(items) => items.iter().map(one).collect::<Result<Vec<_>, _>>()?,
        _ => vec![one(v)?],
    };
    // A list that repeats an id means the same; keep the first of each, in order.
    let mut seen = std::collections::HashSet::new();
    ids.retain(|id| seen.insert(*id));
    Ok(ids)
}

fn float(
    obj: &Map<String, Value>,
    key: &str,
    ok: impl Fn(f64) -> bool,
    range: &str,
) -> Result<Option<f32>, HfError> {
    let Some(v) = get(obj, key) else {
        return Ok(None);
    };
    let Some(x) = v.as_f64() else {
        return Err(bad(key, format!("{v} is {}, not a number", kind(v))));
    };
    if !ok(x) {
        return Err(bad(key, format!("{v} is out of range: it must be {range}")));
    }
    if !(x as f32).is_finite() {
        return Err(bad(key, format!("{v} is out of range of a 32-bit float")));
    }
    Ok(Some(x as f32))
}

fn top_k(obj: &Map<String, Value>) -> Result<Option<u32>, HfError> {
    match int(obj, "top_k")? {
        None | Some(0) | Some(-1) => Ok(None),
        Some(n) if n > 0 => Ok(Some(u32::try_from(n).unwrap_or(u32::MAX))),
        Some(n) => Err(bad(
            "top_k",
            format!("{n} is out of range: it must be positive, or 0 or -1 for off"),
        )),
    }
}

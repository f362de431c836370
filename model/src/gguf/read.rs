//! Strict readers of hyper-parameter keys. A key of the wrong type is an error naming it (never
//! read as absent, which would put a default in its place), a per-layer array is taken only when
//! every layer has the same value (the engine runs one value for all), and every size is bounded
//! where it is read, so that nothing is sized by a damaged header.

use crate::HparamsError;
use npu_gguf::{GgufError, GgufFile, MetaValue};

/// llama.cpp's `LLAMA_MAX_LAYERS`.
pub(crate) const MAX_LAYERS: u64 = 512;
/// llama.cpp's `LLAMA_MAX_EXPERTS`.
pub(crate) const MAX_EXPERTS: u64 = 1024;
/// Far beyond any released model (16,384 for Llama 3.1 405B); keeps products of sizes small.
pub(crate) const MAX_EMBEDDING: u64 = 1 << 17;
/// Feed-forward widths (dense or one expert's): 53,248 for Llama 3.1 405B.
pub(crate) const MAX_FF: u64 = 1 << 20;
/// Attention heads (query or KV): 128 for the largest released models.
pub(crate) const MAX_HEADS: u64 = 1 << 12;
/// Head width: 256 for Gemma 3.
pub(crate) const MAX_HEAD_DIM: u64 = 1 << 12;
/// Vocabulary: 262,144 for Gemma 3.
pub(crate) const MAX_VOCAB: u64 = 1 << 24;
/// Training context: 10M for Llama 4 Scout.
pub(crate) const MAX_CONTEXT: u64 = 1 << 26;

fn wrong(key: &str, v: &MetaValue, expected: &'static str) -> HparamsError {
    HparamsError::Gguf(GgufError::WrongType {
        key: key.to_string(),
        found: v.type_name(),
        expected,
    })
}

/// An integer value (of any integer type, not a bool), if it is a non-negative one.
fn integer(v: &MetaValue) -> Option<u64> {
    match v {
        MetaValue::Bool(_) => None,
        _ => v.as_u64(),
    }
}

/// A non-negative integer key. With `n_layers`, a per-layer array of that many entries (as
/// llama.cpp's `get_key_or_arr` reads) is taken when all its entries are equal.
pub(super) fn uint(
    f: &GgufFile,
    key: &str,
    n_layers: Option<usize>,
) -> Result<Option<u64>, HparamsError> {
    let Some(v) = f.get(key) else {
        return Ok(None);
    };
    if let (MetaValue::Array(a), Some(n)) = (v, n_layers) {
        let values: Vec<u64> = a
            .iter()
            .map(integer)
            .collect::<Option<_>>()
            .ok_or_else(|| wrong(key, v, "unsigned integer or array of them"))?;
        if values.len() != n {
            return Err(HparamsError::Inconsistent(format!(
                "{key} has {} per-layer values for {n} layers",
                values.len()
            )));
        }
        let first = values[0];
        if let Some(other) = values.iter().find(|&&x| x != first) {
            return Err(HparamsError::Unsupported(format!(
                "{key} differs between layers ({first} and {other}); the engine runs one value \
                 for every layer"
            )));
        }
        return Ok(Some(first));
    }
    integer(v)
        .map(Some)
        .ok_or_else(|| wrong(key, v, "unsigned integer"))
}

/// A required non-negative integer key (see [`uint`]).
pub(super) fn req_uint(
    f: &GgufFile,
    key: &str,
    n_layers: Option<usize>,
) -> Result<u64, HparamsError> {
    uint(f, key, n_layers)?.ok_or_else(|| GgufError::MissingKey(key.to_string()).into())
}

/// A number key (float or integer).
pub(super) fn float(f: &GgufFile, key: &str) -> Result<Option<f64>, HparamsError> {
    let Some(v) = f.get(key) else {
        return Ok(None);
    };
    match v {
        MetaValue::Bool(_) | MetaValue::String(_) | MetaValue::Array(_) => {
            Err(wrong(key, v, "number"))
        }
        _ => Ok(v.as_f64()),
    }
}

/// A string key.
pub(super) fn string<'a>(f: &'a GgufFile, key: &str) -> Result<Option<&'a str>, HparamsError> {
    match f.get(key) {
        None => Ok(None),
        Some(MetaValue::String(s)) => Ok(Some(s)),
        Some(v) => Err(wrong(key, v, "string")),
    }
}

/// `v` as a size within `lo..=hi`, or an error naming the key.
pub(super) fn within(key: &str, v: u64, lo: u64, hi: u64) -> Result<usize, HparamsError> {
    if v < lo || v > hi {
        return Err(HparamsError::Inconsistent(format!(
            "{key} = {v} is outside {lo}..={hi}"
        )));
    }
    usize::try_from(v)
        .map_err(|_| HparamsError::Inconsistent(format!("{key} = {v} does not fit this machine")))
}

/// `v` as a finite, positive f32, or an error naming the key.
pub(super) fn positive(key: &str, v: f64) -> Result<f32, HparamsError> {
    let x = v as f32;
    if !(x.is_finite() && x > 0.0) {
        return Err(HparamsError::Inconsistent(format!(
            "{key} = {v} must be a finite positive number"
        )));
    }
    Ok(x)
}

/// A metadata value for a message: numbers and booleans as they are, strings quoted, arrays
/// shortened.
pub(super) fn show(v: &MetaValue) -> String {
    match v {
        MetaValue::String(s) if s.chars().count() > 40 => {
            format!("{:?}...", s.chars().take(40).collect::<String>())
        }
        MetaValue::String(s) => format!("{s:?}"),
        MetaValue::Array(a) => {
            let mut parts: Vec<String> = a.iter().take(8).map(show).collect();
            if a.len() > 8 {
                parts.push(format!("... ({} values)", a.len()));
            }
            format!("[{}]", parts.join(", "))
        }
        MetaValue::F32(x) => format!("{x}"),
        MetaValue::F64(x) => format!("{x}"),
        MetaValue::Bool(b) => format!("{b}"),
        _ => v
            .as_i64()
            .map_or_else(|| format!("{v:?}"), |i| i.to_string()),
    }
}

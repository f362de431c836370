//! Typed reading of JSON request fields: numbers (also as numeric strings, as pydantic-based
//! servers accept), booleans (also "True"/"False"/"true"/"false"), strings and string lists.
//! A known field of the wrong type is a 400 that names it; null counts as absent. Every key a
//! route asks for is remembered, so that a route may refuse the keys it never asked for
//! (`unknown`), with the known key each one most likely meant.

use std::cell::RefCell;

use serde_json::{Map, Value};

use super::error::ApiError;
use crate::config::{closest, parse_bool_str};

/// The fields of one JSON object, with the path prefix used in error messages.
pub(crate) struct Fields<'a> {
    obj: Option<&'a Map<String, Value>>,
    prefix: &'static str,
    /// The keys asked for so far (known to the route, present or not).
    asked: RefCell<Vec<String>>,
}

/// A key of the object that the route never asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UnknownField {
    /// Its full name (with the object's prefix).
    pub name: String,
    /// The key it most likely meant, when one is close.
    pub hint: Option<String>,
}

impl UnknownField {
    /// `name (did you mean known?)`, or just the name.
    pub fn describe(&self) -> String {
        match &self.hint {
            Some(h) => format!("{} ({h})", self.name),
            None => self.name.clone(),
        }
    }
}

/// The 400 for unknown fields: names every one of them, each with its suggestion.
pub(crate) fn unknown_fields_error(unknown: &[UnknownField]) -> ApiError {
    let list = unknown
        .iter()
        .map(UnknownField::describe)
        .collect::<Vec<_>>()
        .join(", ");
    let what = if unknown.len() == 1 {
        "unknown field"
    } else {
        "unknown fields"
    };
    let param = unknown.first().map_or("", |u| u.name.as_str());
    ApiError::invalid(param, format!("{what}: {list}"))
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

impl<'a> Fields<'a> {
    pub fn new(obj: &'a Map<String, Value>, prefix: &'static str) -> Self {
        Self {
            obj: Some(obj),
            prefix,
            asked: RefCell::default(),
        }
    }

    /// A nested object field (absent or null = no fields).
    pub fn object(&self, key: &str, prefix: &'static str) -> Result<Fields<'a>, ApiError> {
        match self.get(key) {
            None => Ok(Fields {
                obj: None,
                prefix,
                asked: RefCell::default(),
            }),
            Some(Value::Object(m)) => Ok(Fields::new(m, prefix)),
            Some(v) => Err(self.wrong(key, "an object", v)),
        }
    }

    pub fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// Whether the route asked for `key` (by any getter).
    pub fn was_asked(&self, key: &str) -> bool {
        self.asked.borrow().iter().any(|k| k == key)
    }

    /// The keys of the object the route has not asked for, in the body's order, each with the
    /// asked-for key it most likely meant.
    pub fn unknown(&self) -> Vec<UnknownField> {
        let Some(obj) = self.obj else {
            return Vec::new();
        };
        let asked = self.asked.borrow();
        obj.keys()
            .filter(|k| !asked.iter().any(|a| a == *k))
            .map(|k| UnknownField {
                name: self.name(k),
                hint: closest(k, asked.iter().map(String::as_str))
                    .map(|g| format!("did you mean {g}?")),
            })
            .collect()
    }

    pub fn get(&self, key: &str) -> Option<&'a Value> {
        {
            let mut asked = self.asked.borrow_mut();
            if !asked.iter().any(|k| k == key) {
                asked.push(key.to_string());
            }
        }
        match self.obj?.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    pub fn wrong(&self, key: &str, expected: &str, v: &Value) -> ApiError {
        let name = self.name(key);
        ApiError::invalid(
            &name,
            format!("{name} must be {expected}, got {}", kind_of(v)),
        )
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(Value::String(s)) => match parse_bool_str(s) {
                Some(b) => Ok(Some(b)),
                None => {
                    let name = self.name(key);
                    Err(ApiError::invalid(
                        &name,
                        format!("{name} must be a boolean (true/false or \"True\"/\"False\"), got {s:?}"),
                    ))
                }
            },
            Some(v) => Err(self.wrong(key, "a boolean", v)),
        }
    }

    pub fn f64(&self, key: &str) -> Result<Option<f64>, ApiError> {
        let v = match self.get(key) {
            None => return Ok(None),
            Some(Value::Number(n)) => n.as_f64(),
            Some(Value::String(s)) => s.trim().parse::<f64>().ok(),
            Some(v) => return Err(self.wrong(key, "a number", v)),
        };
        match v {
            Some(x) if x.is_finite() => Ok(Some(x)),
            _ => {
                let name = self.name(key);
                Err(ApiError::invalid(
                    &name,
                    format!("{name} must be a finite number"),
                ))
            }
        }
    }

    /// A number as f32 (sampling parameters): one past f32's range (1e39) is refused, not
    /// turned into infinity (the agent refuses non-finite parameters as a damaged plan).
    pub fn f32(&self, key: &str) -> Result<Option<f32>, ApiError> {
        match self.f64(key)? {
            None => Ok(None),
            Some(x) if (x as f32).is_finite() => Ok(Some(x as f32)),
            Some(x) => {
                let name = self.name(key);
                Err(ApiError::invalid(
                    &name,
                    format!("{name} must be a finite number, got {x} (past a 32-bit float)"),
                ))
            }
        }
    }

    /// An integer (an integral float or a numeric string is accepted).
    pub fn i64(&self, key: &str) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let x = match v {
            Value::Number(n) => n.as_i64().or_else(|| {
                n.as_f64()
                    .filter(|f| f.fract() == 0.0 && f.abs() < 9e15)
                    .map(|f| f as i64)
            }),
            Value::String(s) => s.trim().parse::<i64>().ok(),
            _ => None,
        };
        x.map(Some).ok_or_else(|| self.wrong(key, "an integer", v))
    }

    /// An integer in `min..=max`.
    pub fn int_in(&self, key: &str, min: i64, max: i64) -> Result<Option<i64>, ApiError> {
        match self.i64(key)? {
            Some(x) if x < min || x > max => {
                let name = self.name(key);
                Err(ApiError::invalid(
                    &name,
                    format!("{name} must be in {min}..={max}, got {x}"),
                ))
            }
            other => Ok(other),
        }
    }

    /// A seed: any non-negative integer up to 2^64-1.
    pub fn u64(&self, key: &str) -> Result<Option<u64>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let x = match v {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.trim().parse::<u64>().ok(),
            _ => None,
        };
        x.map(Some)
            .ok_or_else(|| self.wrong(key, "a non-negative integer", v))
    }

    pub fn string(&self, key: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(key, "a string", v)),
        }
    }

    /// A string or a list of strings.
    pub fn strings(&self, key: &str) -> Result<Vec<String>, ApiError> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, it)| match it {
                    Value::String(s) => Ok(s.clone()),
                    other => {
                        let name = format!("{}[{i}]", self.name(key));
                        Err(ApiError::invalid(
                            &name,
                            format!("{name} must be a string, got {}", kind_of(other)),
                        ))
                    }
                })
                .collect(),
            Some(v) => Err(self.wrong(key, "a string or a list of strings", v)),
        }
    }

    /// A list of token ids.
    pub fn token_ids(&self, key: &str) -> Result<Vec<u32>, ApiError> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => token_id_list(&self.name(key), items),
            Some(v) => Err(self.wrong(key, "a list of token ids", v)),
        }
    }
}

/// Token ids from a JSON list (each a non-negative integer that fits u32).
pub(crate) fn token_id_list(name: &str, items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, it)| {
            it.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| {
                    ApiError::invalid(
                        name,
                        format!("{name}[{i}] must be a token id (a non-negative integer)"),
                    )
                })
        })
        .collect()
}

/// Parses a request body as a JSON object.
pub(crate) fn parse_body(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if body.is_empty() {
        return Err(ApiError::new(
            400,
            "invalid_request_error",
            "request body is empty: send a JSON object",
        ));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(ApiError::new(
            400,
            "invalid_request_error",
            format!(
                "request body must be a JSON object, got {}",
                kind_of(&other)
            ),
        )),
        Err(e) => Err(ApiError::new(
            400,
            "invalid_request_error",
            format!("request body is not valid JSON: {e}"),
        )),
    }
}

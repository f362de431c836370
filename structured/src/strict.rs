//! Strict JSON Schemas, as OpenAI's strict mode and xgrammar-backed servers read a tool's
//! parameters: an object schema admits only the properties it names unless it says otherwise
//! (`additionalProperties: true` or a schema). JSON Schema's own default admits any property,
//! so a grammar built from a plain schema lets a model write `{"city": "Paris", "type": ...}`;
//! `closed` writes `additionalProperties: false` into every object schema that leaves it unset.
//! Schemas that compose objects (`allOf` and its branches, `$ref` beside other keywords, and
//! the definitions such composition refers to) are left open, since closing one part would
//! refuse the properties another part names.

use std::collections::HashSet;

use serde_json::{Map, Value};

/// Keywords holding one subschema.
const ONE: [&str; 8] = [
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
];
/// Keywords holding a list of subschemas.
const LIST: [&str; 3] = ["anyOf", "oneOf", "prefixItems"];
/// Keywords holding a map of subschemas.
const MAP: [&str; 4] = ["properties", "patternProperties", "$defs", "definitions"];

/// `schema` with `additionalProperties: false` in every object schema that does not set it
/// (see the module's note on composition). Anything that is not an object is returned as is.
pub fn closed(schema: &Value) -> Value {
    let mut open_refs = HashSet::new();
    composed_refs(schema, &mut open_refs, 0);
    let mut out = schema.clone();
    close(&mut out, &open_refs, true, "#", 0);
    out
}

/// Deep enough for any real schema; deeper nesting is left as it is rather than recursed into.
const MAX_DEPTH: usize = 64;

fn is_object_schema(o: &Map<String, Value>) -> bool {
    let typed = match o.get("type") {
        Some(Value::String(t)) => t == "object",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "object"),
        _ => false,
    };
    typed || o.contains_key("properties") || o.contains_key("required")
}

/// The `$ref` targets used in composition (an `allOf` branch, or beside other keywords).
fn composed_refs(v: &Value, out: &mut HashSet<String>, depth: usize) {
    if depth > MAX_DEPTH {
        return;
    }
    match v {
        Value::Object(o) => {
            if let Some(Value::String(r)) = o.get("$ref") {
                if o.len() > 1 {
                    out.insert(r.clone());
                }
            }
            if let Some(Value::Array(branches)) = o.get("allOf") {
                for b in branches {
                    if let Some(Value::String(r)) = b.get("$ref") {
                        out.insert(r.clone());
                    }
                }
            }
            for child in o.values() {
                composed_refs(child, out, depth + 1);
            }
        }
        Value::Array(a) => {
            for child in a {
                composed_refs(child, out, depth + 1);
            }
        }
        _ => {}
    }
}

fn close(v: &mut Value, open_refs: &HashSet<String>, may_close: bool, path: &str, depth: usize) {
    if depth > MAX_DEPTH {
        return;
    }
    let Value::Object(o) = v else { return };
    let composed = o.contains_key("allOf") || (o.contains_key("$ref") && o.len() > 1);
    if may_close
        && !composed
        && !open_refs.contains(path)
        && is_object_schema(o)
        && !o.contains_key("additionalProperties")
        && !o.contains_key("unevaluatedProperties")
    {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in ONE {
        if let Some(child) = o.get_mut(key) {
            match child {
                Value::Array(items) => {
                    for (i, c) in items.iter_mut().enumerate() {
                        close(c, open_refs, true, &format!("{path}/{key}/{i}"), depth + 1);
                    }
                }
                c => close(c, open_refs, true, &format!("{path}/{key}"), depth + 1),
            }
        }
    }
    for key in LIST {
        if let Some(Value::Array(items)) = o.get_mut(key) {
            for (i, c) in items.iter_mut().enumerate() {
                close(c, open_refs, true, &format!("{path}/{key}/{i}"), depth + 1);
            }
        }
    }
    if let Some(Value::Array(items)) = o.get_mut("allOf") {
        for (i, c) in items.iter_mut().enumerate() {
            close(c, open_refs, false, &format!("{path}/allOf/{i}"), depth + 1);
        }
    }
    for key in MAP {
        if let Some(Value::Object(m)) = o.get_mut(key) {
            for (name, c) in m.iter_mut() {
                let p = format!(
                    "{path}/{key}/{}",
                    name.replace('~', "~0").replace('/', "~1")
                );
                close(c, open_refs, true, &p, depth + 1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_are_closed_unless_they_say_otherwise() {
        let s = json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
                "tags": {"type": "array", "items": {"properties": {"k": {}}}},
                "free": {"type": "object", "additionalProperties": true},
                "map": {"type": "object", "additionalProperties": {"type": "object"}},
                "either": {"anyOf": [{"type": "object"}, {"type": "null"}]}
            }
        });
        let c = closed(&s);
        assert_eq!(c["additionalProperties"], false);
        assert_eq!(c["properties"]["where"]["additionalProperties"], false);
        assert_eq!(
            c["properties"]["tags"]["items"]["additionalProperties"],
            false
        );
        assert_eq!(c["properties"]["free"]["additionalProperties"], true);
        assert_eq!(
            c["properties"]["map"]["additionalProperties"]["additionalProperties"],
            false
        );
        assert_eq!(
            c["properties"]["either"]["anyOf"][0]["additionalProperties"],
            false
        );
        assert!(c["properties"]["city"]
            .get("additionalProperties")
            .is_none());
        assert!(c["properties"]["either"]["anyOf"][1]
            .get("additionalProperties")
            .is_none());
    }

    #[test]
    fn composition_is_left_open() {
        let s = json!({
            "type": "object",
            "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {}}}],
            "$defs": {
                "base": {"type": "object", "properties": {"a": {}}},
                "other": {"type": "object", "properties": {"x": {}}}
            }
        });
        let c = closed(&s);
        assert!(c.get("additionalProperties").is_none());
        assert!(c["allOf"][1].get("additionalProperties").is_none());
        assert!(c["$defs"]["base"].get("additionalProperties").is_none());
        assert_eq!(c["$defs"]["other"]["additionalProperties"], false);
        // Not objects: unchanged.
        assert_eq!(closed(&json!(true)), json!(true));
        assert_eq!(
            closed(&json!({"type": "string"})),
            json!({"type": "string"})
        );
    }
}

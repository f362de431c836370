//! The structured-output fields of a request, on every route: OpenAI's `response_format`
//! (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`, `choice`,
//! `grammar`) and its older `guided_*` fields, and TGI's `parameters.grammar`
//! (`{"type": "json" | "regex", "value": ...}`) on llm-serving's routes; compiled into one
//! constraint per engine request. A grammar the compiler refuses is a 400 naming the field.

use npu_structured::{Constraint, ConstraintSpec, StructuredError};
use serde_json::Value;

use super::error::ApiError;
use super::fields::Fields;
use super::ApiContext;

/// What a request constrains its output to, and the field that said so.
pub(super) struct Asked {
    pub spec: ConstraintSpec,
    pub field: String,
}

/// A JSON Schema given as an object, or as a string holding one (vLLM accepts both).
fn schema_value(field: &str, v: &Value) -> Result<Value, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| ApiError::invalid(field, format!("{field} is not a JSON Schema: {e}"))),
        _ => Err(ApiError::invalid(
            field,
            format!("{field} must be a JSON Schema (an object)"),
        )),
    }
}

fn choices(field: &str, v: &Value) -> Result<ConstraintSpec, ApiError> {
    let list = v
        .as_array()
        .ok_or_else(|| ApiError::invalid(field, format!("{field} must be a list of strings")))?;
    let mut out = Vec::with_capacity(list.len());
    for c in list {
        let s = c.as_str().ok_or_else(|| {
            ApiError::invalid(field, format!("{field} must be a list of strings"))
        })?;
        out.push(s.to_string());
    }
    if out.is_empty() {
        return Err(ApiError::invalid(field, format!("{field} is empty")));
    }
    Ok(ConstraintSpec::Choice(out))
}

fn text(field: &str, v: &Value) -> Result<String, ApiError> {
    v.as_str()
        .map(str::to_string)
        .ok_or_else(|| ApiError::invalid(field, format!("{field} must be a string")))
}

/// Keeps the one constraint a request may give.
fn one(found: &mut Option<Asked>, spec: ConstraintSpec, field: &str) -> Result<(), ApiError> {
    if let Some(prev) = found {
        return Err(ApiError::invalid(
            field,
            format!(
                "{field} and {} both constrain the output: give one",
                prev.field
            ),
        ));
    }
    *found = Some(Asked {
        spec,
        field: field.to_string(),
    });
    Ok(())
}

/// The OpenAI routes' constraint fields (`response_format`, `structured_outputs`, `guided_*`).
pub(super) fn openai_constraint(f: &Fields) -> Result<Option<Asked>, ApiError> {
    let mut found = None;
    let rf = f.object("response_format", "response_format.")?;
    match rf.string("type")? {
        None | Some("text") => {}
        Some("json_object") => one(&mut found, ConstraintSpec::JsonObject, "response_format")?,
        Some("json_schema") => {
            let js = rf.object("json_schema", "response_format.json_schema.")?;
            let schema = match js.get("schema") {
                Some(v) => schema_value("response_format.json_schema.schema", v)?,
                None => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.schema",
                        "response_format.json_schema.schema is missing",
                    ))
                }
            };
            // `name`, `description` and `strict` are read and accepted: the schema is always
            // enforced exactly.
            js.string("name")?;
            js.string("description")?;
            js.bool("strict")?;
            one(
                &mut found,
                ConstraintSpec::JsonSchema(schema),
                "response_format.json_schema",
            )?;
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "response_format.type",
                format!(
                    "response_format.type {other:?} is not one of text, json_object, json_schema"
                ),
            ))
        }
    }
    let so = f.object("structured_outputs", "structured_outputs.")?;
    for (key, field, legacy) in [
        ("json", "structured_outputs.json", "guided_json"),
        ("regex", "structured_outputs.regex", "guided_regex"),
        ("choice", "structured_outputs.choice", "guided_choice"),
        ("grammar", "structured_outputs.grammar", "guided_grammar"),
    ] {
        for (v, name) in [(so.get(key), field), (f.get(legacy), legacy)] {
            let Some(v) = v else { continue };
            let spec = match key {
                "json" => ConstraintSpec::JsonSchema(schema_value(name, v)?),
                "regex" => ConstraintSpec::Regex(text(name, v)?),
                "choice" => choices(name, v)?,
                _ => ConstraintSpec::Lark(text(name, v)?),
            };
            one(&mut found, spec, name)?;
        }
    }
    Ok(found)
}

/// TGI's `parameters.grammar` on llm-serving's routes.
pub(super) fn tgi_constraint(p: &Fields) -> Result<Option<Asked>, ApiError> {
    let g = p.object("grammar", "parameters.grammar.")?;
    let Some(kind) = g.string("type")? else {
        if p.get("grammar").is_some() {
            return Err(ApiError::invalid(
                "parameters.grammar.type",
                "parameters.grammar.type is missing (json or regex)",
            ));
        }
        return Ok(None);
    };
    let value = g.get("value").ok_or_else(|| {
        ApiError::invalid(
            "parameters.grammar.value",
            "parameters.grammar.value is missing",
        )
    })?;
    let spec = match kind {
        "json" | "json_schema" => {
            ConstraintSpec::JsonSchema(schema_value("parameters.grammar.value", value)?)
        }
        "regex" => ConstraintSpec::Regex(text("parameters.grammar.value", value)?),
        other => {
            return Err(ApiError::invalid(
                "parameters.grammar.type",
                format!("parameters.grammar.type {other:?} is not json or regex"),
            ))
        }
    };
    Ok(Some(Asked {
        spec,
        field: "parameters.grammar".into(),
    }))
}

/// Compiles a request's constraint `n` times (one per choice); a refused grammar is a 400
/// naming the field it came from.
pub(super) fn compile(
    ctx: &ApiContext,
    asked: &Asked,
    n: usize,
) -> Result<Vec<Constraint>, ApiError> {
    let grammars = ctx.grammars().map_err(|e| {
        ApiError::invalid(
            &asked.field,
            format!("structured output is not available: {e}"),
        )
    })?;
    (0..n)
        .map(|_| match grammars.compile(&asked.spec) {
            Ok(c) => Ok(c),
            Err(StructuredError::Invalid { reason, .. }) => Err(ApiError::invalid(
                &asked.field,
                format!("{}: {reason}", asked.field),
            )),
            Err(e) => Err(ApiError::invalid(&asked.field, e.to_string())),
        })
        .collect()
}

//! Tool calling on the chat route: the request's `tools` and `tool_choice` (checked, and turned
//! into the prompt and, for `required` or a named function, into a grammar the reply must
//! follow), and the reply's tool calls split out of its content as they stream, into OpenAI's
//! `tool_calls` with the arguments as a JSON string. Two forms are read: Hermes / Qwen style
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the reply, and
//! Llama 3's bare JSON, a reply that is nothing but `{"name": ..., "parameters": {...}}` (calls
//! separated by `;`, optionally after `<|python_tag|>`), naming offered tools; such a reply is
//! held back until it ends, and is content after all when it is not entirely calls.

use npu_structured::{closed_schema, ConstraintSpec};
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::reasoning::partial_tag_len;

const CALL_START: &str = "<tool_call>";
const CALL_END: &str = "</tool_call>";
/// What Llama 3.1 writes before a call in its JSON form.
const PYTHON_TAG: &str = "<|python_tag|>";

/// One function the client offers.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Tool {
    pub name: String,
    /// The tool as the client sent it (`{"type": "function", "function": {...}}`), for the
    /// chat template.
    pub raw: Value,
    /// JSON Schema of its arguments (`{}`-like when the client gave none).
    pub parameters: Value,
}

/// What the client asked of the tools.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Choice {
    /// The model decides (the default when tools are given).
    Auto,
    /// No tool call; the reply is text.
    None,
    /// At least one call, of any of the tools.
    Required,
    /// One call of this function.
    Named(String),
}

/// Reads `tools` and `tool_choice`; an unknown function in `tool_choice`, a tool without a name
/// or with parameters that are not a schema object are 400s naming the field.
pub(crate) fn parse(
    tools: Option<&Value>,
    choice: Option<&Value>,
) -> Result<(Vec<Tool>, Choice), ApiError> {
    let list = match tools {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(ApiError::invalid("tools", "tools must be a list of tools")),
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        let field = format!("tools[{i}]");
        let ty = t.get("type").and_then(Value::as_str).unwrap_or("function");
        if ty != "function" {
            return Err(ApiError::invalid(
                &format!("{field}.type"),
                format!("{field}.type {ty:?} is not function"),
            ));
        }
        let f = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                ApiError::invalid(
                    &format!("{field}.function"),
                    format!("{field}.function must be an object with a name"),
                )
            })?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                ApiError::invalid(
                    &format!("{field}.function.name"),
                    format!("{field}.function.name must be a non-empty string"),
                )
            })?;
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(ApiError::invalid(
                    &format!("{field}.function.parameters"),
                    format!("{field}.function.parameters must be a JSON Schema object"),
                ))
            }
        };
        if out.iter().any(|o: &Tool| o.name == name) {
            return Err(ApiError::invalid(
                &format!("{field}.function.name"),
                format!("{field}: a second tool named {name:?}"),
            ));
        }
        out.push(Tool {
            name: name.to_string(),
            raw: json!({"type": "function", "function": Value::Object(f.clone())}),
            parameters,
        });
    }
    let choice = match choice {
        None => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Choice::Auto,
            "none" => Choice::None,
            "required" => Choice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice {other:?} is not auto, none, required or a function"),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice.function.name",
                        "tool_choice names a function: {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !out.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice.function.name",
                    format!("tool_choice names {name:?}, which is not one of the tools"),
                ));
            }
            Choice::Named(name.to_string())
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice must be a string or an object",
            ))
        }
    };
    if out.is_empty() && matches!(choice, Choice::Required | Choice::Named(_)) {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice asks for a tool call, but no tools are given",
        ));
    }
    Ok((out, choice))
}

/// The schema of one call of `tool` as the model writes it. The arguments follow the tool's
/// schema strictly (OpenAI's strict mode): an object admits only the properties it names
/// unless it sets `additionalProperties` itself.
fn call_schema(tool: &Tool) -> Value {
    json!({
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": closed_schema(&tool.parameters)},
        "required": ["name", "arguments"],
        "additionalProperties": false
    })
}

/// The grammar `required` or a named choice puts on the reply: one or more (`required` with
/// `parallel` calls allowed) or exactly one `<tool_call>` blocks whose JSON is a call of an
/// offered function (the named one) with arguments that follow its schema.
pub(crate) fn grammar(tools: &[Tool], choice: &Choice, parallel: bool) -> Option<ConstraintSpec> {
    let (schema, repeat) = match choice {
        Choice::Auto | Choice::None => return None,
        Choice::Named(n) => (call_schema(tools.iter().find(|t| &t.name == n)?), ""),
        Choice::Required => (
            json!({"anyOf": tools.iter().map(call_schema).collect::<Vec<_>>()}),
            if parallel { "+" } else { "" },
        ),
    };
    Some(ConstraintSpec::Lark(format!(
        "start: call{repeat}\ncall: \"{CALL_START}\\n\" body \"\\n{CALL_END}\" \"\\n\"?\nbody: %json {schema}\n"
    )))
}

/// A system message describing the tools, for chat templates that do not render `tools`
/// themselves (Hermes style, the format the reply is parsed in).
pub(crate) fn system_prompt(tools: &[Tool]) -> String {
    let mut s = String::from(
        "You may call one or more functions to help with the user's request. The functions \
         are given as JSON within <tools></tools>:\n<tools>\n",
    );
    for t in tools {
        s.push_str(&t.raw.to_string());
        s.push('\n');
    }
    s.push_str(
        "</tools>\nFor each function call, reply with a JSON object of the function's name and \
         arguments within <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \
         \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// One call found in a reply.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Call {
    pub name: String,
    /// The arguments as a JSON string (OpenAI's shape).
    pub arguments: String,
}

impl Call {
    /// The call as OpenAI reports it, the `index`-th of its reply.
    pub fn to_json(&self, index: usize, id: &str, with_index: bool) -> Value {
        let mut m = Map::new();
        if with_index {
            m.insert("index".into(), index.into());
        }
        m.insert("id".into(), format!("call_{id}_{index}").into());
        m.insert("type".into(), "function".into());
        m.insert(
            "function".into(),
            json!({"name": self.name, "arguments": self.arguments}),
        );
        Value::Object(m)
    }
}

/// Reads one block's JSON; None when it is not a call (the block then stays text).
fn parse_call(body: &str) -> Option<Call> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    let arguments = match args {
        None => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some(Call { name, arguments })
}

/// Reads a whole reply in Llama 3's bare JSON form: one or more call objects (separated by `;`
/// or white space, optionally after `<|python_tag|>`), each naming one of `names`, arguments
/// (`parameters` or `arguments`) an object. None when the reply is anything else.
fn parse_bare_calls(reply: &str, names: &[String]) -> Option<Vec<Call>> {
    let mut rest = reply.trim_start();
    rest = rest.strip_prefix(PYTHON_TAG).unwrap_or(rest);
    let mut calls = Vec::new();
    loop {
        rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
        if rest.is_empty() {
            break;
        }
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = values.next()?.ok()?;
        rest = &rest[values.byte_offset()..];
        let name = v.get("name")?.as_str()?;
        if !names.iter().any(|n| n == name) {
            return None;
        }
        let args = v.get("parameters").or_else(|| v.get("arguments"))?;
        if !args.is_object() {
            return None;
        }
        calls.push(Call {
            name: name.to_string(),
            arguments: args.to_string(),
        });
    }
    (!calls.is_empty()).then_some(calls)
}

/// Where a reply stands with Llama 3's bare JSON form.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Bare {
    /// Nothing but white space so far (or not looked for: no tool names).
    #[default]
    Undecided,
    /// The reply opened like a call: all of it is held until it ends.
    Holding,
    /// Not a bare call: tags only.
    Off,
}

/// Splits a streamed reply into content and tool calls, holding back text that may be the start
/// of a `<tool_call>` tag until it is known, and a reply that may be bare JSON calls until it
/// ends.
#[derive(Debug, Default)]
pub(crate) struct CallSplitter {
    held: String,
    /// Inside a block: its text so far.
    block: Option<String>,
    pub calls: usize,
    /// A call just closed: a newline right after it belongs to it.
    after_call: bool,
    /// The offered tools' names, for the bare JSON form (empty: not looked for).
    bare_names: Vec<String>,
    bare: Bare,
    /// The reply so far while `bare` is Undecided or Holding.
    bare_text: String,
}

/// What one piece of the reply gave.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Parts {
    pub content: String,
    pub calls: Vec<Call>,
}

impl CallSplitter {
    /// A splitter that also reads Llama 3's bare JSON calls of these tools.
    pub fn with_bare_json(names: Vec<String>) -> Self {
        let bare = if names.is_empty() {
            Bare::Off
        } else {
            Bare::Undecided
        };
        Self {
            bare_names: names,
            bare,
            ..Self::default()
        }
    }

    pub fn push(&mut self, text: &str) -> Parts {
        if self.bare != Bare::Off {
            self.bare_text.push_str(text);
            if self.bare == Bare::Undecided {
                let start = self.bare_text.trim_start();
                if start.starts_with('{') || start.starts_with(PYTHON_TAG) {
                    self.bare = Bare::Holding;
                } else if start.is_empty() || PYTHON_TAG.starts_with(start) {
                    // Not yet known.
                } else {
                    self.bare = Bare::Off;
                    let text = std::mem::take(&mut self.bare_text);
                    return self.push_tags(&text);
                }
            }
            return Parts::default();
        }
        self.push_tags(text)
    }

    fn push_tags(&mut self, text: &str) -> Parts {
        let mut out = Parts::default();
        self.held.push_str(text);
        if self.after_call && !self.held.is_empty() {
            self.after_call = false;
            if self.held.starts_with('\n') {
                self.held.drain(..1);
            }
        }
        loop {
            match &mut self.block {
                None => match self.held.find(CALL_START) {
                    Some(at) => {
                        out.content.push_str(&self.held[..at]);
                        self.held.drain(..at + CALL_START.len());
                        self.block = Some(String::new());
                    }
                    None => {
                        let keep = partial_tag_len(&self.held, CALL_START);
                        let cut = self.held.len() - keep;
                        out.content.push_str(&self.held[..cut]);
                        self.held.drain(..cut);
                        return out;
                    }
                },
                Some(block) => match self.held.find(CALL_END) {
                    Some(at) => {
                        block.push_str(&self.held[..at]);
                        let body = std::mem::take(block);
                        self.held.drain(..at + CALL_END.len());
                        self.block = None;
                        match parse_call(&body) {
                            Some(c) => {
                                self.calls += 1;
                                out.calls.push(c);
                                // The newline after a block belongs to it.
                                if self.held.starts_with('\n') {
                                    self.held.drain(..1);
                                } else if self.held.is_empty() {
                                    self.after_call = true;
                                }
                            }
                            None => {
                                out.content.push_str(CALL_START);
                                out.content.push_str(&body);
                                out.content.push_str(CALL_END);
                            }
                        }
                    }
                    None => {
                        let keep = partial_tag_len(&self.held, CALL_END);
                        let cut = self.held.len() - keep;
                        block.push_str(&self.held[..cut]);
                        self.held.drain(..cut);
                        return out;
                    }
                },
            }
        }
    }

    /// The end of the reply: bare JSON calls when the whole reply is some, else an unfinished
    /// block or held text is content.
    pub fn finish(&mut self) -> Parts {
        if self.bare != Bare::Off {
            self.bare = Bare::Off;
            let text = std::mem::take(&mut self.bare_text);
            if let Some(calls) = parse_bare_calls(&text, &self.bare_names) {
                self.calls += calls.len();
                return Parts {
                    content: String::new(),
                    calls,
                };
            }
            let mut out = self.push_tags(&text);
            let rest = self.finish();
            out.content.push_str(&rest.content);
            out.calls.extend(rest.calls);
            return out;
        }
        let mut out = Parts::default();
        if let Some(block) = self.block.take() {
            out.content.push_str(CALL_START);
            out.content.push_str(&block);
        }
        out.content.push_str(&std::mem::take(&mut self.held));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pieces: &[&str]) -> (String, Vec<Call>) {
        split_with(CallSplitter::default(), pieces)
    }

    fn split_with(mut s: CallSplitter, pieces: &[&str]) -> (String, Vec<Call>) {
        let (mut content, mut calls) = (String::new(), Vec::new());
        for p in pieces {
            let o = s.push(p);
            content.push_str(&o.content);
            calls.extend(o.calls);
        }
        let end = s.finish();
        content.push_str(&end.content);
        calls.extend(end.calls);
        (content, calls)
    }

    fn llama(pieces: &[&str]) -> (String, Vec<Call>) {
        let names = vec!["get_weather".to_string(), "t".to_string()];
        split_with(CallSplitter::with_bare_json(names), pieces)
    }

    #[test]
    fn llama_3_bare_json_calls_are_read_however_they_are_cut() {
        let whole = " <|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}; {\"name\": \"t\", \"parameters\": {}}";
        let want = vec![
            Call {
                name: "get_weather".into(),
                arguments: "{\"city\":\"Oslo\"}".into(),
            },
            Call {
                name: "t".into(),
                arguments: "{}".into(),
            },
        ];
        for cut in 1..whole.len() {
            let (content, calls) = llama(&[&whole[..cut], &whole[cut..]]);
            assert_eq!((content.as_str(), &calls), ("", &want), "cut at {cut}");
        }
        // Without the tag, one call.
        let (content, calls) = llama(&["{\"name\": \"t\", \"arguments\": {\"zone\": \"UTC\"}}\n"]);
        assert_eq!((content.as_str(), calls.len()), ("", 1));
        // Tags still work alongside.
        let (content, calls) = llama(&[
            "Sure.",
            "<tool_call>{\"name\": \"t\", \"arguments\": {}}</tool_call>",
        ]);
        assert_eq!((content.as_str(), calls.len()), ("Sure.", 1));
    }

    #[test]
    fn json_that_is_not_entirely_calls_of_offered_tools_stays_content() {
        for reply in [
            "{\"name\": \"Ada\", \"age\": 36}",
            "{\"name\": \"other_tool\", \"parameters\": {}}",
            "{\"name\": \"t\", \"parameters\": \"x\"}",
            "{\"name\": \"t\", \"parameters\": {}} and more text",
            "{\"name\": \"t\", \"parameters\": {",
            "<|python_tag|>print(1)",
        ] {
            let (content, calls) = llama(&[reply]);
            assert_eq!(content, reply);
            assert!(calls.is_empty(), "{reply}: {calls:?}");
        }
        // Text first: streamed as it comes, not held to the end.
        let mut s = CallSplitter::with_bare_json(vec!["t".into()]);
        assert_eq!(s.push("  The").content, "  The");
        assert_eq!(s.push(" answer").content, " answer");
    }

    #[test]
    fn calls_are_split_out_of_the_reply_however_it_is_cut() {
        let whole = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": {}}\n</tool_call>";
        let want_calls = vec![
            Call {
                name: "get_weather".into(),
                arguments: "{\"city\":\"Oslo\"}".into(),
            },
            Call {
                name: "t".into(),
                arguments: "{}".into(),
            },
        ];
        for cut in 1..whole.len() {
            if !whole.is_char_boundary(cut) {
                continue;
            }
            let (content, calls) = split(&[&whole[..cut], &whole[cut..]]);
            assert_eq!(content, "Let me look.\n", "cut at {cut}");
            assert_eq!(calls, want_calls, "cut at {cut}");
        }
        let chars: Vec<String> = whole.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(split(&refs).1, want_calls);
    }

    #[test]
    fn text_that_is_not_a_call_stays_content() {
        assert_eq!(split(&["a < b <tool", "_x> c"]).0, "a < b <tool_x> c");
        let (c, calls) = split(&["<tool_call>not json</tool_call> after"]);
        assert_eq!(c, "<tool_call>not json</tool_call> after");
        assert!(calls.is_empty());
        let (c, calls) = split(&["<tool_call>{\"name\": \"f\""]);
        assert_eq!(c, "<tool_call>{\"name\": \"f\"");
        assert!(calls.is_empty());
        // Llama-style "parameters" and string arguments are read too.
        let (_, calls) =
            split(&["<tool_call>{\"name\": \"f\", \"parameters\": {\"a\": 1}}</tool_call>"]);
        assert_eq!(calls[0].arguments, "{\"a\":1}");
    }

    #[test]
    fn tools_and_choices_are_checked() {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
        let (t, c) = parse(Some(&tools), Some(&json!("required"))).unwrap();
        assert_eq!((t.len(), c), (1, Choice::Required));
        let e = parse(
            Some(&tools),
            Some(&json!({"type": "function", "function": {"name": "g"}})),
        )
        .unwrap_err();
        assert!(e.message.contains("\"g\""), "{}", e.message);
        let e = parse(Some(&json!([{"type": "function", "function": {}}])), None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].function.name"));
        let e = parse(None, Some(&json!("required"))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        assert!(grammar(&t, &Choice::Auto, true).is_none());
        match grammar(&t, &Choice::Required, true) {
            Some(ConstraintSpec::Lark(g)) => assert!(g.starts_with("start: call+"), "{g}"),
            other => panic!("{other:?}"),
        }
        match grammar(&t, &Choice::Required, false) {
            Some(ConstraintSpec::Lark(g)) => assert!(g.starts_with("start: call\n"), "{g}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn call_arguments_admit_only_the_schema_properties() {
        let tools = json!([{"type": "function", "function": {"name": "w", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "opts": {"type": "object", "properties": {"u": {}}}},
        }}}]);
        let (t, _) = parse(Some(&tools), None).unwrap();
        let Some(ConstraintSpec::Lark(g)) = grammar(&t, &Choice::Named("w".into()), false) else {
            panic!("no grammar");
        };
        let schema: Value = serde_json::from_str(g.split("%json ").nth(1).unwrap().trim()).unwrap();
        let args = &schema["properties"]["arguments"];
        assert_eq!(args["additionalProperties"], false, "{g}");
        assert_eq!(
            args["properties"]["opts"]["additionalProperties"], false,
            "{g}"
        );
        // The client's own schema, as the template sees it, is unchanged.
        assert!(t[0].raw["function"]["parameters"]
            .get("additionalProperties")
            .is_none());
    }
}

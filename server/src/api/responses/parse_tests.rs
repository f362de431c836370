//! Unit tests of the Responses request parser (parse.rs).

use super::*;
use serde_json::json;

fn parsed(body: Value) -> Result<Parsed, ApiError> {
    let Value::Object(m) = body else {
        panic!("not an object")
    };
    let f = Fields::new(&m, "");
    parse(&f, &ApiSettings::default())
}

fn err_param(body: Value) -> String {
    let Err(e) = parsed(body.clone()) else {
        panic!("accepted: {body}")
    };
    assert_eq!(e.status, 400, "{}", e.message);
    e.param.unwrap_or_default()
}

#[test]
fn string_input_is_one_user_message_and_items_are_canonical() {
    let p = parsed(json!({"input": "Hi", "instructions": "Be brief"})).unwrap();
    assert_eq!(p.input, vec![message_item("user", "Hi")]);
    assert_eq!(p.instructions.as_deref(), Some("Be brief"));
    assert!(p.store && !p.stream);
    assert_eq!(p.echo["tool_choice"], "auto");
    assert_eq!(p.echo["text"]["format"]["type"], "text");
    let p = parsed(json!({"input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\":1}", "id": "fc_9"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "done", "annotations": []}]},
    ]}))
    .unwrap();
    assert_eq!(p.input.len(), 6);
    assert_eq!(p.input[1]["content"][0]["text"], "ab");
    assert_eq!(p.input[2]["id"], "fc_9");
    let chat = to_chat(&p.input);
    let roles: Vec<&str> = chat.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "assistant"]);
    let call = &chat[2].tool_calls.as_ref().unwrap()[0];
    assert_eq!(call["function"]["arguments"], json!({"x": 1}));
    assert_eq!(call["id"], "c1");
    assert_eq!(chat[3].tool_call_id.as_deref(), Some("c1"));
    assert_eq!(chat[3].name.as_deref(), Some("f"));
    assert_eq!(
        (chat[3].content.as_str(), chat[4].content.as_str()),
        ("42", "done")
    );
}

#[test]
fn calls_after_assistant_text_join_its_turn() {
    let items = vec![
        message_item("user", "q"),
        message_item("assistant", "Let me look."),
        json!({"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"}),
        json!({"type": "function_call", "call_id": "b", "name": "g", "arguments": "not json"}),
    ];
    let chat = to_chat(&items);
    assert_eq!(chat.len(), 2);
    let calls = chat[1].tool_calls.as_ref().unwrap().as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[1]["function"]["arguments"], "not json");
}

#[test]
fn tools_choice_text_and_reasoning_are_read_and_echoed() {
    let p = parsed(json!({
        "input": "x",
        "tools": [{"type": "function", "name": "get_weather", "description": "d",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                   "strict": true}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "reasoning": {"effort": "low", "summary": "auto"},
        "metadata": {"k": "v"},
        "user": "u1",
        "max_output_tokens": 20,
        "temperature": 0,
    }))
    .unwrap();
    assert_eq!(p.tools.len(), 1);
    assert_eq!(p.tools[0].raw["function"]["strict"], true);
    assert_eq!(p.tool_choice, Choice::Named("get_weather".into()));
    assert_eq!(p.echo["tools"][0]["name"], "get_weather");
    assert_eq!(p.echo["tool_choice"]["name"], "get_weather");
    assert_eq!(
        p.echo["reasoning"],
        json!({"effort": "low", "summary": "auto"})
    );
    assert_eq!(p.echo["metadata"]["k"], "v");
    assert_eq!(p.echo["max_output_tokens"], 20);
    assert_eq!(p.max_tokens, 20);
    assert_eq!(p.effort.as_deref(), Some("low"));
    let p = parsed(
        json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "p",
        "schema": {"type": "object"}, "strict": true}}}),
    )
    .unwrap();
    assert!(matches!(
        p.constraint.unwrap().spec,
        ConstraintSpec::JsonSchema(_)
    ));
    assert_eq!(p.echo["text"]["format"]["name"], "p");
    let p = parsed(json!({"input": "x", "text": {"format": {"type": "json_object"}}})).unwrap();
    assert!(matches!(
        p.constraint.unwrap().spec,
        ConstraintSpec::JsonObject
    ));
}

#[test]
fn malformed_bodies_are_400s_naming_the_field() {
    let cases = [
        (json!({}), "input"),
        (json!({"input": 3}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": ["hi"]}), "input[0]"),
        (
            json!({"input": [{"type": "web_search_call"}]}),
            "input[0].type",
        ),
        (
            json!({"input": [{"role": "tool", "content": "x"}]}),
            "input[0].role",
        ),
        (
            json!({"input": [{"role": 5, "content": "x"}]}),
            "input[0].role",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
            "input[0].content[0].type",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}),
            "input[0].content[0].text",
        ),
        (
            json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
            "input[0].call_id",
        ),
        (
            json!({"input": [{"type": "function_call_output", "call_id": "c"}]}),
            "input[0].output",
        ),
        (
            json!({"input": [{"type": "item_reference", "id": "x"}]}),
            "input[0].type",
        ),
        (json!({"input": "x", "tools": {}}), "tools"),
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
        (
            json!({"input": "x", "tools": [{"type": "file_search"}]}),
            "tools[0].type",
        ),
        (
            json!({"input": "x", "tools": [{"type": "function"}]}),
            "tools[0].name",
        ),
        (
            json!({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 1}]}),
            "tools[0].parameters",
        ),
        (
            json!({"input": "x", "tools": [{"type": "function", "name": "f"},
                                        {"type": "function", "name": "f"}]}),
            "tools[1].name",
        ),
        (
            json!({"input": "x", "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"input": "x", "tool_choice": "sometimes"}),
            "tool_choice",
        ),
        (
            json!({"input": "x", "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"}}),
            "tool_choice.name",
        ),
        (
            json!({"input": "x", "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "web_search"}}),
            "tool_choice.type",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "xml"}}}),
            "text.format.type",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "json_schema"}}}),
            "text.format.schema",
        ),
        (json!({"input": "x", "text": "json"}), "text"),
        (
            json!({"input": "x", "reasoning": {"effort": "max"}}),
            "reasoning.effort",
        ),
        (json!({"input": "x", "metadata": {"k": 1}}), "metadata.k"),
        (json!({"input": "x", "background": true}), "background"),
        (
            json!({"input": "x", "conversation": "conv_1"}),
            "conversation",
        ),
        (json!({"input": "x", "prompt": {"id": "p"}}), "prompt"),
        (
            json!({"input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (json!({"input": "x", "temperature": "hot"}), "temperature"),
        (json!({"input": "x", "store": "maybe"}), "store"),
        (
            json!({"input": "x", "previous_response_id": 7}),
            "previous_response_id",
        ),
        (json!({"input": "x", "instructions": ["a"]}), "instructions"),
        (json!({"input": "x", "truncation": "middle"}), "truncation"),
    ];
    for (body, param) in cases {
        assert_eq!(err_param(body.clone()), param, "{body}");
    }
}

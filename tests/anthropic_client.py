#!/usr/bin/env python3
"""The server through Anthropic's Python SDK (`anthropic`), as an application or an agent
calls /v1/messages. Run by tests/e2e_anthropic.rs.

  anthropic_client.py BASE_URL

Checks, at temperature 0 (sent in extra_body; greedy, so replies repeat):
  - messages.create: a message object with a text block, a stop reason, usage; the same
    reply twice;
  - messages.stream: the text deltas and the SDK's assembled final message equal the
    unstreamed reply;
  - stop_sequences: a word of that reply as stop sequence ends the reply before it, with
    stop_reason "stop_sequence" and the sequence reported;
  - tools: tool_choice naming a tool (whole) and "any" (streamed, assembled by the SDK) give
    tool_use blocks whose input validates against the tool's input_schema, stop_reason
    "tool_use"; the call and a tool_result in the history get a text answer;
  - output_config.format: a JSON Schema reply that validates;
  - count_tokens: equal to the input_tokens a create of the same conversation reports;
  - errors: an image block is a BadRequestError naming it.

Prints one line of JSON: what was checked. Any failure raises (a non-zero exit).
"""

import json
import sys

import anthropic
import jsonschema

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
        "required": ["zone"], "additionalProperties": False}},
]
MODEL = "claude-sonnet-4-5"  # any name is answered by the served model
# The SDK has no sampling arguments any more; the server still reads temperature from the body.
GREEDY = {"temperature": 0}
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def create(client):
    r = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY,
                               system="You are a poet.", messages=HELLO)
    assert r.type == "message" and r.role == "assistant", r
    assert r.id.startswith("msg_"), r.id
    assert r.content and r.content[0].type == "text", r.content
    assert r.stop_reason in ("end_turn", "max_tokens"), r.stop_reason
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0, r.usage
    assert r.usage.cache_read_input_tokens == 0, r.usage
    again = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY,
                                   system="You are a poet.", messages=HELLO)
    assert text_of(again) == text_of(r), (text_of(again), text_of(r))
    return r


def stream(client, whole):
    deltas = []
    with client.messages.stream(model=MODEL, max_tokens=40, extra_body=GREEDY,
                                system="You are a poet.", messages=HELLO) as s:
        for text in s.text_stream:
            deltas.append(text)
        final = s.get_final_message()
    assert "".join(deltas) == text_of(whole), (deltas, text_of(whole))
    assert text_of(final) == text_of(whole), (text_of(final), text_of(whole))
    assert final.stop_reason == whole.stop_reason, (final.stop_reason, whole.stop_reason)
    assert final.usage.output_tokens == whole.usage.output_tokens, final.usage
    assert final.usage.input_tokens == whole.usage.input_tokens, final.usage
    return len(deltas)


def stop_sequences(client, whole):
    text = text_of(whole)
    words = [w for w in text.split() if len(w) > 3]
    assert len(words) >= 2, f"too short a reply to pick a stop word from: {text!r}"
    stop = words[1]
    r = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY,
                               system="You are a poet.", messages=HELLO,
                               stop_sequences=["@@never@@", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop, (r.stop_reason,
                                                                         r.stop_sequence)
    assert text_of(r) == text[:text.index(stop)], (text_of(r), text, stop)


def check_tool_use(block):
    assert block.type == "tool_use" and block.id.startswith("toolu_"), block
    schemas = {t["name"]: t["input_schema"] for t in TOOLS}
    assert block.name in schemas, block
    assert isinstance(block.input, dict), block
    jsonschema.validate(block.input, schemas[block.name])


def tools(client):
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    r = client.messages.create(model=MODEL, max_tokens=80, extra_body=GREEDY, tools=TOOLS,
                               messages=question,
                               tool_choice={"type": "tool", "name": "get_weather"})
    calls = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(calls) == 1, r
    assert calls[0].name == "get_weather", calls
    check_tool_use(calls[0])
    checked = 1

    with client.messages.stream(model=MODEL, max_tokens=120, extra_body=GREEDY, tools=TOOLS,
                                messages=question,
                                tool_choice={"type": "any",
                                             "disable_parallel_tool_use": True}) as s:
        final = s.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(streamed) == 1, final
    check_tool_use(streamed[0])
    checked += 1

    # The call and its result in the history: the answer is text.
    history = question + [
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": calls[0].id,
             "content": [{"type": "text", "text": "{\"temp\": 3, \"sky\": \"clear\"}"}]}]},
    ]
    answer = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, tools=TOOLS,
                                    messages=history, tool_choice={"type": "none"})
    assert answer.content and answer.content[0].type == "text", answer
    assert answer.stop_reason in ("end_turn", "max_tokens"), answer
    counted = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=history,
                                           tool_choice={"type": "none"})
    assert counted.input_tokens == answer.usage.input_tokens, (counted, answer.usage)
    return checked


def count_tokens(client, whole):
    counted = client.messages.count_tokens(model=MODEL, system="You are a poet.",
                                           messages=HELLO)
    assert counted.input_tokens == whole.usage.input_tokens, (counted, whole.usage)
    with_tools = client.messages.count_tokens(model=MODEL, system="You are a poet.",
                                              messages=HELLO, tools=TOOLS)
    assert with_tools.input_tokens > counted.input_tokens, (with_tools, counted)
    return counted.input_tokens


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def structured(client):
    r = client.messages.create(model=MODEL, max_tokens=80, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Describe a person as JSON."}],
                               output_config={"format": {"type": "json_schema", "schema": PERSON}})
    assert r.stop_reason == "end_turn", r
    jsonschema.validate(json.loads(text_of(r)), PERSON)


def errors(client):
    try:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}])
    except anthropic.BadRequestError as e:
        assert e.status_code == 400, e
        assert e.body["type"] == "error", e.body
        assert e.body["error"]["type"] == "invalid_request_error", e.body
        assert "messages[0].content[0]" in e.body["error"]["message"], e.body
    else:
        raise AssertionError("an image block was accepted")


def main():
    base = sys.argv[1]
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=300,
                                 default_headers={"anthropic-beta": "tools-2024-04-04"})
    whole = create(client)
    out = {"text": text_of(whole), "deltas": stream(client, whole)}
    stop_sequences(client, whole)
    out["tool_uses_checked"] = tools(client)
    out["input_tokens"] = count_tokens(client, whole)
    structured(client)
    errors(client)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The server's /v1/responses through the official OpenAI Python client (openai-python), as
agent tools call it. Run by tests/e2e_responses.rs.

  responses_client.py BASE_URL text
      responses.create (instructions, a string input, temperature 0) parsed as the SDK's
      Response; the same request streamed with create(stream=True) (events checked in order,
      deltas put together equal the final text) and with the responses.stream helper (whose
      accumulator checks item identities); retrieve, input_items.list, previous_response_id,
      delete, then retrieve and previous_response_id of the deleted id are NotFoundError;
      max_output_tokens cuts a reply into status "incomplete".
  responses_client.py BASE_URL tools
      a function tool with tool_choice naming it (not streamed) and "required" (streamed): a
      function_call item whose arguments validate against the tool's parameters; its output sent
      back as a function_call_output item after previous_response_id gives a message.
  responses_client.py BASE_URL schema
      text.format json_schema: output_text parses and validates (also through responses.parse
      with a pydantic model); json_object parses as an object.
  responses_client.py BASE_URL errors
      malformed requests raise BadRequestError whose body names the field.

Prints one line of JSON: what was checked. Any failure raises (a non-zero exit).
"""

import json
import sys

import jsonschema
import openai
from openai import OpenAI
from pydantic import BaseModel

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": WEATHER, "strict": True}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


class Person(BaseModel):
    name: str
    age: int


def model_name(client):
    return client.models.list().data[0].id


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def text_mode(client, model):
    checked = {}
    r = client.responses.create(model=model, instructions="Answer in one short sentence.",
                                input="What is the capital of France?", temperature=0,
                                max_output_tokens=24)
    expect(r.object == "response" and r.id.startswith("resp_"), r)
    expect(r.status in ("completed", "incomplete"), r.status)
    expect(r.output[0].type == "message" and r.output[0].content[0].type == "output_text", r.output)
    expect(r.output_text.strip() != "", "empty output_text")
    expect(r.usage.input_tokens > 0 and r.usage.output_tokens > 0, r.usage)
    expect(r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage)
    expect(r.instructions == "Answer in one short sentence." and r.temperature == 0, r)
    expect(r.max_output_tokens == 24 and r.store is True, r)
    checked["create"] = r.output_text

    # The same request streamed: events in order, the deltas make the final text.
    events = list(client.responses.create(model=model, instructions="Answer in one short sentence.",
                                          input="What is the capital of France?", temperature=0,
                                          max_output_tokens=24, stream=True))
    kinds = [e.type for e in events]
    expect(kinds[:2] == ["response.created", "response.in_progress"], kinds)
    expect(kinds[-1] in ("response.completed", "response.incomplete"), kinds)
    expect([e.sequence_number for e in events] == list(range(len(events))), "sequence numbers")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    expect(deltas == final.output_text, (deltas, final.output_text))
    expect(final.output_text == r.output_text, (final.output_text, r.output_text))
    for k in ("response.output_item.added", "response.content_part.added",
              "response.output_text.done", "response.content_part.done",
              "response.output_item.done"):
        expect(k in kinds, f"no {k} in {kinds}")
    checked["stream_events"] = len(events)

    # The SDK's stream helper (its accumulator checks item identities and order).
    with client.responses.stream(model=model, input="Say hello.", temperature=0,
                                 max_output_tokens=200) as s:
        for _ in s:
            pass
        helper = s.get_final_response()
    expect(helper.status == "completed" and helper.output_text != "", helper)

    got = client.responses.retrieve(r.id)
    expect(got.id == r.id and got.output_text == r.output_text, got)
    items = client.responses.input_items.list(r.id)
    expect(len(items.data) == 1 and items.data[0].type == "message", items)

    follow = client.responses.create(model=model, previous_response_id=r.id,
                                     input="And of Italy?", temperature=0, max_output_tokens=24)
    expect(follow.previous_response_id == r.id and follow.output_text != "", follow)
    expect(follow.usage.input_tokens > r.usage.input_tokens, "earlier turn not in the prompt")
    checked["follow_up"] = follow.output_text

    nostore = client.responses.create(model=model, input="Hi", store=False, max_output_tokens=4)
    try:
        client.responses.retrieve(nostore.id)
        raise AssertionError("store: false was stored")
    except openai.NotFoundError:
        pass

    deleted = client.responses.delete(r.id)  # returns None in the SDK
    del deleted
    for call in (lambda: client.responses.retrieve(r.id),
                 lambda: client.responses.create(model=model, previous_response_id=r.id,
                                                 input="x", max_output_tokens=4)):
        try:
            call()
            raise AssertionError("a deleted response was found")
        except openai.NotFoundError as e:
            expect(e.body.get("type") == "invalid_request_error", e.body)

    cut = client.responses.create(model=model, input="Write a long story about a dragon.",
                                  temperature=0, max_output_tokens=5)
    expect(cut.status == "incomplete", cut.status)
    expect(cut.incomplete_details.reason == "max_output_tokens", cut.incomplete_details)
    expect(cut.usage.output_tokens == 5, cut.usage)
    checked["incomplete"] = True
    return checked


def tools_mode(client, model):
    checked = 0
    r = client.responses.create(model=model, input="What is the weather in Paris, in celsius?",
                                tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                                temperature=0, max_output_tokens=100)
    calls = [o for o in r.output if o.type == "function_call"]
    expect(len(calls) == 1, r.output)
    call = calls[0]
    expect(call.name == "get_weather" and call.call_id and call.status == "completed", call)
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    checked += 1

    # The result, after the call: a message.
    follow = client.responses.create(
        model=model, previous_response_id=r.id, tools=TOOLS, temperature=0, max_output_tokens=40,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}])
    expect(follow.output[-1].type in ("message", "function_call"), follow.output)
    checked += 1

    # The whole history sent by hand instead (no previous_response_id, no store).
    manual = client.responses.create(
        model=model, tools=TOOLS, temperature=0, max_output_tokens=40, store=False,
        input=[{"role": "user", "content": "What is the weather in Paris, in celsius?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "18 C, sunny"}])
    expect(manual.status in ("completed", "incomplete"), manual)

    events = list(client.responses.create(model=model, input="Weather in Oslo and in Lima?",
                                          tools=TOOLS, tool_choice="required", temperature=0,
                                          max_output_tokens=120, stream=True))
    kinds = [e.type for e in events]
    expect("response.function_call_arguments.delta" in kinds, kinds)
    expect("response.function_call_arguments.done" in kinds, kinds)
    final = events[-1].response
    streamed = [o for o in final.output if o.type == "function_call"]
    expect(len(streamed) >= 1, final.output)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    expect(args == "".join(c.arguments for c in streamed), (args, streamed))
    for c in streamed:
        jsonschema.validate(json.loads(c.arguments), WEATHER)
        checked += 1
    return {"tool_calls_checked": checked}


def schema_mode(client, model):
    r = client.responses.create(
        model=model, input="Make up a person.", temperature=0, max_output_tokens=80,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    expect(r.text.format.type == "json_schema", r.text)
    parsed = client.responses.parse(model=model, input="Make up a person.", temperature=0,
                                    max_output_tokens=80, text_format=Person)
    expect(isinstance(parsed.output_parsed, Person), parsed)
    obj = client.responses.create(model=model, input="Reply in JSON.", temperature=0,
                                  max_output_tokens=60, text={"format": {"type": "json_object"}})
    expect(obj.status != "completed" or isinstance(json.loads(obj.output_text), dict), obj)
    # A schema that is one constant (as llama.cpp's server tests send, with a foreign model name).
    const = client.responses.create(model="gpt-4.1", input="Write an example",
                                    max_output_tokens=10,
                                    text={"format": {"type": "json_schema", "name": "test",
                                                     "schema": {"const": "foooooo"}}})
    expect(const.output_text == '"foooooo"', const.output_text)
    return {"validated": 3, "person": parsed.output_parsed.model_dump()}


def errors_mode(client, model):
    cases = [
        (dict(input="x", tools=[{"type": "web_search"}]), "tools[0].type"),
        (dict(input=[{"type": "message", "role": "robot", "content": "x"}]), "input[0].role"),
        (dict(input="x", background=True), "background"),
        (dict(input="x", tools="get_weather"), "tools"),
        (dict(input=[{"type": "computer_call_output", "call_id": "c"}]), "input[0].type"),
        (dict(input="x", text={"format": {"type": "json_schema", "name": "n"}}),
         "text.format.schema"),
    ]
    for kwargs, param in cases:
        try:
            client.responses.create(model=model, **kwargs)
            raise AssertionError(f"{kwargs} accepted")
        except openai.BadRequestError as e:
            expect(e.body.get("param") == param, (kwargs, e.body))
    return {"refused": len(cases)}


def main():
    base, mode = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    model = model_name(client)
    out = {"text": text_mode, "tools": tools_mode, "schema": schema_mode,
           "errors": errors_mode}[mode](client, model)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The server through the official OpenAI Python client (openai-python), as an application or
an agent framework calls it. Run by tests/e2e_openai_client.rs.

  openai_client.py BASE_URL tools
      tool_choice naming a function (not streamed) and "required" (streamed, the calls put
      together from their deltas as OpenAI's documentation shows): parsed tool_calls whose
      arguments validate against the tool's parameters.
  openai_client.py BASE_URL schema N CONCURRENCY [FILLER_WORDS [TEMPERATURE [long]]]
      N json_schema chat completions (at temperature 1 unless given), CONCURRENCY at a time,
      each reply parsed and validated against the schema with jsonschema; FILLER_WORDS words of
      context in each prompt (to fill the KV pool); `long` adds a required story of 100 to 120
      characters to the schema (long replies, to outgrow the KV pool).

Prints one line of JSON: what was checked. Any failure raises (a non-zero exit).
"""

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
from openai import OpenAI

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
MODEL = None  # the first model /v1/models lists

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Lima", "Oslo", "Kyoto"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}


LONG_PERSON = {
    **PERSON,
    "properties": {**PERSON["properties"],
                   "story": {"type": "string", "minLength": 100, "maxLength": 120}},
    "required": PERSON["required"] + ["story"],
}


def check_call(name, arguments):
    assert name in PARAMS, f"a call of {name!r}, not an offered tool"
    jsonschema.validate(json.loads(arguments), PARAMS[name])


def tools(client):
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    checked = 0
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=question, tools=TOOLS, temperature=1.0, seed=seed,
            max_tokens=80, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None, choice.message
        calls = choice.message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_weather", calls
        assert calls[0].id and calls[0].type == "function", calls[0]
        check_call(calls[0].function.name, calls[0].function.arguments)
        checked += 1

        stream = client.chat.completions.create(
            model=MODEL, messages=question, tools=TOOLS, temperature=1.0, seed=seed,
            max_tokens=120, tool_choice="required", stream=True, parallel_tool_calls=seed == 0,
        )
        calls, finish = {}, None
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    call["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            finish = chunk.choices[0].finish_reason or finish
        assert calls, "required, yet no call was streamed"
        if seed == 0:
            # Parallel calls allowed: a sampled small model may go on calling until max_tokens.
            assert finish in ("tool_calls", "length"), finish
        else:
            assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
        for call in calls.values():
            assert call["id"], call
            check_call(call["name"], call["arguments"])
            checked += 1

        # The call and its result in the history; the answer is text again.
        first = calls[min(calls)]
        r = client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=16, tools=TOOLS,
            messages=question + [
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": first["id"], "type": "function",
                     "function": {"name": first["name"], "arguments": first["arguments"]}}]},
                {"role": "tool", "tool_call_id": first["id"], "content": "{\"temp\": 3}"},
            ],
        )
        assert r.choices[0].message.content is not None, r
    return {"tool_calls_checked": checked}


def schema(client, n, concurrency, filler, temperature, shape):
    context = " ".join(f"word{i % 50}" for i in range(filler))

    def one(i):
        r = client.chat.completions.create(
            model=MODEL, temperature=temperature, seed=1000 + i, max_tokens=240,
            messages=[{"role": "user",
                       "content": f"{context}\nDescribe person number {i} as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "strict": True, "schema": shape}},
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (i, choice)
        jsonschema.validate(json.loads(choice.message.content), shape)
        return choice.message.content

    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(one, range(n)))
    return {"validated": len(replies), "distinct": len(set(replies))}


def main():
    base, what = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
    global MODEL
    MODEL = client.models.list().data[0].id
    if what == "tools":
        out = tools(client)
    else:
        filler = int(sys.argv[5]) if len(sys.argv) > 5 else 0
        temperature = float(sys.argv[6]) if len(sys.argv) > 6 else 1.0
        shape = LONG_PERSON if sys.argv[7:8] == ["long"] else PERSON
        out = schema(client, int(sys.argv[3]), int(sys.argv[4]), filler, temperature, shape)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

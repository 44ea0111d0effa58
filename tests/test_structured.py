"""Structured output and forced tool calls, enforced by llguidance in the sampler: on SmolLM2 (bare JSON calls) and
Qwen2.5-Coder (Hermes <tool_call> blocks), through the OpenAI and Anthropic SDKs, instructor and LangChain."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.serving import openai_sdk

CALLS = 5  # sampled replies per schema, temperature 0.7: each must validate
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                                                            "unit": {"enum": ["C", "F"]}},
                                                           "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                                                                          "required": ["zone"], "additionalProperties": False}}}
HELLO = [{"role": "user", "content": "Hello! How are you today?"}]  # a prompt that would get a text answer


@pytest.fixture(scope="module")
def smol(smol_server):
    with openai_sdk(smol_server) as client:
        yield smol_server, client


@pytest.fixture(scope="module")
def qwen(qwen_server):
    with openai_sdk(qwen_server) as client:
        yield qwen_server, client


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}}


@pytest.mark.parametrize(("model", "calls"), [("smol", CALLS), ("qwen", 3)])
def test_json_schema_replies_validate_every_time(request, model, calls):
    _, client = request.getfixturevalue(model)
    for i in range(calls):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Make up a person."}], temperature=0.7, seed=i,
                                           max_tokens=200, response_format=_schema_format(PERSON))  # type: ignore[arg-type]
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), PERSON)


def test_streamed_schema(smol):
    _, client = smol
    stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Make up a person."}], max_tokens=200, stream=True,
                                            temperature=0.7, seed=5, response_format=_schema_format(PERSON))  # type: ignore[arg-type]
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_a_constrained_row_beside_free_ones_in_one_batch(smol):
    """n=3 free choices and a constrained request at once on a batching model: the constrained one validates, the
    free ones are the same as without it (greedy)."""
    import threading

    server, client = smol
    free = lambda: client.completions.create(model="smol", prompt="The sea is", max_tokens=24, temperature=0, n=3).choices
    alone = [c.text for c in free()]
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(r=client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Make up a person."}], max_tokens=200, temperature=0.7, seed=9,
        response_format=_schema_format(PERSON))))  # type: ignore[arg-type]
    t.start()
    beside = [c.text for c in free()]
    t.join(300)
    assert beside == alone
    jsonschema.validate(json.loads(got["r"].choices[0].message.content), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_makes_a_call_with_valid_arguments(smol, stream):
    _, client = smol
    kw = {"model": "smol", "messages": HELLO, "max_tokens": 120, "tools": [WEATHER, TIME], "tool_choice": "required", "temperature": 0.7, "seed": 1}
    if stream:
        calls: dict[int, dict] = {}
        for chunk in client.chat.completions.create(**kw, stream=True):  # type: ignore[call-overload]
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                calls.setdefault(tc.index, {"name": tc.function.name, "arguments": ""})["arguments"] += tc.function.arguments or ""
        call = calls[0]
    else:
        r = client.chat.completions.create(**kw)  # type: ignore[call-overload]
        assert r.choices[0].finish_reason == "tool_calls"
        call = {"name": r.choices[0].message.tool_calls[0].function.name, "arguments": r.choices[0].message.tool_calls[0].function.arguments}
    tool = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
    named = client.chat.completions.create(**{**kw, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})  # type: ignore[call-overload]
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_choice_any_and_named(smol, stream):
    server, _ = smol
    tools = [{"name": f["function"]["name"], "input_schema": f["function"]["parameters"]} for f in (WEATHER, TIME)]
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as an:
        for choice, want in (({"type": "any"}, None), ({"type": "tool", "name": "get_weather"}, "get_weather")):
            kw = {"model": "smol", "max_tokens": 120, "messages": HELLO, "tools": tools, "tool_choice": choice}
            if stream:
                with an.messages.stream(**kw) as s:  # type: ignore[arg-type]
                    msg = s.get_final_message()
            else:
                msg = an.messages.create(**kw)  # type: ignore[arg-type]
            uses = [b for b in msg.content if b.type == "tool_use"]
            assert msg.stop_reason == "tool_use" and uses, msg
            assert want is None or uses[0].name == want
            schema = next(t["input_schema"] for t in tools if t["name"] == uses[0].name)
            jsonschema.validate(uses[0].input, schema)


def test_bad_schemas_are_400s(smol):
    server, _ = smol
    body = {"model": "smol", "messages": HELLO, "max_tokens": 8}
    for fmt, words in (({"type": "xml"}, "json_schema"), ({"type": "json_schema"}, "json_schema"),
                       (_schema_format({"type": "object", "properties": {"a": {"type": "nonsense"}}}), "response_format")):
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, "response_format": fmt}, timeout=120)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, timeout=60)
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


# -- Qwen2.5-Coder: Hermes calls, and the frameworks ------------------------------------------------------------------


class Address(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    hobbies: list[str] = Field(max_length=3)
    address: Address


def test_json_object(qwen):
    """Any JSON object (a free schema: a 135M model may fill its arrays until max_tokens, so the 0.5B answers this)."""
    _, client = qwen
    for i in range(3):
        r = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "Give me a small JSON object about a cat."}],
                                           max_tokens=300, response_format={"type": "json_object"}, temperature=0.7, seed=i)
        assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_qwen_forced_call_is_a_hermes_block(qwen):
    server, client = qwen
    r = client.chat.completions.create(model="qwen", messages=HELLO, max_tokens=120, tools=[WEATHER], tool_choice="required")  # type: ignore[list-item]
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


FRAMEWORK_CALLS = {0: 4, 1: 3, 2: 3}  # 10 calls per framework, over its three modes


@pytest.mark.parametrize(("k", "mode"), list(enumerate(["JSON", "JSON_SCHEMA", "TOOLS"])))
def test_instructor_modes_validate(qwen, k, mode):
    import instructor

    _, client = qwen
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    for i in range(FRAMEWORK_CALLS[k]):
        # JSON mode holds the reply to a JSON object only, the schema being the prompt's (as OpenAI's json_object does): a
        # sampled reply may miss a field, which instructor's own retry (the error sent back) is for; the others are held
        # to the schema by the server, no retry
        person = patched.chat.completions.create(model="qwen", response_model=Person, max_retries=1 if mode == "JSON" else 0, temperature=0.7,
                                                 seed=i, max_tokens=300,
                                                 messages=[{"role": "user", "content": "Invent a person who lives in Italy."}])
        assert isinstance(person, Person)


@pytest.mark.parametrize(("k", "method"), list(enumerate(["json_mode", "json_schema", "function_calling"])))
def test_langchain_with_structured_output(qwen, k, method):
    from langchain_openai import ChatOpenAI

    server, _ = qwen
    prompt = "Invent a person who lives in Italy."
    if method == "json_mode":  # only "a JSON object" is enforced: the schema is the prompt's to give, as LangChain's docs say
        prompt += (' Answer with a JSON object shaped like {"name": "Ann", "age": 30, "role": "user", "hobbies": ["chess"], '
                   '"address": {"city": "Rome", "country": "Italy"}} (role is admin, user or guest).')
    for i in range(FRAMEWORK_CALLS[k]):  # sampled, each call its own seed: the same samples every run, not a rare one
        llm = ChatOpenAI(model="qwen", base_url=server.url + "/v1", api_key="unused", temperature=0.7, max_tokens=300, max_retries=0,  # type: ignore[arg-type]
                         seed=100 * k + i)
        structured = llm.with_structured_output(Person, method=method)  # type: ignore[arg-type]
        assert isinstance(structured.invoke(prompt), Person), i


def test_openai_sdk_parse(qwen):
    _, client = qwen
    r = client.chat.completions.parse(model="qwen", messages=[{"role": "user", "content": "Invent a person who lives in Italy."}],
                                      response_format=Person, max_tokens=300, temperature=0.7, seed=4)
    assert isinstance(r.choices[0].message.parsed, Person)

"""Anthropic structured output (output_config.format json_schema, and the beta's top-level output_format) enforced by
the grammar OpenAI's response_format compiles to: on SmolLM2, through the anthropic SDK's messages.parse and raw
HTTP, streamed and not; bad formats are 400s in Anthropic's error shape naming the field."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.lib._parse._transform import transform_schema
from pydantic import BaseModel

HELLO = [{"role": "user", "content": "Hello! How are you today?"}]  # a prompt that gets prose when nothing constrains it
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "schema": PERSON}
MAKE = [{"role": "user", "content": "Make up a person."}]
GREEDY = {"temperature": 0}  # this SDK's typed signature has no sampling fields; they travel as extra body fields


class Mood(BaseModel):
    mood: Literal["happy", "sad", "calm"]
    sure: bool
    count: int


@pytest.fixture(scope="module")
def url(smol_server):
    return smol_server.url


@pytest.fixture(scope="module")
def client(url):
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as c:
        yield c


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/messages", json={"model": "smol", "max_tokens": 120, **body}, timeout=300)


def _streamed_text(url: str, body: dict) -> tuple[str, str]:
    """The text of a raw SSE stream's text deltas, and its stop reason."""
    text, reason = [], ""
    with httpx.stream("POST", url + "/v1/messages", json={"model": "smol", "max_tokens": 120, **body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                if ev["type"] == "content_block_delta":
                    text.append(ev["delta"]["text"])
                elif ev["type"] == "message_delta":
                    reason = ev["delta"]["stop_reason"]
    return "".join(text), reason


def test_sdk_parse_gives_the_model(client):
    """messages.parse(output_format=Model): the SDK sends output_config.format with the model's (transformed) schema;
    the reply is JSON of it, which the SDK parses into the model."""
    msg = client.messages.parse(model="smol", max_tokens=120, messages=HELLO, output_format=Mood, extra_body=GREEDY)
    assert msg.stop_reason == "end_turn", msg
    assert isinstance(msg.parsed_output, Mood)
    jsonschema.validate(json.loads(msg.content[0].text), transform_schema(Mood))


def test_sdk_stream_with_output_format(client):
    with client.messages.stream(model="smol", max_tokens=120, messages=HELLO, output_format=Mood, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert isinstance(final.parsed_output, Mood) and final.stop_reason == "end_turn"
    assert Mood.model_validate_json(text) == final.parsed_output
    assert text == client.messages.parse(model="smol", max_tokens=120, messages=HELLO, output_format=Mood, extra_body=GREEDY).content[0].text


def test_the_format_is_enforced_not_ignored(url):
    """The same greedy request: prose without the format, JSON valid against the schema with it."""
    free = _post(url, {"messages": HELLO, "temperature": 0}).json()["content"][0]["text"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(free)
    r = _post(url, {"messages": HELLO, "temperature": 0, "output_config": {"format": FORMAT}})
    assert r.status_code == 200 and r.json()["stop_reason"] == "end_turn", r.text
    jsonschema.validate(json.loads(r.json()["content"][0]["text"]), PERSON)


@pytest.mark.parametrize("attempt", range(3))
def test_sampled_replies_validate_streamed_and_not(url, attempt):
    """temperature 0.7: whatever is sampled, every reply validates (the schema bounds its length)."""
    body = {"messages": MAKE, "temperature": 0.7, "max_tokens": 200, "output_config": {"format": FORMAT}}
    r = _post(url, body)
    assert r.status_code == 200 and r.json()["stop_reason"] == "end_turn", r.text
    jsonschema.validate(json.loads(r.json()["content"][0]["text"]), PERSON)
    text, reason = _streamed_text(url, body)
    assert reason == "end_turn"
    jsonschema.validate(json.loads(text), PERSON)


def test_the_beta_spelling(url):
    """The structured-outputs beta's top-level output_format (older SDKs and LangChain send it): the same grammar."""
    body = {"messages": HELLO, "temperature": 0}
    beta = _post(url, {**body, "output_format": FORMAT})
    assert beta.status_code == 200, beta.text
    jsonschema.validate(json.loads(beta.json()["content"][0]["text"]), PERSON)
    assert beta.json()["content"] == _post(url, {**body, "output_config": {"format": FORMAT}}).json()["content"]
    text, _ = _streamed_text(url, {**body, "output_format": FORMAT})
    assert text == beta.json()["content"][0]["text"]


def test_a_forced_tool_call_wins_over_the_format(url):
    tool = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                                                 "required": ["zone"], "additionalProperties": False}}
    r = _post(url, {"messages": HELLO, "temperature": 0, "tools": [tool], "tool_choice": {"type": "any"}, "output_config": {"format": FORMAT}})
    assert r.status_code == 200 and r.json()["stop_reason"] == "tool_use", r.text
    [use] = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    jsonschema.validate(use["input"], tool["input_schema"])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"output_config": "json"}, "output_config"),
        ({"output_config": {"format": "json"}}, "output_config.format"),
        ({"output_config": {"format": {"schema": PERSON}}}, "output_config.format.type"),
        ({"output_config": {"format": {"type": "json", "schema": PERSON}}}, "output_config.format.type"),
        ({"output_config": {"format": {"type": 3, "schema": PERSON}}}, "output_config.format.type"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
        ({"output_config": {"format": {"type": "json_schema", "schema": "object"}}}, "output_config.format.schema"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
         "output_config.format.schema"),
        ({"output_format": {"type": "json_schema", "schema": [1]}}, "output_format.schema"),
        ({"output_format": FORMAT, "output_config": {"format": FORMAT}}, "output_format"),
        ({"output_config": {"format": FORMAT}, "messages": [*HELLO, {"role": "assistant", "content": "{"}]}, "output_config.format"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_formats_are_400s_naming_the_field(url, extra, param, stream):
    r = _post(url, {"messages": HELLO, **extra, "stream": stream})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"].startswith(param + ":") or body["error"]["message"].startswith(param + " "), body


def test_sdk_sees_a_bad_schema_as_a_bad_request(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="smol", max_tokens=8, messages=HELLO,
                               output_config={"format": {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}})
    assert err.value.status_code == 400 and "output_config.format.schema" in str(err.value)

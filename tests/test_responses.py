"""The OpenAI Responses API (/v1/responses) with the real clients: the openai SDK's create, stream, parse,
previous_response_id chains and function-tool round trips, the openai-agents SDK running a tool-using agent, LangChain's
ChatOpenAI on the Responses API; every body and streamed event checked against OpenAI's own schemas; the store's
bounds, its directory across a restart, cancel, and bad input."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from .serving import InProcessServer, openai_sdk

pytestmark = pytest.mark.slow

# OpenAI's own schemas, vendored from its OpenAPI document by scripts/openai_schemas.py: a stream's every event is one
# of ResponseStreamEvent's (a oneOf of each event's schema, told apart by its type).
SCHEMAS = json.loads((Path(__file__).parent / "data" / "openai_schemas.json").read_text())["schemas"]
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class Schemas:
    """Bodies checked against the vendored schemas, by name."""

    def __init__(self) -> None:
        self.validators = {name: jsonschema.Draft202012Validator(schema) for name, schema in SCHEMAS.items()}

    def validate(self, name: str, body: Any) -> None:
        error = jsonschema.exceptions.best_match(self.validators[name].iter_errors(body))
        assert error is None, f"not a {name} at {error.json_path}: {error.message}\n{json.dumps(body)[:4000]}"

    def event(self, body: dict[str, Any]) -> None:
        self.validate("ResponseStreamEvent", body)


@pytest.fixture(scope="module")
def schemas() -> Schemas:
    return Schemas()


@pytest.fixture(scope="module")
def smol(smol_server):
    with openai_sdk(smol_server) as client:
        yield smol_server, client


def _post(server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _events(text: str) -> list[dict[str, Any]]:
    """An SSE body's events: each `event:` line names the `data:` that follows."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        out.append(data)
    return out


def test_create_is_a_response_and_continues_by_id(smol, schemas):
    server, client = smol
    body = {"model": "smol", "input": "What is the capital of France?", "instructions": "Be terse.", "temperature": 0, "max_output_tokens": 40}
    raw = _post(server, "/v1/responses", body)
    assert raw.status_code == 200, raw.text
    first = raw.json()
    schemas.validate("Response", first)
    assert first["status"] == "completed" and first["object"] == "response" and first["store"] is True
    [item] = first["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and "Paris" in item["content"][0]["text"]
    assert first["usage"]["output_tokens"] > 0 and first["jitllm"]["session_id"]

    # the SDK, chained by id: only the new turn is fed (the rest is the session's KV), and the answer is the one a chat
    # completion of the whole conversation gives
    r2 = client.responses.create(model="smol", input="And of Italy?", instructions="Be terse.", previous_response_id=first["id"], temperature=0,
                                 max_output_tokens=40)
    history = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": body["input"]},
               {"role": "assistant", "content": item["content"][0]["text"]}, {"role": "user", "content": "And of Italy?"}]
    chat = client.chat.completions.create(model="smol", messages=history, temperature=0, max_tokens=40)  # type: ignore[arg-type]
    assert r2.output_text == chat.choices[0].message.content and "Rome" in r2.output_text
    assert r2.usage is not None and r2.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
    assert r2.usage.input_tokens_details.cached_tokens >= first["usage"]["input_tokens"]  # the first turn was not fed again
    assert r2.previous_response_id == first["id"]
    count = client.responses.input_tokens.count(model="smol", input="And of Italy?", instructions="Be terse.", previous_response_id=first["id"])
    assert count.input_tokens == r2.usage.input_tokens

    got = _post(server, "/v1/responses/input_tokens", {"model": "smol", "input": "Hi"}).json()
    schemas.validate("TokenCountsResource", got)


def test_stream_event_by_event(smol, schemas):
    server, client = smol
    body = {"model": "smol", "input": "Say hello.", "temperature": 0, "max_output_tokens": 60}
    whole = _post(server, "/v1/responses", body).json()
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.read().decode())
    for ev in events:
        schemas.event(ev)
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    kinds = [ev["type"] for ev in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    text = "".join(ev["delta"] for ev in events if ev["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert text == final["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]  # greedy: the same reply
    assert events[0]["response"]["status"] == "in_progress" and final["status"] == "completed"
    assert client.responses.retrieve(final["id"]).output_text == text

    with client.responses.stream(model="smol", input="Say hello.", temperature=0, max_output_tokens=60) as s:
        sdk_text = "".join(ev.delta for ev in s if ev.type == "response.output_text.delta")
        assert s.get_final_response().output_text == sdk_text == text


def test_incomplete_at_max_output_tokens(smol, schemas):
    server, client = smol
    r = client.responses.create(model="smol", input="Write a long story about a dragon.", max_output_tokens=5, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 5
    with httpx.stream("POST", server.url + "/v1/responses", json={"model": "smol", "input": "Write a long story.", "max_output_tokens": 5,
                                                                  "stream": True}, timeout=120) as raw:
        events = _events(raw.read().decode())
    assert events[-1]["type"] == "response.incomplete"
    schemas.event(events[-1])


class Person(BaseModel):
    name: str
    age: int


def test_parse_and_json_formats(smol):
    _, client = smol
    p = client.responses.parse(model="smol", input="Make up a person.", text_format=Person, temperature=0, max_output_tokens=200)
    assert isinstance(p.output_parsed, Person), p.output_text
    r = client.responses.create(model="smol", input="Give me a JSON object about a cat.", text={"format": {"type": "json_object"}},
                                max_output_tokens=200, temperature=0)
    assert isinstance(json.loads(r.output_text), dict)
    assert r.text is not None and r.text.format.type == "json_object"


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(smol, schemas, stream):
    """tool_choice required: the reply is a call (a grammar holds it); its output goes back by previous_response_id
    and the model answers in text."""
    server, client = smol
    body = {"model": "smol", "input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required", "temperature": 0,
            "max_output_tokens": 100}
    if stream:
        with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as raw:
            events = _events(raw.read().decode())
        for ev in events:
            schemas.event(ev)
        kinds = [ev["type"] for ev in events]
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
        first = events[-1]["response"]
    else:
        first = _post(server, "/v1/responses", body).json()
        schemas.validate("Response", first)
    [call] = first["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert isinstance(json.loads(call["arguments"])["city"], str) and call["call_id"].startswith("call_")
    assert first["tools"][0]["name"] == "get_weather" and first["tool_choice"] == "required"

    answer = client.responses.create(model="smol", previous_response_id=first["id"], tools=[WEATHER],  # type: ignore[list-item]
                                     input=[{"type": "function_call_output", "call_id": call["call_id"], "output": '{"sky": "sunny", "celsius": 18}'}],
                                     temperature=0, max_output_tokens=60)
    assert answer.status == "completed" and answer.output[0].type == "message" and answer.output_text
    assert answer.usage is not None and answer.usage.input_tokens > first["usage"]["input_tokens"]  # the call and its output reached the template

    # the same turn sent as items, without the store: the same prompt
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": call["call_id"], "name": "get_weather", "arguments": call["arguments"]},
             {"type": "function_call_output", "call_id": call["call_id"], "output": '{"sky": "sunny", "celsius": 18}'}]
    manual = client.responses.create(model="smol", input=items, tools=[WEATHER], temperature=0, max_output_tokens=60, store=False)  # type: ignore[arg-type, list-item]
    assert manual.output_text == answer.output_text and manual.usage.input_tokens == answer.usage.input_tokens  # type: ignore[union-attr]


def test_store_retrieve_items_delete(smol, schemas):
    server, client = smol
    items = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}]
    r = client.responses.create(model="smol", input=items, max_output_tokens=8, metadata={"k": "v"}, temperature=0)  # type: ignore[arg-type]
    got = httpx.get(f"{server.url}/v1/responses/{r.id}").json()
    schemas.validate("Response", got)
    assert got["id"] == r.id and got["metadata"] == {"k": "v"} and got["output"][0]["content"][0]["text"] == r.output_text

    page = httpx.get(f"{server.url}/v1/responses/{r.id}/input_items").json()
    schemas.validate("ResponseItemList", page)
    assert [it["role"] for it in page["data"]] == ["user", "assistant", "user", "developer"]  # newest first, as OpenAI's default
    asc = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [it.role for it in asc.data] == ["developer", "user"] and asc.has_more  # type: ignore[union-attr]
    rest = httpx.get(f"{server.url}/v1/responses/{r.id}/input_items", params={"order": "asc", "after": asc.data[1].id}).json()
    assert [it["role"] for it in rest["data"]] == ["assistant", "user"] and not rest["has_more"]

    bad = httpx.post(f"{server.url}/v1/responses/{r.id}/cancel")
    assert bad.status_code == 400 and f"is {r.status}: only one in progress" in bad.json()["error"]["message"]
    client.responses.delete(r.id)
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items"), ("POST", "/cancel")):
        gone = httpx.request(method, f"{server.url}/v1/responses/{r.id}{path}")
        assert gone.status_code == 404 and gone.json()["error"]["message"] == f"Response with id {r.id!r} not found."

    unstored = client.responses.create(model="smol", input="Hi", max_output_tokens=4, store=False)
    assert httpx.get(f"{server.url}/v1/responses/{unstored.id}").status_code == 404
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="smol", input="Hi", previous_response_id=unstored.id)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_cancel_a_response_in_progress(smol):
    """A streamed response is cancelled from another connection: its stream ends at once with status cancelled, and the
    stored response says so."""
    server, _ = smol
    body = {"model": "smol", "input": "Write a very long story about a dragon.", "max_output_tokens": 900, "stream": True, "temperature": 0,
            "ignore_eos": True}
    seen: list[dict[str, Any]] = []
    started = threading.Event()
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as raw:
        lines = raw.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
                if seen[-1]["type"] == "response.output_text.delta":
                    started.set()
                    break
        rid = seen[0]["response"]["id"]
        cancelled = httpx.post(f"{server.url}/v1/responses/{rid}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        for line in lines:
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
    assert started.is_set()
    assert seen[-1]["type"] == "response.incomplete" and seen[-1]["response"]["status"] == "cancelled"
    final = httpx.get(f"{server.url}/v1/responses/{rid}").json()
    assert final["status"] == "cancelled" and final["usage"]["output_tokens"] < 900


@pytest.mark.parametrize(("body", "param"), [
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "mcp", "server_label": "m"}}, "tool_choice.type"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "bogus"}}}}, "text.format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "top_p": "high"}, "top_p"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata.k"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "instructions": 5}, "instructions"),
])
def test_bad_input_is_a_400_naming_the_field(smol, body, param):
    server, _ = smol
    r = _post(server, "/v1/responses", {"model": "smol", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err


def test_logprobs_on_request(smol, schemas):
    server, _ = smol
    body = {"model": "smol", "input": "Say hi.", "max_output_tokens": 6, "top_logprobs": 2, "temperature": 0}
    r = _post(server, "/v1/responses", body).json()
    schemas.validate("Response", r)
    part = r["output"][0]["content"][0]
    assert len(part["logprobs"]) == r["usage"]["output_tokens"] and all(len(lp["top_logprobs"]) == 2 for lp in part["logprobs"])
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as raw:
        events = _events(raw.read().decode())
    streamed = [lp for ev in events if ev["type"] == "response.output_text.delta" for lp in ev["logprobs"]]
    assert [lp["token"] for lp in streamed] == [lp["token"] for lp in part["logprobs"]]


def test_store_bounds_and_directory_across_a_restart(tiny_serve_jlm, tmp_path):
    """-responses-store 2: a third response drops the first; -responses-dir keeps them across a restart, so a chain
    goes on after it."""
    keep = tmp_path / "kept"
    flags = ("-load", str(tiny_serve_jlm), "-id", "tiny", "-responses-store", "2", "-responses-dir", str(keep))
    server = InProcessServer(*flags)
    try:
        with openai_sdk(server) as client:
            ids = [client.responses.create(model="tiny", input=f"hello {i}", max_output_tokens=3, temperature=0).id for i in range(3)]
            assert httpx.get(f"{server.url}/v1/responses/{ids[0]}").status_code == 404
            assert sorted(p.stem for p in keep.glob("*.json")) == sorted(ids[1:])
            expected = client.responses.create(model="tiny", input="go on", previous_response_id=ids[2], max_output_tokens=3, temperature=0,
                                               store=False).output_text
    finally:
        server.stop()
    server = InProcessServer(*flags)
    try:
        with openai_sdk(server) as client:
            assert client.responses.retrieve(ids[2]).status == "incomplete"
            again = client.responses.create(model="tiny", input="go on", previous_response_id=ids[2], max_output_tokens=3, temperature=0, store=False)
            assert again.output_text == expected
    finally:
        server.stop()
    small = InProcessServer("-load", str(tiny_serve_jlm), "-id", "tiny", "-responses-store-mem", "1K")
    try:
        with openai_sdk(small) as client:
            r = client.responses.create(model="tiny", input="x" * 2000, max_output_tokens=2, temperature=0)  # greedy: no EOS drawn by chance
            assert r.status == "incomplete"  # answered, though too large to keep
            assert httpx.get(f"{small.url}/v1/responses/{r.id}").status_code == 404
    finally:
        small.stop()


def test_openai_agents_sdk_runs_a_tool_using_agent(smol):
    """The openai-agents SDK's default model speaks the Responses API: an agent calls a function tool, gets its result
    and answers."""
    agents = pytest.importorskip("agents")
    server, _ = smol
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        calls.append(city)
        return "sunny, 18 C"

    agents.set_tracing_disabled(True)

    async def main() -> Any:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:  # closed on this loop
            model = agents.OpenAIResponsesModel(model="smol", openai_client=client)
            agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                                 model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=80))
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(main())
    assert len(calls) == 1 and isinstance(result.final_output, str) and result.final_output


def test_langchain_on_the_responses_api(smol):
    langchain_openai = pytest.importorskip("langchain_openai")
    server, _ = smol
    with httpx.Client(timeout=120) as http:  # closed here: LangChain's own client is left to the garbage collector
        llm = langchain_openai.ChatOpenAI(model="smol", base_url=server.url + "/v1", api_key="unused", use_responses_api=True, temperature=0,
                                          max_tokens=40, max_retries=0, http_client=http)
        msg = llm.invoke("What is the capital of France?")
        assert "Paris" in msg.text
        streamed = "".join(chunk.text for chunk in llm.stream("What is the capital of France?"))
        assert streamed == msg.text


@pytest.fixture(scope="module")
def thinker(serve, tiny_thinker_jlm):
    """The scripted tiny Qwen3 that writes <think>abcdef</think>\\n\\nOK! (tests/test_reasoning.py's server)."""
    server = serve("-load", str(tiny_thinker_jlm), "-id", "thinker", "-devices", "cpu", "-sessions", "4", "-max-batch", "4", "-max-seq", "512")
    with openai_sdk(server) as client:
        yield server, client


def test_reasoning_items(thinker, schemas):
    """A thinking model's thought is a reasoning item before the message, whole and streamed; reasoning.effort none
    turns it off; its tokens are counted; chained, the thought reaches the template as the turn's reasoning_content."""
    server, client = thinker
    body = {"model": "thinker", "input": "Hi", "temperature": 0, "reasoning": {"effort": "high", "summary": "auto"}}
    r = _post(server, "/v1/responses", body).json()
    schemas.validate("Response", r)
    thought, message = r["output"]
    assert thought["type"] == "reasoning" and thought["content"] == [{"type": "reasoning_text", "text": "abcdef"}]
    assert thought["summary"] == [{"type": "summary_text", "text": "abcdef"}]
    assert message["content"][0]["text"] == "OK!"
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == 8 and r["usage"]["output_tokens"] == 12

    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as raw:
        events = _events(raw.read().decode())
    for ev in events:
        schemas.event(ev)
    kinds = [ev["type"] for ev in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds[2] == "response.output_item.added" and events[2]["item"]["type"] == "reasoning"
    assert "response.reasoning_summary_text.done" in kinds[:first_text] and kinds.count("response.output_item.done") == 2
    assert "".join(ev["delta"] for ev in events if ev["type"] == "response.reasoning_text.delta") == "abcdef"
    assert events[-1]["response"]["output"] == [{**r["output"][0], "id": events[2]["item"]["id"]}, {**message, "id": events[-1]["response"]["output"][1]["id"]}]

    off = client.responses.create(model="thinker", input="Hi", temperature=0, reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.output_text == "OK!"
    assert off.usage is not None and off.usage.output_tokens_details.reasoning_tokens == 0

    chained = client.responses.create(model="thinker", input="Again", previous_response_id=r["id"], temperature=0, max_output_tokens=1)
    count = client.responses.input_tokens.count(model="thinker", input=[
        {"role": "user", "content": "Hi"}, {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "abcdef"}]},
        {"role": "assistant", "content": "OK!"}, {"role": "user", "content": "Again"}])  # type: ignore[list-item]
    assert chained.usage is not None and chained.usage.input_tokens == count.input_tokens




def test_qwen_tool_round_trip_is_chat_s(qwen_server):
    """A real tool-trained model (Qwen2.5-Coder-0.5B-Instruct), tool_choice auto: its own call comes back as a
    function_call item; its output, sent back by previous_response_id, is fed from the KV the first turn left, and the
    reply is the one chat completions gives for the same conversation (this small model calls again, then writes)."""
    output = '{"temperature_c": 18, "sky": "sunny"}'
    with openai_sdk(qwen_server) as client:
        first = client.responses.create(model="qwen", input="What is the weather in Paris?", tools=[WEATHER], temperature=0,  # type: ignore[list-item]
                                        max_output_tokens=96)
        [call] = [o for o in first.output if o.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}, first.output
        answer = client.responses.create(model="qwen", previous_response_id=first.id, tools=[WEATHER], temperature=0, max_output_tokens=48,  # type: ignore[list-item]
                                         input=[{"type": "function_call_output", "call_id": call.call_id, "output": output}])
        tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
        messages = [{"role": "user", "content": "What is the weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function",
                                                                         "function": {"name": call.name, "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": output}]
        chat = client.chat.completions.create(model="qwen", messages=messages, tools=tools, temperature=0, max_tokens=48)  # type: ignore[arg-type]
    m = chat.choices[0].message
    assert answer.usage is not None and chat.usage is not None and answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # type: ignore[union-attr]  # (its call is rendered as the template writes calls)
    assert [(o.name, o.arguments) for o in answer.output if o.type == "function_call"] == [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    assert answer.output_text == (m.content or "")

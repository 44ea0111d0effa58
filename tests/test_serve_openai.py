"""The OpenAI surface of a real server, driven by the official openai SDK (sync, async, streaming) and checked
against OpenAI's own response schemas."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

JITLLM_KEYS = {
    "session_id", "queued_ms", "queue_depth_on_entry", "device_blocks", "host_blocks", "device_ids",
    "prefill_ms", "decode_ms", "decode_tokens_per_second", "bytes_per_token", "drafted_tokens", "accepted_tokens",
}
SCHEMAS = json.loads((Path(__file__).parent / "data" / "openai_schemas.json").read_text())["schemas"]
HELLO = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three prime numbers."}]


def validate(name: str, body: dict) -> None:
    jsonschema.Draft202012Validator(SCHEMAS[name]).validate(body)


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def check_figures(figures: dict) -> None:
    assert set(figures) == JITLLM_KEYS
    assert figures["session_id"].startswith("s-")
    assert figures["host_blocks"] == 4 and figures["device_blocks"] == 0 and figures["device_ids"] == []  # 2 layers + embed + head
    assert figures["queued_ms"] >= 0 and figures["prefill_ms"] > 0 and figures["decode_ms"] >= 0
    assert figures["bytes_per_token"] > 0 and figures["decode_tokens_per_second"] > 0


def test_chat_non_streaming_matches_schema(tiny_server):
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    validate("CreateChatCompletionResponse", data)
    assert data["object"] == "chat.completion" and data["model"] == "tiny"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 12
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + 12
    check_figures(data["jitllm"])


def test_chat_sdk_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", messages=HELLO, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    check_figures(finals[0].model_extra["jitllm"])


def test_stream_framing_and_chunk_schema(tiny_server):
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", tiny_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    for obj in objs:
        validate("CreateChatCompletionStreamResponse", obj)
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "jitllm" in objs[-1] and objs[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("jitllm" not in o for o in objs[:-1])


def test_async_client_streams(tiny_server, client):
    async def main() -> tuple[str, str]:
        aclient = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="tiny", messages=HELLO, max_tokens=16, temperature=0)
        stream = await aclient.chat.completions.create(**kw, stream=True)
        parts = [c.choices[0].delta.content or "" async for c in stream]
        whole = await aclient.chat.completions.create(**kw)
        await aclient.close()
        return "".join(parts), whole.choices[0].message.content or ""

    streamed, whole = asyncio.run(main())
    assert streamed == whole


def test_content_parts_and_file_name_alias(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "prime numbers."}]}]
    a = client.chat.completions.create(model="tiny", messages=parts, max_tokens=8, temperature=0)
    b = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Name three prime numbers."}], max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_seed_reproducible_through_the_api(client):
    kw = dict(model="tiny", messages=HELLO, max_tokens=24, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw, seed=7).choices[0].message.content
    b = client.chat.completions.create(**kw, seed=7).choices[0].message.content
    c = client.chat.completions.create(**kw, seed=8).choices[0].message.content
    assert a == b
    assert a != c


def test_stop_ends_before_the_stop_string(client):
    kw = dict(model="tiny", messages=HELLO, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].message.content
    assert len(full) > 12
    stop = full[6:9]
    cut = full[: full.index(stop)]
    r = client.chat.completions.create(**kw, stop=[stop, "never-seen-stop"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stop=stop, stream=True) if c.choices)
    assert streamed == cut


def test_max_tokens_absent_runs_to_the_room(tiny_server):
    """Without max_tokens a reply that never ends fills its session (a named one of 300 positions, so a busy machine
    still gets through it) and finishes as length; a max_tokens past the room is cut to it."""
    made = httpx.post(tiny_server.url + "/jitllm.v1.SessionService/CreateSession", json={"model": "tiny", "maxSeq": 300}, timeout=60).json()
    body = {"jitllm_session": made["session"]["id"], "prompt": "abc", "temperature": 0, "ignore_eos": True}
    r = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=600).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == 300
    body["max_tokens"] = 10**6  # too large: cut to the room
    r = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=600).json()
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == 300
    httpx.post(tiny_server.url + "/jitllm.v1.SessionService/CloseSession", json={"sessionId": made["session"]["id"]}, timeout=60)


def test_completions_echo_and_token_prompt(tiny_server, client):
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert r.choices[0].text == "Once upon a time" + plain.choices[0].text
    body = httpx.post(tiny_server.url + "/v1/completions", json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}, timeout=60).json()
    validate("CreateCompletionResponse", body)
    assert body["object"] == "text_completion"
    ids = [40, 41, 42, 43]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.usage.prompt_tokens == 4
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True))
    assert streamed == plain.choices[0].text
    echoed = "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt="Once", max_tokens=4, temperature=0, echo=True, stream=True))
    assert echoed.startswith("Once")


def test_models_list(tiny_server, client):
    data = httpx.get(tiny_server.url + "/v1/models", timeout=10).json()
    validate("ListModelsResponse", data)
    ids = [m.id for m in client.models.list()]
    assert ids == ["tiny", "spare"]  # loaded first, then the unloaded .jlm of -models
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_penalties_and_top_k_accepted(client):
    r = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=8, temperature=0.7, top_p=0.9, seed=1,
        presence_penalty=0.5, frequency_penalty=0.5, extra_body={"top_k": 5, "min_p": 0.05},
    )
    assert r.usage.completion_tokens >= 1

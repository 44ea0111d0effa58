"""The Anthropic surface of a real server, driven by the official anthropic SDK and raw SSE."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import pytest

USER = [{"role": "user", "content": "Why is the sky blue?"}]
# This SDK's typed signature has no sampling fields; they travel as extra body fields, as the API takes them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(tiny_server):
    with anthropic.Anthropic(base_url=tiny_server.url, api_key="unused", max_retries=0) as c:
        yield c


def test_message_with_system_blocks(client):
    msg = client.messages.create(
        model="tiny", max_tokens=10, extra_body=GREEDY, system=[{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}], messages=USER
    )
    same = client.messages.create(model="tiny", max_tokens=10, extra_body=GREEDY, system="You are terse.", messages=USER)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert msg.content[0].type == "text" and msg.content[0].text == same.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens <= 10
    figures = msg.model_extra["jitllm"]
    assert figures["host_blocks"] == 4 and figures["session_id"].startswith("s-")


def test_stream_text_equals_message(client):
    kw = dict(model="tiny", max_tokens=20, extra_body=GREEDY, messages=USER)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_async_stream(tiny_server, client):
    async def main() -> str:
        client = anthropic.AsyncAnthropic(base_url=tiny_server.url, api_key="unused", max_retries=0)
        async with client.messages.stream(model="tiny", max_tokens=12, extra_body=GREEDY, messages=USER) as stream:
            text = "".join([t async for t in stream.text_stream])
        await client.close()
        return text

    assert asyncio.run(main()) == client.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY, messages=USER).content[0].text


def test_event_sequence(tiny_server):
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": USER, "stream": True}
    with httpx.stream("POST", tiny_server.url + "/v1/messages", json=body, timeout=60) as r:
        raw = r.read().decode()
    names, datas = [], []
    for block in filter(None, raw.split("\n\n")):
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        names.append(event[7:])
        datas.append(json.loads(data[6:]))
        assert datas[-1]["type"] == names[-1]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas, "content_block_stop", "message_delta", "message_stop"]
    assert datas[0]["message"]["usage"]["output_tokens"] == 0
    final = datas[names.index("message_delta")]
    assert final["delta"]["stop_reason"] in ("end_turn", "max_tokens") and "jitllm" in final
    assert final["usage"]["output_tokens"] <= 6


def test_stop_sequences(client):
    kw = dict(model="tiny", max_tokens=30, extra_body=GREEDY | {"ignore_eos": True}, messages=USER)
    full = client.messages.create(**kw).content[0].text
    assert len(full) > 10
    stop = full[5:8]
    msg = client.messages.create(**kw, stop_sequences=[stop])
    assert msg.content[0].text == full[: full.index(stop)]
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop


def test_prefill_continues_the_assistant_turn(client):
    kw = dict(model="tiny", max_tokens=12, extra_body=GREEDY | {"ignore_eos": True})
    whole = client.messages.create(**kw, messages=USER).content[0].text
    assert len(whole) > 4
    head = whole[:3].rstrip()
    rest = client.messages.create(**kw, messages=[*USER, {"role": "assistant", "content": head}]).content[0].text
    assert (head + rest).startswith(whole[:6])


def test_errors_in_anthropic_shape(tiny_server, client):
    r = httpx.post(tiny_server.url + "/v1/messages", json={"model": "tiny", "messages": USER}, timeout=10)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.create(model="nope", max_tokens=4, messages=USER)
    assert exc.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        client.messages.create(model="tiny", max_tokens=4, extra_body={"temperature": 1.5}, messages=USER)
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        client.messages.create(model="tiny", max_tokens=4, messages=[])
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\].role"):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "system", "content": "x"}])
    r = httpx.post(tiny_server.url + "/v1/messages", content=b"{nope", headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_blocks_come_in_the_order_generated():
    """Issue 20, part 9: text, a call, text, a call cut short by max_tokens: four blocks in that order, whole and as
    the stream's content_block_start events."""
    from jitllmd.serve.anthropic import _Blocks, content_blocks
    from jitllmd.serve.tools import ToolCallParser, parse_pieces

    names = {"get_weather"}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    reply = f'Checking.\n{call}\nThen Rome.\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Rome", "da'
    whole = [(b["type"], b.get("text") or b.get("input")) for b in content_blocks(parse_pieces(reply, names, cut=True))]
    assert whole == [("text", "Checking.\n"), ("tool_use", {"city": "Paris"}), ("text", "Then Rome.\n"), ("tool_use", {"city": "Rome"})]

    parser, blocks = ToolCallParser(names), _Blocks()
    sse = b"".join([*(b for ch in reply for b in blocks.add(parser.feed(ch))), *blocks.add(parser.finish(cut=True)), *blocks.close()])
    events = [json.loads(line[6:]) for line in sse.decode().splitlines() if line.startswith("data: ")]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["text", "tool_use", "text", "tool_use"]
    inputs = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]
    assert [json.loads(i) for i in inputs] == [{"city": "Paris"}, {"city": "Rome"}]
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1, 2, 3]

"""Anthropic's POST /v1/messages/count_tokens on a real server, through the official anthropic SDK: the count is the
prompt /v1/messages runs for the same body, system and tools through the model's template."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from .conftest import write_tiny_llama

# The tiny model's template, writing out the tools it is given (the stock tiny template ignores them).
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t['function']['name'] }}: {{ t['function']['description'] }};{% endfor %}</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
USER = [{"role": "user", "content": "Why is the sky blue?"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city.", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve):
    from jitllmd.engine.convert import convert

    root = tmp_path_factory.mktemp("count_tokens")
    hf_dir, _ = write_tiny_llama(root / "hf", chat_template=TOOLS_TEMPLATE, max_position_embeddings=512)
    jlm = convert(hf_dir, root / "tools.jlm", "f32").path
    return serve("-load", str(jlm), "-id", "tools", "-max-seq", "512")


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as c:
        yield c


def sent(client: anthropic.Anthropic, **body) -> int:
    """The input tokens /v1/messages reports for this body: those it fed and those it read from a cache."""
    usage = client.messages.create(max_tokens=1, **body).usage
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": USER},
        {"messages": USER, "system": "You are terse."},
        {"messages": USER, "system": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}], "tools": [WEATHER]},
        {"messages": [*USER, {"role": "assistant", "content": "Because"}]},  # a final assistant turn is continued
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
            ],
            "tools": [WEATHER],
        },
    ],
    ids=["plain", "system", "system-blocks-and-tools", "prefill", "tool-turns"],
)
def test_count_equals_the_input_tokens_of_the_same_message(client, body):
    counted = client.messages.count_tokens(model="tools", **body)
    assert counted.input_tokens > 0
    assert counted.input_tokens == sent(client, model="tools", **body)


def test_tools_and_system_count_through_the_template(client):
    bare = client.messages.count_tokens(model="tools", messages=USER).input_tokens
    with_system = client.messages.count_tokens(model="tools", messages=USER, system="You are terse.").input_tokens
    with_tools = client.messages.count_tokens(model="tools", messages=USER, tools=[WEATHER]).input_tokens
    withheld = client.messages.count_tokens(model="tools", messages=USER, tools=[WEATHER], tool_choice={"type": "none"}).input_tokens
    assert with_system > bare and with_tools > bare
    assert withheld == bare  # tool_choice none withholds the tools, as /v1/messages does


def test_the_stream_reports_the_same_count(server, client):
    """message_start's usage splits the prompt as message_delta's does (issue 20, part 10): sent twice, the second
    time the slot holds all but the prompt's last token, and neither event counts the cached tokens as input."""
    body = {"model": "tools", "messages": USER, "system": "Be brief.", "tools": [WEATHER]}
    counted = client.messages.count_tokens(**body).input_tokens
    for attempt in range(2):
        with client.messages.stream(max_tokens=2, **body) as stream:
            events = list(stream)
        start = next(ev for ev in events if ev.type == "message_start").message.usage
        end = next(ev for ev in events if ev.type == "message_delta").usage
        assert (start.input_tokens, start.cache_read_input_tokens) == (end.input_tokens, end.cache_read_input_tokens)
        assert start.input_tokens + (start.cache_read_input_tokens or 0) == counted
        if attempt:
            assert start.cache_read_input_tokens == counted - 1


def test_errors_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.count_tokens(model="nope", messages=USER)
    assert exc.value.body["error"]["type"] == "not_found_error" and "tools" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        client.messages.count_tokens(model="tools", messages=[])
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\].role"):
        client.messages.count_tokens(model="tools", messages=[{"role": "system", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="tools"):
        client.messages.count_tokens(model="tools", messages=USER, tools=[{"name": "f"}])  # no input_schema
    url = server.url + "/v1/messages/count_tokens"
    r = httpx.post(url, json={"model": "tools", "messages": USER, "max_tokens": 0}, timeout=30)  # max_tokens is not count_tokens' field
    assert r.status_code == 200 and r.json() == {"input_tokens": client.messages.count_tokens(model="tools", messages=USER).input_tokens}
    r = httpx.post(url, content=b"{nope", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(url, timeout=30)
    assert r.status_code == 405 and r.json()["type"] == "error"

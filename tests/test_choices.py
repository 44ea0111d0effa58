"""n > 1 (the prompt fed once, each choice its own sampler) and several prompts in one /v1/completions, on a real
server of the tiny model batching 8 rows on the CPU device."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serving import openai_sdk, stats

N = 3
SEED = 1234


@pytest.fixture(scope="module")
def served(serve, tiny_serve_jlm):
    server = serve("-load", str(tiny_serve_jlm), "-id", "tiny", "-devices", "cpu", "-sessions", "8", "-max-batch", "8", "-max-seq", "512")
    with openai_sdk(server) as client:
        yield server, client



def _sampled(**kw):
    return {"temperature": 1.0, "top_p": 1.0, "seed": SEED, "max_tokens": 12, "extra_body": {"ignore_eos": True, "top_k": 0}, **kw}


def test_n_choices_differ_are_reproducible_and_count_the_prompt_once(served):
    server, client = served
    messages = [{"role": "user", "content": "tell me something"}]
    before = stats(server)
    r = client.chat.completions.create(model="tiny", messages=messages, n=N, **_sampled())  # type: ignore[arg-type]
    after = stats(server)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == list(range(N)) and len(set(texts)) == N  # three different choices
    assert r.usage is not None and r.usage.completion_tokens == N * 12
    one = client.chat.completions.create(model="tiny", messages=messages, **_sampled())  # type: ignore[arg-type]
    assert one.usage is not None and r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert after["promptTokens"] - before["promptTokens"] == one.usage.prompt_tokens  # ... and fed once
    again = client.chat.completions.create(model="tiny", messages=messages, n=N, **_sampled())  # type: ignore[arg-type]
    assert [c.message.content for c in again.choices] == texts  # the same seed, the same choices
    # choice i samples with seed + i: the same as a request of its own with that seed
    for i in range(N):
        alone = client.chat.completions.create(model="tiny", messages=messages, **_sampled(seed=SEED + i))  # type: ignore[arg-type]
        assert alone.choices[0].message.content == texts[i], i


def test_n_choices_stream_interleaved(served):
    server, client = served
    messages = [{"role": "user", "content": "tell me something"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, n=N, **_sampled())  # type: ignore[arg-type]
    stream = client.chat.completions.create(model="tiny", messages=messages, n=N, stream=True, stream_options={"include_usage": True}, **_sampled())  # type: ignore[arg-type]
    texts, finishes, usage, order = [""] * N, [None] * N, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            order.append(ch.index)
            texts[ch.index] += ch.delta.content or ""
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert texts == [c.message.content for c in whole.choices] and finishes == ["length"] * N
    assert usage is not None and usage.completion_tokens == N * 12 and usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]
    content = order[N:]  # past the role chunks
    assert content.index(1) < len(content) - 1 - content[::-1].index(0)  # interleaved as the rows ran, not one after another


def test_several_prompts_in_one_completions_request(served):
    server, client = served
    prompts = ["abc", "hello there", "xyz"]
    r = client.completions.create(model="tiny", prompt=prompts, n=2, **_sampled(max_tokens=5))
    assert [c.index for c in r.choices] == list(range(6))
    for k, p in enumerate(prompts):  # choices 2k, 2k+1 belong to prompt k: each as that prompt alone would give
        alone = client.completions.create(model="tiny", prompt=p, n=2, **_sampled(max_tokens=5))
        assert [c.text for c in r.choices[2 * k : 2 * k + 2]] == [c.text for c in alone.choices], p
    single = [client.completions.create(model="tiny", prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts]  # type: ignore[union-attr]
    assert r.usage is not None and r.usage.prompt_tokens == sum(single) and r.usage.completion_tokens == 30
    ids = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2 and ids.usage is not None and ids.usage.prompt_tokens == 5
    # streamed: each prompt's choices by index, with echo
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 3, "temperature": 0, "echo": True, "stream": True, "ignore_eos": True}
    texts = [""] * 3
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    texts[ch["index"]] += ch["text"]
    assert all(t.startswith(p) and len(t) > len(p) for t, p in zip(texts, prompts))


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/v1/completions", {"prompt": ["a"] * 65}, "at most 64"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt[1]"),
        ("/v1/completions", {"prompt": "a", "n": 65}, "-max-choices"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 0}, "n"),
    ],
)
def test_bad_choices_are_400s(served, path, body, words):
    server = served[0]
    r = httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_n_with_a_named_session_is_refused(served):
    server = served[0]
    sid = httpx.post(server.url + "/jitllm.v1.SessionService/CreateSession", json={"model": "tiny"}, timeout=60).json()["session"]["id"]
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}], "n": 2, "jitllm_session": sid}, timeout=60)
        assert r.status_code == 400 and "jitllm_session" in r.json()["error"]["message"]
    finally:  # the server is shared by every test that asks for its flags: leave it as found
        httpx.post(server.url + "/jitllm.v1.SessionService/CloseSession", json={"sessionId": sid}, timeout=60).raise_for_status()


def test_n_choices_after_a_connect_call(served):
    """A Connect Complete (or Generate) runs in a session its service makes; the next n > 1 request copies the
    prompt's KV between sessions: both must work, one after the other, on one server."""
    server, client = served
    r = httpx.post(f"{server.url}/jitllm.v1.InferenceService/Complete", timeout=60,
                   json={"model": "tiny", "prompt": "hello", "maxTokens": 4})
    assert r.status_code == 200, r.text
    messages = [{"role": "user", "content": "tell me something"}]
    for _ in range(2):
        many = client.chat.completions.create(model="tiny", messages=messages, n=2, **_sampled())  # type: ignore[arg-type]
        assert [c.index for c in many.choices] == [0, 1]
        assert many.usage is not None and many.usage.completion_tokens == 2 * 12

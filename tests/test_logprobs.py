"""Log probabilities (chat logprobs/top_logprobs, completions logprobs with echo) and logit_bias, through a real
server of SmolLM2 in f32, against transformers' log_softmax on the same GGUF weights."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from tests.serving import openai_sdk

TOL = 1e-4


@pytest.fixture(scope="module")
def reference(smollm2_hf_model):
    return smollm2_hf_model


@pytest.fixture(scope="module")
def served(smol_server):
    with openai_sdk(smol_server) as client:
        yield smol_server, client



def _tokenize(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/jitllm.v1.ModelService/Tokenize", json={"model": "smol", "text": text}, timeout=60)
    return [int(i) for i in r.json()["tokenIds"]]


def _log_softmax(reference, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of `ids` [len(ids), V]."""
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_echo_scores_the_prompt_as_transformers_does(served, reference):
    """lm-eval's loglikelihood request: echo, logprobs 5, max_tokens 0 — the prompt alone, each token scored."""
    server, client = served
    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    r = client.completions.create(model="smol", prompt=prompt, echo=True, logprobs=5, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length" and r.usage.completion_tokens == 0  # type: ignore[union-attr]
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None and lp.tokens is not None
    ids = _tokenize(server, prompt)
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _log_softmax(reference, ids)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - float(ref[i - 1, ids[i]])) < TOL, i
        best = torch.topk(ref[i - 1], 5)
        top = sorted(lp.top_logprobs[i].values(), reverse=True)
        if ids[i] not in best.indices.tolist():  # the prompt's own token, outside the top 5, is there too (logprobs + 1 entries)
            assert len(top) == 6 and top[-1] == pytest.approx(lp.token_logprobs[i], abs=TOL)
            top = top[:5]
        assert top == pytest.approx(best.values.tolist(), abs=TOL)
    assert "".join(lp.tokens) == prompt and lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_completion_logprobs_of_generated_tokens_streamed_and_not(served, reference):
    server, client = served
    prompt = "Once upon a time"
    body = {"model": "smol", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    ids = _tokenize(server, prompt)
    gen_ids = _tokenize(server, prompt + whole["text"])[len(ids):]
    lp = whole["logprobs"]
    assert len(lp["token_logprobs"]) == 6 and "".join(lp["tokens"]) == whole["text"]
    ref = _log_softmax(reference, ids + gen_ids)
    for i, g in enumerate(gen_ids):
        assert abs(lp["token_logprobs"][i] - float(ref[len(ids) - 1 + i, g])) < TOL
        assert len(lp["top_logprobs"][i]) <= 3 and max(lp["top_logprobs"][i].values()) == pytest.approx(lp["token_logprobs"][i], abs=TOL)  # greedy: the best
    # streamed: the same tokens and values, chunk by chunk, offsets continuing
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    streamed = [c["logprobs"] for c in chunks if c.get("logprobs")]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [v for s in streamed for v in s["token_logprobs"]] == pytest.approx(lp["token_logprobs"], abs=TOL)
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]


def test_chat_logprobs_and_top_logprobs_streamed_and_not(served, reference):
    server, client = served
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model="smol", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=4)  # type: ignore[arg-type]
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    prompt = [int(i) for i in httpx.post(server.url + "/jitllm.v1.ModelService/ApplyChatTemplate",
                                         json={"model": "smol", "messages": messages, "addGenerationPrompt": True}, timeout=60).json()["tokenIds"]]
    gen_ids = _tokenize(server, "".join(c.token for c in content))
    ref = _log_softmax(reference, prompt + gen_ids)
    for i, c in enumerate(content):
        assert abs(c.logprob - float(ref[len(prompt) - 1 + i, gen_ids[i]])) < TOL
        assert len(c.top_logprobs) == 4 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=TOL)  # greedy
        assert c.bytes == list(c.token.encode())
    assert "".join(c.token for c in content) == r.choices[0].message.content
    stream = client.chat.completions.create(model="smol", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=4, stream=True)  # type: ignore[arg-type]
    streamed = [t for chunk in stream for ch in chunk.choices if ch.logprobs and ch.logprobs.content for t in ch.logprobs.content]
    assert [t.token for t in streamed] == [c.token for c in content]
    assert [t.logprob for t in streamed] == pytest.approx([c.logprob for c in content], abs=TOL)
    r = client.chat.completions.create(model="smol", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert r.choices[0].logprobs is None  # not asked, not given


def test_logit_bias_moves_the_choice(served):
    server, client = served
    prompt = "The capital of France is"
    plain = client.completions.create(model="smol", prompt=prompt, max_tokens=1, temperature=0, logprobs=0)
    first = _tokenize(server, prompt + plain.choices[0].text)[len(_tokenize(server, prompt)):][0]
    banned = client.completions.create(model="smol", prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text
    forced_id = _tokenize(server, " banana")[0]
    forced = client.completions.create(model="smol", prompt=prompt, max_tokens=3, temperature=0, logit_bias={str(forced_id): 100}, logprobs=1)
    lp = forced.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    assert _tokenize(server, prompt + forced.choices[0].text)[-3:] == [forced_id] * 3
    assert all(v < 0 and math.isfinite(v) for v in lp.token_logprobs)  # the model's own view of it: the bias is not in the logprobs


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"logprobs": 6}, "logprobs"),
        ({"logit_bias": {"x": 1}}, "token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "token ids must be in"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_fields_are_400s(served, body, words):
    server = served[0]
    r = httpx.post(server.url + "/v1/completions", json={"model": "smol", "prompt": "a", **body}, timeout=60)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_top_logprobs_needs_logprobs(served):
    server = served[0]
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 21}, timeout=60)
    assert r.status_code == 400

"""/v1/completions' top_logprobs hold the N likeliest tokens and the sampled one where it is not among them (N + 1
entries, as OpenAI's and vLLM's); logprobs 0 gives the sampled token's alone. On SmolLM2 through a real server,
streamed and not; a token forced by logit_bias is one the model's own distribution does not rank in its top N."""

from __future__ import annotations

import json

import httpx
import pytest

TOL = 1e-4
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def url(smol_server):
    return smol_server.url


def _tokenize(url: str, text: str) -> list[int]:
    r = httpx.post(url + "/jitllm.v1.ModelService/Tokenize", json={"model": "smol", "text": text}, timeout=60)
    return [int(i) for i in r.json()["tokenIds"]]


def _complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "smol", "prompt": PROMPT, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _streamed(url: str, **body) -> dict[str, list]:
    """A streamed completion's logprobs, chunk by chunk joined."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    body = {"model": "smol", "prompt": PROMPT, "temperature": 0, **body, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                for k in out:
                    out[k] += lp[k] if lp else []
    return out


def _same(a: dict[str, list], b: dict[str, list]) -> bool:
    """Two logprobs objects alike: the same tokens, offsets and top tokens, the values within TOL."""
    return (a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"] and a["token_logprobs"] == pytest.approx(b["token_logprobs"], abs=TOL)
            and len(a["top_logprobs"]) == len(b["top_logprobs"]) and all(x == pytest.approx(y, abs=TOL) for x, y in zip(a["top_logprobs"], b["top_logprobs"])))


def _banana(url: str) -> int:
    return _tokenize(url, " banana")[0]


@pytest.mark.parametrize("n", [1, 3, 5])
def test_a_forced_token_outside_the_top_n_is_added(url, n):
    """logit_bias forces a token the model ranks low (logprobs are the model's own, before the bias): the first
    position holds the model's top n (as the unbiased request's shows) and the forced token, n + 1 entries; later ones
    n + 1 where the token is still outside the top n (repeated, the model comes to expect it), else n."""
    plain = _complete(url, max_tokens=1, logprobs=n)["logprobs"]
    forced = _complete(url, max_tokens=3, logprobs=n, logit_bias={str(_banana(url)): 100})
    lp = forced["logprobs"]
    assert len(lp["tokens"]) == 3 and "".join(lp["tokens"]) == forced["text"] == " banana" * 3
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        others = [v for t, v in top.items() if t != token]
        assert top[token] == value and (len(top) == n or len(top) == n + 1 and value < min(others)), top
    assert len(lp["top_logprobs"][0]) == n + 1
    first = dict(lp["top_logprobs"][0])
    first.pop(lp["tokens"][0])
    assert first == pytest.approx(plain["top_logprobs"][0], abs=TOL) and len(first) == n
    assert _same(_streamed(url, max_tokens=3, logprobs=n, logit_bias={str(_banana(url)): 100}), lp)


def test_greedy_tokens_are_among_the_top_n(url):
    """Greedy: the sampled token is the likeliest, so each position holds exactly n entries, the token's the highest."""
    lp = _complete(url, max_tokens=6, logprobs=3, ignore_eos=True)["logprobs"]
    assert len(lp["tokens"]) == 6
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 3 and top[token] == value == max(top.values()), top


@pytest.mark.parametrize("forced", [False, True])
def test_logprobs_0_gives_the_sampled_token(url, forced):
    body = {"max_tokens": 4, "logprobs": 0, "ignore_eos": True, **({"logit_bias": {str(_banana(url)): 100}} if forced else {})}
    choice = _complete(url, **body)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 4 and "".join(lp["tokens"]) == choice["text"]
    assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]
    assert all(v < 0 for v in lp["token_logprobs"])
    assert _same(_streamed(url, **body), lp)


def test_echo_scores_each_prompt_token_with_its_top_n(url):
    """echo: the prompt's tokens are scored as the sampled ones are, each beside the top n (its first has no score)."""
    choice = _complete(url, max_tokens=0, echo=True, logprobs=2)
    lp = choice["logprobs"]
    assert lp["top_logprobs"][0] is None and lp["token_logprobs"][0] is None and "".join(lp["tokens"]) == PROMPT
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        others = [v for t, v in top.items() if t != token]
        assert top[token] == value and len(top) in (2, 3), top
        assert len(top) == 2 or value < min(others), top  # n + 1 only when outside the top n
    assert any(len(top) == 3 for top in lp["top_logprobs"][1:])  # some prompt token is not among the model's top 2


def test_chat_top_logprobs_stay_the_top_n(url):
    """Chat's shape differs (OpenAI's ChatCompletionTokenLogprob): the token is the entry's own; its top_logprobs are
    the n likeliest only, even for a token outside them."""
    body = {"model": "smol", "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 2, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "logit_bias": {str(_banana(url)): 100}}
    content = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]["content"]
    for entry in content:
        assert len(entry["top_logprobs"]) == 2 and entry["token"] not in [t["token"] for t in entry["top_logprobs"]]

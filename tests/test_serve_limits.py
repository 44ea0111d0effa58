"""What one request may cost the server (a real `jitllmd serve` of the tiny model, room 3000): a prompt that cannot fit
is refused once a piece of it shows that, a request's prompts all checked before any runs, its fan-out (choices,
grammar matchers, logit_bias) bounded with a 400 that names the limit, and bad input a 400 naming the field."""

from __future__ import annotations

import random
import threading

import httpx
import pytest

from jitllmd.engine.tokenizer import Tokenizer
from tests.serving import device_queue, stats

MESSAGES = [{"role": "user", "content": "hi"}]


def _peak_rss_mb(server) -> float:
    """The server process's peak resident memory so far (VmHWM), in MiB."""
    with open(f"/proc/{server.proc.pid}/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _post(server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


# -- a prompt that cannot fit costs what fits ---------------------------------------------------------------------------


def test_count_past_reads_only_what_it_needs(smollm2_jlm):
    """count_past on SmolLM2's tokenizer: a text far over `most` is found so from its first pieces; its bound never
    exceeds the true count; a text that may fit says None (and is then encoded whole by the caller)."""
    from jitllmd.engine.jlm import JLMFile

    meta = JLMFile(smollm2_jlm).meta
    special = meta.get("special_tokens", {})
    tok = Tokenizer(meta["tokenizer"], bos_token_id=special.get("bos_token_id"), eos_token_ids=list(special.get("eos_token_ids") or []),
                    add_bos_token=bool(special.get("add_bos_token")))
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "\n", "and", "then", "more", "words"]
    rng = random.Random(0)
    text = " ".join(rng.choice(words) for _ in range(40_000))
    whole = len(tok.encode(text, add_special_tokens=False))
    read: list[int] = []

    class Counting:  # the backend, counting the characters it is asked to encode
        def __init__(self, backend):
            self.backend = backend

        def encode(self, piece, **kw):
            read.append(len(piece))
            return self.backend.encode(piece, **kw)

    tok._backend = Counting(tok._backend)  # type: ignore[assignment]
    least = tok.count_past(text, 1000)
    assert least is not None and 1000 < least <= whole
    assert sum(read) < len(text) // 4  # it stopped after a piece or two of a 200k-character text
    read.clear()
    assert tok.count_past(text, whole) is None and tok.count_past(text[:5000], 10) is None  # may fit; short text: encoded whole
    assert tok.count_past(text, whole // 2) is not None and tok.count_past(text, whole // 2) <= whole


def test_two_huge_requests_are_refused_from_a_piece_beside_a_small_one(tiny_server):
    """Two /v1/completions of 64 prompts of 70k characters each (each over the room of 3000 tokens, but under the
    character bound): refused with 400s naming the room, after counting a piece of each prompt, not all of it (so
    they are refused in about the time the small chat beside them takes, which is why their order is not asserted);
    the small chat is answered; the server's peak RSS stays within 300 MB of where it was."""
    before = _peak_rss_mb(tiny_server)
    prompt = "ab " * 23_000
    results: dict[str, httpx.Response] = {}

    def big(name: str) -> None:
        results[name] = _post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": [prompt] * 64, "max_tokens": 1})

    threads = [threading.Thread(target=big, args=(f"big{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    small = _post(tiny_server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
    for t in threads:
        t.join(300)
    assert small.status_code == 200, small.text
    for name in ("big0", "big1"):
        r = results[name]
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith("prompt[0]: the prompt makes more than") and "room for 3000" in message, message
        assert r.json()["error"]["code"] == "context_length_exceeded"
    assert _peak_rss_mb(tiny_server) - before < 300


def test_a_small_request_never_waits_behind_big_prompt_work(serve, tiny_serve_jlm):
    """Both threads that take prompt work of over BIG characters held busy (as two huge requests would hold them): a
    big request waits for them, and a small chat beside it is answered meanwhile, on threads of its own."""
    from concurrent.futures import ThreadPoolExecutor

    from jitllmd.serve import prompt

    server = serve("-load", str(tiny_serve_jlm), "-id", "tiny", "-max-seq", "3000")
    release = threading.Event()
    held = [prompt._big_pool.submit(release.wait, 120) for _ in range(2)]
    try:
        with ThreadPoolExecutor(1) as pool:
            big = pool.submit(_post, server, "/v1/completions", {"model": "tiny", "prompt": "ab " * 23_000, "max_tokens": 1})
            small = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
            assert small.status_code == 200, small.text
            assert not big.done()  # still waiting for a big-work thread
            release.set()
            assert big.result(120).status_code == 400  # then refused: 69k characters of a room of 3000
    finally:
        release.set()
    assert all(h.result(120) for h in held)


# -- a request's prompts are checked before any runs ---------------------------------------------------------------------


def test_a_refused_prompt_starts_none_of_the_others(tiny_server):
    """prompt[1] has no room (5000 tokens of a room of 3000, under the character bound): the 400 names it, and
    prompt[0] never ran (no prompt tokens counted, nothing running or waiting); a 1-token chat then answers."""
    before = stats(tiny_server)
    r = _post(tiny_server, "/v1/completions", {"model": "tiny", "prompt": ["hello there", "x" * 5000], "max_tokens": 64, "ignore_eos": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]", r.text
    assert "5000 tokens" in r.json()["error"]["message"]
    queue = device_queue(tiny_server)
    assert not queue["running"] and not queue["waiting"]
    assert stats(tiny_server)["promptTokens"] == before["promptTokens"]
    one = _post(tiny_server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "ignore_eos": True})  # a sampled end of text would be none
    assert one.status_code == 200 and one.json()["usage"]["completion_tokens"] == 1


# -- fan-out ------------------------------------------------------------------------------------------------------------


def test_fan_out_is_bounded_and_named(tiny_server):
    """64 prompts x n 16 (1,024 choices) with json_object: refused before any grammar is compiled, naming
    -max-choices; 17 constrained choices, naming -max-constrained; the peak RSS barely moves; 16 constrained run."""
    before = _peak_rss_mb(tiny_server)
    body = {"model": "tiny", "prompt": ["hi"] * 64, "n": 16, "max_tokens": 4, "response_format": {"type": "json_object"}}
    r = _post(tiny_server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "-max-choices" in r.json()["error"]["message"], r.text
    r = _post(tiny_server, "/v1/completions", {**body, "prompt": ["hi"] * 17, "n": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "-max-constrained" in r.json()["error"]["message"]
    r = _post(tiny_server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "n": 17, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 17, r.text  # unconstrained choices are cheaper: up to 64
    r = _post(tiny_server, "/v1/completions", {**body, "prompt": ["hi"] * 8, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 16, r.text
    assert _peak_rss_mb(tiny_server) - before < 300


def test_a_logit_bias_larger_than_the_vocabulary_is_refused_at_once(tiny_server):
    bias = {str(i): 1 for i in range(200_000)}
    r = _post(tiny_server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "logit_bias": bias})
    assert r.status_code == 400 and "200000 entries" in r.json()["error"]["message"], r.text


# -- bad input is a 400 naming the field ---------------------------------------------------------------------------------


def _tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.mark.parametrize(("path", "extra", "field"), [
    ("/v1/chat/completions", {"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit int() refuses
    ("/v1/chat/completions", {"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # past int()'s digit limit
    ("/v1/chat/completions", {"tool_choice": "required", "tools": _tool({"type": "object", "$defs": [1]})}, "tools[0].function.parameters.$defs"),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": _tool({"type": "object", "definitions": "x"})}, "tools[0].function.parameters.definitions"),
    ("/v1/chat/completions", {"tools": _tool({"type": "object", "$defs": {"a": 3}})}, "tools[0].function.parameters.$defs.a"),
    ("/v1/messages", {"tool_choice": {"type": "any"}, "tools": [{"name": "f", "input_schema": {"type": "object", "$defs": [1]}}]}, "tools[0].input_schema.$defs"),
])
def test_bad_input_is_a_400_naming_the_field(tiny_server, path, extra, field):
    r = _post(tiny_server, path, {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **extra},)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith(field), error


def test_the_limits_are_flags(serve, tiny_serve_jlm):
    """-max-choices and -max-constrained set what the 400s name; a limit below 1 is refused at start."""
    from typer.testing import CliRunner

    from jitllmd.cli import app

    server = serve("-load", str(tiny_serve_jlm), "-id", "tiny", "-max-seq", "512", "-max-choices", "3", "-max-constrained", "1")
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "n": 4, "max_tokens": 1})
    assert r.status_code == 400 and "at most 3 for one request (serve -max-choices)" in r.json()["error"]["message"], r.text
    body = {"model": "tiny", "messages": MESSAGES, "n": 2, "max_tokens": 4, "response_format": {"type": "json_object"}}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and "at most 1 for one request (serve -max-constrained)" in r.json()["error"]["message"], r.text
    assert _post(server, "/v1/chat/completions", {**body, "n": 1}).status_code == 200
    result = CliRunner().invoke(app, ["serve", "-max-choices", "0", "-load", str(tiny_serve_jlm)])
    assert result.exit_code == 1 and "-max-choices must be >= 1, got 0" in result.output

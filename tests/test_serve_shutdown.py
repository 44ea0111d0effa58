"""A server told to stop ends every stream properly, even while its engine is held inside a step."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import httpx

from tests.serving import Server, wait_for

STALL_SERVE = Path(__file__).parent / "stall_serve.py"


def _connect(server, method: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}/jitllm.v1.{method}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


class _Stream(threading.Thread):
    """One streaming request read to its end in a thread: its SSE data lines, and an event once it has 2 of them."""

    def __init__(self, server, path: str, body: dict, headers: dict | None = None):
        super().__init__(daemon=True)
        self.server, self.path, self.body, self.headers = server, path, {**body, "stream": True}, headers or {}
        self.data: list[str] = []
        self.events: list[str] = []
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.server.url + self.path, json=self.body, headers=self.headers, timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        self.events.append(line[7:])
                    elif line.startswith("data: "):
                        self.data.append(line[6:])
                        if len(self.data) >= 2:
                            self.started.set()
        except BaseException as exc:  # noqa: BLE001  (the test says what went wrong)
            self.error = exc
        finally:
            self.started.set()


def _openai_final(s: _Stream) -> str:
    """The finish reason of an OpenAI stream that ended with [DONE]."""
    assert s.error is None, s.error
    assert s.data[-1] == "[DONE]", s.data[-3:]
    reasons = [c["finish_reason"] for d in s.data[:-1] for c in json.loads(d)["choices"] if c.get("finish_reason")]
    assert len(reasons) == 1, s.data[-4:]
    return reasons[0]


def _anthropic_final(s: _Stream) -> str:
    assert s.error is None, s.error
    assert s.events[-2:] == ["message_delta", "message_stop"], s.events[-4:]
    return json.loads(s.data[-2])["delta"]["stop_reason"]


def test_sigterm_ends_every_stream_while_the_engine_is_held_inside_a_step(tiny_serve_jlm, tmp_path):
    """Issue 19's case: 8 streams (3 in named sessions, OpenAI chat and completions, Anthropic), half of them long, on a
    batching device model; then the engine is held inside a step and the server gets SIGTERM. Nothing advances during
    the grace, yet every stream ends with its finish reason (`cancelled` unless it had finished) and its end marker,
    and the server exits 0 with no traceback."""
    stall = tmp_path / "stall"
    server = Server("-load", str(tiny_serve_jlm), "-id", "tiny", "-devices", "cpu", "-sessions", "8", "-max-batch", "8", "-max-seq", "3000",
                    launcher=[sys.executable, str(STALL_SERVE)], env={"JITLLMD_TEST_STALL": str(stall)})
    try:
        sessions = [_connect(server, "SessionService/CreateSession", {"model": "tiny"})["session"]["id"] for _ in range(3)]
        for sid in sessions:
            r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                           json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "jitllm_session": sid})
            assert r.status_code == 200, r.text
        chat = lambda n, **kw: {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": n, "temperature": 0, **kw}
        long = {"ignore_eos": True}
        oa = [
            _Stream(server, "/v1/chat/completions", chat(6, jitllm_session=sessions[0])),
            _Stream(server, "/v1/chat/completions", chat(2000, jitllm_session=sessions[1], **long)),
            _Stream(server, "/v1/chat/completions", chat(2000, jitllm_session=sessions[2], **long)),
            _Stream(server, "/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 6}),
            _Stream(server, "/v1/completions", {"model": "tiny", "prompt": "xyz", "max_tokens": 2000, **long}),
        ]
        an = [
            _Stream(server, "/v1/messages", chat(6)),
            _Stream(server, "/v1/messages", chat(6)),
            _Stream(server, "/v1/messages", chat(2000, **long)),
        ]
        for s in oa + an:
            s.start()
        for s in oa + an:
            assert s.started.wait(120)
        stall.touch()
        wait_for(lambda: "held inside a step" in server.log, "the engine to be held inside a step")
        server.signal(signal.SIGTERM)
        for s in oa + an:
            s.join(60)
            assert not s.is_alive(), "a stream did not end"
        reasons = [_openai_final(s) for s in oa] + [_anthropic_final(s) for s in an]
        for s, reason in zip(oa + an, reasons):
            assert reason in (("cancelled", "length", "stop", "max_tokens") if s.body["max_tokens"] == 6 else ("cancelled",)), (s.path, reason)
        # the server logs this after it has ended the streams, and its log reaches us through a pipe: wait for the line
        wait_for(lambda: "ended by the server" in server.log, "the server to log that it ended the streams")
        stall.unlink()  # the engine leaves its step; the process exits
        assert server.wait(60) == 0
        assert "Traceback" not in server.log and "CancelledError" not in server.log, server.log
    finally:
        stall.unlink(missing_ok=True)
        server.stop()

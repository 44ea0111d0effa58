"""Start-up as a probe sees it: the server answers while its models load, /healthz is a 503 that says what it is
loading until they are served, a request for a model still loading is a 503 in its dialect's shape (not a 404), and
a start-up model that cannot load ends the server with one line and exit 1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from tests.serving import wait_for

STALL_SERVE = Path(__file__).parent / "stall_serve.py"


class Starting:
    """`serve` under tests/stall_serve.py, its URL read from the start-up line that comes before any model loads."""

    def __init__(self, *args: str, env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, str(STALL_SERVE), "serve", "-addr", "127.0.0.1:0", *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "400", **env})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        wait_for(lambda: self.url is not None or self.proc.poll() is not None, "the start-up line", timeout=120)
        assert self.url is not None, self.log

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def url(self) -> str | None:
        m = re.search(r"(http://127\.0\.0\.1:\d+)/healthz answers 503", self.log)
        return m.group(1) if m else None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        code = self.proc.wait(60)
        self._reader.join(10)
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        return code


def test_healthz_says_loading_until_the_model_is_served(tiny_serve_jlm, tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    server = Starting("-load", str(tiny_serve_jlm), "-id", "tiny", env={"JITLLMD_TEST_STALL_LOAD": str(hold)})
    try:
        wait_for(lambda: "a model load held" in server.log, "the load to be held")
        r = httpx.get(server.url + "/healthz", timeout=10)
        assert r.status_code == 503 and r.text.strip() == f"loading {tiny_serve_jlm.name}", r.text
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=10)
        assert r.status_code == 503 and "still loading" in r.json()["error"]["message"] and r.json()["error"]["param"] == "model", r.text
        r = httpx.post(server.url + "/v1/messages", json=chat, timeout=10)
        assert r.status_code == 503 and r.json()["type"] == "error" and "still loading" in r.json()["error"]["message"], r.text
        r = httpx.post(server.url + "/jitllm.v1.ModelService/GetModel", json={"model": "tiny"}, timeout=10)
        assert r.status_code == 503 and r.json()["code"] == "unavailable", r.text
        r = httpx.post(server.url + "/v1/chat/completions", json={**chat, "model": "other"}, timeout=10)
        assert r.status_code == 404, r.text  # a name no load is making is still unknown
        hold.unlink()
        wait_for(lambda: httpx.get(server.url + "/healthz", timeout=10).status_code == 200, "the server to be healthy")
        assert httpx.get(server.url + "/healthz", timeout=10).text == "ok"
        assert f"serving {tiny_serve_jlm.name} as tiny" in server.log
        r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
    finally:
        assert server.stop() == 0, server.log


def test_a_start_up_model_that_cannot_load_ends_the_server(tmp_path):
    bad = tmp_path / "bad.jlm"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + b"\0" * 64)  # a safetensors header with no jlm metadata
    server = Starting("-models", str(tmp_path), "-load", "bad.jlm", env={})
    server.proc.wait(120)
    assert server.stop() == 1, server.log
    assert "error:" in server.log and "bad.jlm" in server.log and "Traceback" not in server.log, server.log

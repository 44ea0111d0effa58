"""Real servers on a free loopback port, for the HTTP tests: a `jitllmd serve` process (Server), or the same serve
flags served in this process (InProcessServer, and conftest's `serve` fixture that shares one per set of flags)."""

from __future__ import annotations

import ctypes
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import typer

from jitllmd.cli import app
from jitllmd.commands.serve import _api_key, serve_plan, start_models
from jitllmd.embedded import cache_dir
from jitllmd.engine.catalog import Catalog
from jitllmd.serve.app import build_app
from jitllmd.serve.server import STOP_SECONDS, ServerThread, bind
from jitllmd.serve.services.telemetry import ServerInfo

_URL = re.compile(r" at (http://127\.0\.0\.1:\d+)")


def _die_with_parent() -> None:
    """In the child: SIGTERM when the test process dies, so a crashed run leaves no server behind (Linux)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Server:
    """`python -m jitllmd serve ARGS -addr 127.0.0.1:0`; `url` once it listens; `log` is its stderr so far.
    `launcher` replaces `python -m jitllmd` (a test's wrapper of the CLI)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, timeout: float = 300.0, cwd: Path | None = None, launcher: list[str] | None = None):
        cmd = [*(launcher or [sys.executable, "-m", "jitllmd"]), "serve", "-addr", "127.0.0.1:0", *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "COLUMNS": "400", **(env or {})},
            cwd=cwd,
            preexec_fn=_die_with_parent,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start (exit {self.proc.returncode}):\n{self.log}")

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = _URL.search(line)
            if m and not self.url:
                self.url = m.group(1)
                self._ready.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 60.0) -> int:
        code = self.proc.wait(timeout)
        self._close()
        return code

    def _close(self) -> None:
        self._reader.join(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close()


def jitllmd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m jitllmd ARGS` with a wide terminal, so tables do not wrap ids."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "jitllmd", *args], capture_output=True, text=True, env=env, timeout=timeout)


class InProcessServer:
    """`jitllmd serve ARGS -addr 127.0.0.1:0` in this process: ARGS parsed by the serve command's own options, its
    Catalog built and the start-up models loaded as serve loads them, and the app served by serve's hypercorn set-up on
    a thread of its own (jitllmd.serve.server.ServerThread), on a real loopback socket. Clients reach `url` as they
    reach a Server's; it starts in a fraction of the time (no interpreter or imports of its own).
    `catalog` is what it serves. What only the CLI prints (start lines, the log) and only a process has (signals,
    exit codes, RSS, malloc arenas) are a Server's: this one has no `log`."""

    def __init__(self, *args: str):
        command = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
        params = command.make_context("serve", ["-addr", "127.0.0.1:0", *args]).params
        if params["cluster"] is not None or params["world"] is not None:
            raise ValueError("a cluster's rank 0 is a Server (its workers join a process)")
        flags = {name: params[name] for name, p in inspect.signature(serve_plan).parameters.items() if p.kind is p.KEYWORD_ONLY and name not in ("key", "allow_host")}
        plan = serve_plan(params["addr"], params["models"], params["load"] or [], params["id"] or [], key=_api_key(params["api_key"], params["api_key_file"]),
                          allow_host=params["allow_host"] or [], **flags)
        models = plan.models
        self.catalog = Catalog(models, plan.config, (models / ".cache") if models is not None else cache_dir())
        sock = bind(plan.host, plan.port)
        try:
            start_models(self.catalog, plan)
            sock.listen(512)
            self.url = f"http://{plan.host}:{sock.getsockname()[1]}"
            info = ServerInfo(address=self.url, models_dir=str(self.catalog.models_dir or ""), started=time.time())
            served = build_app(self.catalog, info, api_key=plan.key, allowed_hosts=plan.hosts, limits=plan.limits(), stored=plan.stored())
            self._thread: ServerThread | None = ServerThread(served, sock, cancel_all=self.catalog.cancel_all)
        except BaseException:
            sock.close()
            self.catalog.stop(timeout=STOP_SECONDS)
            raise

    def stop(self) -> None:
        """As a Server's stop: no new connections, in-flight requests cancelled; then the models unloaded."""
        if self._thread is not None:
            thread, self._thread = self._thread, None
            if not thread.stop(60):
                raise RuntimeError(f"the in-process server at {self.url} did not stop")
        self.catalog.stop(timeout=STOP_SECONDS)


def openai_sdk(server) -> openai.OpenAI:
    """The OpenAI SDK pointed at a server (close it, or use it as a context manager)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def tiny_models_dir(root: Path, jlm: Path) -> Path:
    """A -models directory holding the tiny model and a second .jlm that is not loaded."""
    d = root / "models"
    d.mkdir(exist_ok=True)
    for name in ("tiny.jlm", "spare.jlm"):
        if not (d / name).exists():
            shutil.copyfile(jlm, d / name)
    return d


_COUNTS = ("requests", "cancelled", "promptTokens", "generatedTokens", "steps", "activeRows", "queueDepth", "maxRows", "acceptedTokens")


def stats(server, model: str = "tiny") -> dict[str, int]:
    """A model's engine counters from TelemetryService GetStats (Connect JSON: 64-bit counts are strings, zeros left out)."""
    models = httpx.post(server.url + "/jitllm.v1.TelemetryService/GetStats", json={}, timeout=60).json()["models"]
    m = next(m for m in models if m["model"] == model)
    return {k: int(m.get(k, 0)) for k in _COUNTS}


def device_queue(server, model: str = "tiny") -> dict:
    """The model's running and waiting requests now (SessionService GetDeviceQueue)."""
    r = httpx.post(server.url + "/jitllm.v1.SessionService/GetDeviceQueue", json={"model": model}, timeout=60).json()
    return {"running": [], "waiting": [], **r["queues"][0]}


def wait_for(condition, what: str, timeout: float = 120.0) -> None:
    """Poll until `condition()` holds. The timeout only bounds the wait for an event that should come; it claims no speed."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)

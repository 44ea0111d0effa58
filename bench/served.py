"""The served section of bench/vs_llamacpp.py: llama-server against `jitllmd serve` on one GGUF file, one streaming client.

Each server is spawned fresh, timed from spawn until its health endpoint answers 200, warmed with one request, driven
with N concurrent streaming chat requests at each client count, read for peak RSS, and stopped. The results come back
as lists per engine and key (one value a round, or the reason it failed) for vs_llamacpp.py's tables.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
PROMPT_CHARS = 330  # ~100 prompt tokens with SmolLM2's chat template around it (~4.5 characters a token of this text)
SESSIONS = 16
MAX_SEQ = 1024
HEALTHY_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 900
ENGINES = ("llama-server", "jitllmd")
NOTE_WORDS = ("rows", "chunk", "kernels")  # the jitllmd start lines that say how it batches


class ServerFailed(Exception):
    """A server that did not start, answered an error, or died; the message is the table cell."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_cmd(bin_dir: Path, gguf: Path, port: int, threads: int) -> list[str]:
    """16 slots of 1024 positions; --no-repack as the other llama.cpp tools here (the repack/AMX path crashes in these VMs)."""
    return [str(bin_dir / "llama-server"), "-m", str(gguf), "-np", str(SESSIONS), "-c", str(SESSIONS * MAX_SEQ), "-t", str(threads),
            "--no-repack", "--host", "127.0.0.1", "--port", str(port)]


# `jitllmd` with a kernel variant forced (kernels.use_variant, which the CLI's configure leaves as it is): ARGV[1] the
# variant, the rest the CLI's arguments
FORCED = "import sys; from jitllmd.engine import kernels; kernels.use_variant(sys.argv[1]); sys.argv[1:2] = []; from jitllmd.cli import main; main()"


def jitllmd_cmd(models_dir: Path, gguf_name: str, port: int, kernel: str | None = None) -> list[str]:
    """`jitllmd serve` at its defaults but for the sessions and their room (no -max-batch, no -prompt-chunk); `kernel`:
    with that kernel variant forced (the AVX2 kind on an AVX-512 machine)."""
    exe = Path(sys.executable).parent / "jitllmd"
    head = [sys.executable, "-c", FORCED, kernel] if kernel else [str(exe)] if exe.exists() else [sys.executable, "-m", "jitllmd"]
    return [*head, "serve", "-addr", f"127.0.0.1:{port}", "-models", str(models_dir), "-load", gguf_name, "-id", "m", "-devices", "cpu",
            "-sessions", str(SESSIONS), "-max-seq", str(MAX_SEQ)]


class Server:
    """One server process: spawned at construction (the start-to-healthy clock starts then), its output drained into
    `log` by a thread, its peak RSS read from /proc."""

    def __init__(self, cmd: list[str], url: str, health: str) -> None:
        self.url, self.health = url, health
        self.log: list[str] = []
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                     env={**os.environ, "COLUMNS": "400"})
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip())

    def wait_healthy(self) -> float:
        """Seconds from spawn until the health endpoint answers 200 (both answer 503, or refuse, while loading)."""
        with httpx.Client(timeout=5, trust_env=False) as client:
            while time.perf_counter() - self.t0 < HEALTHY_TIMEOUT_S:
                if self.proc.poll() is not None:
                    raise ServerFailed(f"exited with {self.proc.returncode} before healthy: {self.last_line()}")
                try:
                    if client.get(self.url + self.health).status_code == 200:
                        return time.perf_counter() - self.t0
                except httpx.TransportError:
                    pass
                time.sleep(0.02)
        raise ServerFailed(f"not healthy after {HEALTHY_TIMEOUT_S}s: {self.last_line()}")

    def peak_rss_mb(self) -> float:
        """VmHWM of the server process, or of the largest in its process tree."""
        return max(vm_hwm_kb(pid) for pid in process_tree(self.proc.pid)) / 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def last_line(self, limit: int = 160) -> str:
        lines = [ln.strip() for ln in self.log if ln.strip()]
        last = lines[-1] if lines else "no output"
        return last if len(last) <= limit else last[: limit - 3] + "..."


def process_tree(pid: int) -> list[int]:
    out = [pid]
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [p for c in (task / "children").read_text().split() for p in process_tree(int(c))]
        except OSError:
            pass
    return out


def vm_hwm_kb(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmHWM:")), 0)


# -- the client -----------------------------------------------------------------------------------------------------


@dataclass
class Stream:
    """One streamed chat completion as the client saw it."""

    sent: float
    first: float  # the first content delta
    end: float  # the stream's end
    num_tokens: int  # usage.completion_tokens where the server sends it, else the content deltas counted
    num_prompt_tokens: int  # -1 where no usage came
    num_cached_tokens: int = -1  # usage.prompt_tokens_details.cached_tokens, where the server sends it


def prompt(k: int) -> str:
    """The k-th request's prompt: its own number first, so that no prefix cache finds two alike, then a slice of text."""
    text = TEXT.read_text()
    start = (k * 389) % (len(text) - PROMPT_CHARS)
    return f"Reader {k}, continue this passage:\n\n" + text[start : start + PROMPT_CHARS]


def stream_messages(client: httpx.Client, url: str, messages: list[dict], num_tokens: int, barrier: threading.Barrier | None = None,
                    model: str = "m", timeout: float = REQUEST_TIMEOUT_S) -> Stream:
    """One streamed greedy chat of `messages` (ignore_eos: num_tokens generated), timed from its send (after `barrier`)."""
    body = {"model": model, "messages": messages, "max_tokens": num_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if barrier is not None:
        barrier.wait()
    sent = time.perf_counter()
    first, deltas, usage = 0.0, 0, None
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise ServerFailed(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:160]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if obj.get("error"):  # a failure after the 200, as a stream event
                raise ServerFailed(f"stream error: {json.dumps(obj['error'])[:160]}")
            if obj.get("usage"):
                usage = obj["usage"]
            for choice in obj.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    deltas += 1
    end = time.perf_counter()
    if not first:
        raise ServerFailed("a request streamed no content")
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return Stream(sent, first, end, usage["completion_tokens"] if usage else deltas, usage["prompt_tokens"] if usage else -1,
                  cached if isinstance(cached, int) else -1)


def stream_chat(client: httpx.Client, url: str, k: int, num_tokens: int, barrier: threading.Barrier | None = None) -> Stream:
    return stream_messages(client, url, [{"role": "user", "content": prompt(k)}], num_tokens, barrier)


def at_once(num_clients: int, send: Callable[[int, httpx.Client, threading.Barrier], Stream]) -> list[Stream]:
    """`send(i, client, barrier)` for each of `num_clients` clients at once, each from its own thread and connection, all
    let go together at the barrier. ServerFailed where any failed."""
    barrier = threading.Barrier(num_clients)
    got: list[Stream | BaseException] = [ServerFailed("no result")] * num_clients

    def one(i: int) -> None:
        try:
            with httpx.Client(trust_env=False) as client:
                got[i] = send(i, client, barrier)
        except (httpx.HTTPError, ServerFailed, threading.BrokenBarrierError, KeyError, ValueError) as exc:
            got[i] = exc
            barrier.abort()  # the others stop waiting for this one

    threads = [threading.Thread(target=one, args=(i,)) for i in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [g for g in got if not isinstance(g, Stream)]
    if bad:
        first = next((b for b in bad if not isinstance(b, threading.BrokenBarrierError)), bad[0])
        raise ServerFailed(f"{len(bad)}/{num_clients} requests failed: {type(first).__name__}: {first}")
    return [g for g in got if isinstance(g, Stream)]


def load(url: str, num_clients: int, num_tokens: int, first_k: int) -> list[Stream]:
    """`num_clients` streaming requests sent at once, each from its own thread and connection."""
    return at_once(num_clients, lambda i, client, barrier: stream_chat(client, url, first_k + i, num_tokens, barrier))


# -- one server's round, and the rounds -----------------------------------------------------------------------------


def keys(clients: tuple[int, ...]) -> list[str]:
    return [k for n in clients for k in (f"tps_{n}", f"ttft_ms_{n}")] + ["healthy_s", "rss_mb", "prompt_tokens"]


def why(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, ServerFailed) else f"{type(exc).__name__}: {exc}"


def serve_round(server: Server, clients: tuple[int, ...], num_tokens: int) -> dict[str, float | str]:
    """Healthy, one warm-up request, each client count in turn (tokens/s, TTFT p50, and the median cached prompt tokens
    where the server reports them); then the peak RSS. The server is stopped by the caller."""
    out: dict[str, float | str] = {"healthy_s": server.wait_healthy()}
    prompts: list[int] = []
    try:
        with httpx.Client(trust_env=False) as client:
            stream_chat(client, server.url, 0, num_tokens)  # warm up
        k = 1
        for n in clients:
            try:
                streams = load(server.url, n, num_tokens, k)
            except ServerFailed as exc:
                out[f"tps_{n}"] = out[f"ttft_ms_{n}"] = str(exc)
                continue
            finally:
                k += n
            wall = max(s.end for s in streams) - min(s.sent for s in streams)
            out[f"tps_{n}"] = sum(s.num_tokens for s in streams) / wall
            out[f"ttft_ms_{n}"] = statistics.median(1000 * (s.first - s.sent) for s in streams)
            if all(s.num_cached_tokens >= 0 for s in streams):  # where the server says (usage's cached_tokens)
                out[f"cached_{n}"] = statistics.median(s.num_cached_tokens for s in streams)
            prompts += [s.num_prompt_tokens for s in streams if s.num_prompt_tokens >= 0]
    except (ServerFailed, httpx.HTTPError) as exc:
        for key in keys(clients):
            out.setdefault(key, why(exc))
    rss = server.peak_rss_mb() if server.proc.poll() is None else 0.0
    out["rss_mb"] = rss if rss > 0 else f"exited with {server.proc.returncode}: {server.last_line()}"
    if prompts:
        out["prompt_tokens"] = statistics.mean(prompts)
    return out


class Quiet(Protocol):
    """vs_llamacpp.Quiet: start() waits for idle cores before a measurement; finish() returns the cores others kept busy."""

    def start(self) -> None: ...

    def finish(self) -> float: ...


@dataclass
class Served:
    """What the rounds measured: per engine, per key, a value (or failure) a round; and notes for the table."""

    got: dict[str, dict[str, list]]
    convert_s: float | str  # jitllmd's first start, which converts the GGUF into models_dir/.cache once (not in the table)
    jitllmd_notes: list[str]  # its start lines about rows per step, prompt chunks and kernels


def measure(gguf: Path, bin_dir: Path, models_dir: Path, threads: int, rounds: int, clients: tuple[int, ...], num_tokens: int,
            quiet: Quiet, log: Callable[[str], None], kernel: str | None = None) -> Served:
    """`rounds` interleaved rounds (llama-server first in the first round, jitllmd in the second, ...), each engine a
    fresh server a round, `quiet` around each; `kernel`: jitllmd's kernel variant forced."""
    models_dir.mkdir(parents=True, exist_ok=True)
    link = models_dir / gguf.name
    if not link.exists():  # absent, or a link left dangling
        link.unlink(missing_ok=True)
        link.symlink_to(gguf.resolve())

    def spawn(engine: str) -> Server:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if engine == "llama-server":
            return Server(llama_server_cmd(bin_dir, gguf, port, threads), url, "/health")
        return Server(jitllmd_cmd(models_dir, gguf.name, port, kernel), url, "/healthz")

    notes: list[str] = []
    first = spawn("jitllmd")
    try:
        convert_s: float | str = first.wait_healthy()
    except ServerFailed as exc:
        convert_s = str(exc)
    finally:
        first.stop()
    log(f"served: jitllmd first start (converts into {models_dir / '.cache'} unless done before): {convert_s if isinstance(convert_s, str) else f'{convert_s:.1f}s'}")

    got: dict[str, dict[str, list]] = {e: {} for e in ENGINES}
    for r in range(rounds):
        for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
            quiet.start()
            t0 = time.perf_counter()
            server = spawn(engine)
            try:
                res = serve_round(server, clients, num_tokens)
            except (ServerFailed, httpx.HTTPError) as exc:
                res = {k: why(exc) for k in keys(clients)}
            finally:
                server.stop()
            if engine == "jitllmd":
                notes += [ln.strip() for ln in server.log if any(w in ln for w in NOTE_WORDS) and ln.strip() not in notes]
            for k, v in res.items():
                got[engine].setdefault(k, []).append(v)
            others = quiet.finish()
            shown = {k: round(v, 1) if isinstance(v, float) else v for k, v in res.items()}
            log(f"served round {r + 1} {engine:12s} {time.perf_counter() - t0:6.1f}s, other processes {others:.2f} cores: {shown}")
    return Served(got, convert_s, notes)

"""A soak of `jitllmd serve`: N clients for M minutes with random disconnects, then the server's RSS, threads, file
descriptors, sessions, KV and queues against a baseline taken before the load.

    python bench/soak.py                                  # 8 clients, 2 minutes, the embedded SmolLM2-135M
    python bench/soak.py --clients 4 --minutes 1 --sessions 4
    python bench/soak.py --load model.jlm --json
    python bench/soak.py --addr http://127.0.0.1:8080 --pid 1234

Each client loops on a random request: OpenAI chat or completions, or Anthropic messages, mostly streamed, some in a
named session of its own (created with SessionService, used for a few turns, closed), with a random max_tokens; about
a third of them it drops mid-stream after a random number of chunks (or, unstreamed, by a short read timeout). A warm-up
round first fills what the server keeps by design (pooled KV slots, worker threads); the baseline is taken once it is
idle and its thread and descriptor counts hold still, the after figures once it is idle again. RSS may grow by 10% or
64 MiB (allocators keep pages); threads, descriptors, sessions, KV, running and waiting must come back. Exits non-zero
on a failed verdict, a stream that ends without its end marker (`data: [DONE]`, `message_stop`), an error event in a
stream, any 5xx, or a dropped connection.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.serving import Server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_MIB = 1 << 20
AUTH: dict[str, str] = {}  # the API key header, when --api-key gives one
_TREND = 15  # seconds between RSS samples during the load
_STEADY = 7  # seconds: longer than the 5 s a closed connection's descriptor stays open on the server

PROMPTS = [
    "Say hello.", "Name three colours.", "What is two plus two?", "Write one sentence about the sea.", "Count from one to ten.",
    "Give me a word that rhymes with cat.", "What is the capital of France?", "Describe a cloud in a few words.",
]
# (dialect, streamed): the mix each client draws from
KINDS = [("chat", True), ("completions", True), ("messages", True), ("chat", False), ("completions", False), ("messages", False)]
WEIGHTS = [3, 2, 3, 1, 1, 1]


class Control:
    """Connect JSON calls to the control plane (camelCase fields, 64-bit counts as strings, zeros left out)."""

    def __init__(self, url: str):
        # one kept-alive connection: a closed one holds its server-side descriptor for a few seconds (the server's
        # keep-alive timeout), so a connection per call would make the descriptor count depend on how often we ask
        self.http = httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_connections=1), headers=AUTH)

    def call(self, method: str, body: dict | None = None) -> dict:
        r = self.http.post(f"/jitllm.v1.{method}", json=body or {})
        if r.status_code != 200:
            raise RuntimeError(f"{method}: HTTP {r.status_code} {r.text[:300]}")
        return r.json()

    def model(self) -> str:
        models = self.call("TelemetryService/GetStats").get("models", [])
        if not models:
            sys.exit("the server has no model loaded")
        return models[0]["model"]

    def busy(self) -> bool:
        """Anything running or waiting on any model, or a session still marked busy."""
        queues = self.call("SessionService/GetDeviceQueue").get("queues", [])
        sessions = self.call("SessionService/ListSessions").get("sessions", [])
        return any(q.get("running") or q.get("waiting") for q in queues) or any(s.get("busy") for s in sessions)


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS (bytes) and Threads of a local process, and its open descriptors."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "VmRSS":
                out["rss"] = int(value.split()[0]) * 1024
            elif key == "Threads":
                out["threads"] = int(value)
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def probe(ctl: Control, pid: int | None) -> dict[str, int]:
    """One reading of every figure the verdicts look at."""
    stats = ctl.call("TelemetryService/GetStats")
    sessions = ctl.call("SessionService/ListSessions").get("sessions", [])
    queues = ctl.call("SessionService/GetDeviceQueue").get("queues", [])
    models = stats.get("models", [])
    out = {
        "rss": int(stats.get("rssBytes", 0)),
        "sessions": len(sessions),
        "session_kv": sum(int(s.get("kvBytes", 0)) for s in sessions),
        "kv": sum(int(m.get("kvBytes", 0)) for m in models),
        "running": sum(len(q.get("running", [])) for q in queues),
        "waiting": sum(len(q.get("waiting", [])) for q in queues),
        "requests": int(stats.get("requests", 0)),
        "cancelled": sum(int(m.get("cancelled", 0)) for m in models),
    }
    if pid is not None:
        out |= proc_status(pid)
    return out


def wait_idle(ctl: Control, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while ctl.busy():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def settle(ctl: Control, pid: int | None, timeout: float, target: dict[str, int] | None = None) -> dict[str, int]:
    """Probe until threads and descriptors hold still for `_STEADY` seconds (or, with a target, are back at or under
    it): idle worker threads and the descriptors of closed connections take a few seconds to go."""
    deadline = time.monotonic() + timeout
    last = probe(ctl, pid)
    if pid is None:
        return last
    steady = 0
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = probe(ctl, pid)
        if target is not None and all(now[k] <= target[k] for k in ("threads", "fds")):
            return now
        steady = steady + 1 if (now["threads"], now["fds"]) == (last["threads"], last["fds"]) else 0
        last = now
        if target is None and steady >= _STEADY * 2:
            break
    return last


@dataclass
class Tally:
    """Per request kind: outcome counts; a sample message per error."""

    counts: dict[str, collections.Counter] = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    samples: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: str, sample: str = "") -> None:
        with self.lock:
            self.counts[kind][outcome] += 1
            if sample and outcome not in self.samples:
                self.samples[outcome] = f"{kind}: {sample}"

    def total(self) -> collections.Counter:
        out: collections.Counter = collections.Counter()
        for c in self.counts.values():
            out.update(c)
        return out


def _body(dialect: str, model: str, rng: random.Random, stream: bool, session: str | None, max_tokens: int) -> tuple[str, dict]:
    prompt = rng.choice(PROMPTS)
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": stream, "temperature": rng.choice([0.0, 0.7])}
    if dialect == "completions":
        return "/v1/completions", body | {"prompt": prompt}
    if session is not None:
        body["jitllm_session"] = session
    return ("/v1/chat/completions" if dialect == "chat" else "/v1/messages"), body | {"messages": [{"role": "user", "content": prompt}]}


def _read_stream(r: httpx.Response, dialect: str, drop_after: int | None) -> tuple[str, str]:
    """Read SSE lines to the end or to the drop: (outcome, sample)."""
    chunks, ended, finished = 0, False, False
    for line in r.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if ended:
            return "data after the end marker", data[:200]
        if data == "[DONE]":
            ended = True
            continue
        obj = json.loads(data)
        if "error" in obj:
            return "error event in stream", json.dumps(obj["error"])[:200]
        chunks += 1
        if dialect == "messages":
            if obj.get("type") == "message_delta" and obj["delta"].get("stop_reason"):
                finished = True
            elif obj.get("type") == "message_stop":
                ended = True
        elif obj.get("choices") and obj["choices"][0].get("finish_reason"):
            finished = True
        if drop_after is not None and chunks >= drop_after and not ended:
            return "disconnected", ""  # leaving the `with` closes the connection mid-stream
    if not ended:
        return "no end marker", f"{chunks} chunks, then the stream closed"
    if not finished:
        return "no finish reason", f"{chunks} chunks"
    return "completed", ""


def _check_reply(dialect: str, obj: dict) -> bool:
    if dialect == "messages":
        return obj.get("type") == "message" and bool(obj.get("stop_reason"))
    return bool(obj.get("choices")) and bool(obj["choices"][0].get("finish_reason"))


def one_request(http: httpx.Client, path: str, body: dict, dialect: str, rng: random.Random, drop: float) -> tuple[str, str]:
    """Send one request, maybe dropping it partway: (outcome, sample)."""
    dropping = rng.random() < drop
    try:
        if body["stream"]:
            drop_after = rng.randint(0, body["max_tokens"] + 2) if dropping else None
            with http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return f"HTTP {r.status_code}", r.text[:200]
                if drop_after == 0:
                    return "disconnected", ""  # gone right after the headers
                return _read_stream(r, dialect, drop_after)
        timeout = httpx.Timeout(300, connect=30, read=rng.uniform(0.05, 1.5)) if dropping else httpx.USE_CLIENT_DEFAULT
        try:
            r = http.post(path, json=body, timeout=timeout)
        except httpx.ReadTimeout:
            if dropping:
                return "disconnected", ""
            raise
        if r.status_code != 200:
            return f"HTTP {r.status_code}", r.text[:200]
        return ("completed", "") if _check_reply(dialect, r.json()) else ("malformed reply", r.text[:200])
    except (httpx.TransportError, json.JSONDecodeError) as exc:
        return "transport error", f"{type(exc).__name__}: {exc}"[:200]


class SoakClient:
    """One client's loop; it owns at most one named session at a time and closes it when its turns are up."""

    def __init__(self, index: int, url: str, model: str, seed: int, tally: Tally, a: argparse.Namespace):
        self.rng = random.Random(seed * 1000 + index)
        self.url, self.model, self.tally, self.a = url, model, tally, a
        self.session: str | None = None
        self.turns = 0
        self.sent = 0

    def run(self, until: float, stop: threading.Event) -> None:
        with httpx.Client(base_url=self.url, timeout=httpx.Timeout(300, connect=30), headers=AUTH) as http:
            while time.monotonic() < until and not stop.is_set():
                self.step(http)
            self.close_session(http)

    def step(self, http: httpx.Client) -> None:
        dialect, stream = self.rng.choices(KINDS, WEIGHTS)[0]
        in_session = dialect != "completions" and self.rng.random() < self.a.session_share
        if in_session and self.session is None:
            self.open_session(http)
        session = self.session if in_session else None
        path, body = _body(dialect, self.model, self.rng, stream, session, self.rng.randint(1, self.a.max_tokens))
        kind = f"{dialect} {'stream' if stream else 'whole'}" + (" session" if session else "")
        outcome, sample = one_request(http, path, body, dialect, self.rng, self.a.drop)
        self.tally.add(kind, outcome, sample)
        self.sent += 1
        if session is not None:
            self.turns -= 1
            if self.turns <= 0:
                self.close_session(http)

    def open_session(self, http: httpx.Client) -> None:
        r = http.post("/jitllm.v1.SessionService/CreateSession", json={"model": self.model})
        if r.status_code != 200:
            self.tally.add("session create", f"HTTP {r.status_code}", r.text[:200])
            return
        self.session, self.turns = r.json()["session"]["id"], self.rng.randint(1, 4)
        self.tally.add("session create", "completed")

    def close_session(self, http: httpx.Client) -> None:
        """CloseSession; a session still busy with a dropped request answers failed_precondition until the engine lets
        it go, so retry (counted) for up to a minute."""
        if self.session is None:
            return
        deadline = time.monotonic() + 60
        while True:
            r = http.post("/jitllm.v1.SessionService/CloseSession", json={"sessionId": self.session})
            if r.status_code == 200:
                self.tally.add("session close", "completed")
                break
            if "failed_precondition" in r.text and time.monotonic() < deadline:
                self.tally.add("session close", "retried (busy)")
                time.sleep(0.05)
                continue
            self.tally.add("session close", f"HTTP {r.status_code}", r.text[:200])
            break
        self.session = None


def warm_up(url: str, model: str, n: int, max_tokens: int) -> None:
    """n clients at once, one request of each dialect and a session turn: the pooled KV slots (grown by a reply of
    the longest prompt and max_tokens), worker threads and lazily built state the server keeps exist before the
    baseline."""

    def one(i: int) -> None:
        with httpx.Client(base_url=url, timeout=300, headers=AUTH) as http:
            longest = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "messages": [{"role": "user", "content": max(PROMPTS, key=len)}]}
            r = http.post("/v1/chat/completions", json=longest)
            if r.status_code != 200:
                sys.exit(f"warm-up: HTTP {r.status_code} {r.text[:300]}")
            for dialect in ("chat", "completions", "messages"):
                for stream in (True, False):
                    path, body = _body(dialect, model, random.Random(i), stream, None, 8)
                    outcome, sample = one_request(http, path, body, dialect, random.Random(i), 0.0)
                    if outcome != "completed":
                        sys.exit(f"warm-up {dialect} {'stream' if stream else 'whole'}: {outcome} {sample}")
            sid = http.post("/jitllm.v1.SessionService/CreateSession", json={"model": model}).json()["session"]["id"]
            one_request(http, *_body("chat", model, random.Random(i), True, sid, 8), "chat", random.Random(i), 0.0)
            http.post("/jitllm.v1.SessionService/CloseSession", json={"sessionId": sid}).raise_for_status()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@dataclass(frozen=True)
class Row:
    metric: str
    baseline: float
    after: float
    verdict: str
    mib: bool = False

    def cells(self) -> list[str]:
        f = (lambda x: f"{x:.1f}") if self.mib else (lambda x: f"{int(x)}")
        return [self.metric, f(self.baseline), f(self.after), ("{:+.1f}" if self.mib else "{:+.0f}").format(self.after - self.baseline), self.verdict]


def verdicts(base: dict[str, int], after: dict[str, int], idle: bool) -> list[Row]:
    rows = []
    if "rss" in base:
        slack = max(base["rss"] * 0.10, 64 * _MIB)
        rows.append(Row("RSS MiB", base["rss"] / _MIB, after["rss"] / _MIB, "ok" if after["rss"] <= base["rss"] + slack else "FAIL (grew)", mib=True))
    exact = [("threads", "threads"), ("fds", "open fds"), ("sessions", "named sessions"), ("session_kv", "named-session KV bytes"),
             ("kv", "KV bytes (sessions + slots + running)"), ("running", "running"), ("waiting", "waiting")]
    for key, name in exact:
        if key in base:
            rows.append(Row(name, base[key], after[key], "ok" if after[key] <= base[key] else "FAIL (not back)"))
    rows.append(Row("engine requests finished", base["requests"], after["requests"], "-"))
    rows.append(Row("engine requests cancelled", base["cancelled"], after["cancelled"], "-"))
    rows.append(Row("idle after the load", 1, 1 if idle else 0, "ok" if idle else "FAIL (still busy)"))
    return rows


def run_load(url: str, pid: int | None, model: str, tally: Tally, a: argparse.Namespace, server: Server | None) -> tuple[float, list[float]]:
    """The clients for `a.minutes`: (seconds it took, RSS MiB every _TREND seconds: a leak climbs, an allocator levels off)."""
    stop = threading.Event()
    clients = [SoakClient(i, url, model, a.seed, tally, a) for i in range(a.clients)]
    print(f"load: {a.clients} clients for {a.minutes:g} min", file=sys.stderr)
    t0 = time.monotonic()
    threads = [threading.Thread(target=c.run, args=(t0 + a.minutes * 60, stop), daemon=True) for c in clients]
    for t in threads:
        t.start()
    trend: list[float] = []
    try:
        while any(t.is_alive() for t in threads):
            if server is not None and server.proc.poll() is not None:
                stop.set()
                sys.exit(f"the server exited ({server.proc.returncode}) during the load:\n{server.log[-4000:]}")
            if pid is not None and time.monotonic() - t0 >= len(trend) * _TREND:
                trend.append(proc_status(pid)["rss"] / _MIB)
            time.sleep(1)
    except KeyboardInterrupt:
        stop.set()
        print("interrupted: the clients finish their requests", file=sys.stderr)
        for t in threads:
            t.join()
    return time.monotonic() - t0, trend


def print_report(model: str, a: argparse.Namespace, elapsed: float, requests: int, rows: list[Row], tally: Tally, trend: list[float], failed: list[str]) -> None:
    totals = tally.total()
    completed = totals["completed"] - tally.counts["session create"]["completed"] - tally.counts["session close"]["completed"]
    print(f"\n{model}, {a.clients} clients for {elapsed:.0f} s (seed {a.seed}): {requests} requests, {requests / elapsed:.2f} req/s, "
          f"{completed} completed, {totals['disconnected']} dropped by the client")
    print("| metric | baseline | after | delta | verdict |\n|---|---:|---:|---:|---|")
    for r in rows:
        print("| " + " | ".join(r.cells()) + " |")
    outcomes = sorted(totals)
    print("\n| request | " + " | ".join(outcomes) + " |\n|---|" + "---:|" * len(outcomes))
    for kind, c in sorted(tally.counts.items()):
        print(f"| {kind} | " + " | ".join(str(c[o]) for o in outcomes) + " |")
    if trend:
        print(f"\nRSS MiB every {_TREND} s of the load: " + ", ".join(f"{x:.0f}" for x in trend) + f"; after {rows[0].after:.0f}")
    for outcome, sample in sorted(tally.samples.items()):
        print(f"- {outcome}: {sample}")
    print("\nverdict: " + ("FAIL: " + ", ".join(failed) if failed else "ok"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients")
    ap.add_argument("--minutes", type=float, default=2.0, help="how long the load runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load", help="a .jlm or .gguf for the server (default: the embedded SmolLM2-135M)")
    ap.add_argument("--sessions", type=int, default=0, help="run the model on the CPU device batching N rows (-sessions N -max-batch N -devices cpu)")
    ap.add_argument("--serve-args", default="", help="more flags for `jitllmd serve`, one string")
    ap.add_argument("--addr", help="soak this running server (its URL) instead of starting one")
    ap.add_argument("--pid", type=int, help="with --addr: the server's process id, for threads and descriptors")
    ap.add_argument("--drop", type=float, default=0.35, help="share of requests the client drops partway")
    ap.add_argument("--session-share", type=float, default=0.3, help="share of chat and messages requests sent in a named session")
    ap.add_argument("--max-tokens", type=int, default=48, help="max_tokens is drawn from 1..this")
    ap.add_argument("--idle-timeout", type=float, default=120.0, help="seconds to wait for the server to go idle after the load")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--api-key", default=os.environ.get("JITLLMD_API_KEY"), help="the server's API key (default: $JITLLMD_API_KEY); a started server gets it too")
    a = ap.parse_args()
    if a.api_key:
        AUTH["authorization"] = f"Bearer {a.api_key}"

    server = None
    if a.addr:
        url, pid = a.addr.rstrip("/"), a.pid
    else:
        flags = ["-load", a.load] if a.load else []
        if a.sessions:
            flags += ["-sessions", str(a.sessions), "-max-batch", str(a.sessions), "-devices", "cpu"]
        flags += ["-api-key", a.api_key] if a.api_key else []
        server = Server(*flags, *shlex.split(a.serve_args), timeout=900, cwd=ROOT)
        print(f"$ jitllmd serve {shlex.join(flags)} {a.serve_args}", file=sys.stderr)
        url, pid = server.url, server.proc.pid
    try:
        ctl = Control(url)
        model = ctl.model()
        max_rows = max(int(m.get("maxRows", 1)) for m in ctl.call("TelemetryService/GetStats")["models"])
        print(f"soaking {model} at {url}: warm-up with {max(a.clients, max_rows)} clients", file=sys.stderr)
        warm_up(url, model, max(a.clients, max_rows), a.max_tokens)
        wait_idle(ctl, a.idle_timeout)
        base = settle(ctl, pid, 30)

        tally = Tally()
        elapsed, trend = run_load(url, pid, model, tally, a, server)
        idle = wait_idle(ctl, a.idle_timeout)
        after = settle(ctl, pid, 30, target=base)
    finally:
        if server is not None:
            server.stop()

    rows = verdicts(base, after, idle)
    totals = tally.total()
    requests = sum(n for kind, c in tally.counts.items() if not kind.startswith("session ") for n in c.values())
    # expected: completions, drops, closes retried while a dropped request lets go; a 4xx is shown, not fatal
    fatal = [k for k in totals if k not in ("completed", "disconnected", "retried (busy)") and not k.startswith("HTTP 4")]
    failed = [r.metric for r in rows if r.verdict.startswith("FAIL")] + sorted(fatal)
    if a.json:
        print(json.dumps({
            "model": model, "clients": a.clients, "minutes": a.minutes, "seed": a.seed, "elapsed_s": elapsed,
            "requests": requests, "requests_per_s": requests / elapsed, "rss_mib_during_load": trend,
            "metrics": [{"metric": r.metric, "baseline": r.baseline, "after": r.after, "delta": r.after - r.baseline, "verdict": r.verdict} for r in rows],
            "outcomes": {k: dict(c) for k, c in sorted(tally.counts.items())}, "samples": tally.samples, "failed": failed,
        }, indent=2))
    else:
        print_report(model, a, elapsed, requests, rows, tally, trend, failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

"""Continuous batching through the HTTP surface: a device model (the CPU named as a device) runs its requests as rows."""

from __future__ import annotations

import json
import math
import threading
import time

import httpx
import pytest

from jitllmd.engine.request import RequestState
from jitllmd.engine.scheduler import Scheduler
from tests.serving import InProcessServer, Server, device_queue, stats, wait_for

PROMPTS = ["abc", "The quick brown fox", "hello there, general", "xyz " * 6, "once upon a time", "Qq", "numbers 1 2 3 4", "end."]


def complete(server, prompt: str, n: int, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()


def at_once(fn, args: list[tuple]) -> list:
    out: list = [None] * len(args)
    threads = [threading.Thread(target=lambda i=i, a=a: out.__setitem__(i, fn(*a))) for i, a in enumerate(args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def in_engine(server) -> int:
    """Requests the engine holds now, running or waiting."""
    q = device_queue(server)
    return len(q["running"]) + len(q["waiting"])


@pytest.fixture(scope="module")
def alone(tiny_server) -> list[str]:
    """Each prompt's greedy text when it runs alone (the one-row host server)."""
    return [complete(tiny_server, p, 12 + i)["choices"][0]["text"] for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("mode", ["always", "never"])
def test_eight_concurrent_requests_get_their_text_alone(tiny_serve_jlm, alone, mode):
    server = InProcessServer("-load", str(tiny_serve_jlm), "-id", "tiny", "-devices", "cpu", "-sessions", "8", "-max-batch", "8", "-max-seq", "512", "-joint-steps", mode, "-prompt-chunk", "7")
    try:
        results = at_once(lambda p, n: complete(server, p, n), [(p, 12 + i) for i, p in enumerate(PROMPTS)])
        assert [r["choices"][0]["text"] for r in results] == alone
        assert max(r["jitllm"]["queue_depth_on_entry"] for r in results) <= 7
        model_stats = httpx.post(server.url + "/jitllm.v1.TelemetryService/GetStats", json={}, timeout=60).json()["models"][0]
        assert model_stats["jointSteps"] == mode and float(model_stats["rowsPerStep"]) > 0
    finally:
        server.stop()


def test_a_quantized_model_batches_rows_as_it_runs_them_alone(tiny_serve_q8_jlm):
    """Q8_0 blocks: eight requests at once, rows of shared steps, give each one's text alone (one at a time, same server)."""
    server = InProcessServer("-load", str(tiny_serve_q8_jlm), "-id", "tiny", "-devices", "cpu", "-sessions", "8", "-max-batch", "8", "-max-seq", "512")
    try:
        one_by_one = [complete(server, p, 12 + i)["choices"][0]["text"] for i, p in enumerate(PROMPTS)]
        results = at_once(lambda p, n: complete(server, p, n), [(p, 12 + i) for i, p in enumerate(PROMPTS)])
        assert [r["choices"][0]["text"] for r in results] == one_by_one
        model_stats = httpx.post(server.url + "/jitllm.v1.TelemetryService/GetStats", json={}, timeout=60).json()["models"][0]
        assert float(model_stats["rowsPerStep"]) > 1  # the eight shared steps
    finally:
        server.stop()


def test_two_sessions_six_requests_queue_and_all_finish(tiny_serve_jlm):
    """-sessions 2: two long generations hold the rows; four more arrive behind them and wait in line (all six in the
    engine, the four waiting); the long ones are let go, and the four finish."""
    server = InProcessServer("-load", str(tiny_serve_jlm), "-id", "tiny", "-devices", "cpu", "-sessions", "2", "-max-seq", "3000")  # fresh: its counts start at 0
    leave = threading.Event()

    def hold(i: int) -> None:  # streams until told to leave; closing the stream cancels the generation
        body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": 2900, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                if leave.is_set():
                    return

    holders = [threading.Thread(target=hold, args=(i,)) for i in range(2)]
    rest: list = [None] * 4
    waiters = [threading.Thread(target=lambda i=i: rest.__setitem__(i, complete(server, PROMPTS[2 + i], 30))) for i in range(4)]
    try:
        rows = stats(server)["maxRows"]
        assert 1 <= rows <= 2  # measured at load, at most -sessions
        for t in holders:
            t.start()
        wait_for(lambda: in_engine(server) == 2, "the two long generations")
        for t in waiters:
            t.start()
        wait_for(lambda: in_engine(server) == 6 and len(device_queue(server)["waiting"]) >= 4, "the four behind them")
        leave.set()
        for t in [*holders, *waiters]:
            t.join(300)
        assert [r["usage"]["completion_tokens"] for r in rest] == [30] * 4
        assert all(r["jitllm"]["queue_depth_on_entry"] >= 2 for r in rest), [r["jitllm"] for r in rest]
        # a closed stream's generation ends when the engine next sees it: wait for both cancellations to be counted
        wait_for(lambda: stats(server)["requests"] == 6, "the two cancelled generations to be counted")
        s = stats(server)
        assert s["requests"] == 6 and s["cancelled"] == 2 and s["activeRows"] == 0 and s["queueDepth"] == 0
        # a step samples a token per row, and the guesses a row's sampler takes (speculative decoding): never more than `rows` ran
        assert s["steps"] * rows + int(s.get("acceptedTokens", 0)) >= s["generatedTokens"], s
    finally:
        leave.set()
        server.stop()


def test_a_joining_prompt_does_not_stall_the_generating_rows(tiny_serve_jlm):
    """Four rows stream; a 440-token prompt joins in 16-token chunks: every step of its prefill gives each row a token."""
    server = InProcessServer("-load", str(tiny_serve_jlm), "-id", "tiny", "-devices", "cpu", "-sessions", "5", "-max-batch", "5", "-max-seq", "4096", "-prompt-chunk", "16")
    chunks = [0] * 4
    leave = threading.Event()

    def stream(i: int) -> None:
        # far more tokens than the test needs (the rows must outlast the joining prompt however fast steps are): closing
        # the stream at the end cancels the rest
        body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    chunks[i] += 1
                if leave.is_set():
                    return  # closing the stream cancels the row: the rest of its tokens is not needed

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: min(chunks) >= 5, "all four rows to generate")
        before = stats(server)
        joined = complete(server, "long prompt " * 40, 4)
        after = stats(server)
        rows = device_queue(server)["running"]
        leave.set()
        assert joined["usage"]["prompt_tokens"] >= 300 and joined["usage"]["completion_tokens"] == 4, joined
        # the four rows generated from before the prompt arrived until after it finished
        assert len(rows) == 4 and all(r["state"] == "REQUEST_STATE_DECODE" for r in rows), rows
        fed = after["promptTokens"] - before["promptTokens"]  # only the joining prompt was fed meanwhile
        steps = after["steps"] - before["steps"]
        row_tokens = after["generatedTokens"] - before["generatedTokens"] - 4
        assert fed >= 300 and steps >= math.ceil(fed / 16) + 3, (fed, steps)  # 16 prompt tokens a step, then 3 decode steps
        # every one of those steps gave each of the four rows its token (less one step: the counters are read mid-step);
        # a prompt that stalled the rows would leave them a token short for each of its ~28 chunk steps
        assert row_tokens >= 4 * (steps - 1), (row_tokens, steps)
    finally:
        leave.set()
        server.stop()
        for t in threads:
            t.join(60)


# -- the scheduler as pure logic ------------------------------------------------------------------------------------


class _Req:
    """Just what the scheduler reads of a request."""

    def __init__(self, n_prompt: int, session: object | None = None):
        self.prompt_ids = list(range(n_prompt))
        self.fed = 0
        self.state = RequestState.WAITING
        self.session = session if session is not None else type("S", (), {"busy": False})()
        self.queue_depth_on_entry = 0
        self.leader = None  # no shared prompt (n > 1)
        self.forked = False

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def prompt_left(self) -> int:
        return len(self.prompt_ids) - self.fed


def test_scheduler_admits_up_to_max_batch_and_chunks_prompts():
    s = Scheduler(max_batch=2, prompt_chunk=10)
    a, b, c = _Req(15), _Req(8), _Req(3)
    for r in (a, b, c):
        s.add(r)
    assert [r.queue_depth_on_entry for r in (a, b, c)] == [0, 1, 2]
    rows = s.schedule()
    assert rows == [(a, 10)]  # the chunk budget goes first come first served
    a.fed = 10
    rows = s.schedule()
    assert rows == [(a, 5), (b, 5)] and c in s.waiting
    a.state, a.fed, b.fed = RequestState.DECODE, 15, 5
    assert s.schedule() == [(a, 1), (b, 3)]
    a.state = RequestState.FINISHED  # a row that ends leaves, and the waiting request takes its place at once
    b.state, b.fed = RequestState.DECODE, 8
    assert s.schedule() == [(b, 1), (c, 3)]


def test_scheduler_keeps_a_busy_sessions_request_in_line():
    shared = type("S", (), {"busy": False})()
    s = Scheduler(max_batch=4, prompt_chunk=100)
    a, b, c = _Req(4, shared), _Req(4, shared), _Req(4)
    for r in (a, b, c):
        s.add(r)
    assert [r for r, _ in s.schedule()] == [a, c]  # b waits for its session; c goes past it
    assert list(s.waiting) == [b]
    s.remove(b)  # cancelled while waiting: it never runs
    a.state = RequestState.FINISHED
    shared.busy = False
    assert b not in [r for r, _ in s.schedule()]


def test_scheduler_validates():
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(max_batch=0)
    with pytest.raises(ValueError, match="prompt_chunk"):
        Scheduler(prompt_chunk=0)


def test_max_batch_and_prompt_chunk_zero_are_decided_from_counts():
    from jitllmd.engine.tuning.batching import PREFILL_CHUNK, decide

    b = decide(max_batch=0, sessions=16, prompt_chunk=0, device_kind="cpu", max_seq=1024)
    assert (b.max_rows, b.prompt_chunk) == (16, PREFILL_CHUNK["cpu"])
    assert "-sessions 16" in b.rows_why and "cpu prefill chunk" in b.chunk_why
    short = decide(max_batch=0, sessions=3, prompt_chunk=0, device_kind="cuda", max_seq=100)
    assert (short.max_rows, short.prompt_chunk) == (3, 100) and "session room 100" in short.chunk_why
    kept = decide(max_batch=2, sessions=16, prompt_chunk=7, device_kind="cpu", max_seq=1024)
    assert (kept.max_rows, kept.prompt_chunk) == (2, 7) and kept.rows_why == "-max-batch 2" and kept.chunk_why == "-prompt-chunk 7"
    with pytest.raises(ValueError):
        decide(max_batch=-1, sessions=1, prompt_chunk=0, device_kind="cpu", max_seq=8)


def test_defaults_batch_every_session_the_same_at_every_load(tiny_serve_jlm):
    """-max-batch 0 is -sessions rows, and the choice is the same at each start while a busy loop runs beside the
    server (nothing at load is timed); the start line and stats say what was chosen and why."""
    import multiprocessing

    busy = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    busy.start()
    try:
        seen = []
        for _ in range(2):
            server = Server("-load", str(tiny_serve_jlm), "-id", "tiny", "-devices", "cpu", "-sessions", "6", "-max-seq", "512")  # a process: its start line is read
            try:
                deadline = time.monotonic() + 120  # the line after the one Server waits for
                while "batching:" not in server.log:
                    assert time.monotonic() < deadline, server.log
                    time.sleep(0.05)
                assert "batching: 6 rows per step (-max-batch 0: one per session, -sessions 6), prompt chunk 512 tokens" in server.log, server.log
                stats = httpx.post(server.url + "/jitllm.v1.TelemetryService/GetStats", json={}, timeout=10).json()["models"][0]
                seen.append((stats["maxRows"], stats["promptChunk"], stats["rowsWhy"], stats["promptChunkWhy"]))
            finally:
                server.stop()
        assert seen[0] == seen[1] and seen[0][:2] == (6, 512), seen
    finally:
        busy.terminate()
        busy.join()


def _spin() -> None:
    while True:
        pass

"""TelemetryService: engine counters, a tokens-per-second rate, and the server's identity."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch

from ... import __version__
from ...engine.catalog import Catalog
from ...engine.draft import draft_kv_bytes
from ...gen.jitllm.v1 import telemetry_pb2 as tel
from ...gen.jitllm.v1.telemetry_connect import TelemetryService

__all__ = ["ServerInfo", "Telemetry"]

_WINDOW = 10.0  # seconds of history a tokens-per-second rate looks back over


@dataclass(frozen=True)
class ServerInfo:
    address: str
    models_dir: str
    started: float  # time.time() at start


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Telemetry(TelemetryService):
    def __init__(self, catalog: Catalog, info: ServerInfo):
        self.catalog = catalog
        self.info = info
        self._samples: deque[tuple[float, dict[str, int]]] = deque()  # (monotonic time, generated tokens per model)

    def _rates(self, now: float, generated: dict[str, int]) -> dict[str, float]:
        """Generated tokens per second per model over the last _WINDOW seconds of samples."""
        while self._samples and now - self._samples[0][0] > _WINDOW:
            self._samples.popleft()
        rates = {}
        if self._samples:
            then, before = self._samples[0]
            dt = now - then
            rates = {m: (n - before.get(m, n)) / dt for m, n in generated.items()} if dt > 0.05 else {}
        if not self._samples or now - self._samples[-1][0] > 0.05:
            self._samples.append((now, generated))
        return rates

    def _stats(self) -> tel.GetStatsResponse:
        models = self.catalog.loaded()
        generated = {m.id: m.engine.stats.generated_tokens for m in models}
        rates = self._rates(time.monotonic(), generated)
        out = []
        for m in models:
            st, engine = m.engine.stats, m.engine
            running, waiting = engine.snapshot()
            sessions = engine.sessions.list()
            kv = engine.loaded.kv_bytes() + draft_kv_bytes(engine.speculator)  # a draft model's sessions' too
            pages = engine.loaded.kv_pages()
            relocation = self.catalog.relocation
            moved = relocation.counts(m.id)
            out.append(tel.ModelStats(
                model=m.id, requests=st.requests, cancelled=st.cancelled, prompt_tokens=st.prompt_tokens,
                generated_tokens=st.generated_tokens, steps=st.steps, active_rows=len(running), queue_depth=len(waiting),
                rows_per_step=st.rows_per_step, prompt_tokens_per_step=st.prompt_tokens_per_step,
                tokens_per_second=rates.get(m.id, 0.0), weight_bytes=engine.loaded.weight_nbytes(), kv_bytes=kv,
                sessions=len(sessions), max_rows=engine.scheduler.max_batch, joint_steps=engine.joint.mode, prompt_chunk=engine.scheduler.prompt_chunk,
                joint=[tel.JointStep(rows=n, choice=c, joint_ms=j, sequential_ms=q) for n, (c, j, q) in engine.joint.choices().items()],
                relocation=relocation.enabled(m.id), demotions=moved["demote"], promotions=moved["promote"],
                rows_why=engine.rows_why(), prompt_chunk_why=engine.batching.chunk_why if engine.batching is not None else "",
                speculative=engine.speculator.describe() if engine.speculator is not None else "off",
                drafted_tokens=engine.speculator.drafted if engine.speculator is not None else 0,
                accepted_tokens=engine.speculator.accepted if engine.speculator is not None else 0,
                prefix_cache=engine.scheduler.prefix_cache, prefix_hit_tokens=pages.hit_tokens, prefix_query_tokens=pages.query_tokens,
                kv_pages_held=pages.held, kv_pages_cached=pages.cached, kv_pages_free=pages.free,
                kv_pages_shared=pages.shared, kv_pages_host=pages.host, kv_pages_file=pages.file,
            ))
        return tel.GetStatsResponse(
            uptime_s=time.time() - self.info.started,
            requests=sum(s.requests for s in out), active_rows=sum(s.active_rows for s in out),
            queue_depth=sum(s.queue_depth for s in out), prompt_tokens=sum(s.prompt_tokens for s in out),
            generated_tokens=sum(s.generated_tokens for s in out), tokens_per_second=sum(s.tokens_per_second for s in out),
            models=out, rss_bytes=_rss_bytes(), sessions=sum(s.sessions for s in out),
        )

    async def get_stats(self, request: tel.GetStatsRequest, ctx: Any) -> tel.GetStatsResponse:
        return self._stats()

    async def watch_stats(self, request: tel.WatchStatsRequest, ctx: Any) -> AsyncIterator[tel.GetStatsResponse]:
        interval = max(100, request.interval_ms or 1000) / 1000
        while True:
            yield self._stats()
            await asyncio.sleep(interval)

    async def get_server_info(self, request: tel.GetServerInfoRequest, ctx: Any) -> tel.GetServerInfoResponse:
        return tel.GetServerInfoResponse(
            version=__version__, uptime_s=time.time() - self.info.started, address=self.info.address,
            models_dir=self.info.models_dir, started_unix=int(self.info.started),
            surfaces=["openai", "anthropic", "connect", "grpc", "grpc-web"], torch_version=torch.__version__,
        )

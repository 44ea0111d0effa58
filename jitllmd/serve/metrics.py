"""GET /metrics: the engine counters `jitllmd stats` shows, and requests by route and status, in Prometheus text format.

Names follow vLLM's, with `jitllmd:` for its `vllm:` and a `model_name` label as it has: `prompt_tokens_total`,
`generation_tokens_total`, `request_success_total` (by `finished_reason`: stop, length, cancelled, failed; vLLM says
abort for cancelled), `num_requests_running`, `num_requests_waiting`, `time_to_first_token_seconds`,
`time_per_output_token_seconds` (each gap between a request's sampled tokens, as vLLM's inter-token latency) and
`e2e_request_latency_seconds`, with vLLM's buckets. Where llama.cpp's server has the name: `n_decode_total` (steps) and
`n_busy_slots_per_decode` (rows per step; a mean over about the last ten steps, where llama.cpp's is since start).
jitllmd's own: `prompt_tokens_per_step`, `kv_cache_usage_bytes`, `weight_bytes`, `sessions`, `pager_reads_total`,
`pager_read_bytes_total`, `pager_read_seconds_total`; `device_memory_bytes` by device and state (total, free). HTTP requests are `http_requests_total` by method, route (the
route's template, never the raw path) and status, as vLLM's server counts them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import accumulate

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from starlette.requests import Request
from starlette.responses import Response

from ..engine.catalog import Catalog, ServedModel
from ..engine.draft import draft_kv_bytes
from ..engine.memory.devices import available_devices, device_info
from ..engine.stats import Histogram

__all__ = ["Metrics"]

_P = "jitllmd:"
_MODEL = ["model_name"]


def _histogram(name: str, doc: str, of: Iterable[tuple[str, Histogram]]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(_P + name, doc, labels=_MODEL)
    for model, h in of:
        total = h.sum  # read before the counts: a token the engine adds meanwhile shows in neither or only the counts
        cumulative = list(accumulate(list(h.counts)))  # one copy, so +Inf and _count agree with the buckets
        buckets = [(floatToGoString(b), float(n)) for b, n in zip(h.bounds, cumulative)] + [("+Inf", float(cumulative[-1]))]
        family.add_metric([model], buckets, total)
    return family


def _pager_reads(m: ServedModel) -> tuple[int, int, float]:
    """Host pager block reads from the .jlm so far: (reads, bytes, seconds); none for a model without a pager."""
    placement = m.engine.loaded.placement
    if placement is None:
        return 0, 0, 0.0
    stats = list(dict(placement.pager.reader.stats).values())  # the pager's thread may add a block meanwhile
    return sum(s.reads for s in stats), sum(s.bytes for s in stats), sum(s.seconds for s in stats)


class _Engines(Collector):
    """Reads every loaded model's engine counters when scraped (the engine thread keeps writing them meanwhile)."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def collect(self) -> Iterator[Metric]:
        models = self.catalog.loaded()
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def add(kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, model: str, value: float, **labels: str) -> None:
            family = families.get(name)
            if family is None:
                family = families[name] = kind(_P + name, doc, labels=[*_MODEL, *labels])
            family.add_metric([model, *labels.values()], value)

        counter, gauge = CounterMetricFamily, GaugeMetricFamily
        for m in models:
            st, engine = m.engine.stats, m.engine
            running, waiting = engine.snapshot()
            reads, read_bytes, read_seconds = _pager_reads(m)
            add(counter, "prompt_tokens", "Prompt tokens fed to the model (a session's cached prefix is not fed).", m.id, st.prompt_tokens)
            add(counter, "generation_tokens", "Tokens generated (an end-of-sequence token is not one).", m.id, st.generated_tokens)
            for reason, n in dict(st.finish_reasons).items():
                add(counter, "request_success", "Requests finished, by how they ended.", m.id, n, finished_reason=reason)
            add(gauge, "num_requests_running", "Requests holding a row of the engine's steps.", m.id, len(running))
            add(gauge, "num_requests_waiting", "Requests queued for a row.", m.id, len(waiting))
            add(counter, "n_decode", "Engine steps run (prompt chunks and decode rows together).", m.id, st.steps)
            add(gauge, "n_busy_slots_per_decode", "Rows per step, a mean over about the last ten steps.", m.id, st.rows_per_step)
            add(gauge, "prompt_tokens_per_step", "Prompt tokens per step, a mean over about the last ten steps.", m.id, st.prompt_tokens_per_step)
            add(gauge, "kv_cache_usage_bytes", "Bytes of the model's KV pages that sessions hold or the prefix cache keeps (its draft model's too).", m.id,
                engine.loaded.kv_bytes() + draft_kv_bytes(engine.speculator))
            pages = engine.loaded.kv_pages()
            for state in ("held", "shared", "cached", "free", "host", "file"):
                add(gauge, "kv_pages", "KV pages (64 positions of a group of layers) held by sessions (shared: by several), kept by the prefix cache "
                    "alone, free, or out of the pool in host memory or the spill file.", m.id,
                    getattr(pages, state), state=state)
            add(counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's name).", m.id, pages.query_tokens)
            add(counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache, not fed again (vLLM's name).", m.id, pages.hit_tokens)
            add(gauge, "weight_bytes", "Weight bytes a decode step reads.", m.id, engine.loaded.weight_nbytes())
            add(gauge, "sessions", "Named sessions the model holds.", m.id, len(engine.sessions.list()))
            add(counter, "pager_reads", "Blocks the host pager read from the model file.", m.id, reads)
            add(counter, "pager_read_bytes", "Bytes the host pager read from the model file.", m.id, read_bytes)
            add(counter, "pager_read_seconds", "Seconds the host pager spent reading the model file.", m.id, read_seconds)
            spec = engine.speculator
            if spec is not None:  # vLLM's names for the same counts
                add(counter, "spec_decode_num_draft_tokens", "Tokens speculative decoding guessed and fed to check.", m.id, spec.drafted)
                add(counter, "spec_decode_num_accepted_tokens", "Guessed tokens the sampler took.", m.id, spec.accepted)
        yield from families.values()
        pairs = [(m.id, m.engine.stats) for m in models]
        yield _histogram("time_to_first_token_seconds", "Seconds from a request's arrival to its first sampled token.",
                         ((model, st.time_to_first_token) for model, st in pairs))
        yield _histogram("time_per_output_token_seconds", "Seconds between a request's consecutive sampled tokens.",
                         ((model, st.time_per_output_token) for model, st in pairs))
        yield _histogram("e2e_request_latency_seconds", "Seconds from a generation's arrival to its end.",
                         ((model, st.e2e_request_latency) for model, st in pairs))


class _Devices(Collector):
    """Each device's memory when scraped: total and free (the driver's figure; the CPU's and Apple's, the host's)."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(_P + "device_memory_bytes", "Memory of each device this server may place blocks on, total and free.", labels=["device", "state"])
        for d in available_devices():
            info = device_info(d)
            family.add_metric([d, "total"], info.total_bytes)
            family.add_metric([d, "free"], info.free_bytes)
        cluster = self.catalog.cluster
        for rank, link in sorted(cluster.links.items()) if cluster is not None else []:  # what each other rank last said
            for r in link.devices:
                family.add_metric([f"{rank}:{r['id']}", "total"], r["total"])
                family.add_metric([f"{rank}:{r['id']}", "free"], r["free"])
        yield family


class Metrics:
    """The /metrics endpoint of one app: its own registry (never the process-wide one, so apps in one process stay
    apart), the catalog's engine counters read at scrape time, and the HTTP requests the app's middleware reports."""

    def __init__(self, catalog: Catalog):
        self.registry = CollectorRegistry()
        self.registry.register(_Engines(catalog))
        self.registry.register(_Devices(catalog))
        self.http_requests = Counter(
            "http_requests", "HTTP requests answered, by method, route template and status.", ["method", "route", "status"], registry=self.registry,
        )

    def observe_request(self, method: str, route: str, status: int) -> None:
        """Count one answered request. `route` is the route's template (/v1/models/{model:path}), not the raw path."""
        self.http_requests.labels(method, route, str(status)).inc()

    async def endpoint(self, request: Request) -> Response:
        """GET /metrics."""
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

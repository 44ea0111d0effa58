"""GET /metrics of a real server (serve's app on hypercorn on a loopback port, in this process): the
engine counters move by what the responses report, the gauges follow the queue, and the text parses as Prometheus's."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from jitllmd.serve.metrics import Metrics
from tests.serving import InProcessServer, openai_sdk, wait_for

ENGINE_COUNTERS = {
    "prompt_tokens", "generation_tokens", "request_success", "n_decode", "pager_reads", "pager_read_bytes", "pager_read_seconds",
}
ENGINE_GAUGES = {
    "num_requests_running", "num_requests_waiting", "n_busy_slots_per_decode", "prompt_tokens_per_step", "kv_cache_usage_bytes",
    "weight_bytes", "sessions",
}
HISTOGRAMS = {"time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_serve_jlm) -> Iterator[InProcessServer]:
    """`tiny` wholly resident, and `paged` (the same weights) with a page budget of one layer: its other blocks are
    read from the file at every step. A server of its own: the fixture re-budgets `paged` in it."""
    d = tmp_path_factory.mktemp("metrics")
    shutil.copyfile(tiny_serve_jlm, d / "paged.jlm")
    server = InProcessServer("-load", str(tiny_serve_jlm), "-id", "tiny", "-load", str(d / "paged.jlm"), "-id", "paged", "-max-seq", "3000")
    try:
        paged = server.catalog.get("paged")
        placement = paged.engine.loaded.placement
        assert placement is not None
        paged.engine.set_page_budget(placement.pager.largest_layer()[1]).result(timeout=120)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(served) -> Iterator[openai.OpenAI]:
    with openai_sdk(served) as c:
        yield c


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(served: InProcessServer) -> Samples:
    """Every sample of GET /metrics by (name, labels), through Prometheus's own parser."""
    r = httpx.get(served.url + "/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_LATEST
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(r.text) for s in f.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[("jitllmd:" + name if not name.startswith("http_") else name, tuple(sorted(labels.items())))]


def delta(before: Samples, after: Samples, name: str, model: str = "tiny", **labels: str) -> float:
    return value(after, name, model_name=model, **labels) - value(before, name, model_name=model, **labels)


def idle(served: InProcessServer) -> Samples:
    """The samples once neither model runs or queues anything (what earlier tests left has ended)."""
    def quiet() -> bool:
        s = scrape(served)
        return all(value(s, g, model_name=m) == 0 for g in ("num_requests_running", "num_requests_waiting") for m in ("tiny", "paged"))

    wait_for(quiet, "the engines to be idle")
    return scrape(served)


def test_every_family_parses_with_its_type_and_a_series_per_model(served):
    r = httpx.get(served.url + "/metrics", timeout=60)
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for names, kind in ((ENGINE_COUNTERS, "counter"), (ENGINE_GAUGES, "gauge"), (HISTOGRAMS, "histogram")):
        for name in names:
            f = families["jitllmd:" + name]
            assert f.type == kind, name
            assert {s.labels["model_name"] for s in f.samples} == {"tiny", "paged"}, name
    reasons = {s.labels["finished_reason"] for s in families["jitllmd:request_success"].samples}
    assert reasons == {"stop", "length", "cancelled", "failed"}  # each there from the start, at 0 before any request ends
    for s in families["jitllmd:time_to_first_token_seconds"].samples:
        assert s.labels.keys() <= {"model_name", "le"}
    assert families["http_requests"].type == "counter"


def test_completions_move_the_counters_by_the_usage_they_report(served, client):
    """Three generations to `tiny` (the same prompt twice, so the second may reuse the first's cache): the token
    counters move by their usage, and each latency histogram by one per request (first token, end) or per later token."""
    before = idle(served)
    lengths = (3, 5, 4)
    usages = [
        client.completions.create(model="tiny", prompt="the cat sat", max_tokens=lengths[0], temperature=0, extra_body={"ignore_eos": True}).usage,
        client.completions.create(model="tiny", prompt="the cat sat", max_tokens=lengths[1], temperature=0, extra_body={"ignore_eos": True}).usage,
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=lengths[2], extra_body={"ignore_eos": True}).usage,
    ]
    after = scrape(served)
    assert all(u is not None and u.prompt_tokens_details is not None for u in usages)
    assert [u.completion_tokens for u in usages] == list(lengths)  # type: ignore[union-attr]
    fed = sum(u.prompt_tokens - u.prompt_tokens_details.cached_tokens for u in usages)  # type: ignore[union-attr]
    assert delta(before, after, "prompt_tokens_total") == fed
    assert delta(before, after, "generation_tokens_total") == sum(lengths)
    assert delta(before, after, "request_success_total", finished_reason="length") == 3
    assert delta(before, after, "time_to_first_token_seconds_count") == 3
    assert delta(before, after, "time_per_output_token_seconds_count") == sum(n - 1 for n in lengths)
    assert delta(before, after, "e2e_request_latency_seconds_count") == 3
    assert delta(before, after, "time_to_first_token_seconds_sum") > 0
    assert delta(before, after, "n_decode_total") >= sum(lengths)  # a step per token at least
    assert delta(before, after, "generation_tokens_total", model="paged") == 0  # the other model's series stay apart
    assert value(after, "kv_cache_usage_bytes", model_name="tiny") > 0  # the pooled slot keeps its cache for reuse
    assert value(after, "weight_bytes", model_name="tiny") == served.catalog.get("tiny").engine.loaded.weight_nbytes()
    for name in HISTOGRAMS:  # cumulative buckets, the last (+Inf) equal to the count
        buckets = sorted((float(dict(labels)["le"]), v) for (n, labels), v in after.items() if n == f"jitllmd:{name}_bucket" and ("model_name", "tiny") in labels)
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)
        assert buckets[-1] == (float("inf"), value(after, f"{name}_count", model_name="tiny"))


def test_running_and_waiting_follow_the_queue(served):
    """One row at a time: a long stream runs, a second request waits behind it; the stream's client leaves, so it
    ends as cancelled and the second runs to its length."""
    before = idle(served)
    body = {"model": "tiny", "prompt": "abc", "temperature": 0, "ignore_eos": True, "stream": True}  # to its room, ~3,000 tokens
    second: dict = {}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        now = scrape(served)
        assert value(now, "num_requests_running", model_name="tiny") == 1 and value(now, "num_requests_waiting", model_name="tiny") == 0
        t = threading.Thread(target=lambda: second.update(httpx.post(
            served.url + "/v1/completions", json={"model": "tiny", "prompt": "xyz", "max_tokens": 4, "ignore_eos": True}, timeout=120).json()))
        t.start()
        wait_for(lambda: value(scrape(served), "num_requests_waiting", model_name="tiny") == 1, "the second request to queue")
    t.join(120)
    assert second["usage"]["completion_tokens"] == 4 and second["jitllm"]["queue_depth_on_entry"] == 1
    after = idle(served)
    assert delta(before, after, "request_success_total", finished_reason="cancelled") == 1
    assert delta(before, after, "request_success_total", finished_reason="length") == 1
    assert delta(before, after, "e2e_request_latency_seconds_count") == 2


def test_pager_reads_move_only_for_the_paged_model(served, client):
    before = idle(served)
    usage = client.completions.create(model="paged", prompt="the cat", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}).usage
    after = scrape(served)
    assert usage is not None and usage.completion_tokens == 6
    assert delta(before, after, "pager_reads_total", model="paged") >= 6  # its paged blocks, read at every step
    assert delta(before, after, "pager_read_bytes_total", model="paged") > 0
    assert delta(before, after, "pager_reads_total", model="tiny") == 0  # wholly resident: read once, at load


def test_requests_are_counted_by_route_template_and_status(served):
    before = scrape(served)
    for name in ("tiny", "paged", "nothing-by-this-name"):
        httpx.get(served.url + f"/v1/models/{name}", timeout=60)
    after = scrape(served)
    count = lambda s, status: s.get(("http_requests_total", (("method", "GET"), ("route", "/v1/models/{model:path}"), ("status", status))), 0.0)
    assert count(after, "200") - count(before, "200") == 2
    assert count(after, "404") - count(before, "404") == 1
    assert not any("nothing-by-this-name" in v for _, labels in after for _, v in labels)  # the template, never the path


def test_each_metrics_has_its_own_registry(served):
    """Two apps in one process: what one counts the other does not, and both read the same engines."""
    a, b = Metrics(served.catalog), Metrics(served.catalog)
    a.observe_request("POST", "/v1/completions", 200)
    a.observe_request("POST", "/v1/completions", 200)
    sa = {s.name: s.value for f in a.registry.collect() for s in f.samples if s.name == "http_requests_total"}
    assert sa == {"http_requests_total": 2.0}
    assert not [s for f in b.registry.collect() for s in f.samples if s.name == "http_requests_total"]
    assert any(f.name == "jitllmd:generation_tokens" for f in b.registry.collect())

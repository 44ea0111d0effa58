"""The engine's step loop on a tiny random llama: greedy parity with transformers, lengths, room, stop strings,
cancelling, session reuse, figures, batching."""

from __future__ import annotations

import json
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from jitllmd.engine.convert import convert
from jitllmd.engine.engine import Engine
from jitllmd.engine.figures import Figures
from jitllmd.engine.kv import RoomError
from jitllmd.engine.loader import load_model
from jitllmd.engine.request import Delta, Done, Failed, FinishReason, Generation
from jitllmd.engine.sampler import SamplingParams

MAX_SEQ = 64
GREEDY = SamplingParams(temperature=0)
TIMEOUT = 60.0
FIGURE_KEYS = {
    "session_id", "queued_ms", "queue_depth_on_entry", "device_blocks", "host_blocks", "device_ids",
    "prefill_ms", "decode_ms", "decode_tokens_per_second", "bytes_per_token", "drafted_tokens", "accepted_tokens",
}


@dataclass
class Result:
    text: str
    ids: list[int]
    done: Done
    deltas: list[Delta]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    _, hf_model, jlm = tiny_llama
    return load_model(jlm, max_seq=MAX_SEQ), hf_model


@pytest.fixture
def engine(tiny):
    e = Engine(tiny[0]).start()
    yield e
    e.stop()


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 90, (n,), generator=g).tolist()


PROMPTS = [_prompt(1, 5), _prompt(2, 12), _prompt(3, 1), _prompt(4, 23)]  # PROMPTS[2], [3]: EOS after 6, 7 tokens
LONG = [_prompt(20, 12), _prompt(22, 12)]  # 30 greedy tokens without an EOS


def hf_greedy(hf_model, ids: list[int], n: int, eos: tuple[int, ...] = (2,)) -> list[int]:
    """transformers' greedy continuation (full forward each step), ending before an EOS."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            t = int(hf_model(torch.tensor([ids])).logits[0, -1].argmax())
            if t in eos:
                break
            out.append(t)
            ids.append(t)
    return out


def collect(events) -> Result:
    """Iterate a generate() iterator in a worker thread, so a hung engine fails the test instead of hanging it."""
    box: dict = {}

    def work() -> None:
        try:
            box["events"] = list(events)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive(), "the engine did not finish the request"
    if "error" in box:
        raise box["error"]
    evs = box["events"]
    assert isinstance(evs[-1], Done), evs[-1]
    assert all(isinstance(e, Delta) for e in evs[:-1]), evs
    deltas = evs[:-1]
    return Result("".join(d.text for d in deltas), [i for d in deltas for i in d.token_ids], evs[-1], deltas)


def _wait(event: threading.Event) -> None:
    assert event.wait(TIMEOUT), "timed out waiting for the engine"


# -- greedy parity --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", range(len(PROMPTS)))
def test_greedy_matches_transformers(tiny, engine, k: int) -> None:
    loaded, hf_model = tiny
    ids = PROMPTS[k]
    r = collect(engine.generate(Generation(ids, GREEDY, max_tokens=16)))
    want = hf_greedy(hf_model, ids, 16)
    assert r.ids == want
    assert r.text == loaded.tokenizer.decode(want)
    assert r.done.completion_tokens == len(want)
    assert r.done.prompt_tokens == len(ids)
    # the reference ends before 16 tokens only on an EOS: then the engine reports stop, without a stop string
    assert r.done.finish_reason is (FinishReason.STOP if len(want) < 16 else FinishReason.LENGTH)
    assert r.done.stop is None


def test_some_prompt_ends_on_eos(tiny) -> None:
    """Keeps the parity test honest: at least one of its prompts reaches EOS, at least one reaches the length."""
    _, hf_model = tiny
    lengths = [len(hf_greedy(hf_model, p, 16)) for p in PROMPTS]
    assert min(lengths) < 16 and max(lengths) == 16


def test_max_tokens_ends_with_length(tiny, engine) -> None:
    _, hf_model = tiny
    ids = PROMPTS[1]
    assert 2 not in hf_greedy(hf_model, ids, 7)  # the model does not end on its own first
    for k, n in enumerate((1, 2, 7)):
        r = collect(engine.generate(Generation(ids, GREEDY, max_tokens=n)))
        assert r.done.finish_reason is FinishReason.LENGTH
        assert len(r.ids) == r.done.completion_tokens == n
        assert r.done.prompt_tokens == len(ids)
        assert r.done.fed_tokens == (len(ids) if k == 0 else 1)  # then the pooled slot holds the prompt
        assert r.done.stop is None


def test_prompt_longer_than_room_raises(tiny, engine) -> None:
    for n in (MAX_SEQ + 6, MAX_SEQ):  # a prompt that fills the room exactly leaves nothing to generate
        with pytest.raises(RoomError) as info:
            engine.generate(Generation(_prompt(5, n), GREEDY, max_tokens=4))
        assert str(n) in str(info.value) and str(MAX_SEQ) in str(info.value), str(info.value)
    s = engine.new_session(max_seq=16)
    with pytest.raises(RoomError) as info:
        engine.generate(Generation(_prompt(5, 20), GREEDY, session=s))
    assert "20" in str(info.value) and "16" in str(info.value)
    # the engine still serves afterwards
    assert collect(engine.generate(Generation(PROMPTS[0], GREEDY, max_tokens=3))).done.completion_tokens == 3


@pytest.mark.parametrize("max_tokens", [100, None])
def test_max_tokens_is_cut_to_the_room(tiny, engine, max_tokens) -> None:
    _, hf_model = tiny
    ids = _prompt(6, MAX_SEQ - 5)
    want = hf_greedy(hf_model, ids, 5)
    assert len(want) == 5, "the reference hit EOS; pick another prompt"
    r = collect(engine.generate(Generation(ids, GREEDY, max_tokens=max_tokens)))
    assert r.done.finish_reason is FinishReason.LENGTH
    assert r.ids == want
    assert r.done.completion_tokens == MAX_SEQ - len(ids)


def test_bad_requests(engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.generate(Generation([], GREEDY))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate(Generation([5], GREEDY, max_tokens=-1))
    with pytest.raises(ValueError, match=r"\[0, 96\)"):
        engine.generate(Generation([5, 96], GREEDY))
    with pytest.raises(ValueError, match=r"\[0, 96\)"):
        engine.generate(Generation([-1], GREEDY))


def test_eos_ends_with_stop(tiny, tmp_path: Path) -> None:
    """An end-of-sequence id (here one the greedy path reaches, declared in generation_config.json) ends with stop."""
    loaded, hf_model = tiny
    ids = PROMPTS[1]
    path = hf_greedy(hf_model, ids, 12)
    k = next(k for k in range(2, len(path)) if path[k] not in path[:k])  # a token new at step k
    eos = path[k]
    hf_dir = tmp_path / "hf"
    shutil.copytree(loaded.path.parent / "hf", hf_dir)
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eos]}))
    other = load_model(convert(hf_dir, tmp_path / "eos.jlm", "f32").path, max_seq=MAX_SEQ)
    assert other.eos_token_ids == [2, eos]
    e = Engine(other).start()
    try:
        r = collect(e.generate(Generation(ids, GREEDY, max_tokens=12)))
    finally:
        e.stop()
    assert r.done.finish_reason is FinishReason.STOP and r.done.stop is None
    assert r.ids == path[:k] == hf_greedy(hf_model, ids, 12, eos=(2, eos))
    assert r.done.completion_tokens == k  # the EOS itself is not part of the output
    assert r.text == other.tokenizer.decode(path[:k])


# -- stop strings -----------------------------------------------------------------------------------------------------


def _stop_across_tokens(full: Result) -> tuple[str, int]:
    """A 3-character stop string that spans a token boundary, and where it first occurs in the text."""
    offsets, at = [], 0
    for d in full.deltas:
        offsets.append(at)
        at += len(d.text)
    for b in offsets[len(offsets) // 3 :]:
        if 1 <= b <= len(full.text) - 2:
            stop = full.text[b - 1 : b + 2]
            if full.text.find(stop) == b - 1 and stop.strip():
                return stop, b - 1
    raise AssertionError(f"no usable stop string in {full.text!r}")


def test_stop_string_cuts_right_before_it(engine) -> None:
    ids = LONG[0]
    full = collect(engine.generate(Generation(ids, GREEDY, max_tokens=30)))
    assert full.done.finish_reason is FinishReason.LENGTH
    stop, at = _stop_across_tokens(full)
    r = collect(engine.generate(Generation(ids, GREEDY, max_tokens=30, stop=[stop])))
    assert r.text == full.text[:at]
    assert stop not in r.text
    assert r.done.finish_reason is FinishReason.STOP
    assert r.done.stop == stop
    assert r.done.completion_tokens < full.done.completion_tokens


def test_earliest_stop_string_wins(engine) -> None:
    ids = LONG[1]
    full = collect(engine.generate(Generation(ids, GREEDY, max_tokens=30)))
    text = full.text
    early, late = text[4:6], text[len(text) - 3 :]
    assert text.find(early) < text.find(late)
    r = collect(engine.generate(Generation(ids, GREEDY, max_tokens=30, stop=[late, "not in the text at all", early])))
    assert r.text == text[: text.find(early)]
    assert r.done.stop == early


def test_stop_string_never_seen_changes_nothing(engine) -> None:
    ids = PROMPTS[0]
    full = collect(engine.generate(Generation(ids, GREEDY, max_tokens=20)))
    r = collect(engine.generate(Generation(ids, GREEDY, max_tokens=20, stop=["@@@@", ""])))
    assert (r.text, r.ids, r.done.finish_reason) == (full.text, full.ids, FinishReason.LENGTH)
    assert r.done.stop is None


def test_stop_string_at_the_start_gives_empty_text(engine) -> None:
    ids = PROMPTS[0]
    full = collect(engine.generate(Generation(ids, GREEDY, max_tokens=10)))
    first = full.text[:1]
    assert first.strip()
    r = collect(engine.generate(Generation(ids, GREEDY, max_tokens=10, stop=[first])))
    assert r.text == "" and r.done.finish_reason is FinishReason.STOP and r.done.stop == first


# -- cancelling -------------------------------------------------------------------------------------------------------


def test_closing_the_generator_frees_the_engine(tiny, engine) -> None:
    _, hf_model = tiny
    s = engine.new_session()
    gen = engine.generate(Generation(_prompt(7, 10), SamplingParams(temperature=1.0, seed=0), session=s))
    first = next(gen)
    assert isinstance(first, Delta)
    gen.close()
    r = collect(engine.generate(Generation(PROMPTS[1], GREEDY, max_tokens=6)))
    assert r.ids == hf_greedy(hf_model, PROMPTS[1], 6)
    assert r.done.finish_reason is FinishReason.LENGTH
    # the cancelled request released its session: it can take another request
    r2 = collect(engine.generate(Generation(_prompt(8, 4), GREEDY, max_tokens=2, session=s)))
    assert r2.done.completion_tokens == 2


def test_cancel_running_request(tiny) -> None:
    """cancel() of a running request ends it with `cancelled` before it reaches its length; the engine goes on."""
    loaded, hf_model = tiny
    e = Engine(loaded).start()
    try:
        events: list = []
        first, finished, release = threading.Event(), threading.Event(), threading.Event()

        def emit(ev) -> None:
            events.append(ev)
            if isinstance(ev, Delta) and not first.is_set():
                first.set()
                _wait(release)  # hold the engine thread until the test has asked to cancel
            if isinstance(ev, (Done, Failed)):
                finished.set()

        req = e.submit(Generation(PROMPTS[1], GREEDY, max_tokens=40), emit)
        _wait(first)
        e.cancel(req)
        release.set()
        _wait(finished)
        done = events[-1]
        assert isinstance(done, Done) and done.finish_reason is FinishReason.CANCELLED
        assert done.completion_tokens < 40
        r = collect(e.generate(Generation(PROMPTS[0], GREEDY, max_tokens=5)))
        assert r.ids == hf_greedy(hf_model, PROMPTS[0], 5)
    finally:
        e.stop()


def test_cancel_waiting_request(tiny) -> None:
    loaded, hf_model = tiny
    e = Engine(loaded, max_batch=1).start()
    try:
        started, release, a_done = threading.Event(), threading.Event(), threading.Event()
        a_events, b_events = [], []

        def emit_a(ev) -> None:
            a_events.append(ev)
            if isinstance(ev, Delta) and not started.is_set():
                started.set()
                _wait(release)
            if isinstance(ev, Done):
                a_done.set()

        a = e.submit(Generation(PROMPTS[0], GREEDY, max_tokens=4), emit_a)
        _wait(started)
        b = e.submit(Generation(PROMPTS[1], GREEDY, max_tokens=4), b_events.append)
        e.cancel(b)
        release.set()
        _wait(a_done)
        assert a.finished
        assert [i for ev in a_events if isinstance(ev, Delta) for i in ev.token_ids] == hf_greedy(hf_model, PROMPTS[0], 4)
        for _ in range(int(TIMEOUT / 0.05)):  # a bound on the wait for B's end, not a speed
            if b.finished:
                break
            threading.Event().wait(0.05)
        assert len(b_events) == 1 and isinstance(b_events[0], Done)
        assert b_events[0].finish_reason is FinishReason.CANCELLED and b_events[0].completion_tokens == 0
        assert b_events[0].figures.queue_depth_on_entry == 1  # A was running when B arrived
    finally:
        e.stop()


def test_stop_cancels_everything(tiny) -> None:
    loaded, _ = tiny
    e = Engine(loaded).start()
    started, release = threading.Event(), threading.Event()
    events: list = []

    def emit(ev) -> None:
        events.append(ev)
        if isinstance(ev, Delta) and not started.is_set():
            started.set()
            _wait(release)

    e.submit(Generation(PROMPTS[0], GREEDY, max_tokens=40), emit)
    _wait(started)
    stopper = threading.Thread(target=e.stop, daemon=True)
    stopper.start()
    release.set()
    stopper.join(TIMEOUT)
    assert not stopper.is_alive()
    assert isinstance(events[-1], Done) and events[-1].finish_reason is FinishReason.CANCELLED


# -- sessions ---------------------------------------------------------------------------------------------------------


def test_named_session_reuses_its_cache(tiny, engine) -> None:
    _, hf_model = tiny
    s = engine.new_session()
    p1 = PROMPTS[1]
    r1 = collect(engine.generate(Generation(p1, GREEDY, max_tokens=5, session=s)))
    assert r1.done.fed_tokens == len(p1)
    assert r1.done.figures.session_id == s.id
    p2 = p1 + r1.ids + _prompt(9, 6)
    r2 = collect(engine.generate(Generation(p2, GREEDY, max_tokens=8, session=s)))
    assert r2.done.prompt_tokens == len(p2)
    assert r2.done.fed_tokens < len(p2)
    assert r2.done.fed_tokens <= len(p2) - len(p1)  # at least the whole first prompt came from the cache
    fresh = collect(engine.generate(Generation(p2, GREEDY, max_tokens=8)))
    assert fresh.done.fed_tokens == len(p2)
    assert r2.ids == fresh.ids == hf_greedy(hf_model, p2, 8)
    # a prompt that diverges early reuses only the shared prefix, and is still right
    p3 = p1[:3] + _prompt(10, 7)
    r3 = collect(engine.generate(Generation(p3, GREEDY, max_tokens=6, session=s)))
    assert len(p3) - 3 <= r3.done.fed_tokens <= len(p3)
    assert r3.ids == hf_greedy(hf_model, p3, 6)
    # the same prompt again: everything but the last token comes from the cache
    r4 = collect(engine.generate(Generation(p3, GREEDY, max_tokens=6, session=s)))
    assert r4.done.fed_tokens < len(p3) - 3
    assert r4.ids == r3.ids


def test_session_room_applies(tiny, engine) -> None:
    _, hf_model = tiny
    s = engine.new_session(max_seq=20)
    assert s.max_seq == 20
    ids = _prompt(11, 15)
    r = collect(engine.generate(Generation(ids, GREEDY, max_tokens=50, session=s)))
    assert r.done.finish_reason is FinishReason.LENGTH and r.done.completion_tokens == 5
    assert r.ids == hf_greedy(hf_model, ids, 5)


# -- figures ----------------------------------------------------------------------------------------------------------


def test_figures(tiny, engine) -> None:
    loaded, _ = tiny
    r = collect(engine.generate(Generation(PROMPTS[1], GREEDY, max_tokens=6)))
    assert isinstance(r.done.figures, Figures) and r.done.figures.prefill_ms > 0  # typed (engine/figures.py) ...
    f = r.done.figures.to_json()  # ... and rendered as the spec's `jitllm` object
    assert FIGURE_KEYS <= set(f), FIGURE_KEYS - set(f)
    assert re.fullmatch(r"s-\d+-\d+", f["session_id"])  # the spec's shape, ephemeral or not
    assert f["session_id"] not in {s.id for s in engine.sessions.list()}  # ephemeral: never registered
    assert f["queue_depth_on_entry"] == 0
    assert f["device_blocks"] + f["host_blocks"] == loaded.model.cfg.num_layers + 2
    assert f["device_blocks"] == 0 and f["device_ids"] == []  # CPU
    for key in ("queued_ms", "prefill_ms", "decode_ms", "decode_tokens_per_second"):
        assert isinstance(f[key], (int, float)) and f[key] >= 0, key
    assert f["prefill_ms"] > 0
    assert f["bytes_per_token"] >= loaded.weight_nbytes() > 0
    json.dumps(f)  # plain JSON values


# -- batching ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_chunk", [512, 4])
def test_concurrent_requests_match_alone(tiny, prompt_chunk: int) -> None:
    loaded, hf_model = tiny
    a, b = PROMPTS[3], PROMPTS[0]
    e = Engine(loaded, max_batch=2, prompt_chunk=prompt_chunk).start()
    try:
        ga = e.generate(Generation(a, GREEDY, max_tokens=12))  # both are submitted here, before either is read
        gb = e.generate(Generation(b, GREEDY, max_tokens=9))
        results: dict[str, Result] = {}
        threads = [threading.Thread(target=lambda k=k, g=g: results.__setitem__(k, collect(g))) for k, g in (("a", ga), ("b", gb))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert results["a"].ids == hf_greedy(hf_model, a, 12)
        assert results["b"].ids == hf_greedy(hf_model, b, 9)
    finally:
        e.stop()


def test_more_requests_than_rows(tiny) -> None:
    loaded, hf_model = tiny
    e = Engine(loaded, max_batch=2, prompt_chunk=8).start()
    try:
        gens = [e.generate(Generation(p, GREEDY, max_tokens=6)) for p in PROMPTS]
        results = [None] * len(gens)

        def run(i: int) -> None:
            results[i] = collect(gens[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(gens))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        for p, r in zip(PROMPTS, results):
            assert r is not None and r.ids == hf_greedy(hf_model, p, 6)
    finally:
        e.stop()


def test_seeded_sampling_is_reproducible_alone_and_batched(tiny) -> None:
    loaded, _ = tiny
    params = SamplingParams(temperature=1.0, top_k=20, seed=123)
    e1 = Engine(loaded).start()
    try:
        alone = collect(e1.generate(Generation(PROMPTS[1], params, max_tokens=12))).ids
        again = collect(e1.generate(Generation(PROMPTS[1], params, max_tokens=12))).ids
        other = collect(e1.generate(Generation(PROMPTS[1], SamplingParams(temperature=1.0, top_k=20, seed=124), max_tokens=12))).ids
    finally:
        e1.stop()
    assert alone == again
    assert alone != other
    e2 = Engine(loaded, max_batch=2).start()
    try:
        g1 = e2.generate(Generation(PROMPTS[1], params, max_tokens=12))
        g2 = e2.generate(Generation(PROMPTS[2], SamplingParams(temperature=1.0, seed=5), max_tokens=12))
        r1 = collect(g1)
        collect(g2)
    finally:
        e2.stop()
    assert r1.ids == alone


def test_text_held_for_a_stop_string_is_released_at_the_end(engine) -> None:
    """The output ends with the first characters of a stop string that never completes: they still come out."""
    ids = LONG[0]
    full = collect(engine.generate(Generation(ids, GREEDY, max_tokens=12)))
    tail = full.text[-2:]
    assert tail.strip() and "@" not in full.text
    r = collect(engine.generate(Generation(ids, GREEDY, max_tokens=12, stop=[tail + "@"])))
    assert r.text == full.text
    assert r.ids == full.ids
    assert r.done.finish_reason is FinishReason.LENGTH and r.done.stop is None


def test_text_held_for_a_stop_string_is_released_at_eos(tiny, engine) -> None:
    _, hf_model = tiny
    ids = PROMPTS[2]  # ends on EOS after 6 tokens
    full = collect(engine.generate(Generation(ids, GREEDY, max_tokens=16)))
    assert full.done.finish_reason is FinishReason.STOP and len(full.ids) < 16
    r = collect(engine.generate(Generation(ids, GREEDY, max_tokens=16, stop=[full.text[-1:] + "@@"])))
    assert r.text == full.text and r.done.finish_reason is FinishReason.STOP and r.done.stop is None


def test_one_named_session_two_requests_at_once(tiny) -> None:
    """Two requests on one session with two rows free: the second waits for the session, then reuses it."""
    loaded, hf_model = tiny
    e = Engine(loaded, max_batch=2).start()
    try:
        s = e.new_session()
        p1 = PROMPTS[1]
        p2 = p1 + _prompt(12, 5)
        g1 = e.generate(Generation(p1, GREEDY, max_tokens=4, session=s))
        g2 = e.generate(Generation(p2, GREEDY, max_tokens=4, session=s))
        r1, r2 = collect(g1), collect(g2)
    finally:
        e.stop()
    assert r1.ids == hf_greedy(hf_model, p1, 4)
    assert r2.ids == hf_greedy(hf_model, p2, 4)
    assert r2.done.fed_tokens <= len(p2) - len(p1)


@pytest.mark.parametrize("prompt_chunk", [1, 3])
def test_chunked_prefill_with_cache_reuse(tiny, prompt_chunk: int) -> None:
    loaded, hf_model = tiny
    e = Engine(loaded, prompt_chunk=prompt_chunk).start()
    try:
        s = e.new_session()
        p1 = PROMPTS[3]
        r1 = collect(e.generate(Generation(p1, GREEDY, max_tokens=3, session=s)))
        p2 = p1 + r1.ids + _prompt(13, 8)
        r2 = collect(e.generate(Generation(p2, GREEDY, max_tokens=5, session=s)))
    finally:
        e.stop()
    assert r1.ids == hf_greedy(hf_model, p1, 3)
    assert r2.ids == hf_greedy(hf_model, p2, 5)
    assert r2.done.fed_tokens <= len(p2) - len(p1)

"""The prefix cache: a prompt starts from the pages another request left for the same tokens, shared, not fed again;
the tokens are those it would have made feeding them, and the K/V of the pages found are the same bits."""

from __future__ import annotations

import threading

import pytest
import torch

from jitllmd.engine import kernels
from jitllmd.engine.engine import Engine
from jitllmd.engine.kv import PAGE
from jitllmd.engine.pages import PART
from jitllmd.engine.request import Generation
from jitllmd.engine.sampler import SamplingParams
from tests.test_engine import collect

GREEDY = SamplingParams(temperature=0.0)
SHARED = [(7 * i + 3) % 90 + 3 for i in range(3 * PAGE + 20)]  # a long system prompt: three full pages and some


def _question(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 90, (9,), generator=g).tolist()


@pytest.fixture(params=kernels.variants() or [None])
def variant(request):
    kernels.use_variant(request.param)
    yield request.param
    kernels.use_variant(None)


def _engine(path, prefix_cache: bool = True) -> Engine:
    return Engine.load(path, max_batch=4, sessions=4, max_seq=1024, prefix_cache=prefix_cache)


def _ask(engine: Engine, prompt: list[int], session=None, n: int = 12):
    return collect(engine.generate(Generation(prompt, GREEDY, max_tokens=n, ignore_eos=True, session=session)))


@pytest.mark.parametrize("model", ["tiny_serve_q8_jlm", "tiny_gemma_q8_jlm", "tiny_serve_jlm"])
def test_a_shared_prefix_is_found_and_its_tokens_are_those_fed(request, variant, model: str) -> None:
    """Each kernel variant, llama and Gemma (a window of 8: its sliding layer's pages of the prefix kept by the cache)
    quantized, and the f32 llama: after one request, others with the same long start feed only what follows its last
    full page; their tokens are an engine's without the cache, and the pages they found hold the bits it made."""
    path = request.getfixturevalue(model)
    cached, plain = _engine(path), _engine(path, prefix_cache=False)
    try:
        first = cached.new_session()
        _ask(cached, SHARED + _question(0), first)
        pages = list(first.kv.pages[0][:3])
        for seed in (1, 2):
            session, alone = cached.new_session(), plain.new_session()
            got, want = _ask(cached, SHARED + _question(seed), session), _ask(plain, SHARED + _question(seed), alone)
            assert got.done.fed_tokens == len(SHARED) + 9 - 3 * PAGE and want.done.fed_tokens == len(SHARED) + 9
            assert got.ids == want.ids
            assert session.kv.pages[0][:3] == pages  # the very pages: shared, not copied
            for layer in range(cached.loaded.model.cfg.num_layers):
                for x, y in zip(session.kv.read(layer, session.kv.start(layer), 3 * PAGE), alone.kv.read(layer, alone.kv.start(layer), 3 * PAGE)):
                    assert torch.equal(x, y), layer
        pages = cached.loaded.kv_pages()
        assert pages.hit_tokens == 2 * 3 * PAGE and pages.held > 0
    finally:
        cached.stop()
        plain.stop()


@pytest.mark.parametrize("model", ["tiny_serve_q8_jlm", "tiny_gemma_q8_jlm", "tiny_serve_jlm"])
def test_a_start_shorter_than_a_page_is_copied_from_the_page_that_has_it(request, variant, model: str) -> None:
    """A system prompt shorter than a page (SmolLM2's default is 26 tokens of its chat template): a prompt that shares
    only the first 40 tokens of another's first page takes a copy of those 40 positions and feeds the rest; its tokens
    are an engine's without the cache, its K/V there the bits the first request made, and the first page, still the
    first request's and the cache's, is left as it was. A start shorter than pages.PART is fed again, and so is one
    whose rest would be a short feed."""
    path = request.getfixturevalue(model)
    cached, plain = _engine(path), _engine(path, prefix_cache=False)
    system = SHARED[:40]
    try:
        first = cached.new_session()
        _ask(cached, system + _question(0) * 4, first)  # 76 prompt tokens: its first page full, entered
        page = [first.kv.read(layer, 0, PAGE) for layer in range(cached.loaded.model.cfg.num_layers)]
        for seed in (1, 2):
            session, alone = cached.new_session(), plain.new_session()
            # token 40 differs from the others' (_question's are 3..89); the rest past a short feed's 64 tokens, so that
            # it is a prompt chunk's, as the whole prompt is without the cache (a short feed runs as decode rows)
            prompt = system + [seed] + _question(seed) * 8
            got, want = _ask(cached, prompt, session), _ask(plain, prompt, alone)
            assert got.done.fed_tokens == len(prompt) - 40 and want.done.fed_tokens == len(prompt)
            assert got.ids == want.ids
            assert session.kv.pages[0][0] != first.kv.pages[0][0]  # a copy: the session writes on past position 40
            for layer in range(cached.loaded.model.cfg.num_layers):
                for x, y in zip(session.kv.read(layer, 0, 40), alone.kv.read(layer, 0, 40)):
                    assert torch.equal(x, y), layer
                for x, y in zip(first.kv.read(layer, 0, PAGE), page[layer]):
                    assert torch.equal(x, y), layer
        short = _ask(cached, SHARED[:12] + [2] + _question(3) * 8, cached.new_session())
        assert short.done.fed_tokens == 12 + 1 + 72
        # a short prompt (its rest a short feed's, which a quantized model runs as decode rows) is fed whole, so a
        # repeat in a fresh session makes its tokens as its first run did; a float model has no short feeds
        feed = cached.loaded.runner.short_feed
        prompt = system + [3] + _question(4)
        again = [_ask(cached, prompt, cached.new_session()) for _ in range(2)]
        assert again[0].ids == again[1].ids
        assert again[1].done.fed_tokens == (len(prompt) if feed >= len(prompt) - 40 else len(prompt) - 40)
        assert cached.loaded.kv_pages().hit_tokens == 2 * 40 + (0 if feed >= len(prompt) - 40 else 2 * 40)
    finally:
        cached.stop()
        plain.stop()


def test_rows_at_once_share_the_pages_and_leave_them_cached(tiny_serve_jlm) -> None:
    """Four requests at once after a first: each starts from its pages (or its slot's own), their tokens each one's
    alone; once all are done the pages are the cache's, and a prompt that differs in its first page finds nothing. (The
    f32 model: a quantized one's short feed of a prompt's last tokens takes decode rows' products, a near tie apart.)"""
    cached, plain = _engine(tiny_serve_jlm), _engine(tiny_serve_jlm, prefix_cache=False)
    try:
        _ask(cached, SHARED + _question(0))
        out: dict[int, object] = {}

        def go(seed: int) -> None:
            out[seed] = _ask(cached, SHARED + _question(seed))

        threads = [threading.Thread(target=go, args=(s,)) for s in range(1, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for seed in range(1, 5):
            assert out[seed].ids == _ask(plain, SHARED + _question(seed), plain.new_session()).ids
            assert out[seed].done.fed_tokens <= len(SHARED) + 9 - 3 * PAGE  # its own slot's, or the cache's
        assert cached.loaded.kv_pages().cached + cached.loaded.kv_pages().held >= 3
        other = _ask(cached, [5] + SHARED[1:] + _question(9))
        assert other.done.fed_tokens == len(SHARED) + 9
    finally:
        cached.stop()
        plain.stop()


def test_a_reply_continued_in_a_new_session_starts_from_its_pages(tiny_serve_jlm) -> None:
    """A conversation's next turn, sent without its session (the whole history again, as OpenAI clients do) to a
    fresh one: the pages of the first turn's prompt and reply are found."""
    engine = _engine(tiny_serve_jlm)
    try:
        first = engine.new_session()
        turn = _ask(engine, SHARED, first, n=2 * PAGE)
        history = SHARED + turn.ids + [11, 12]
        assert len(first.kv.prefix) == len(first.token_ids) // PAGE  # every full page entered
        again = _ask(engine, history, engine.new_session())
        assert again.done.fed_tokens == len(history) - len(history) // PAGE * PAGE
    finally:
        engine.stop()


def test_n_choices_fork_the_prompts_pages(tiny_serve_q8_jlm) -> None:
    """n > 1: the choices share the prompt's full pages (its last partial one copied), and each goes on alone."""
    engine = _engine(tiny_serve_q8_jlm)
    try:
        session = engine.new_session()
        _ask(engine, SHARED, session)
        held = engine.loaded.kv_pages().held
        fork = engine.new_session()
        fork.kv.copy_from(session.kv, len(SHARED))
        assert engine.loaded.kv_pages().held == held + 1 and fork.kv.pages[0][:3] == session.kv.pages[0][:3]
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def served_models(tmp_path_factory, tiny_serve_jlm):
    d = tmp_path_factory.mktemp("prefix_models")
    (d / "tiny.jlm").symlink_to(tiny_serve_jlm)
    return d


def _chat(url: str, system: str, question: str, session: str | None = None) -> dict:
    import httpx

    body = {"model": "tiny", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}], "max_tokens": 8,
            "temperature": 0}
    if session is not None:
        body["jitllm_session"] = session
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


FIRST = "What is a page? " * 8  # long enough that the first request's page past the shared ones is full: entered


def test_served_a_new_session_starts_from_the_prefix_another_request_left(serve, served_models) -> None:
    """serve: after one request, a fresh session (sessions -new) asking with the same long system prompt feeds only
    what follows the shared tokens (the full pages, and the start of the next where it is pages.PART or more): usage's
    cached_tokens, the same reply as with -prefix-cache off (where it feeds everything), and stats, GetStats and
    /metrics count what the cache found."""
    import httpx

    from tests.serving import jitllmd

    system = "You answer in the voice of a careful engineer who checks every figure twice. " * 6
    replies = {}
    for mode in ("on", "off"):
        server = serve("-models", str(served_models), "-load", "tiny.jlm", "-id", "tiny", "-devices", "cpu", "-sessions", "2", "-prefix-cache", mode)
        _chat(server.url, system, FIRST)
        sid = httpx.post(server.url + "/jitllm.v1.SessionService/CreateSession", json={"model": "tiny"}, timeout=60).json()["session"]["id"]
        replies[mode] = _chat(server.url, system, "And a table?", session=sid)
        if mode == "on":  # what the two prompts share: the full pages, and the next page's start where it is PART or more
            ids = [httpx.post(server.url + "/tokenize", json={"model": "tiny", "messages": [{"role": "system", "content": system},
                                                                                          {"role": "user", "content": q}]}, timeout=60).json()["tokens"]
                   for q in (FIRST, "And a table?")]
            same = next(i for i, (x, y) in enumerate(zip(*ids)) if x != y)
            shared = same if same % PAGE >= PART else same // PAGE * PAGE
            assert shared % PAGE >= PART and len(ids[0]) >= (same // PAGE + 1) * PAGE  # the start of a page shared; that page full
        stats = httpx.post(server.url + "/jitllm.v1.TelemetryService/GetStats", json={}, timeout=60).json()["models"][0]
        shown = jitllmd("stats", "-addr", server.url.removeprefix("http://"))
        if mode == "on":
            assert stats["prefixCache"] and int(stats["prefixHitTokens"]) >= PAGE and int(stats["kvPagesHeld"]) > 0, stats
            assert "prefix cache: " in shown.stdout and "prompt tokens found" in shown.stdout, shown.stdout
            metrics = httpx.get(server.url + "/metrics", timeout=60).text
            assert "jitllmd:prefix_cache_hits_total" in metrics and 'jitllmd:kv_pages{model_name="tiny",state="held"}' in metrics
        else:
            assert not stats.get("prefixCache") and "prefixHitTokens" not in stats
            assert "prefix cache off" in shown.stdout, shown.stdout
    on, off = replies["on"], replies["off"]
    assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
    found = on["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert found == shared and off["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r = jitllmd("serve", "-models", str(served_models), "-load", "tiny.jlm", "-prefix-cache", "maybe")
    assert r.returncode != 0 and "-prefix-cache 'maybe': give on or off" in r.stderr and "Traceback" not in r.stderr


# -- sessions saved and restored ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny_serve_q8_jlm", "tiny_gemma_q8_jlm"])
def test_a_saved_session_restored_in_another_engine_goes_on_with_the_same_tokens(request, model: str) -> None:
    """Save a session after a turn, restore it in a new engine of the same model: the next turn's tokens are those
    the session itself makes, and its K/V the same bits; a session file of another model is refused."""
    from jitllmd.engine import session_file

    path = request.getfixturevalue(model)
    first, second = _engine(path), _engine(path)
    try:
        session = first.new_session()
        _ask(first, SHARED + _question(0), session, n=40)
        session.messages.append({"role": "user", "content": "hi"})
        data = first.save_session(session).result(timeout=60)
        saved = session_file.load(data)
        restored = second.restore_session(saved, session.id).result(timeout=60)
        assert restored.id == session.id and restored.token_ids == session.token_ids and restored.messages == session.messages
        for layer in range(first.loaded.model.cfg.num_layers):
            start = max(session.kv.start(layer), restored.kv.start(layer))
            for x, y in zip(session.kv.read(layer, start, session.kv.length), restored.kv.read(layer, start, restored.kv.length)):
                assert torch.equal(x, y), layer
        more = session.token_ids + _question(5)
        assert _ask(second, more, restored, n=20).ids == _ask(first, more, session, n=20).ids
    finally:
        first.stop()
        second.stop()
    for damaged, says in ((b"nonsense", "not a jitllmd session file"), (data[:-100], "damaged")):
        with pytest.raises(ValueError, match=says):
            session_file.load(damaged)


def test_served_sessions_save_to_a_file_and_restore_on_another_server(serve, served_models, tmp_path) -> None:
    """sessions -save S FILE on one server, -restore FILE on another of the same model: the same id, and the next
    turn is the same reply, starting from the restored K/V; damaged files and unknown sessions are clear errors."""
    import httpx

    from tests.serving import InProcessServer, jitllmd

    a = serve("-models", str(served_models), "-load", "tiny.jlm", "-id", "tiny", "-devices", "cpu")
    b = InProcessServer("-models", str(served_models), "-load", "tiny.jlm", "-id", "tiny", "-devices", "cpu")
    try:
        addr = lambda s: s.url.removeprefix("http://")
        sid = jitllmd("sessions", "-new", "-model", "tiny", "-addr", addr(a)).stdout.strip()
        system = "Answer in one careful sentence, and check it twice before you send it. " * 4
        _chat(a.url, system, "What is a page?", session=sid)
        file = tmp_path / "convo.kv"
        saved = jitllmd("sessions", "-save", sid, str(file), "-addr", addr(a))
        assert saved.returncode == 0 and file.stat().st_size > 0 and "saved" in saved.stdout, saved.stderr
        restored = jitllmd("sessions", "-restore", str(file), "-addr", addr(b))
        assert restored.returncode == 0 and restored.stdout.strip() == sid, restored.stderr
        there = httpx.post(b.url + "/jitllm.v1.SessionService/GetSession", json={"sessionId": sid}, timeout=60).json()["session"]
        here = httpx.post(a.url + "/jitllm.v1.SessionService/GetSession", json={"sessionId": sid}, timeout=60).json()["session"]
        assert there["position"] == here["position"] > 0 and there.get("numMessages") == here.get("numMessages")
        on_a, on_b = _chat(a.url, system, "And a table?", session=sid), _chat(b.url, system, "And a table?", session=sid)
        assert on_b["choices"][0]["message"]["content"] == on_a["choices"][0]["message"]["content"]
        assert on_b["usage"]["prompt_tokens_details"]["cached_tokens"] == on_a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        (tmp_path / "bad.kv").write_bytes(b"\0" * 64)
        for args, says in ((("-restore", str(tmp_path / "bad.kv")), "not a jitllmd session file"), (("-save", "s-1-1", str(file)), "no session"),
                           (("-restore", str(tmp_path / "none.kv")), "no such file"), (("-save", sid), "take a FILE")):
            r = jitllmd("sessions", *args, "-addr", addr(b))
            assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    finally:
        b.stop()


def test_a_session_dir_keeps_named_sessions_across_restarts(served_models, tmp_path) -> None:
    """-session-dir: a server that stops keeps its named sessions there; the next one starts with them (same ids, same
    positions), and a session closed there loses its file."""
    import httpx

    from tests.serving import InProcessServer

    flags = ("-models", str(served_models), "-load", "tiny.jlm", "-id", "tiny", "-devices", "cpu", "-session-dir", str(tmp_path / "kept"))
    first = InProcessServer(*flags)
    try:
        sid = httpx.post(first.url + "/jitllm.v1.SessionService/CreateSession", json={"model": "tiny"}, timeout=60).json()["session"]["id"]
        _chat(first.url, "Be brief.", "Hello there, how are you?", session=sid)
        position = httpx.post(first.url + "/jitllm.v1.SessionService/GetSession", json={"sessionId": sid}, timeout=60).json()["session"]["position"]
    finally:
        first.stop()
    assert (tmp_path / "kept" / f"{sid}.kv").is_file()
    second = InProcessServer(*flags)
    try:
        listed = httpx.post(second.url + "/jitllm.v1.SessionService/ListSessions", json={}, timeout=60).json()["sessions"]
        assert [(s["id"], s["position"]) for s in listed] == [(sid, position)]
        httpx.post(second.url + "/jitllm.v1.SessionService/CloseSession", json={"sessionId": sid}, timeout=60).raise_for_status()
        assert not (tmp_path / "kept" / f"{sid}.kv").exists()
    finally:
        second.stop()


# -- -kv-mem: a limit on the pages, and requests that wait for theirs ---------------------------------------------------


def test_a_request_waits_until_its_pages_fit_under_kv_mem(tiny_serve_jlm) -> None:
    """-kv-mem room for one request's pages (prompt and max_tokens), not two: the second waits until the first ends
    (its events all after the first's), the pages never pass the limit; one that could never fit is refused at once,
    and one that an idle named session's pages keep out runs once they leave the pool (tests/test_kv_spill.py), the
    session keeping its conversation."""
    from jitllmd.engine.kv import RoomError
    from jitllmd.engine.request import Delta, Done

    engine = Engine.load(tiny_serve_jlm, max_batch=2, sessions=2, max_seq=1024, kv_mem=100_000)
    pool = engine.loaded.runner.kv_pool
    try:
        page = pool.group_bytes(0)
        assert page == 32768 and pool.limit == 100_000  # 2 layers x K and V x 2 heads x 64 positions x 16 x 4 bytes
        seen: list[tuple[str, object]] = []
        done = threading.Event()
        lock = threading.Lock()

        def emit(name: str):
            def put(ev) -> None:
                with lock:
                    seen.append((name, ev))
                    if sum(isinstance(e, Done) for _, e in seen) == 2:
                        done.set()
            return put

        for name in ("a", "b"):  # 20 + 100 positions: two pages each
            engine.submit(Generation(_question(1) + _question(2) + [3, 4], GREEDY, max_tokens=100, ignore_eos=True), emit(name))
        assert done.wait(60)
        order = [name for name, ev in seen if isinstance(ev, (Delta, Done))]
        assert order.index("b") > max(i for i, n in enumerate(order) if n == "a")  # b's first token after a's last event
        assert pool.used_bytes() <= pool.limit
        with pytest.raises(RoomError, match="-kv-mem is 100000"):
            engine.submit(Generation([5] * 20, GREEDY, max_tokens=300), emit("c"))
        keeper = engine.new_session()
        _ask(engine, [7] * 100, keeper, n=20)  # two pages held by a named session
        kept = list(keeper.token_ids)
        out = list(engine.generate(Generation([9] * 20, GREEDY, max_tokens=100)))  # the session's pages leave the pool for it
        assert isinstance(out[-1], Done) and keeper.kv.spilled and engine.loaded.kv_pages().file >= 2
        assert keeper.token_ids == kept and keeper.kv.length == len(kept)
    finally:
        engine.stop()
    from tests.serving import jitllmd

    r = jitllmd("serve", "-load", str(tiny_serve_jlm), "-kv-mem", "0")
    assert r.returncode != 0 and "-kv-mem must be a positive size" in r.stderr and "Traceback" not in r.stderr, r.stderr

"""KV beyond the pool: idle named sessions' pages and cold cached prefixes leave a model's pool for host memory or the
spill file (under -kv-mem, under -maxmem) and come back for their next turn bit for bit, with the tokens of an engine
that never let them go."""

from __future__ import annotations

import gc

import pytest
import torch

from jitllmd.engine import session_file
from jitllmd.engine.engine import Engine
from jitllmd.engine.kv import PAGE
from jitllmd.engine.kv_store import PageStore
from jitllmd.engine.request import Generation
from jitllmd.engine.sampler import SamplingParams
from tests.test_engine import collect

GREEDY = SamplingParams(temperature=0.0)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 90, (n,), generator=g).tolist()


def _ask(engine: Engine, prompt: list[int], session=None, n: int = 10):
    return collect(engine.generate(Generation(prompt, GREEDY, max_tokens=n, ignore_eos=True, session=session)))


def _kv(session) -> list[tuple[torch.Tensor, torch.Tensor]]:
    kv = session.kv
    return [tuple(t.clone() for t in kv.read(layer, kv.start(layer), kv.length, raw=True)) for layer in range(kv.num_layers)]


def test_the_store_keeps_pages_in_memory_while_there_is_room_then_in_a_file(tmp_path) -> None:
    room = {"left": 300}
    store = PageStore(lambda: room["left"] - store.memory_bytes, tmp_path)
    pages = [torch.randint(0, 256, (100,), dtype=torch.uint8) for _ in range(5)]
    slots = [store.put(p.clone()) for p in pages]
    assert store.counts() == (3, 2) and store.memory_bytes == 300 and store.file_bytes == 200
    assert [store.where(s) for s in slots] == ["host"] * 3 + ["file"] * 2
    assert all(torch.equal(store.get(s), p) for s, p in zip(slots, pages))
    assert not list(tmp_path.iterdir())  # the file has no name
    store.free(slots[3:4])
    again = store.put(pages[0].clone(), memory=False)  # a freed slot of the file is used again
    assert store.file_bytes == 200 and torch.equal(store.get(again), pages[0])
    assert store.demote(150) == 200 and store.counts() == (1, 4)  # the oldest two went to the file
    assert all(torch.equal(store.get(s), p) for s, p in zip(slots[:3], pages))
    store.free([*slots, again])
    assert store.counts() == (0, 0) and store.memory_bytes == store.file_bytes == 0
    store.close()


@pytest.mark.parametrize("model", ["tiny_serve_q8_jlm", "tiny_gemma_q8_jlm"])
def test_a_spilled_session_comes_back_bit_for_bit(request, model: str) -> None:
    """Llama and Gemma (its window layer's early pages let go) quantized: a named session's pages out of the pool
    (to the file: the pool is in host memory) and back are the same bits, those the prefix cache still keeps shared again
    rather than copied; saved while out, it is the same file; its next turn's tokens are an engine's that never spilled."""
    path = request.getfixturevalue(model)
    spilled, plain = (Engine.load(path, max_batch=2, sessions=2, max_seq=1024, kv_mem=1 << 30) for _ in range(2))
    try:
        a, b = spilled.new_session(), plain.new_session()
        first = _prompt(1, 3 * PAGE + 30)
        assert _ask(spilled, first, a).ids == _ask(plain, first, b).ids
        before, pool = _kv(a), spilled.loaded.runner.kv_pool
        ident = session_file.identity(spilled.loaded)
        saved = session_file.dump(a, ident)
        held = pool.counts()[0]
        cached_pages = [list(e.pages) for e in a.kv.prefix]
        assert a.kv.spill() > 0 and a.kv.spilled
        assert pool.counts()[0] < held and spilled.loaded.kv_pages().file > 0
        a.kv.fill()
        assert not a.kv.spilled and spilled.loaded.kv_pages().file == 0
        shared = [(g, i) for i, pages in enumerate(cached_pages) for g, held in enumerate(a.kv.pages) if held[i] >= 0]
        assert shared and all(a.kv.pages[g][i] == cached_pages[i][g] for g, i in shared)  # the cache's own pages, shared again
        for (k0, v0), (k1, v1) in zip(before, _kv(a)):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
        a.kv.spill()
        assert session_file.dump(a, ident) == saved and a.kv.spilled  # saved while out of the pool: the same file
        more = _prompt(2, 20)
        got = _ask(spilled, a.token_ids + more, a)
        want = _ask(plain, b.token_ids + more, b)
        assert got.ids == want.ids and got.done.fed_tokens == want.done.fed_tokens == len(more)
    finally:
        spilled.stop()
        plain.stop()


def _turns(engine: Engine, sessions: list, rounds: int = 2, check=None) -> list[list[int]]:
    """Each session in turn, `rounds` times: a 40-token first prompt, then what it holds and 20 more."""
    out = []
    for r in range(rounds):
        for i, s in enumerate(sessions):
            prompt = _prompt(10 * i + r, 40) if r == 0 else s.token_ids + _prompt(10 * i + r, 20)
            out.append(_ask(engine, prompt, s).ids)
            if check is not None:
                check()
    return out


def test_named_sessions_past_kv_mem_take_turns(tiny_serve_jlm) -> None:
    """-kv-mem room for three pages; three named sessions of two pages each take turns: the idle ones' pages leave the
    pool (for the file: it is in host memory) rather than failing a request, the pages in the pool never pass the limit,
    every turn's tokens are an engine's without the limit; closed, the sessions leave nothing of theirs in the store."""
    limited = Engine.load(tiny_serve_jlm, max_batch=1, sessions=1, max_seq=1024, kv_mem=100_000)
    plain = Engine.load(tiny_serve_jlm, max_batch=1, sessions=1, max_seq=1024)
    pool = limited.loaded.runner.kv_pool
    try:
        seen: list[int] = []

        def check() -> None:
            assert pool.used_bytes() <= pool.limit
            seen.append(limited.loaded.kv_pages().file)

        got = _turns(limited, [limited.new_session() for _ in range(3)], check=check)
        assert got == _turns(plain, [plain.new_session() for _ in range(3)])
        assert max(seen) >= 2  # a session's pages were in the file
        for s in limited.sessions.list():
            limited.sessions.close(s.id)
        gc.collect()
        cold = sum(slot >= 0 for e in pool.prefixes.values() if e.away for slot in e.away)
        assert limited.loaded.kv_pages().file == cold  # what is left in the file: the prefix cache's cold pages
    finally:
        limited.stop()
        plain.stop()


def test_cold_prefixes_leave_the_pool_and_a_prompt_brings_them_back(tiny_serve_jlm) -> None:
    """-kv-mem for three pages: a long prompt's cached pages, pushed out by another prompt's, go to the store rather
    than being dropped; a third prompt with the first's start finds them there (counted as hits) with the tokens of an
    engine that feeds it all; and, out again, a fourth that shares only the start of the first page copies it from
    the page brought back."""
    limited = Engine.load(tiny_serve_jlm, max_batch=1, sessions=1, max_seq=1024, kv_mem=100_000)
    plain = Engine.load(tiny_serve_jlm, max_batch=1, sessions=1, max_seq=1024, prefix_cache=False)
    pool = limited.loaded.runner.kv_pool
    try:
        shared = _prompt(1, 2 * PAGE + 10)
        _ask(limited, shared + _prompt(2, 8))
        _ask(limited, _prompt(3, 2 * PAGE + 20))  # its pages take the pool: the first's cached ones leave it
        assert limited.loaded.kv_pages().file >= 2 and pool.hits == 0
        asked = shared + _prompt(4, 8)
        got, want = _ask(limited, asked), _ask(plain, asked)
        assert got.ids == want.ids and got.done.fed_tokens == len(asked) - 2 * PAGE
        assert pool.hits == 2 * PAGE and pool.used_bytes() <= pool.limit
        _ask(limited, _prompt(5, 2 * PAGE + 20))  # out again
        assert pool.prefixes[(0, tuple(shared[:PAGE]))].away is not None
        start = shared[:40] + [1] + _prompt(6, 70)  # the first page's first 40 tokens, then a rest past a short feed's
        got, want = _ask(limited, start), _ask(plain, start)
        assert got.ids == want.ids and got.done.fed_tokens == len(start) - 40  # brought back for its start's copy
        assert pool.hits == 2 * PAGE + 40 and pool.used_bytes() <= pool.limit
    finally:
        limited.stop()
        plain.stop()


def test_under_maxmem_idle_sessions_of_a_host_model_go_to_the_file(tiny_serve_jlm) -> None:
    """A host model (blocks in the pager) whose -maxmem holds its blocks and one page more: after each turn the idle
    sessions' pages go to the spill file until the host holds no more than the budget, and come back for their next
    turn with the tokens of an engine with no budget."""
    plain = Engine.load(tiny_serve_jlm, max_seq=1024)
    weights = plain.loaded.placement.pager.resident_bytes()
    budgeted = Engine.load(tiny_serve_jlm, max_seq=1024, page_budget=weights + 40_000)
    pager, pool = budgeted.loaded.placement.pager, budgeted.loaded.runner.kv_pool
    assert pager.resident_bytes() == weights and budgeted.kv_spill is not None
    try:
        seen: list[int] = []

        def check() -> None:  # between turns (the engine idle): the host within the budget, the pages of idle sessions out
            held = budgeted.loaded.kv_pages()
            seen.append(held.file)
            assert pager.resident_bytes() + pool.used_bytes() <= pager.budget + 2 * pool.group_bytes(0)  # the last turn's pages

        got = _turns(budgeted, [budgeted.new_session() for _ in range(3)], check=check)
        assert got == _turns(plain, [plain.new_session() for _ in range(3)])
        assert max(seen) >= 4 and budgeted.kv_spill.store.memory_bytes == 0
    finally:
        budgeted.stop()
        plain.stop()


def test_a_device_pool_spills_to_host_memory_then_the_file_under_maxmem(tiny_serve_jlm) -> None:
    """The CPU named as a device, as a GPU would be: idle sessions' pages leave its pool for host memory (no -maxmem: no
    bound), and once `place -maxmem` budgets the host below them, the next step moves the oldest on to the file; the
    sessions' next turns have the tokens of an engine that never spilled."""
    limited = Engine.load(tiny_serve_jlm, devices=["cpu"], max_batch=1, sessions=1, max_seq=1024, kv_mem=270_000)  # 8 pages
    plain = Engine.load(tiny_serve_jlm, devices=["cpu"], max_batch=1, sessions=1, max_seq=1024)
    spill = limited.kv_spill
    assert spill is not None and not spill.room.on_host() and not spill.room.host_layers()
    page = limited.loaded.runner.kv_pool.group_bytes(0)
    try:
        mine, theirs = [limited.new_session(), limited.new_session()], [plain.new_session(), plain.new_session()]
        for i, (a, b) in enumerate(zip(mine, theirs)):  # three pages each
            assert _ask(limited, _prompt(i, 2 * PAGE + 40), a).ids == _ask(plain, _prompt(i, 2 * PAGE + 40), b).ids
        assert limited.loaded.kv_pages().host == 0
        _ask(limited, _prompt(5, 5 * PAGE + 40), n=4)  # six pages: both sessions leave the pool, for host memory
        assert all(s.kv.spilled for s in mine) and limited.loaded.kv_pages().host >= 6 and limited.loaded.kv_pages().file == 0  # and cold prefixes
        pager = limited.loaded.placement.pager
        limited.set_page_budget(pager.largest_layer()[1]).result(timeout=60)  # ~3.8 pages
        _ask(limited, _prompt(6, 8), n=2)
        held = limited.loaded.kv_pages()
        assert held.host * page <= pager.budget and held.file >= 3
        for i, (a, b) in enumerate(zip(mine, theirs)):
            more = _prompt(7 + i, 20)
            assert _ask(limited, a.token_ids + more, a).ids == _ask(plain, b.token_ids + more, b).ids
    finally:
        limited.stop()
        plain.stop()


def test_served_sessions_past_kv_mem_show_their_pages_in_the_spill_file(serve, tmp_path, tiny_serve_jlm) -> None:
    """serve -kv-mem: named sessions whose pages do not all fit take turns (none fails); stats, GetStats and /metrics
    show the pages in the spill file; a session's reply after its pages came back is the one a server without the
    limit gives."""
    import httpx

    from tests.serving import jitllmd

    (tmp_path / "tiny.jlm").symlink_to(tiny_serve_jlm)
    replies = {}
    for mem in ("100000", None):
        server = serve("-models", str(tmp_path), "-load", "tiny.jlm", "-id", "tiny", "-sessions", "1", *(("-kv-mem", mem) if mem else ()))
        sids = [httpx.post(server.url + "/jitllm.v1.SessionService/CreateSession", json={"model": "tiny"}, timeout=60).json()["session"]["id"] for _ in range(3)]
        out = []
        for turn in range(2):
            for i, sid in enumerate(sids):
                body = {"model": "tiny", "prompt": f"turn {turn} of session {i}: " + "tell me about pages and tables. " * 4, "max_tokens": 8,
                        "temperature": 0, "jitllm_session": sid}
                r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                out.append(r.json()["choices"][0]["text"])
        replies[mem] = out
        if mem:
            stats = httpx.post(server.url + "/jitllm.v1.TelemetryService/GetStats", json={}, timeout=60).json()["models"][0]
            assert int(stats["kvPagesFile"]) >= 2, stats
            shown = jitllmd("stats", "-addr", server.url.removeprefix("http://"))
            assert "in the spill file" in shown.stdout, shown.stdout
            metrics = httpx.get(server.url + "/metrics", timeout=60).text
            assert 'jitllmd:kv_pages{model_name="tiny",state="file"}' in metrics
    assert replies["100000"] == replies[None]

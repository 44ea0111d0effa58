"""Session KV in pages: tables grow a page at a time, pages are shared (forks, the prefix cache) and copied before a
shared one is written, window groups let go of what no query sees, pages come back when a session goes, and the pool
grows keeping what it holds."""

from __future__ import annotations

import gc

import pytest
import torch

from jitllmd.engine.kv import PAGE, RoomError, SessionKV
from jitllmd.engine.pages import PagePool


def _pool(windows: list[int | None] = [None, None], pages: int = 4, heads: int = 2, dim: int = 8) -> PagePool:  # noqa: B006
    return PagePool(heads, dim, torch.float32, [torch.device("cpu")] * len(windows), windows, [pages] * len(dict.fromkeys(windows)))


@torch.inference_mode()  # as a forward writes it
def _fill(kv: SessionKV, start: int, n: int, base: float = 0.0) -> None:
    """Positions start .. start + n - 1 of every layer: K = base + position + 1000 * layer, V its negative."""
    kv.reserve(start + n)
    for i in range(kv.num_layers):
        k = (base + torch.arange(start, start + n, dtype=torch.float32) + 1000 * i)[:, None, None].expand(n, kv.num_kv_heads, kv.head_dim)
        kv.write(i, start, k, -k)
    kv.length = start + n


def _keys(kv: SessionKV, layer: int, lo: int = 0, hi: int | None = None) -> list[float]:
    return kv.read(layer, lo, kv.length if hi is None else hi)[0][0, :, 0].tolist()


def test_pages_come_as_positions_do_and_hold_them() -> None:
    pool = _pool()
    kv = SessionKV(pool, capacity=1000)
    _fill(kv, 0, 10)
    assert len(kv.pages[0]) == 1 and kv.nbytes() == 2 * PAGE * kv.bytes_per_position() // 2
    _fill(kv, 10, 300)
    assert len(kv.pages[0]) == 5 and kv.pages[0] == sorted(kv.pages[0])  # the lowest free pages first
    assert _keys(kv, 1) == [1000.0 + p for p in range(310)] and kv.read(0, 5, 9)[1][1, :, 3].tolist() == [-5.0, -6.0, -7.0, -8.0]
    assert pool.capacity == [8] and pool.counts() == (5, 0, 0, 3)  # it doubled once, keeping what it held
    with pytest.raises(RoomError):
        kv.reserve(1001)
    kv.truncate(100)
    assert len(kv.pages[0]) == 2 and pool.counts() == (2, 0, 0, 6)
    del kv
    gc.collect()
    assert pool.counts() == (0, 0, 0, 8)  # a session dropped gives its pages back


def test_a_fork_shares_full_pages_and_a_write_copies_a_shared_one() -> None:
    pool = _pool()
    src = SessionKV(pool, 1000)
    _fill(src, 0, 150)
    fork = SessionKV(pool, 1000)
    fork.copy_from(src, 140)
    assert fork.pages[0][:2] == src.pages[0][:2] and fork.pages[0][2] != src.pages[0][2]  # the partial third page copied
    assert pool.counts()[:2] == (4, 2)  # src's three and the fork's own third; two of them shared
    assert _keys(fork, 0) == _keys(src, 0, 0, 140)
    _fill(fork, 140, 10, base=0.5)  # into its own page
    assert _keys(src, 0, 140) == [float(p) for p in range(140, 150)]
    fork.truncate(100)  # inside a page it shares: writing there copies it first
    shared = fork.pages[0][1]
    _fill(fork, 100, 40, base=0.25)
    assert fork.pages[0][1] != shared and src.pages[0][1] == shared
    assert _keys(src, 0, 64, 140) == [float(p) for p in range(64, 140)]
    assert _keys(fork, 0, 64, 140) == [float(p) for p in range(64, 100)] + [p + 0.25 for p in range(100, 140)]


def test_the_prefix_cache_finds_a_prompt_by_its_tokens_up_to_each_page() -> None:
    pool = _pool()
    prompt = list(range(300))
    a = SessionKV(pool, 1000)
    _fill(a, 0, 200)
    a.publish(prompt[:200])
    assert len(a.prefix) == 3 and len(pool.prefixes) == 3
    b = SessionKV(pool, 1000)
    assert b.adopt(prompt, 0) == 192 and b.pages[0] == a.pages[0][:3] and _keys(b, 1) == _keys(a, 1, 0, 192)
    c = SessionKV(pool, 1000)
    assert c.adopt(prompt[:150] + [7] * 100, 0) == 150  # a different third page: the start of the cached one copied
    assert c.pages[0][:2] == a.pages[0][:2] and c.pages[0][2] != a.pages[0][2] and _keys(c, 1) == _keys(a, 1, 0, 150)
    assert c.adopt(prompt[:140] + [7] * 100, 0) == 128  # a start shorter than PART: fed again
    assert c.adopt(prompt[:129], 0) == 128 and c.adopt(prompt[:128], 0) == 127  # at least the last token is fed
    assert c.adopt([1] + prompt[1:], 0) == 0  # the first page's tokens differ: nothing after it counts
    assert pool.hits == 192 + 150 + 128 + 128 + 127 and pool.queries == 300 + 250 + 240 + 129 + 128 + 300
    b.publish(prompt[:192])
    assert len(pool.prefixes) == 3  # the same pages: nothing new


def test_a_cached_start_goes_with_its_page() -> None:
    """The index of pages' starts follows the cache: a page let go is no longer found by its first tokens, and
    nothing of it is left behind; the starts of the pages kept still are."""
    pool = _pool()
    a = SessionKV(pool, 1000)
    _fill(a, 0, 128)
    a.publish(list(range(128)))
    b = SessionKV(pool, 1000)
    assert b.adopt(list(range(40)) + [999] * 30, 0) == 40 and b.adopt(list(range(100)) + [999] * 30, 0) == 100
    del a
    b.reset()
    gc.collect()
    pool.clear_cache()
    assert not pool.prefixes and not pool._starts
    assert b.adopt(list(range(40)) + [999] * 30, 0) == 0


def test_cached_pages_outlive_their_session_until_wanted() -> None:
    pool = _pool(pages=4)
    a = SessionKV(pool, 1000)
    _fill(a, 0, 256)
    a.publish(list(range(256)))
    del a
    gc.collect()
    assert pool.counts() == (0, 0, 4, 0)  # no table holds them; the cache does
    b = SessionKV(pool, 1000)
    assert b.adopt(list(range(300)), 0) == 256
    b.reset()
    c = SessionKV(pool, 1000)
    _fill(c, 0, 64)  # no free page: the least recently used entry without children goes (the last page)
    assert pool.capacity == [4] and len(pool.prefixes) == 3
    assert SessionKV(pool, 1000).adopt(list(range(300)), 0) == 192


def test_a_window_group_lets_go_of_what_no_query_sees() -> None:
    """Layer 0 slides (window 100), layer 1 keeps everything: 1000 positions written a few at a time leave layer 0
    holding a few pages, the keys a query at 1000 sees still there; a session cannot rewind to before them."""
    pool = _pool(windows=[100, None])
    kv = SessionKV(pool, 4000)
    for start in range(0, 1000, 5):
        _fill(kv, start, 5)
    assert 0 < kv.start(0) <= 1000 - 100 - 64 and kv.start(0) % PAGE == 0 and kv.start(1) == 0
    assert len(kv.pages[0]) - kv.first[0] <= 4 and kv.pages[0][: kv.first[0]] == [-1] * kv.first[0]
    assert _keys(kv, 0, 900, 1000) == [float(p) for p in range(900, 1000)]  # what a query at 1000 attends
    assert kv.bytes_at(1000) == (100 + 1000) * kv.bytes_per_position() // 2
    assert kv.reusable(1000) == 1000 and kv.reusable(kv.start(0) + 98) == 0 and not kv.forkable()
    kv.truncate(0)
    assert kv.first == [0, 0] and pool.counts()[0] == 0


def test_moves_carry_every_sessions_pages() -> None:
    pool = _pool()
    kv = SessionKV(pool, 600)
    _fill(kv, 0, 70)
    kv.move(1, torch.device("meta"))  # another rank holds layer 1 now: nothing of it here
    assert pool.k[1].device.type == "meta" and kv.layer_nbytes(1) == 0 and kv.layer_nbytes(0) > 0
    kv.move(1, torch.device("cpu"), (0, torch.arange(70.0)[None, :, None].expand(2, 70, 8), -torch.arange(70.0)[None, :, None].expand(2, 70, 8)))
    assert _keys(kv, 1) == [float(p) for p in range(70)] and _keys(kv, 0) == [float(p) for p in range(70)]

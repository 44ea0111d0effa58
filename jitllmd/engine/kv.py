"""Session KV caches (page tables into the model's pages) and the row layout a forward attends with."""

from __future__ import annotations

import ctypes
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .pages import META, PAGE, Q8_0, PagePool, Prefix, dequantize_q8, quantize_q8

__all__ = ["META", "PAGE", "RoomError", "RowSpan", "SessionKV"]

# A sliding-window layer keeps this many positions more than its window needs, so a session rewound a little (a
# regenerated reply, prefix reuse) still finds the keys its next query sees
_REWIND = 64
_KEYS = itertools.count(1)  # a session KV's key, by which another rank holding some of its layers knows it


class RoomError(ValueError):
    """A prompt or generation does not fit in the session's KV capacity."""


def _release(pool: PagePool, pages: list[list[int]], away: list[list[int]]) -> None:
    for group, held in enumerate(pages):
        pool.release(group, held)
        held.clear()
    if away and pool.store is not None:
        pool.store.free([slot for slots in away for slot in slots if slot >= 0])
    away.clear()


class SessionKV:
    """K and V for every attention block of one session: a page table per group of layers (engine/pages.py) into the
    model's pool, position p in page `pages[g][p // PAGE]`.

    A session costs the pages it holds, growing a page at a time up to `capacity` (its -max-seq); pages are shared
    with other sessions where they hold the same positions (a prompt's cached prefix, a fork), and a shared page is
    copied before this session writes into it. A sliding-window group (`windows`, one per layer: its window, or None)
    lets go of the pages no query can see any more (less _REWIND), so a long generation holds about its window.
    `prefix`: the prefix cache's entries of this session's full pages, in order, as far as they are entered. Each
    layer's pages are on its block's place (`devices`); a layer on another rank is on `meta` here, its bookkeeping
    going on as for any layer, its K/V that rank's (`remotes`: engine/cluster/remote.py's proxies of the ranks
    holding some of this cache's layers, told of a copy). The pages go back to the pool when the session is dropped.
    An idle session's pages may be taken out of the pool into its store (`spill`: host memory or a file) and brought
    back before it runs again (`fill`); while away, only `fill`, `read` (from the store), `reset` and the figures may be
    asked of it.
    """

    def __init__(self, pool: PagePool, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.pool = pool
        self.num_layers = len(pool.windows)
        self.num_kv_heads, self.head_dim, self.dtype = pool.num_kv_heads, pool.head_dim, pool.dtype
        self.capacity = capacity
        self.windows = pool.windows
        self._group = pool.group
        self._full = self.windows.count(None)  # bytes_at's terms, once: it runs for every decode row of every step
        self._sliding = [w for w in self.windows if w is not None]
        self.length = 0  # positions filled
        self._layer_bytes = pool.page_bytes // PAGE  # one position of one layer
        groups = len(pool.group_windows)
        self.pages: list[list[int]] = [[] for _ in range(groups)]  # per group, the page of each PAGE positions (-1: let go)
        self.first = [0] * groups  # per group, the first page index still held
        slots = (capacity + PAGE - 1) // PAGE
        self.tables = [(ctypes.c_int32 * slots)() for _ in range(groups)]  # the kernels' copy of `pages`
        self._table_at = [ctypes.addressof(t) for t in self.tables]
        self.prefix: list[Prefix] = []
        self.key = next(_KEYS)
        self.remotes: set[Any] = set()
        self.away: list[list[int]] = []  # while spilled: per group, the store's slot of each page (-1: let go)
        self._from: list[list[Prefix | None]] = []  # ... and the cache entry whose page was this one's, to share again
        self.used = 0.0  # when it last ran (spill's order: least recently used first)
        weakref.finalize(self, _release, pool, self.pages, self.away)

    @property
    def devices(self) -> list[torch.device]:
        return self.pool.devices

    @property
    def device(self) -> torch.device:
        """Where the first layer's K/V are (the masks of a forward are built there)."""
        return self.pool.devices[0]

    def bytes_per_position(self) -> int:
        """One position's K/V in every layer."""
        return self._layer_bytes * self.num_layers

    def bytes_at(self, length: int) -> int:
        """The K/V bytes `length` positions hold (and a step at that length reads): a window layer's at most its
        window's."""
        return self._layer_bytes * (self._full * length + sum(min(length, w) for w in self._sliding))

    def nbytes(self) -> int:
        return sum(self.layer_nbytes(i) for i in range(self.num_layers))

    def layer_nbytes(self, layer: int) -> int:
        """Bytes of the pages this session holds in one layer (on this rank: none where another holds it; none while
        spilled)."""
        if self.devices[layer] == META or self.away:
            return 0
        g = self._group[layer]
        return (len(self.pages[g]) - self.first[g]) * PAGE * self._layer_bytes

    # -- pages ------------------------------------------------------------------------------------

    def reserve(self, total: int) -> None:
        """Make room for positions up to `total`: pages up to it, the page being written made this session's own; a
        window group first lets go of what its queries from position `length` on cannot see."""
        if total > self.capacity:
            raise RoomError(f"{total} positions do not fit in the session's {self.capacity}")
        pool = self.pool
        for g, window in enumerate(pool.group_windows):
            pages, table = self.pages[g], self.tables[g]
            if window is not None:
                self._let_go(g, window)
            tail = self.length // PAGE
            if self.length % PAGE and pool.shared(g, pages[tail]):  # a page others hold too: written, it is copied
                page = pool.alloc(g)
                pool.copy_page(g, pages[tail], page, self.length % PAGE)
                pool.release(g, [pages[tail]])
                pages[tail] = table[tail] = page
            while len(pages) * PAGE < total:
                page = pool.alloc(g)
                table[len(pages)] = page
                pages.append(page)

    def trim(self) -> None:
        """Window groups let go of the pages no query from `length` on sees (a restored session's, never written)."""
        for g, window in enumerate(self.pool.group_windows):
            if window is not None:
                self._let_go(g, window)

    def _let_go(self, g: int, window: int) -> None:
        keep = max(0, self.length - window + 1 - _REWIND) // PAGE  # pages before this one hold no key a query sees
        pages = self.pages[g]
        if keep > self.first[g]:
            self.pool.release(g, pages[self.first[g] : keep])
            for i in range(self.first[g], keep):
                pages[i] = -1
            self.first[g] = keep

    @property
    def spilled(self) -> bool:
        return bool(self.away)

    def spill(self) -> int:
        """Take every page this session holds out of the pool into the pool's store, its tables left until `fill`.
        -> bytes the pool no longer holds for it."""
        pool, store = self.pool, self.pool.store
        assert store is not None and not self.away and not self.remotes
        freed = 0
        for g, pages in enumerate(self.pages):
            slots: list[int] = []
            sources: list[Prefix | None] = []
            for i, page in enumerate(pages):
                if page < 0:
                    slots.append(-1)
                    sources.append(None)
                    continue
                slots.append(store.put(pool.page_out(g, page)))
                entry = self.prefix[i] if i < len(self.prefix) else None
                sources.append(entry if entry is not None and entry.away is None and entry.pages[g] == page else None)
                freed += pool.group_bytes(g) if pool.refs[g][page] == 1 and not pool.shared(g, page) else 0
            pool.release(g, pages)
            pages[:] = [-1] * len(pages)
            self.away.append(slots)
            self._from.append(sources)
        return freed

    def fill(self) -> None:
        """Back into the pool after `spill`: a page the prefix cache still keeps as it was is shared again, the others
        read from the store."""
        if not self.away:
            return
        pool, store = self.pool, self.pool.store
        assert store is not None
        found = [e for sources in self._from for e in sources if e is not None and pool.alive(e)]
        with pool.keeping(found):
            pool.bring_back(found)
            self._fill_pages()
        self.away.clear()
        self._from.clear()

    def _fill_pages(self) -> None:
        pool, store = self.pool, self.pool.store
        assert store is not None
        for g, (slots, sources) in enumerate(zip(self.away, self._from)):
            pages, table = self.pages[g], self.tables[g]
            for i, slot in enumerate(slots):
                if slot < 0:
                    continue
                entry = sources[i]
                if entry is not None and pool.alive(entry) and entry.pages[g] >= 0:
                    page = entry.pages[g]
                    pool.share(g, page)
                else:
                    page = pool.alloc(g)
                    pool.page_in(g, page, store.get(slot))
                store.free([slot])
                slots[i] = -1
                pages[i] = table[i] = page

    def start(self, layer: int) -> int:
        """The first position whose K/V layer still holds."""
        return self.first[self._group[layer]] * PAGE

    def table(self, layer: int) -> int:
        """The address of the int32 page table of layer's group (the kernels read it)."""
        return self._table_at[self._group[layer]]

    def storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's pages in the pool, K and V [pages, Hkv, PAGE, D]."""
        return self.pool.k[layer], self.pool.v[layer]

    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put k, v [n, Hkv, D] at positions pos .. pos + n - 1 (reserved) of layer (a q8_0 cache quantizes them; rows
        of its own already are)."""
        K, V = self.storage(layer)
        if self.dtype == Q8_0 and k.dtype != Q8_0:
            k, v = quantize_q8(k), quantize_q8(v)
        pages, n, i = self.pages[self._group[layer]], k.shape[0], 0
        while i < n:
            at = pos + i
            page, off = pages[at // PAGE], at % PAGE
            m = min(n - i, PAGE - off)
            K[page, :, off : off + m] = k[i : i + m].transpose(0, 1)
            V[page, :, off : off + m] = v[i : i + m].transpose(0, 1)
            i += m

    def read(self, layer: int, lo: int, hi: int, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's K/V of positions lo .. hi - 1 (held), contiguous: [Hkv, hi - lo, D] each (a q8_0 cache's in f32, or
        with `raw` its rows as stored)."""
        K, V = self.storage(layer)
        if hi <= lo:
            empty = K.new_empty((self.num_kv_heads, 0, K.shape[-1] if raw else self.head_dim), dtype=K.dtype if raw or self.dtype != Q8_0 else torch.float32)
            return empty, empty
        a, b = lo // PAGE, (hi + PAGE - 1) // PAGE
        if self.away:  # out of the pool: the pages' bytes from the store
            K, V = self._away_pages(layer, a, b)
            slots: Sequence[int] = range(b - a)
        else:
            slots = self.pages[self._group[layer]][a:b]

        def gather(store: torch.Tensor) -> torch.Tensor:  # pages [slots, Hkv, PAGE, row] -> [Hkv, hi - lo, row]
            # each page's rows in range, joined in one copy (an index_select of whole pages, then their transpose
            # copied again, cost a dense model's decode 5% at a depth of 256)
            starts = range(a * PAGE, b * PAGE, PAGE)  # each page's first position
            run = torch.cat([store[slot, :, max(lo - at, 0) : min(hi - at, PAGE)] for slot, at in zip(slots, starts)], dim=1)
            return dequantize_q8(run, self.head_dim) if self.dtype == Q8_0 and not raw else run

        return gather(K), gather(V)

    def _away_pages(self, layer: int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's pages a .. b - 1 as the store keeps them (pool.page_out's layout), K and V [b - a, Hkv, PAGE, row]."""
        pool, g = self.pool, self._group[layer]
        assert pool.store is not None
        half = pool.page_bytes // 2
        at = [i for i in pool.layers(g) if pool.devices[i] != META].index(layer) * 2 * half
        shape = (self.num_kv_heads, PAGE, pool.row)
        blobs = [pool.store.get(slot) for slot in self.away[g][a:b]]
        K = torch.stack([blob[at : at + half].view(self.dtype).view(shape) for blob in blobs])
        V = torch.stack([blob[at + half : at + 2 * half].view(self.dtype).view(shape) for blob in blobs])
        return K, V

    @torch.inference_mode()
    def move(self, layer: int, device: torch.device, filled: tuple[int, torch.Tensor, torch.Tensor] | None = None) -> None:
        """Layer's K/V to `device`, where its block now runs: every session's, as the pool holds them. `filled`: the
        K/V another rank held for this session (first position, K, V [Hkv, n, D]), written here."""
        self.pool.move(layer, device)
        if filled is not None:
            self.put(layer, *filled)

    @torch.inference_mode()
    def put(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write layer's K/V of positions start .. start + n - 1 (k, v [Hkv, n, D], from another rank); positions
        before this session's first held page are skipped."""
        skip = max(0, self.start(layer) - start)
        n = min(k.shape[1], self.length - start) - skip
        if n > 0 and self.devices[layer] != META:
            device = self.devices[layer]
            self.write(layer, start + skip, k[:, skip : skip + n].transpose(0, 1).to(device), v[:, skip : skip + n].transpose(0, 1).to(device))

    def filled(self, layer: int, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K/V from its first held position (`start`) to the length, [Hkv, n, D] each (`raw`: see read)."""
        return self.read(layer, self.start(layer), self.length, raw)

    def reusable(self, length: int) -> int:
        """How much of a prefix of `length` positions the cache can go on from: all of it where every window group
        still holds the keys a query at `length` sees, else none (a shorter prefix needs older keys still)."""
        ok = all(w is None or self.first[g] == 0 or length - w + 1 >= self.first[g] * PAGE for g, w in enumerate(self.pool.group_windows))
        return length if ok else 0

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (prefix reuse, reset, a draft refused): the pages past it go back; a window
        group must still hold what a query at `length` sees (`reusable`)."""
        if self.away:
            if length == 0:
                _release(self.pool, [], self.away)
                self._from.clear()
            else:
                self.fill()
        length = max(0, min(self.length, length))
        assert self.reusable(length) == length, "a window layer dropped keys the truncated session needs"
        keep = (length + PAGE - 1) // PAGE
        for g, pages in enumerate(self.pages):
            if len(pages) > keep:
                self.pool.release(g, pages[keep:])
                del pages[keep:]
            if length == 0:
                self.first[g] = 0
        del self.prefix[length // PAGE :]
        self.length = length

    def reset(self) -> None:
        self.truncate(0)

    def forkable(self) -> bool:
        """Whether copy_from can take this cache's positions: every window group still holds them from position 0."""
        return not any(self.first)

    @torch.inference_mode()
    def copy_from(self, src: SessionKV, length: int) -> None:
        """Become a copy of `src`'s first `length` positions (a prompt run once for several rows): its full pages
        shared, the last partial one copied; src.forkable()."""
        assert src.forkable() and length <= src.length and src.pool is self.pool
        self.reset()
        self.map(src.pages, length, src.prefix)
        for remote in src.remotes:  # the layers other ranks hold are copied there
            remote.copy_kv(src, self, length)

    def map(self, pages: list[list[int]], length: int, prefix: list[Prefix]) -> None:
        """From empty, hold `pages` (per group, as a table names them; -1: not needed) for `length` positions: full
        pages shared, a partial last one copied."""
        assert self.length == 0
        pool, full = self.pool, length // PAGE
        for g, src in enumerate(pages):
            own, table = self.pages[g], self.tables[g]
            for i in range(full):
                if src[i] >= 0:
                    pool.share(g, src[i])
                own.append(src[i])
                table[i] = src[i]
            self.first[g] = next((i for i in range(full) if src[i] >= 0), full)
            if length % PAGE:
                page = pool.alloc(g)
                pool.copy_page(g, src[full], page, length % PAGE)
                own.append(page)
                table[full] = page
        self.prefix = list(prefix[:full])
        self.length = length

    # -- the prefix cache -------------------------------------------------------------------------

    def publish(self, token_ids: list[int]) -> None:
        """Enter this session's full pages not yet in the prefix cache (`token_ids`: the tokens its positions hold)."""
        pool = self.pool
        while (len(self.prefix) + 1) * PAGE <= self.length:
            i = len(self.prefix)
            parent = self.prefix[-1] if self.prefix else None
            entry = pool.enter(parent, tuple(token_ids[i * PAGE : (i + 1) * PAGE]), [pages[i] for pages in self.pages])
            self.prefix.append(entry)

    def adopt(self, prompt_ids: list[int], own: int, short_feed: int = 0) -> int:
        """Take the longest cached prefix of `prompt_ids` (but its last token) where it is longer than `own` (what this
        session already holds of it): its full pages, shared, and where the prompt goes on from the first tokens of a
        cached page but not its whole (at least pages.PART of them: a system prompt shorter than a page, the start
        of a page two prompts share), a copy of those positions, as many as leave more than `short_feed` tokens to
        feed: the rest is then a prompt chunk, fed as the whole prompt would be (a short feed's products are decode
        rows': a short prompt repeated in a fresh session keeps its first run's tokens, near ties included). -> the
        positions held of the prompt now."""
        pool = self.pool
        entries: list[Prefix] = []
        parent = None
        limit = (len(prompt_ids) - 1) // PAGE
        while len(entries) < limit:
            i = len(entries)
            entry = pool.lookup(parent, tuple(prompt_ids[i * PAGE : (i + 1) * PAGE]))
            if entry is None:
                break
            entries.append(entry)
            parent = entry
        length = len(entries) * PAGE
        start = pool.lookup_start(parent, tuple(prompt_ids[length : max(length, len(prompt_ids) - 1 - short_feed)]))
        if start is not None and self._sees_all(entries + [start[0]], length + start[1]):
            entries.append(start[0])
            length += start[1]
        # a window group needs the pages its last query sees: fewer entries where it let them go
        while entries and not self._sees_all(entries, length):
            entries.pop()
            length = len(entries) * PAGE
        pool.queries += len(prompt_ids)
        if length <= own:
            return own
        pool.hits += length
        self.reset()
        pool.bring_back(entries)  # cold ones the store kept
        with pool.keeping(entries[length // PAGE :]):  # a start to copy from: not let go for the copy's page
            self.map([[e.pages[g] for e in entries] for g in range(len(self.pages))], length, entries)
        return length

    def _sees_all(self, entries: list[Prefix], length: int) -> bool:
        """Whether every window group still has the pages of `entries` that a query at `length` sees."""
        return all(self._sees(g, w, entries, length) for g, w in enumerate(self.pool.group_windows) if w is not None)

    @staticmethod
    def _sees(g: int, window: int, entries: list[Prefix], length: int) -> bool:
        first = max(0, length - window + 1) // PAGE
        return all((e.pages if e.away is None else e.away)[g] >= 0 for e in entries[first:])


@dataclass
class RowSpan:
    """One row of a packed batch: tokens [start, start + num_tokens) attend to `kv` from position `kv.length`.

    A causal mask is made on first use, once per forward, device and (group, window), and shared by the layers that
    ask for it (the compiled chunk attention needs none; a single token sees everything).
    """

    start: int
    num_tokens: int
    kv: SessionKV
    prompt: bool = False  # tokens of a prompt (even one): quantized projections multiply them exactly
    short: bool = False  # ... unless it is a short feed: its tokens multiply as decode rows do (runner.pack)
    many: bool = False  # ... as a prompt chunk's (a feed past rows_feed), though a layer with a fused call still runs them in it
    exact: bool = field(init=False)  # its tokens take the prompt chunks' products (a prompt's, or any row of several)
    _masks: dict[tuple[int, int | None], dict[torch.device, torch.Tensor]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.exact = (self.num_tokens > 1 or self.prompt) and not self.short  # once: every layer of a forward asks

    def begin(self) -> None:
        """Before a forward: the masks of the last one no longer apply."""
        self._masks.clear()

    def key_start(self, window: int | None) -> int:
        """The first key any query of this chunk sees: with a sliding `window` a query at q sees keys in (q - window, q]."""
        return max(0, self.kv.length - window + 1) if window else 0

    def mask_on(self, device: torch.device, group: int, window: int | None) -> torch.Tensor | None:
        """Causal mask for this chunk against its history from `key_start(window)` on `device`, tiled for the GQA query
        layout [Hkv, group*n, D] (`group` query heads per kv head): [group*n, keys]. None for a single token."""
        if self.num_tokens == 1:
            return None
        masks = self._masks.setdefault((group, window), {})
        if device not in masks:
            if masks:  # made for another place of this forward: copied
                masks[device] = next(iter(masks.values())).to(device)
            else:
                n, p = self.num_tokens, self.kv.length
                keys = torch.arange(self.key_start(window), p + n, device=device)
                queries = torch.arange(p, p + n, device=device)
                mask = keys[None, :] <= queries[:, None]  # [n, keys]
                if window:
                    mask &= keys[None, :] > queries[:, None] - window
                masks[device] = mask.repeat(group, 1) if group > 1 else mask
        return masks[device]

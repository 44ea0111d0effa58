"""One model's K/V pages: a pool of fixed-size pages per group of layers that keep the same positions, their reference
counts, and the prefix cache (full pages found again by the tokens up to their end, or the start of one by its first
tokens)."""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

__all__ = ["KV_DTYPES", "META", "PAGE", "Q8_0", "KVPages", "PagePool", "PoolFull", "Prefix", "dequantize_q8", "pages_for", "quantize_q8"]

if TYPE_CHECKING:
    from .kv_store import PageStore

PAGE = 64  # positions per page: the attention kernels' blocks of keys (kernels/simd.h KV_PAGE)
META = torch.device("meta")  # a layer held by another rank: its shapes are kept here, its K/V there
_IDS = itertools.count(1)
# A prompt that goes on from a cached page's first tokens but not its whole takes a copy of that page's start, at least
# this many positions (vLLM's block: shorter starts, a chat template's opening tokens, are not worth a page's copy). The
# cache finds such a start by the page's first 16, 32 or 48 tokens, then the longest among the few entries found.
PART = 16
_PART_LOOKS = 8  # entries compared a lookup, the most recently used first
Q8_0 = torch.uint8  # a q8_0 cache's storage: rows of D int8 then D / 32 f16 scales (kernels/simd.h)
KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": Q8_0}  # -kv-dtype's names


def pages_for(window: int | None, positions: int) -> int:
    """The most pages a session of `positions` holds in a group of layers with this window (None: full attention): a
    window group's, its window's, the rewind's and a page at each end (kv.py lets go of the rest)."""
    return -(-(positions if window is None else min(positions, window + 3 * PAGE)) // PAGE)


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """Rows of D values (D a multiple of 32) as q8_0 rows [..., D + D / 16] uint8, as kernels/rows.c's to_q8 makes
    them: per block of 32, scale = amax / 127, q = value * (1 / scale) rounded to nearest even, the scale kept as f16."""
    D = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], D // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv).to(torch.int8).reshape(*x.shape[:-1], D)
    return torch.cat([q.view(torch.uint8), d.squeeze(-1).half().view(torch.uint8).reshape(*x.shape[:-1], D // 16)], dim=-1)


def dequantize_q8(rows: torch.Tensor, D: int) -> torch.Tensor:
    """q8_0 rows back to f32 [..., D]: each value its block's scale times its integer."""
    q = rows[..., :D].contiguous().view(torch.int8).float().reshape(*rows.shape[:-1], D // 32, 32)
    d = rows[..., D:].contiguous().view(torch.float16).float()[..., None]
    return (d * q).reshape(*rows.shape[:-1], D)


class PoolFull(RuntimeError):
    """No page to be had under the pool's byte limit: every page is held (admission keeps rows from getting here)."""


def _start_keys(key: tuple[int, tuple[int, ...]]) -> list[tuple[int, tuple[int, ...]]]:
    """Where a cache entry (its key: parent id, page tokens) is found by its page's start: its first PART, 2 PART, ..."""
    return [(key[0], key[1][:n]) for n in range(PART, PAGE, PART)]


@dataclass(frozen=True)
class KVPages:
    """A model's pages now (every group's): held by sessions' tables (a shared page once), those held by more than one,
    kept by the prefix cache alone, free in storage; out of the pool, in host memory and in the spill file (idle sessions'
    and cold prefixes', engine/kv_store.py); and the prompt tokens the cache found, of those looked up, over its life."""

    held: int
    shared: int
    cached: int
    free: int
    hit_tokens: int
    query_tokens: int
    host: int = 0
    file: int = 0


@dataclass(eq=False)
class Prefix:
    """An entry of the prefix cache: one full page of positions, found by its parent entry and its tokens, holding the
    page of each group (-1 where a window group had already let it go); or, taken out of the pool (`away`), each group's
    slot in the pool's store, brought back when a prompt finds it."""

    key: tuple[int, tuple[int, ...]]  # (the parent entry's id, 0 at the start; this page's tokens)
    pages: list[int]
    parent: Prefix | None
    id: int = field(default_factory=lambda: next(_IDS))
    children: int = 0
    away: list[int] | None = None


class PagePool:
    """K/V pages of every attention layer of one model. Layers that drop positions alike (every full-attention layer;
    the layers of one sliding window) form a group and number their pages together: page p of a group is positions'
    K/V in each of its layers, `k[layer][p]` [Hkv, PAGE, D]. A page is held by the sessions whose page tables name it
    (`refs`); full pages of a prompt are entered in the prefix cache, where a later prompt with the same tokens up to
    their end finds them; a page no table names stays cached until a page is wanted and none is free (least recently
    used first). Storage per layer is on its block's place; it grows by doubling (the pages in use copied) when every
    page is held. With a byte `limit` (-kv-mem) the pages held and cached never take more: a cached page goes before a
    new one comes past it, and where none can, PoolFull. With a `store` (engine/kv_store.py) a cached page that goes is
    kept there, up to `away_cap` bytes of them (the least recently used leaves dropped past it), and brought back when a
    prompt finds it; idle sessions' pages go there too (kv.py SessionKV.spill). Thread-safe: sessions let their pages go
    from whatever thread drops them."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, devices: list[torch.device], windows: list[int | None],
                 pages: list[int] | None = None, limit: int | None = None):
        self.limit = limit
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.windows = list(windows)
        self.devices = list(devices)
        kinds = list(dict.fromkeys(self.windows))  # the groups, in the order the layers first name them
        self.group = [kinds.index(w) for w in self.windows]  # each layer's group
        self.group_windows = kinds
        self._layers = [[i for i, g in enumerate(self.group) if g == k] for k in range(len(kinds))]
        self.capacity = list(pages) if pages is not None else [PAGE] * len(kinds)  # pages per group's storage
        self.refs = [[0] * c for c in self.capacity]
        self._free = [list(range(c)) for c in self.capacity]  # heaps: the lowest page first, so what is touched stays compact
        self._entry: list[dict[int, Prefix]] = [{} for _ in kinds]  # page -> the cache entry holding it
        self.prefixes: dict[tuple[int, tuple[int, ...]], Prefix] = {}
        self._starts: dict[tuple[int, tuple[int, ...]], dict[int, Prefix]] = {}  # (parent id, first PART * j tokens) -> entries
        self._lru: OrderedDict[int, Prefix] = OrderedDict()  # entries by last use, oldest first
        if dtype == Q8_0 and head_dim % 32:
            raise ValueError(f"a q8_0 KV cache takes blocks of 32 values: this model's head size is {head_dim}")
        self.row = head_dim + head_dim // 16 if dtype == Q8_0 else head_dim  # one position of one kv head, in dtype's elements
        self.page_bytes = 2 * num_kv_heads * PAGE * self.row * torch.empty((), dtype=dtype).element_size()  # one layer's K and V
        self.k = [self._storage(d, self.capacity[g]) for d, g in zip(self.devices, self.group)]
        self.v = [self._storage(d, self.capacity[g]) for d, g in zip(self.devices, self.group)]
        self.hits = 0  # prompt tokens found in the cache, and looked for
        self.queries = 0
        self.store: PageStore | None = None
        self.away_cap = 0  # bytes of cached pages the store keeps
        self._away_bytes = 0
        self._keep: set[int] = set()  # entries being adopted: not to be evicted by the pages bringing others back
        self._lock = threading.RLock()

    def _storage(self, device: torch.device, pages: int) -> torch.Tensor:
        return torch.empty((pages, self.num_kv_heads, PAGE, self.row), dtype=self.dtype, device=device)

    def layers(self, group: int) -> list[int]:
        return self._layers[group]

    # -- pages ------------------------------------------------------------------------------------

    def alloc(self, group: int) -> int:
        """A page of `group` for one table: a free one, else the least recently used cached one, else storage doubles."""
        with self._lock:
            if self.limit is not None:
                while self.used_bytes() + self.group_bytes(group) > self.limit:
                    if not self._evict(None):
                        raise PoolFull(f"the KV pages take {self.used_bytes()} bytes of -kv-mem's {self.limit}, every one held")
            free = self._free[group]
            if not free and not self._evict(group):
                self._grow(group)
            page = heapq.heappop(free)
            self.refs[group][page] = 1
            return page

    def share(self, group: int, page: int) -> None:
        with self._lock:
            self.refs[group][page] += 1

    def release(self, group: int, pages: list[int]) -> None:
        """Tables no longer name these pages (-1s skipped): each is free once none does, unless it is cached."""
        with self._lock:
            refs, entries = self.refs[group], self._entry[group]
            for page in pages:
                if page < 0:
                    continue
                refs[page] -= 1
                assert refs[page] >= 0, f"page {page} of group {group} released twice"
                if refs[page] == 0 and page not in entries:
                    heapq.heappush(self._free[group], page)

    def shared(self, group: int, page: int) -> bool:
        """Whether writing into this page would change what another table or the cache holds."""
        return self.refs[group][page] > 1 or page in self._entry[group]

    @torch.inference_mode()
    def copy_page(self, group: int, src: int, dst: int, positions: int = PAGE) -> None:
        for layer in self.layers(group):
            if self.devices[layer] != META:
                self.k[layer][dst, :, :positions] = self.k[layer][src, :, :positions]
                self.v[layer][dst, :, :positions] = self.v[layer][src, :, :positions]

    @torch.inference_mode()
    def page_out(self, group: int, page: int) -> torch.Tensor:
        """One page's bytes, every layer of the group this rank holds, K then V: a uint8 CPU tensor of group_bytes."""
        parts = [store[layer][page].reshape(-1).view(torch.uint8) for layer in self.layers(group) if self.devices[layer] != META for store in (self.k, self.v)]
        return torch.cat(parts).cpu() if parts else torch.empty(0, dtype=torch.uint8)

    @torch.inference_mode()
    def page_in(self, group: int, page: int, data: torch.Tensor) -> None:
        """Write page_out's bytes back into `page`."""
        at = 0
        for layer in self.layers(group):
            if self.devices[layer] != META:
                for store in (self.k, self.v):
                    dst = store[layer][page]
                    n = dst.numel() * dst.element_size()
                    dst.view(-1).view(torch.uint8).copy_(data[at : at + n])
                    at += n
        assert at == data.numel(), "a page's bytes taken out with other layers here than now"  # moves across ranks fill first

    @torch.inference_mode()
    def _grow(self, group: int) -> None:
        """Double a group's storage: the pages held or cached are copied, the rest are new (on the CPU never touched)."""
        old = self.capacity[group]
        new = old * 2
        used = torch.tensor([p for p in range(old) if self.refs[group][p] or p in self._entry[group]], dtype=torch.long)
        for layer in self.layers(group):
            for store in (self.k, self.v):
                grown = self._storage(self.devices[layer], new)
                if self.devices[layer] != META and len(used):
                    grown[used.to(grown.device)] = store[layer][used.to(grown.device)]
                store[layer] = grown
        self.capacity[group] = new
        self.refs[group].extend([0] * (new - old))
        for page in range(old, new):
            heapq.heappush(self._free[group], page)

    @torch.inference_mode()
    def move(self, layer: int, device: torch.device) -> None:
        """Carry one layer's pages to `device` (its block's new place); to or from `meta` nothing is copied."""
        if self.devices[layer] == device:
            return
        source, self.devices[layer] = self.devices[layer], device
        for store in (self.k, self.v):
            grown = self._storage(device, store[layer].shape[0])
            if source != META and device != META:
                grown.copy_(store[layer])
            store[layer] = grown
        if device == META or source == META:  # what the cache held of this layer is not here
            self.clear_cache()

    # -- the prefix cache -------------------------------------------------------------------------

    def lookup(self, parent: Prefix | None, tokens: tuple[int, ...]) -> Prefix | None:
        """The cache entry for the page of `tokens` after `parent` (None: the first page), marked used."""
        with self._lock:
            entry = self.prefixes.get((parent.id if parent is not None else 0, tokens))
            if entry is not None:
                self._lru.move_to_end(entry.id)
            return entry

    def lookup_start(self, parent: Prefix | None, tokens: tuple[int, ...]) -> tuple[Prefix, int] | None:
        """The cache entry after `parent` whose page's first tokens are most of `tokens` (at least PART of them, fewer
        than a page), and how many, marked used; None where none starts so."""
        with self._lock:
            pid = parent.id if parent is not None else 0
            for n in range(min(len(tokens), PAGE - 1) // PART * PART, 0, -PART):
                found = self._starts.get((pid, tokens[:n]))
                if not found:
                    continue
                best, most = None, 0
                for entry in itertools.islice(reversed(found.values()), _PART_LOOKS):
                    same = n
                    page = entry.key[1]
                    while same < len(tokens) and same < PAGE - 1 and page[same] == tokens[same]:
                        same += 1
                    if same > most:
                        best, most = entry, same
                assert best is not None
                self._lru.move_to_end(best.id)
                found[best.id] = found.pop(best.id)  # the most recently used last
                return best, most
            return None

    def enter(self, parent: Prefix | None, tokens: tuple[int, ...], pages: list[int]) -> Prefix:
        """Cache a full page (each group's, -1 where dropped) under its tokens after `parent`; an entry already there
        for them is returned instead (another session made the same page: its own stays its)."""
        with self._lock:
            key = (parent.id if parent is not None else 0, tokens)
            entry = self.prefixes.get(key)
            if entry is not None:
                self._lru.move_to_end(entry.id)
                return entry
            entry = Prefix(key, list(pages), parent)
            self.prefixes[key] = entry
            self._lru[entry.id] = entry
            for start in _start_keys(key):
                self._starts.setdefault(start, {})[entry.id] = entry
            if parent is not None:
                parent.children += 1
            for g, page in enumerate(pages):
                if page >= 0:
                    self._entry[g][page] = entry
            return entry

    def _evict(self, group: int | None) -> bool:
        """Let the least recently used cache entry no table holds go from the pool, freeing a page of `group` (None: of
        any): to the store where there is one (any entry: it stays in the cache), else dropped (a leaf), with its pages
        no table holds. -> whether a page came free."""
        store = self.store if self.away_cap > 0 else None
        for entry in self._lru.values():
            if entry.away is None and (store is not None or entry.children == 0) and entry.id not in self._keep and (group is None or entry.pages[group] >= 0) \
                    and not any(p >= 0 and self.refs[g][p] for g, p in enumerate(entry.pages)):
                if store is None:
                    self._drop(entry)
                else:
                    self._send_away(entry, store)
                return True
        return False

    def _send_away(self, entry: Prefix, store: PageStore) -> None:
        entry.away = [store.put(self.page_out(g, p)) if p >= 0 else -1 for g, p in enumerate(entry.pages)]
        self._away_bytes += sum(self.group_bytes(g) for g, p in enumerate(entry.pages) if p >= 0)
        for g, page in enumerate(entry.pages):
            if page >= 0:
                del self._entry[g][page]
                heapq.heappush(self._free[g], page)
        entry.pages = [-1] * len(entry.pages)
        while self._away_bytes > self.away_cap:  # past the cap the least recently used leaves go for good
            leaf = next((e for e in self._lru.values() if e.away is not None and e.children == 0 and e.id not in self._keep), None)
            if leaf is None:
                break
            self._drop(leaf)

    def bring_back(self, entries: list[Prefix]) -> None:
        """Put entries the store keeps back into pages of the pool (a prompt found them), the cache's as before."""
        with self._lock, self.keeping(entries):
            for entry in entries:
                if entry.away is None:
                    continue
                assert self.store is not None
                for g, slot in enumerate(entry.away):
                    if slot >= 0:
                        page = self.alloc(g)
                        self.refs[g][page] = 0
                        self.page_in(g, page, self.store.get(slot))
                        entry.pages[g] = page
                        self._entry[g][page] = entry
                self._forget_away(entry)

    @contextmanager
    def keeping(self, entries: list[Prefix]) -> Iterator[None]:
        """While inside, these entries' pages are not evicted (pages being brought back for a session that will hold
        them)."""
        ids = {e.id for e in entries} - self._keep
        self._keep.update(ids)
        try:
            yield
        finally:
            self._keep.difference_update(ids)

    def _forget_away(self, entry: Prefix) -> None:
        assert entry.away is not None and self.store is not None
        self._away_bytes -= sum(self.group_bytes(g) for g, s in enumerate(entry.away) if s >= 0)
        self.store.free([s for s in entry.away if s >= 0])
        entry.away = None

    def alive(self, entry: Prefix) -> bool:
        """Whether an entry is still in the cache (its pages, or its slots in the store, as they were)."""
        return self.prefixes.get(entry.key) is entry

    def _drop(self, entry: Prefix) -> None:
        del self.prefixes[entry.key]
        del self._lru[entry.id]
        for start in _start_keys(entry.key):
            found = self._starts[start]
            del found[entry.id]
            if not found:
                del self._starts[start]
        if entry.parent is not None:
            entry.parent.children -= 1
        if entry.away is not None:
            self._forget_away(entry)
        for g, page in enumerate(entry.pages):
            if page >= 0 and self._entry[g].get(page) is entry:
                del self._entry[g][page]
                if self.refs[g][page] == 0:
                    heapq.heappush(self._free[g], page)

    def clear_cache(self) -> None:
        with self._lock:
            for entry in list(self._lru.values())[::-1]:  # children were entered after their parents
                self._drop(entry)

    def send_away_cold(self, nbytes: int) -> int:
        """Take at least `nbytes` of cached pages no table holds out of the pool (to the store), least recently used
        first. -> bytes taken."""
        taken = 0
        with self._lock:
            while taken < nbytes:
                before = self.used_bytes()
                if not self._evict(None):
                    break
                taken += before - self.used_bytes()
        return taken

    # -- figures ----------------------------------------------------------------------------------

    def used(self, group: int) -> int:
        """Pages of a group that tables hold or the cache keeps."""
        return self.capacity[group] - len(self._free[group])

    def group_bytes(self, group: int) -> int:
        """Bytes of one page of `group` here: its positions in every layer of the group this rank holds."""
        return self.page_bytes * sum(self.devices[i] != META for i in self.layers(group))


    def used_bytes(self) -> int:
        """Bytes of the pages held or cached here, every group (what -kv-mem limits; storage never touched on the CPU
        costs nothing)."""
        with self._lock:
            return sum(self.used(g) * self.group_bytes(g) for g in range(len(self.capacity)))

    def held_bytes(self) -> int:
        """Bytes of the pages tables hold (the rest of used_bytes can be let go)."""
        with self._lock:
            return sum(sum(1 for r in self.refs[g] if r) * self.group_bytes(g) for g in range(len(self.capacity)))

    def counts(self) -> tuple[int, int, int, int]:
        """Pages (every group's) held by tables, held by more than one, cached but held by none, and free in storage."""
        with self._lock:
            held = sum(1 for refs in self.refs for r in refs if r)
            shared = sum(1 for refs in self.refs for r in refs if r > 1)
            used = sum(self.used(g) for g in range(len(self.capacity)))
            return held, shared, used - held, sum(self.capacity) - used


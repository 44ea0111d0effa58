"""KV beyond the device: which pages leave a model's pool for host memory or the spill file (engine/kv_store.py), and
when. Pages of idle named sessions and cold cached prefixes go, least recently used first, when the pool's -kv-mem
wants room for a request, or when the host holds more than -maxmem of resident blocks and KV pages; a session's come
back for its next turn, a prefix's when a prompt finds it. Bookkeeping over a pool, a pager and the sessions."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .kv_store import PageStore
from .memory.devices import host_memory
from .memory.placement import HOST, Placement, layer_of

if TYPE_CHECKING:
    from .loader import LoadedModel
    from .pages import PagePool
    from .sessions import Session

__all__ = ["HostRoom", "KVSpill", "spill_for"]


Sessions = Callable[[], tuple[list["Session"], list["Session"]]]  # a model's named sessions, and its pooled slots


def spill_for(loaded: LoadedModel, sessions: Sessions) -> KVSpill | None:
    """A decoder's spill policy, with a store on its pool (used only while -kv-mem or -maxmem bounds it: `place
    -maxmem` may set the second at any time)."""
    runner, placement = loaded.runner, loaded.placement
    if runner is None or placement is None:
        return None
    return KVSpill(runner.kv_pool, placement, sessions, loaded.path.parent)


class HostRoom:
    """Where a model's K/V are host memory, and how much more of its pages out of the pool host memory may keep. The
    pool's store calls it: it reaches the placement weakly (the placement holds the pool), never a session (their
    finalizers hold the pool)."""

    def __init__(self, placement: Placement):
        self._placement = weakref.ref(placement)

    @property
    def placement(self) -> Placement:
        placement = self._placement()
        assert placement is not None, "the model was let go of"
        return placement

    @property
    def maxmem(self) -> int | None:
        return self.placement.pager.budget

    def host_layers(self) -> list[int]:
        """The layers whose blocks are the host's now (their K/V in host memory, counted in -maxmem)."""
        placement = self.placement
        return [layer for i, name in enumerate(placement.names) if (layer := layer_of(name)) is not None and placement.places[i] == HOST]

    def on_host(self) -> bool:
        pool = self.placement.kv_pool
        return pool is not None and len(self.host_layers()) == len(pool.windows)

    def __call__(self) -> int | None:
        """Bytes more the store may keep in host memory: none for a pool that is itself in host memory."""
        placement = self._placement()
        pool = placement.kv_pool if placement is not None else None
        if pool is None or pool.store is None or self.on_host():
            return 0
        if self.maxmem is None:  # no budget: while half the host's available memory is there for them
            return max(0, host_memory()[1] // 2 - pool.store.memory_bytes)
        return max(0, self.maxmem - self.placement.pager.resident_bytes() - pool.store.memory_bytes)


class KVSpill:
    """The spill policy of one model. The K/V of host blocks (the pager's) are host memory: their idle pages count in
    -maxmem beside the resident blocks, and a pool wholly on the host spills to the file alone; a pool on a device
    (the CPU named as one included) spills to host memory while -maxmem has room for it, then to the file. The engine
    thread calls it: `make_room` at admission, `settle` after a step. A session some of whose layers another rank holds
    stays (that rank's K/V have no store)."""

    def __init__(self, pool: PagePool, placement: Placement, sessions: Sessions, directory: Path | None = None):
        self.pool, self.pager, self.sessions = pool, placement.pager, sessions
        self.room = HostRoom(placement)
        self.store = pool.store = PageStore(self.room, directory)
        self._running: tuple[int, ...] = ()
        self._cap()

    def _cap(self) -> None:
        """Cold prefixes are kept out of the pool up to as many bytes as it may hold (none without a bound)."""
        self.pool.away_cap = self.pool.limit if self.pool.limit is not None else (self.room.maxmem or 0)

    # -- under -kv-mem: room in the pool for a request --------------------------------------------

    def make_room(self, nbytes: int, keep: Session) -> int:
        """Take idle named sessions' pages out of the pool (not `keep`'s), least recently used first, until at least
        `nbytes` held bytes are let go. -> bytes let go."""
        freed = 0
        for session in self._spillable(keep):
            if freed >= nbytes:
                break
            freed += session.kv.spill()
        return freed

    def _spillable(self, keep: Session | None = None) -> list[Session]:
        named, _ = self.sessions()
        idle = [s for s in named if s is not keep and not s.busy and not s.kv.spilled and not s.kv.remotes and s.kv.length]
        return sorted(idle, key=lambda s: s.kv.used)

    # -- under -maxmem: the host's resident set ---------------------------------------------------

    def settle(self, running: list[Session]) -> None:
        """After a step: where the running sessions changed, bring the host's resident blocks and KV pages within
        -maxmem (the running sessions' pages are that turn's working set, as a paged block's buffers are): the store's
        pages in memory to the file first, then the pool's cold prefixes, idle slots and idle named sessions out."""
        key = tuple(id(s) for s in running)
        if key == self._running:
            return
        self._running = key
        self._cap()
        if self.room.maxmem is None:
            return
        over = self._host_bytes(running) - self.room.maxmem
        if over > 0:
            over -= self.store.demote(over)
        if over <= 0 or not self.room.host_layers():
            return
        over = self._host_bytes(running) - self.room.maxmem
        over -= self.pool.send_away_cold(over)
        for slot in [s for s in self.sessions()[1] if s.kv.length and not s.reserved]:  # a slot's full pages are cached
            if over <= 0:
                break
            before = self.pool.used_bytes()
            slot.reset()
            over -= before - self.pool.used_bytes()
            over -= self.pool.send_away_cold(over)
        for session in self._spillable():
            if over <= 0:
                break
            session.kv.spill()
            over = self._host_bytes(running) - self.room.maxmem
            over -= self.pool.send_away_cold(over)

    def _host_bytes(self, running: list[Session]) -> int:
        """What the host holds now against -maxmem: resident blocks, the store's memory, and the pages of host layers
        that no running session holds."""
        pool = self.pool
        total = self.pager.resident_bytes() + self.store.memory_bytes
        host = set(self.room.host_layers())
        for g in range(len(pool.group_windows)):
            layers = sum(1 for layer in pool.layers(g) if layer in host)
            if layers:
                working = len({p for s in running for p in s.kv.pages[g] if p >= 0})
                total += max(0, pool.used(g) - working) * pool.page_bytes * layers
        return total

"""-kv-mem's admission: a request runs once the KV pages it may hold at its end fit beside what the running requests
may still take and what is held, so no row ever finds the pool full. Bookkeeping over requests and the pool."""

from __future__ import annotations

from collections.abc import Callable

from .draft import Speculator
from .kv_spill import KVSpill
from .pages import PagePool, pages_for
from .request import Request
from .sessions import Session

__all__ = ["KVBudget"]


class KVBudget:
    """Pages promised against a pool with a byte limit (engine/pages.py PagePool.limit)."""

    def __init__(self, pool: PagePool, speculator: Speculator | None):
        assert pool.limit is not None
        self.pool, self.limit = pool, pool.limit
        self.guesses = speculator.config.draft_max if speculator is not None else 0

    def need(self, req: Request) -> int:
        """Bytes of pages a request may hold at its end: its prompt, its max_tokens and a step's guesses, within its
        room (a window group's: its window's)."""
        positions = min(req.session.max_seq, len(req.prompt_ids) + req.max_tokens + (self.guesses if req.spec is not None else 0))
        return sum(pages_for(w, positions) * self.pool.group_bytes(g) for g, w in enumerate(self.pool.group_windows))

    def refuses(self, req: Request) -> str | None:
        """Why a request can never run under the limit (None: it can)."""
        need = self.need(req)
        if need <= self.limit:
            return None
        return (f"this request may take {need} bytes of KV pages ({len(req.prompt_ids)} prompt tokens and up to {req.max_tokens} more); "
                f"-kv-mem is {self.limit}: ask for fewer max_tokens, or raise -kv-mem")

    def more(self, req: Request) -> int:
        """What a request may still take: its need less what its session holds."""
        kv = req.session.kv
        held = 0 if kv.spilled else sum((len(pages) - first) * self.pool.group_bytes(g) for g, (pages, first) in enumerate(zip(kv.pages, kv.first)))
        return max(0, self.need(req) - held)

    def fits(self, req: Request, running: list[Request], slots: list[Session], fail: Callable[[Request, str], None], spill: KVSpill | None = None) -> bool:
        """Whether `req` may start now. Where it does not fit, idle named sessions' pages leave the pool (`spill`:
        kv_spill.py); where it still does not and nothing runs, idle slots let their pages go (their full pages stay
        cached, to be let go in turn); one that still does not (named sessions hold the rest) is failed with why,
        rather than left to wait forever."""
        owed = sum(self.more(r) for r in running)

        def short() -> int:  # bytes missing for it beside what the running requests may still take
            return self.more(req) + owed - (self.limit - self.pool.held_bytes())

        if short() <= 0 or (spill is not None and spill.make_room(short(), req.session) and short() <= 0):
            return True
        if not running:
            for slot in slots:
                if not slot.reserved:
                    slot.reset()
            if short() <= 0:
                return True
            fail(req, f"the KV pages this request may take ({self.need(req)} bytes) do not fit beside those the named sessions hold "
                      f"({self.pool.held_bytes()} bytes) in -kv-mem's {self.limit}: close a session, or raise -kv-mem")
        return False

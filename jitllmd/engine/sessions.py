"""Sessions: a KV cache with a position and the tokens it holds, and the registry that names them."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .kv import RoomError, SessionKV
from .memory.devices import host_memory

__all__ = ["Session", "SessionRegistry", "SlotPool", "common_prefix", "default_max_seq", "new_session_id"]

_seq = itertools.count(1)


def default_max_seq(context_length: int, bytes_at: Callable[[int], int], fraction: float = 0.25) -> int:
    """The model's context, capped so one session's full KV (`bytes_at(positions)`, growing with them) takes at most
    `fraction` of available memory."""
    budget = int(host_memory()[1] * fraction)
    lo, hi = 1, context_length  # the most positions that fit: bytes_at only grows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if bytes_at(mid) <= budget else (lo, mid - 1)
    return lo


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two id lists share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def new_session_id() -> str:
    """s-<ms since epoch>-<n>, unique in this process."""
    return f"s-{int(time.time() * 1000)}-{next(_seq)}"


@dataclass(eq=False)
class Session:
    """A conversation's KV cache. `token_ids` are exactly the tokens whose K/V the cache holds."""

    id: str
    model: str
    kv: SessionKV
    token_ids: list[int] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    busy: bool = False  # a request is running on it
    reserved: bool = False  # a pooled ephemeral slot promised to a request (waiting or running)
    messages: list[dict[str, str]] = field(default_factory=list)  # a named session's chat so far
    short: tuple[int, int, bool] = (0, 0, False)  # positions [a, b) a short feed made, and whether `many`: fed again, made so again

    @property
    def max_seq(self) -> int:
        return self.kv.capacity

    @property
    def position(self) -> int:
        return self.kv.length

    def reuse_prefix(self, prompt_ids: list[int], cache: bool = False, short_feed: int = 0) -> int:
        """Keep the longest prefix of `prompt_ids` this session holds, or with `cache` the longer one the model's prefix
        cache holds (leaving at least one token to feed; a page's start only where more than `short_feed` are left:
        SessionKV.adopt); return its length."""
        if len(prompt_ids) > self.kv.capacity:
            raise RoomError(f"prompt has {len(prompt_ids)} tokens; the session has room for {self.kv.capacity}")
        n = self.kv.reusable(common_prefix(self.token_ids, prompt_ids[:-1]))
        self.kv.truncate(n)
        del self.token_ids[n:]
        if cache and (found := self.kv.adopt(prompt_ids, n, short_feed)) > n:
            self.token_ids[:] = prompt_ids[:found]
            n = found
        return n

    def publish(self) -> None:
        """Enter the full pages of what this session holds in the model's prefix cache."""
        self.kv.publish(self.token_ids)

    def reset(self) -> None:
        self.kv.reset()
        self.token_ids.clear()
        self.messages.clear()
        self.short = (0, 0, False)


class SessionRegistry:
    """Named sessions (`sessions -new`); requests without one run in an unregistered ephemeral session."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def create(self, model: str, kv: SessionKV, sid: str | None = None) -> Session:
        """A new named session: id `sid` where no session has it, else a new one."""
        with self._lock:
            if sid is None or sid in self._sessions:
                sid = new_session_id()
            s = Session(sid, model, kv)
            self._sessions[sid] = s
        return s

    def get(self, sid: str) -> Session:
        with self._lock:
            if sid not in self._sessions:
                raise KeyError(f"no session {sid!r}")
            return self._sessions[sid]

    def close(self, sid: str) -> None:
        with self._lock:
            self._sessions.pop(sid, None)

    def list(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())


class SlotPool:
    """Ephemeral sessions kept between requests, so a prompt that extends the last one on a slot feeds only the rest:
    at most one per row of the engine's steps. Thread-safe."""

    def __init__(self, model: str, new_kv: Callable[[], SessionKV]):
        self.model = model
        self._new_kv = new_kv
        self._slots: list[Session] = []
        self._lock = threading.Lock()

    def held(self) -> list[Session]:
        with self._lock:
            return list(self._slots)

    def take(self, prompt_ids: list[int], max_slots: int) -> Session:
        """A session for a request: the free slot whose cached tokens share the longest prefix with the prompt, a new
        slot while the pool has fewer than `max_slots`, else a fresh session that goes with the request."""
        with self._lock:
            free = [s for s in self._slots if not s.reserved]
            if free:
                best = max(free, key=lambda s: common_prefix(s.token_ids, prompt_ids))
            elif len(self._slots) < max_slots:
                best = Session(new_session_id(), self.model, self._new_kv())
                self._slots.append(best)
            else:
                return Session(new_session_id(), self.model, self._new_kv())
            best.reserved = True
            return best

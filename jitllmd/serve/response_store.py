"""The stored responses of /v1/responses: what `previous_response_id`, GET, DELETE, cancel and input_items read. Bounded
by count and by bytes (the oldest go first); in memory unless a directory is named, where finished ones are kept as
one JSON file each and read back at start-up."""

from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ResponseStore", "StoreLimits", "Stored"]

log = logging.getLogger(__name__)

_ID = re.compile(r"resp_[0-9a-f]{32}")  # the ids this server makes: a file name never comes from elsewhere


@dataclass(frozen=True)
class StoreLimits:
    """serve's -responses-store, -responses-store-mem and -responses-dir."""

    most: int = 1000  # responses
    most_bytes: int = 256 << 20  # of their JSON
    directory: Path | None = None


@dataclass
class Stored:
    """One response: the object the API returns, its own input items (as input_items lists them), and the
    conversation through it in chat-template messages (its instructions left out: a next response brings its own),
    which a response that names it as previous_response_id continues."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    cancel: Callable[[], None] | None = field(default=None, repr=False)  # while it runs: stops its generation
    deleted: bool = False  # deleted while it ran: its end is not stored

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def running(self) -> bool:
        return self.response["status"] in ("queued", "in_progress")

    def size(self) -> int:
        return len(json.dumps(self._record(), separators=(",", ":"), ensure_ascii=False).encode())

    def _record(self) -> dict[str, Any]:
        return {"response": self.response, "input_items": self.input_items, "messages": self.messages}


class ResponseStore:
    """Responses by id, oldest first; every method runs on the event loop (no lock)."""

    def __init__(self, limits: StoreLimits = StoreLimits()):
        self.limits = limits
        self._items: OrderedDict[str, tuple[Stored, int]] = OrderedDict()  # id -> (stored, its bytes)
        self._bytes = 0
        if limits.directory is not None:
            limits.directory.mkdir(parents=True, exist_ok=True)
            self._load(limits.directory)

    def __len__(self) -> int:
        return len(self._items)

    def get(self, ident: str) -> Stored | None:
        got = self._items.get(ident)
        return got[0] if got else None

    def put(self, stored: Stored) -> None:
        """Add or replace `stored` (as the newest), then drop the oldest past the bounds; a finished one is written
        to the directory, if any. One larger than the byte bound alone is not kept."""
        self._drop(stored.id, unlink=False)
        size = stored.size()
        self._items[stored.id] = (stored, size)
        self._bytes += size
        while self._items and (len(self._items) > self.limits.most or self._bytes > self.limits.most_bytes):
            self._drop(next(iter(self._items)), unlink=True)
        if stored.id in self._items and not stored.running and self.limits.directory is not None:
            self._write(stored)

    def delete(self, ident: str) -> bool:
        return self._drop(ident, unlink=True)

    def _drop(self, ident: str, *, unlink: bool) -> bool:
        got = self._items.pop(ident, None)
        if got is None:
            return False
        self._bytes -= got[1]
        if unlink and self.limits.directory is not None:
            (self.limits.directory / f"{ident}.json").unlink(missing_ok=True)
        return True

    def _write(self, stored: Stored) -> None:
        assert self.limits.directory is not None
        path = self.limits.directory / f"{stored.id}.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(stored._record(), ensure_ascii=False))
            os.replace(tmp, path)
        except OSError as exc:  # a full disk loses the copy on disk, never the response
            log.warning("could not keep response %s in %s: %s", stored.id, self.limits.directory, exc)
            tmp.unlink(missing_ok=True)

    def _load(self, directory: Path) -> None:
        found: list[Stored] = []
        for path in directory.glob("resp_*.json"):
            if not _ID.fullmatch(path.stem):
                continue
            try:
                record = json.loads(path.read_text())
                stored = Stored(record["response"], record["input_items"], record["messages"])
                if stored.id != path.stem or stored.running:
                    raise ValueError("not a finished response of this name")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("skipping %s: %s", path.name, exc)
                continue
            found.append(stored)
        found.sort(key=lambda s: (s.response.get("created_at") or 0, s.id))
        for stored in found:
            size = stored.size()
            self._items[stored.id] = (stored, size)
            self._bytes += size
        while self._items and (len(self._items) > self.limits.most or self._bytes > self.limits.most_bytes):
            self._drop(next(iter(self._items)), unlink=True)

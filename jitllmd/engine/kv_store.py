"""K/V pages taken out of a model's pool: kept in host memory while the budget lets them be, else in a file of fixed
slots (unlinked: nothing is left behind), and read back for the session or prefix that wants them."""

from __future__ import annotations

import os
import tempfile
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["PageStore"]


class PageStore:
    """Pages' bytes by slot: a slot is one page of one group of layers, every layer's K then V (engine/pages.py
    `PagePool.page_out`). `memory_room()` says how many more bytes host memory may hold now (None: no bound, 0: none);
    a page past it goes to the file, created on first use in `directory` (the model file's, else the system's temporary
    directory) and never named, so a crash leaves nothing. Thread-safe: sessions let their slots go from any thread."""

    def __init__(self, memory_room: Callable[[], int | None], directory: Path | None = None):
        self.memory_room = memory_room
        self.directory = directory
        self._memory: dict[int, torch.Tensor] = {}
        self._file: dict[int, tuple[int, int]] = {}  # slot -> (offset, bytes)
        self._free: dict[int, list[int]] = {}  # bytes -> offsets of freed slots of that size, reused first
        self._end = 0
        self._fd = -1
        self._next = 0
        self.memory_bytes = 0
        self.file_bytes = 0  # bytes of slots in use in the file (its size is their high-water mark)
        self._lock = threading.Lock()

    def put(self, data: torch.Tensor, memory: bool = True) -> int:
        """Keep a page's bytes (a contiguous uint8 CPU tensor, now this store's): in memory where `memory` and the room
        allows, else in the file. -> its slot."""
        with self._lock:
            slot, self._next = self._next, self._next + 1
            n = data.numel()
            room = self.memory_room() if memory else 0
            if room is None or n <= room:
                self._memory[slot] = data
                self.memory_bytes += n
            else:
                self._write(slot, data)
            return slot

    def get(self, slot: int) -> torch.Tensor:
        """A slot's bytes (its own tensor, or read from the file into a new one)."""
        with self._lock:
            if slot in self._memory:
                return self._memory[slot]
            offset, n = self._file[slot]
            out = torch.empty(n, dtype=torch.uint8)
            view, done = out.numpy().data, 0
            while done < n:
                got = os.preadv(self._fd, [view[done:]], offset + done)
                if got == 0:
                    raise OSError(f"the KV spill file ended at {offset + done} bytes (expected {offset + n})")
                done += got
            return out

    def free(self, slots: list[int]) -> None:
        with self._lock:
            for slot in slots:
                if slot in self._memory:
                    self.memory_bytes -= self._memory.pop(slot).numel()
                elif slot in self._file:
                    offset, n = self._file.pop(slot)
                    self._free.setdefault(n, []).append(offset)
                    self.file_bytes -= n

    def where(self, slot: int) -> str:
        """'host' or 'file'."""
        return "host" if slot in self._memory else "file"

    def demote(self, nbytes: int) -> int:
        """Move at least `nbytes` of memory's slots (the oldest first) to the file. -> bytes moved."""
        moved = 0
        with self._lock:
            for slot in list(self._memory):
                if moved >= nbytes:
                    break
                data = self._memory.pop(slot)
                self.memory_bytes -= data.numel()
                self._write(slot, data)
                moved += data.numel()
        return moved

    def counts(self) -> tuple[int, int]:
        """Slots (pages) in memory, and in the file."""
        with self._lock:
            return len(self._memory), len(self._file)

    def _write(self, slot: int, data: torch.Tensor) -> None:
        n = data.numel()
        if self._fd < 0:
            self._fd = _unnamed_file(self.directory)
            self._closer = weakref.finalize(self, os.close, self._fd)
        offsets = self._free.get(n)
        if offsets:
            offset = offsets.pop()
        else:
            offset, self._end = self._end, self._end + n
        view, done = data.numpy().data, 0
        while done < n:
            done += os.pwritev(self._fd, [view[done:]], offset + done)
        self._file[slot] = (offset, n)
        self.file_bytes += n

    def close(self) -> None:
        with self._lock:
            self._memory.clear()
            self._file.clear()
            self._free.clear()
            self.memory_bytes = self.file_bytes = 0
            if self._fd >= 0:
                self._closer()
                self._fd = -1


def _unnamed_file(directory: Path | None) -> int:
    """A read-write file no name reaches: in `directory` where it can be made there, else in the temporary directory."""
    for where in ([directory] if directory is not None else []) + [None]:
        try:
            f = tempfile.TemporaryFile(prefix="jitllmd-kv-", dir=where)
        except OSError:
            continue
        fd = os.dup(f.fileno())
        f.close()
        return fd
    raise OSError("no directory to write the KV spill file in")

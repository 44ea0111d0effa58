"""The host pager: host blocks read from the .jlm with pread, up to a page budget of them kept resident, the rest read
just in time for their turn and dropped after, so the host's resident set is measured and bounded (not left to the
OS page cache, which holds the file outside the process). A kept block's quantized parts are the file's own pages,
mapped and populated at once: resident all the same (in the process's RSS, counted in the budget), without a copy."""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..jlm import JLMError, JLMFile, pread_into

__all__ = ["ROW_BLOCKS", "BlockReader", "Layout", "PagedRows", "Pager", "ReadStats"]

Layout = dict[str, list[str]]  # part name -> the file's tensors concatenated along dim 0 into that part
ROW_BLOCKS = ("embed",)  # blocks a forward reads by rows (token ids), so paging them reads only those rows
_MADV_POPULATE_READ = 22  # Linux 5.14: map a range's pages now, read-only (a private mapping's stay the file's)


@dataclass
class ReadStats:
    """What reading one block from the file has cost so far."""

    reads: int = 0
    bytes: int = 0
    seconds: float = 0.0


class BlockReader:
    """Reads a block's tensors from the .jlm with pread into parts laid out as the model wants them (q, k, v rows
    concatenated into one qkv part, say), with no copy beyond the read; or, for a part kept in memory, maps it (keep)."""

    _populate = True  # whether this kernel populates a mapping on request (below: else kept parts are read)

    def __init__(self, jlm: JLMFile):
        self.jlm = jlm
        self._fd = os.open(jlm.path, os.O_RDONLY)
        self.stats: dict[str, ReadStats] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def part_spec(self, names: list[str]) -> tuple[torch.dtype, tuple[int, ...]]:
        """The dtype and shape of a part: its tensors stacked along dim 0. Quantized tensors (rows of block bytes)
        whose rows differ in width, being of different types, stack as one run of bytes."""
        dtype, shape, _, _ = self.jlm.locate(names[0])
        rows = 0
        specs = [self.jlm.locate(n) for n in names]
        if dtype == torch.uint8 and any(s[1:] != shape[1:] for _, s, _, _ in specs) and all(d == dtype for d, *_ in specs):
            return dtype, (sum(size for *_, size in specs),)
        for n in names:
            d, s, _, _ = self.jlm.locate(n)
            if d != dtype or s[1:] != shape[1:]:
                raise JLMError(f"{self.jlm.path}: {n} ({d}, {list(s)}) does not stack with {names[0]} ({dtype}, {list(shape)})")
            rows += s[0] if s else 1
        return dtype, (rows, *shape[1:]) if shape else (rows,)

    def nbytes(self, layout: Layout) -> int:
        return sum(self.jlm.locate(n)[3] for names in layout.values() for n in names)

    def empty(self, layout: Layout) -> dict[str, torch.Tensor]:
        return {part: torch.empty(shape, dtype=dtype) for part, (dtype, shape) in ((p, self.part_spec(n)) for p, n in layout.items())}

    def read(self, block: str, layout: Layout, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Read every part of `layout` (into fresh tensors, or into `into`'s); counted against `block`."""
        t0 = time.perf_counter()
        out = into if into is not None else self.empty(layout)
        size = 0
        for part, names in layout.items():
            buf = _bytes_of(out[part])
            pos = 0
            for n in names:
                _, _, offset, nbytes = self.jlm.locate(n)
                self._pread(buf[pos : pos + nbytes], offset)
                pos += nbytes
            size += pos
        self._count(block, size, time.perf_counter() - t0)
        return out

    def keep(self, block: str, names: list[str]) -> torch.Tensor:
        """A part (the tensors `names`) to keep in memory: where it is quantized and its tensors lie end to end in the
        file, the file's bytes, mapped privately (never written back) and populated now, so no step waits on a fault;
        else read as `read` reads it. Mapping Qwen2.5-1.5B's kept blocks takes ~0.07 s where reading them took ~0.6 s
        (the reads fault in and fill fresh pages; the map takes the page cache's own); counted against `block`."""
        t0 = time.perf_counter()
        mapped = self._mapped(names)
        if mapped is None:
            return self.read(block, {"_": names})["_"]
        self._count(block, mapped.numel() * mapped.element_size(), time.perf_counter() - t0)
        return mapped

    def _mapped(self, names: list[str]) -> torch.Tensor | None:
        """The part of `names` as a view of the file, or None where it cannot be: not quantized (a float part may be
        rewritten in place into panels, which would copy every page), not one run of the file, or a kernel without
        MADV_POPULATE_READ (mapped unpopulated, the first step would fault the whole model in)."""
        if not BlockReader._populate:
            return None
        locs = [self.jlm.locate(n) for n in names]
        if any(dtype != torch.uint8 for dtype, *_ in locs) or any(a[2] + a[3] != b[2] for a, b in zip(locs, locs[1:])):
            return None
        offset, nbytes = locs[0][2], sum(size for *_, size in locs)
        if nbytes == 0:
            return None
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(self._fd, offset + nbytes - start, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        try:
            m.madvise(_MADV_POPULATE_READ, 0, len(m))
        except OSError:
            BlockReader._populate = False
            m.close()
            return None
        dtype, shape = self.part_spec(names)
        return torch.frombuffer(m, dtype=dtype, count=nbytes, offset=offset - start).view(shape)  # the tensor holds the map

    def rows(self, block: str, name: str, ids: list[int]) -> torch.Tensor:
        """Rows `ids` of a 2-D tensor, read one by one (the token embedding of a paged embed block)."""
        t0 = time.perf_counter()
        dtype, shape, offset, nbytes = self.jlm.locate(name)
        row = nbytes // shape[0]
        out = torch.empty((len(ids), *shape[1:]), dtype=dtype)
        buf = _bytes_of(out)
        for j, i in enumerate(ids):
            self._pread(buf[j * row : (j + 1) * row], offset + i * row)
        self._count(block, row * len(ids), time.perf_counter() - t0)
        return out

    def _count(self, block: str, nbytes: int, seconds: float) -> None:
        with self._lock:  # reads ahead run on the pager's thread
            s = self.stats.setdefault(block, ReadStats())
            s.reads += 1
            s.bytes += nbytes
            s.seconds += seconds

    def _pread(self, buf: memoryview, offset: int) -> None:
        pread_into(self._fd, buf, offset, f"{self.jlm.path}: the file ended while reading it (truncated since it was opened?)")


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor."""
    if t.numel() == 0:
        return memoryview(b"")
    return t.view(-1).view(torch.uint8).numpy().data.cast("B")


class PagedRows:
    """A token-embedding table left in the file: a lookup reads only the rows it needs."""

    def __init__(self, reader: BlockReader, block: str, name: str):
        self.reader, self.block, self.name = reader, block, name

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.reader.rows(self.block, self.name, ids.tolist())


Build = Callable[[str, dict[str, Any], bool], Any]  # (block name, parts, for one turn only) -> the runnable block


class Pager:
    """The host blocks of one model. The budget picks which stay resident (built once); the others are read into a
    small pool of buffers for their turn, the next one read ahead on the pager's thread while this one runs.

    Resident choice: the head first, then blocks from the last backwards, the embedding last (paged, it reads only
    a step's rows). A forward touches every block once per step in order, so a fixed resident set beats any cache
    that evicts: the paged ones cost one read each per step whatever is kept.
    """

    def __init__(self, reader: BlockReader, layouts: dict[str, Layout], budget: int | None = None, read_ahead: bool = True):
        self.reader = reader
        self.layouts = layouts
        self.build: Build = lambda name, parts, once: None  # set by the Placement that owns this pager
        if budget is not None:
            self.check_budget(budget)
        self.budget = budget  # None: every host block resident
        self.host: list[str] = []  # host blocks in model order
        self._paged: list[str] = []  # host blocks read for their turn, in model order
        self.resident: dict[str, Any] = {}  # name -> built block
        self._parts: dict[str, dict[str, torch.Tensor]] = {}  # the parts of resident blocks (a tied head shares the embedding's)
        self._rows: dict[str, Any] = {}  # built row-read blocks, for paged embeddings
        self._pool: dict[tuple, list[dict[str, torch.Tensor]]] = {}
        self._lent: dict[str, dict[str, torch.Tensor]] = {}
        self._ahead: tuple[str, Future] | None = None
        self._signatures: dict[str, tuple] = {}
        self._io = ThreadPoolExecutor(1, thread_name_prefix="pager") if read_ahead else None

    # -- sizes ----------------------------------------------------------------------------------

    def block_bytes(self, name: str) -> int:
        return self.reader.nbytes(self.layouts[name])

    def largest_layer(self) -> tuple[str, int]:
        """The biggest transformer block: a budget must hold at least one."""
        layers = [(n, self.block_bytes(n)) for n in self.layouts if n.startswith("blocks.")] or [(n, self.block_bytes(n)) for n in self.layouts]
        return max(layers, key=lambda x: x[1])

    def resident_bytes(self) -> int:
        """Bytes held by resident blocks, shared parts counted once."""
        seen: dict[int, int] = {}
        for parts in self._parts.values():
            for t in parts.values():
                seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())

    def unspent_bytes(self) -> int:
        """What the budget still lets the pager read into memory (0 without a budget: every host block is in)."""
        return 0 if self.budget is None else max(0, self.budget - self.resident_bytes())

    def working_bytes(self) -> int:
        """The pool's buffers: what paging holds besides the resident blocks (one block running, one read ahead)."""
        return sum(t.numel() * t.element_size() for sets in self._pool.values() for parts in sets for t in parts.values()) + sum(
            t.numel() * t.element_size() for parts in self._lent.values() for t in parts.values()
        )

    def check_budget(self, budget: int) -> None:
        name, size = self.largest_layer()
        if budget < size:
            raise ValueError(f"a page budget of {budget} bytes is below one block: {name} takes {size} bytes")

    # -- configuration --------------------------------------------------------------------------

    def set_budget(self, budget: int | None) -> None:
        """A new page budget (None: every host block resident); blocks are read in or dropped to fit it."""
        if budget is not None:
            self.check_budget(budget)
        self.budget = budget
        self.configure(self.host)

    def configure(self, host: list[str]) -> None:
        """Set the host blocks, then read in what should be resident and drop what should not."""
        self._settle_ahead()
        self.host = list(host)
        want = self._choose()
        for name in [n for n in self.resident if n not in want]:
            del self.resident[name], self._parts[name]
        for name in [n for n in self._rows if n not in self.host or n in want]:
            del self._rows[name]
        self._pool.clear()
        for name in want:
            if name not in self.resident:
                parts = self._read_resident(name)
                self._parts[name] = parts
                self.resident[name] = self.build(name, parts, False)
        self._paged = [n for n in self.host if n not in self.resident and n not in ROW_BLOCKS]

    def _choose(self) -> list[str]:
        """The host blocks to keep resident under the budget, in the order of preference, in model order."""
        order = [n for n in reversed(self.host) if n not in ROW_BLOCKS] + [n for n in self.host if n in ROW_BLOCKS]
        left = self.budget
        taken: set[tuple[str, ...]] = set()
        chosen: list[str] = []
        for name in order:
            parts = [tuple(names) for names in self.layouts[name].values()]
            cost = sum(self.reader.nbytes({"_": list(p)}) for p in parts if p not in taken)
            if left is None or cost <= left:
                chosen.append(name)
                taken.update(parts)
                if left is not None:
                    left -= cost
        return [n for n in self.host if n in chosen]

    def _read_resident(self, name: str) -> dict[str, torch.Tensor]:
        """A resident block's parts: read into memory, or taken from another resident block that holds them (a tied
        head's table is the embedding's). An untied token embedding is the file's own bytes, mapped: a step reads a
        few of its rows, so only the pages of tokens seen ever take memory (Qwen2.5-0.5B's table is 89 MB of Q4_K)."""
        shared = {tuple(self.layouts[n][p]): t for n, parts in self._parts.items() for p, t in parts.items()}
        out: dict[str, torch.Tensor] = {}
        for part, names in self.layouts[name].items():
            key = tuple(names)
            if key in shared:
                out[part] = shared[key]
            elif name in ROW_BLOCKS and len(names) == 1 and not self._read_elsewhere(name, key):
                out[part] = self.reader.jlm.tensor(names[0])
            else:
                out[part] = self.reader.keep(name, names)
        return out

    def _read_elsewhere(self, name: str, key: tuple[str, ...]) -> bool:
        """Whether a block other than `name` has a part of the same tensors (read whole at every step)."""
        return any(tuple(names) == key for n, layout in self.layouts.items() if n != name for names in layout.values())

    # -- a forward's turn -----------------------------------------------------------------------

    def acquire(self, name: str) -> Any:
        """The runnable block for its turn: resident, row-read, or read now (or already read ahead)."""
        if name in self.resident:
            return self.resident[name]
        if name in ROW_BLOCKS:
            if name not in self._rows:
                ((part, names),) = self.layouts[name].items()
                self._rows[name] = self.build(name, {part: PagedRows(self.reader, name, names[0])}, False)
            return self._rows[name]
        parts = None
        if self._ahead is not None:
            ahead, fut = self._ahead
            self._ahead = None
            got = fut.result()  # a failed read ahead raises here, in the forward that needed it
            if ahead == name:
                parts = got
            else:
                self._give_back(ahead, got)
        if parts is None:
            parts = self.reader.read(name, self.layouts[name], self._buffers(name))
        self._lent[name] = parts
        self._read_next(name)
        return self.build(name, parts, True)

    def release(self, name: str) -> None:
        """A paged block's turn is over: its buffers go back to the pool."""
        parts = self._lent.pop(name, None)
        if parts is not None:
            self._give_back(name, parts)

    def _read_next(self, name: str) -> None:
        """Read ahead the next paged block (wrapping to the next step's first) while this one runs."""
        if self._io is None:
            return
        paged = self._paged
        if len(paged) < 2 and name in paged:
            return  # one paged block: nothing else to read
        i = paged.index(name) if name in paged else -1
        nxt = paged[(i + 1) % len(paged)]
        into = self._buffers(nxt)
        self._ahead = (nxt, self._io.submit(self.reader.read, nxt, self.layouts[nxt], into))

    def _settle_ahead(self) -> None:
        if self._ahead is not None:
            name, fut = self._ahead
            self._ahead = None
            try:
                self._give_back(name, fut.result())
            except Exception:
                pass  # the read failed; nothing was lent

    def _signature(self, name: str) -> tuple:
        if name not in self._signatures:
            self._signatures[name] = tuple((p, *self.reader.part_spec(n)) for p, n in self.layouts[name].items())
        return self._signatures[name]

    def _buffers(self, name: str) -> dict[str, torch.Tensor]:
        free = self._pool.get(self._signature(name))
        return free.pop() if free else self.reader.empty(self.layouts[name])

    def _give_back(self, name: str, parts: dict[str, torch.Tensor]) -> None:
        self._pool.setdefault(self._signature(name), []).append(parts)

    def close(self) -> None:
        """Drop every block and buffer now (not when a reference cycle is next collected) and close the file."""
        self._settle_ahead()
        if self._io is not None:
            self._io.shutdown(wait=True)
        for held in (self.resident, self._parts, self._rows, self._pool, self._lent):
            held.clear()
        self.reader.close()

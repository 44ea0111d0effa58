"""Rank 0's side of a model's blocks on another rank: the model opened there from that rank's own copy of the .jlm,
its blocks held there, runs of them applied to the hidden state (which crosses the host seam as one tensor for every
row of the step), and the sessions' KV of those blocks carried there and back (engine/cluster/worker.py is the other side)."""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from ..jlm import JLMFile
from ..kv import RowSpan, SessionKV
from .link import Link, RankError

__all__ = ["RemoteModel", "RemoteRun", "fingerprint"]

_HANDLES = itertools.count(1)
_READ_RATE = 50e6  # bytes/s a worker is given at least to read and build the blocks it is asked to hold


def fingerprint(jlm: JLMFile) -> str:
    """What identifies a model's weights across hosts: its arch, config and every tensor's name, dtype and shape (two
    copies of one .jlm agree; a different model or conversion does not)."""
    tensors = [[n, *map(str, jlm.locate(n)[:2])] for n in sorted(jlm.names)]
    doc = json.dumps({"arch": jlm.arch, "config": jlm.config, "tensors": tensors}, sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


@dataclass
class SeamFigures:
    """What the calls over one host seam cost: how many, their time there and back, the part the rank computed, and
    the hidden-state bytes each way (bench/pipeline.py reads them)."""

    calls: int = 0
    seconds: float = 0.0
    compute_seconds: float = 0.0
    bytes_out: int = 0
    bytes_back: int = 0

    def crossed(self, seconds: float, compute: float, out: int, back: int) -> None:
        self.calls += 1
        self.seconds += seconds
        self.compute_seconds += compute
        self.bytes_out += out
        self.bytes_back += back


class RemoteModel:
    """One loaded model's blocks on one other rank. Only the model's engine thread calls it (the link serializes it
    with other models' calls to that rank); `forget` may run on any thread (a session KV collected)."""

    def __init__(self, link: Link, handle: int):
        self.link = link
        self.handle = handle
        self._forgotten: list[int] = []
        self._lock = threading.Lock()
        self._known: set[int] = set()  # KV keys the rank may hold layers of
        self.seam = SeamFigures()

    @classmethod
    def open(cls, link: Link, path: str, source: str | None, jlm: JLMFile, dtype: torch.dtype, kv_dtype: torch.dtype) -> RemoteModel:
        """Open the model on `link`'s rank: `path` (the .jlm, relative to -models there, or absolute), else `source`
        (the .gguf it was converted from, converted there too); its fingerprint must be this one's."""
        handle = next(_HANDLES)
        doc = {"model": handle, "path": path, "source": source, "fingerprint": fingerprint(jlm), "dtype": _name(dtype), "kv_dtype": _name(kv_dtype)}
        link.call("open", doc, timeout=max(link.timeout, 900.0))  # a .gguf converts there first (minutes for a big one)
        return cls(link, handle)

    def hold(self, names: list[str], device: str, nbytes: int) -> None:
        """Read and build blocks `names` on the rank's `device` (its own name there: cpu, cuda:0)."""
        self.link.call("hold", {"model": self.handle, "blocks": names, "device": device}, timeout=self.link.timeout + nbytes / _READ_RATE)

    def drop(self, names: list[str]) -> None:
        self.link.call("drop", {"model": self.handle, "blocks": names})

    def run(self, first: int, last: int, x: torch.Tensor, positions: torch.Tensor, rows: list[RowSpan], keep: list[int] | None) -> torch.Tensor:
        """Layers first..last over the packed hidden state x [T, hidden] (every row of the step in one tensor), each
        row's K/V written into its session's layers there. -> the hidden state after `last` (on the CPU)."""
        spec = []
        for r in rows:
            self._note(r.kv)
            spec.append([r.kv.key, r.start, r.num_tokens, r.kv.length, r.prompt, r.kv.capacity, r.short, r.many])
        doc = {"model": self.handle, "first": first, "last": last, "rows": spec, "keep": keep, "free": self._take_forgotten()}
        t0 = time.perf_counter()
        answer, (out,) = self.link.call("run", doc, [x, positions])
        self.seam.crossed(time.perf_counter() - t0, float(answer.get("seconds", 0.0)), x.nbytes + positions.nbytes, out.nbytes)
        return out

    def put_kv(self, kv: SessionKV, layer: int, filled: tuple[int, torch.Tensor, torch.Tensor], device: str) -> None:
        """Send one layer's K/V of a session (`filled`: its first position, K and V [Hkv, n, D]) to the rank, where the
        layer's block now is."""
        self._note(kv)
        start, k, v = filled
        doc = {"model": self.handle, "key": kv.key, "capacity": kv.capacity, "length": kv.length, "layer": layer, "start": start, "device": device}
        self.link.call("kv_put", doc, [k, v])

    def take_kv(self, kv: SessionKV, layer: int) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """One layer's K/V of a session back from the rank (its first position, K, V); None where it never held them."""
        if kv.key not in self._known:
            return None
        answer, tensors = self.link.call("kv_take", {"model": self.handle, "key": kv.key, "layer": layer, "length": kv.length})
        return (int(answer["start"]), tensors[0], tensors[1]) if answer.get("found") else None

    def copy_kv(self, src: SessionKV, dst: SessionKV, length: int) -> None:
        """dst's layers there become a copy of src's first `length` positions (kv.copy_from: a prompt run once for
        several replies)."""
        if src.key not in self._known:
            return
        self._note(dst)
        self.link.call("kv_copy", {"model": self.handle, "src": src.key, "dst": dst.key, "length": length, "capacity": dst.capacity})

    def _note(self, kv: SessionKV) -> None:
        if kv.key not in self._known:
            self._known.add(kv.key)
            kv.remotes.add(self)
            weakref.finalize(kv, self.forget, kv.key)

    def forget(self, key: int) -> None:
        """A session KV is gone: the rank lets its layers go with the next call."""
        with self._lock:
            self._forgotten.append(key)

    def _take_forgotten(self) -> list[int]:
        with self._lock:
            out, self._forgotten = self._forgotten, []
        self._known.difference_update(out)
        return out

    def close(self) -> None:
        """Let the model go there (its blocks and KV); a rank that is gone has let it go already."""
        try:
            self.link.call("close", {"model": self.handle})
        except (RankError, ValueError):
            pass


class RemoteRun:
    """A run of consecutive layers on one other rank's device, as the forward sees it: one call over the seam."""

    def __init__(self, remote: RemoteModel, first: int, last: int):
        self.remote = remote
        self.first = first
        self.last = last

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, rows: list[RowSpan], keep: list[int] | None) -> torch.Tensor:
        return self.remote.run(self.first, self.last, x, positions, rows, keep)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

"""A worker rank (`jitllmd worker`): holds blocks of rank 0's models, read from its own copy of each .jlm, and those
blocks' KV of each session; runs a run of its blocks over the hidden state rank 0 sends and sends the result back.
Commands come one at a time over the pair group with rank 0 (engine/cluster/link.py); engine/cluster/remote.py is rank 0's side."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..jlm import JLMFile
from ..kv import META, RowSpan, SessionKV
from ..memory.devices import local_device_figures, release_host_memory
from ..memory.pager import BlockReader
from ..models import build_model
from .link import FOREVER, Channel, _first_line
from .remote import fingerprint

__all__ = ["Worker"]

log = logging.getLogger("jitllmd.worker")


class _Model:
    """One of rank 0's models, as this rank holds it: some of its blocks, and their KV of each session (by key)."""

    def __init__(self, jlm: JLMFile, dtype: torch.dtype, kv_dtype: torch.dtype):
        self.jlm = jlm
        self.model = build_model(jlm, dtype, torch.device("cpu"))  # a decoder without its blocks
        self.model.kv_dtype = kv_dtype  # as rank 0's: KV crosses in both directions
        self.reader = BlockReader(jlm)
        self.blocks: dict[int, tuple[Any, torch.device]] = {}  # layer -> (block, device)
        self.kvs: dict[int, SessionKV] = {}
        self.pool = self.model.kv_pool(self.layer_devices())  # its layers' pages; those of layers held elsewhere on meta

    def layer_devices(self) -> list[torch.device]:
        return [self.blocks[i][1] if i in self.blocks else META for i in range(self.model.cfg.num_layers)]

    def kv(self, key: int, capacity: int) -> SessionKV:
        kv = self.kvs.get(key)
        if kv is None:
            kv = self.kvs[key] = SessionKV(self.pool, capacity)
        return kv

    def close(self) -> None:
        self.blocks.clear()
        self.kvs.clear()
        self.reader.close()


class Worker:
    """Answers rank 0's commands until rank 0 goes away. `models_dir`: where a model's relative path is found (as on
    rank 0); `cache_dir`: where a .gguf this rank must convert itself goes."""

    def __init__(self, models_dir: Path, cache_dir: Path, timeout: float = 30.0):
        self.models_dir = models_dir.resolve()
        self.cache_dir = cache_dir
        self.timeout = timeout
        self.models: dict[int, _Model] = {}
        self.commands = 0

    def serve(self, pg: Any) -> str:
        """Answer commands one at a time. -> why it stopped (rank 0 left, or stopped answering)."""
        channel = Channel(pg, 0)
        try:
            while True:
                try:
                    doc, tensors = channel.recv(FOREVER)
                except RuntimeError as exc:
                    return _first_line(exc)
                try:
                    with torch.inference_mode():
                        answer, out = self.handle(doc, tensors)
                except Exception as exc:  # the command's error goes back to rank 0, in one line
                    if not isinstance(exc, (ValueError, OSError)):
                        log.exception("%s failed", doc.get("op"))
                    answer, out = {"error": _first_line(exc) if isinstance(exc, (ValueError, OSError)) else f"internal error: {type(exc).__name__}: {exc}"}, []
                self.commands += 1
                try:
                    channel.send(answer, out, timedelta(seconds=self.timeout))
                except RuntimeError as exc:
                    return _first_line(exc)
                if doc.get("op") == "bye":
                    return "it let this rank go"
        finally:
            for m in self.models.values():
                m.close()
            self.models.clear()
            release_host_memory()

    def handle(self, doc: dict[str, Any], tensors: list[torch.Tensor]) -> tuple[dict[str, Any], list[torch.Tensor]]:
        op = doc.get("op")
        if op == "bye":
            return {}, []
        if op == "info":
            return {"devices": local_device_figures()}, []
        if op == "open":
            return self._open(doc), []
        m = self.models.get(int(doc.get("model", 0)))
        if m is None:
            raise ValueError(f"no model {doc.get('model')} open here (it was closed, or this rank restarted)")
        if op == "hold":
            return self._hold(m, doc["blocks"], torch.device(doc["device"])), []
        if op == "drop":
            for name in doc["blocks"]:
                m.blocks.pop(_layer(name), None)
                m.pool.move(_layer(name), META)
            release_host_memory()
            return {}, []
        if op == "run":
            t0 = time.perf_counter()
            out = self._run(m, doc, tensors[0], tensors[1])
            return {"seconds": time.perf_counter() - t0}, [out]  # the compute: rank 0 tells the seam's cost from it
        if op == "kv_put":
            kv = m.kv(doc["key"], doc["capacity"])
            length, layer = int(doc["length"]), int(doc["layer"])
            if kv.length < length:
                kv.reserve(length)
            kv.length = length
            kv.move(layer, torch.device(doc["device"]), (int(doc["start"]), tensors[0], tensors[1]))
            return {}, []
        if op == "kv_take":
            held = m.kvs.get(doc["key"])
            layer = int(doc["layer"])
            if held is None or held.devices[layer] == META:
                return {"found": False}, []
            held.truncate(min(held.length, int(doc["length"])))
            k, v = (t.clone() for t in held.filled(layer))
            return {"found": True, "start": held.start(layer)}, [k, v]
        if op == "kv_copy":
            src = m.kvs.get(doc["src"])
            if src is not None:
                m.kv(doc["dst"], doc["capacity"]).copy_from(src, int(doc["length"]))
            return {}, []
        if op == "close":
            self.models.pop(int(doc["model"])).close()
            release_host_memory()
            return {}, []
        raise ValueError(f"unknown command {op!r}")

    def _resolve(self, name: str) -> Path:
        given = Path(name)
        return given if given.is_absolute() else self.models_dir / given

    def _open(self, doc: dict[str, Any]) -> dict[str, Any]:
        path = self._resolve(doc["path"])
        if not path.is_file() and doc.get("source"):
            from ..loader import cached_conversion

            source = self._resolve(doc["source"])
            if not source.is_file():
                raise ValueError(f"{doc['source']}: no such model file in {self.models_dir} (each rank needs its own copy, at the same -models path)")
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            path = cached_conversion(source, self.cache_dir)
        if not path.is_file():
            raise ValueError(f"{doc['path']}: no such model file in {self.models_dir} (each rank needs its own copy, at the same -models path)")
        jlm = JLMFile(path)
        if fingerprint(jlm) != doc["fingerprint"]:
            raise ValueError(f"{doc['path']}: this rank's copy is not rank 0's model (its config or tensors differ)")
        self.models[int(doc["model"])] = _Model(jlm, getattr(torch, doc["dtype"]), getattr(torch, doc["kv_dtype"]))
        log.info("opened %s for rank 0", path.name)
        return {}

    def _hold(self, m: _Model, names: list[str], device: torch.device) -> dict[str, Any]:
        for name in names:
            layer = _layer(name)
            m.blocks.pop(layer, None)  # on another of this rank's devices before: let it go first
            parts = {part: t.to(device) for part, t in m.reader.read(name, m.model.layouts[name]).items()}
            m.blocks[layer] = (m.model.build(name, parts, device, False), device)
        for name in names:  # their layers' pages come here too
            m.pool.move(_layer(name), device)
        return {}

    def _run(self, m: _Model, doc: dict[str, Any], x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        for key in doc.get("free") or []:
            m.kvs.pop(key, None)
        first, last = int(doc["first"]), int(doc["last"])
        missing = [i for i in range(first, last + 1) if i not in m.blocks]
        if missing:
            raise ValueError(f"layers {missing} are not held here")
        rows = []
        for key, start, n, length, prompt, capacity, short, many in doc["rows"]:
            kv = m.kv(key, capacity)
            if kv.length != length:
                if length > kv.length:
                    raise ValueError(f"session KV {key} is at {kv.length} positions here, {length} on rank 0")
                kv.truncate(length)  # rank 0 rewound it (prefix reuse, a reset): what follows is written again
            for i in range(first, last + 1):
                if kv.devices[i] != m.blocks[i][1]:
                    m.pool.move(i, m.blocks[i][1])
            rows.append(RowSpan(int(start), int(n), kv, bool(prompt), bool(short), bool(many)))
        for row in rows:
            row.kv.reserve(row.kv.length + row.num_tokens)
            row.begin()
        keep = doc.get("keep")
        state = m.model.begin(positions)
        num_layers = m.model.cfg.num_layers
        for i in range(first, last + 1):
            block, device = m.blocks[i]
            x = block(x.to(device), state, rows, keep if i == num_layers - 1 else None)
        for row in rows:
            row.kv.length += row.num_tokens
        return x


def _layer(name: str) -> int:
    if not name.startswith("blocks."):
        raise ValueError(f"{name}: only transformer layers go to another rank (embed and head stay on rank 0)")
    return int(name.split(".", 1)[1])

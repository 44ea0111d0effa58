"""Sessions saved and restored: a session's K/V, tokens and conversation as one safetensors file (docs/format.md), for
the model it came from and no other."""

from __future__ import annotations

import json
from typing import Any

import torch

from .cluster.remote import fingerprint
from .kv import META
from .loader import LoadedModel
from .pages import Q8_0, dequantize_q8
from .sessions import Session

__all__ = ["FORMAT", "VERSION", "SavedSession", "dump", "identity", "load", "restore_into", "room_for"]

FORMAT = "jitllmd-session"
VERSION = 1
_KEY = "jitllmd"  # the safetensors metadata key holding the JSON document


class SavedSession:
    """A session file read back: its document (what `dump` wrote) and its K/V tensors by layer."""

    def __init__(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]):
        self.meta = meta
        self.tensors = tensors

    @property
    def model(self) -> dict[str, Any]:
        return self.meta["model"]

    @property
    def length(self) -> int:
        return int(self.meta["length"])


def identity(loaded: LoadedModel) -> dict[str, str]:
    """What a session file names its model by: the name it is served as, its file and its weights' fingerprint."""
    return {"name": loaded.name, "file": loaded.path.name, "fingerprint": fingerprint(loaded.jlm)}


def room_for(saved: SavedSession, loaded: LoadedModel, mine: dict[str, str]) -> int:
    """The room a session restored into `loaded` (whose identity is `mine`) gets: the saved one's, within the model's
    context. ValueError where the file is another model's, or longer than this one's context."""
    theirs = saved.model
    if theirs.get("fingerprint") != mine["fingerprint"]:
        raise ValueError(f"the session was saved from {theirs.get('file')} (weights {theirs.get('fingerprint')}); model {loaded.name} is "
                         f"{mine['file']} (weights {mine['fingerprint']})")
    if saved.length > loaded.context_length:
        raise ValueError(f"the session holds {saved.length} positions; model {loaded.name}'s context is {loaded.context_length}")
    return min(loaded.context_length, max(saved.length, int(saved.meta.get("capacity", 0))))


def dump(session: Session, model: dict[str, Any]) -> bytes:
    """The session as a file's bytes: per layer its K and V from the first position it holds, in the cache's dtype;
    its tokens and conversation; `model`, what identifies the model (name, file, fingerprint). A session whose pages
    are out of the pool (kv_spill.py) is read where they are."""
    import safetensors.torch

    kv = session.kv
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(kv.num_layers):
        if kv.devices[layer] == META:
            raise ValueError(f"session {session.id}: layer {layer} is held by another rank; only a session whose layers are all here can be saved")
        k, v = kv.filled(layer, raw=True)
        tensors[f"k.{layer}"], tensors[f"v.{layer}"] = k.contiguous().cpu(), v.contiguous().cpu()
    doc = {
        "format": FORMAT, "version": VERSION, "id": session.id, "model": model, "dtype": _dtype_name(kv.dtype),
        "length": kv.length, "capacity": kv.capacity, "starts": [kv.start(i) for i in range(kv.num_layers)],
        "num_kv_heads": kv.num_kv_heads, "head_dim": kv.head_dim, "token_ids": list(session.token_ids), "messages": list(session.messages),
    }
    return safetensors.torch.save(tensors, metadata={_KEY: json.dumps(doc)})


def load(data: bytes) -> SavedSession:
    """A session file's bytes read and checked (ValueError with what is wrong: not a session file, another version,
    tensors that disagree with the document)."""
    import safetensors.torch

    if len(data) < 8:
        raise ValueError("not a jitllmd session file: too short")
    size = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + size]) if 8 + size <= len(data) else None
        doc = json.loads(header["__metadata__"][_KEY]) if isinstance(header, dict) else None
    except (ValueError, KeyError, TypeError):
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError("not a jitllmd session file (sessions -save writes one)")
    if doc.get("version") != VERSION:
        raise ValueError(f"a session file of version {doc.get('version')}; this jitllmd reads version {VERSION}")
    try:
        tensors = safetensors.torch.load(data)
        length, starts, token_ids = int(doc["length"]), [int(s) for s in doc["starts"]], [int(t) for t in doc["token_ids"]]
        heads, dim = int(doc["num_kv_heads"]), int(doc["head_dim"])
        doc["messages"] = [{"role": str(m["role"]), "content": str(m["content"])} for m in doc.get("messages") or []]
        if not isinstance(doc.get("model"), dict):
            raise ValueError("no model")
    except Exception as exc:  # safetensors' own errors among them
        raise ValueError(f"a damaged session file: {exc}") from None
    if len(token_ids) != length or not 0 <= length <= int(doc["capacity"]):
        raise ValueError(f"a damaged session file: {len(token_ids)} tokens for {length} positions")
    row = dim + dim // 16 if doc.get("dtype") == "q8_0" else dim
    for layer, start in enumerate(starts):
        for name in (f"k.{layer}", f"v.{layer}"):
            t = tensors.get(name)
            if t is None or tuple(t.shape) != (heads, length - start, row) or not 0 <= start <= length:
                raise ValueError(f"a damaged session file: {name} is not [{heads}, {length - start}, {row}]")
    doc["token_ids"] = token_ids
    return SavedSession(doc, tensors)


def _dtype_name(dtype: torch.dtype) -> str:
    return "q8_0" if dtype == Q8_0 else str(dtype).removeprefix("torch.")


def _as(t: torch.Tensor, saved: str, dtype: torch.dtype, dim: int) -> torch.Tensor:
    """Saved K/V for a cache of `dtype`: as they are where the dtypes agree, else through f32."""
    if saved == _dtype_name(dtype):
        return t
    t = dequantize_q8(t, dim) if saved == "q8_0" else t.float()
    return t if dtype == Q8_0 else t.to(dtype)  # a q8_0 cache quantizes floats as it writes them


@torch.inference_mode()
def restore_into(session: Session, saved: SavedSession) -> None:
    """Fill an empty session (of the saved one's model, with room for it) with the saved K/V, tokens and conversation."""
    kv, doc = session.kv, saved.meta
    if (doc["num_kv_heads"], doc["head_dim"], len(doc["starts"])) != (kv.num_kv_heads, kv.head_dim, kv.num_layers):
        raise ValueError("the session file's K/V do not fit this model's layers")
    if saved.length > kv.capacity:
        raise ValueError(f"the session holds {saved.length} positions; this one has room for {kv.capacity}")
    session.reset()
    kv.reserve(saved.length)
    kv.length = saved.length
    for layer, start in enumerate(doc["starts"]):
        if kv.devices[layer] != META:  # a layer on another rank: its K/V are that rank's (not saved from there)
            kv.put(layer, start, *(_as(saved.tensors[f"{kind}.{layer}"], doc["dtype"], kv.dtype, kv.head_dim) for kind in "kv"))
    kv.trim()
    session.token_ids[:] = doc["token_ids"]
    session.messages[:] = doc["messages"]

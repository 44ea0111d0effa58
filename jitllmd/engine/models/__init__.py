"""Model families, one file each, and the registry that picks one by .jlm arch, HF model_type or GGUF architecture."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from ..jlm import JLMFile
from ..pages import PagePool
from . import bert, gemma3, llama
from .family import Family

__all__ = ["FAMILIES", "DecoderModel", "EncoderModel", "Family", "build_model", "family_for", "family_for_gguf", "family_for_hf"]


class DecoderModel(Protocol):
    """What the engine needs of a decoder family: its blocks' parts and how to build each on a device (engine/runner.py
    runs them where the placement holds them; the family never asks where), what a forward's blocks share, and KV."""

    cfg: Any  # with num_layers, num_kv_heads, head_dim, hidden_size, vocab_size
    dtype: torch.dtype
    act: torch.dtype  # the dtype of attention and KV
    layouts: dict[str, dict[str, list[str]]]

    def build(self, name: str, parts: dict[str, Any], device: torch.device, once: bool = False) -> Any: ...

    def begin(self, positions: torch.Tensor) -> Any: ...

    def kv_pool(self, devices: list[torch.device] | None = None, pages: list[int] | None = None, limit: int | None = None) -> PagePool: ...


class EncoderModel(Protocol):
    """What the engine needs of an encoder family: a batch of token-id lists in, one pooled f32 vector per list out."""

    cfg: Any
    dtype: torch.dtype
    device: torch.device

    def embed(self, batch: list[list[int]]) -> torch.Tensor: ...

    def weight_nbytes(self) -> int: ...

    @property
    def scores_pairs(self) -> bool: ...  # a cross-encoder: its lists are pairs, its vectors their scores


# Every family, one line each: a new family is a new file in this folder and its FAMILY here.
FAMILIES: tuple[Family, ...] = (llama.FAMILY, gemma3.FAMILY, bert.FAMILY)


def family_for(arch: str) -> Family:
    """The family that runs a .jlm's arch; ValueError naming the supported ones."""
    return _lookup("arch", arch, lambda f: f.archs)


def family_for_hf(model_type: Any) -> Family:
    """The family whose Hugging Face directories have this config.json model_type; ValueError naming the supported ones."""
    return _lookup("model_type", model_type, lambda f: f.hf.model_types if f.hf is not None else ())


def family_for_gguf(architecture: Any) -> Family:
    """The family whose GGUF files have this general.architecture; ValueError naming the supported ones."""
    return _lookup("GGUF architecture", architecture, lambda f: f.gguf.archs if f.gguf is not None else ())


def _lookup(what: str, key: Any, names: Callable[[Family], Iterable[str]]) -> Family:
    for family in FAMILIES:
        if key in names(family):
            return family
    supported = sorted(n for f in FAMILIES for n in names(f))
    raise ValueError(f"{what} {key!r} is not supported (supported: {', '.join(supported)})")


def build_model(jlm: JLMFile, dtype: torch.dtype, device: torch.device, on_progress: Callable[[int, int], None] | None = None) -> Any:
    """The model a .jlm describes, computing in `dtype`: an encoder built whole on `device`; a decoder without its
    blocks, which the loader places (engine/memory/placement.py)."""
    try:
        family = family_for(jlm.arch)
    except ValueError as exc:
        raise ValueError(f"{jlm.path}: {exc}") from None
    try:
        return family.build(jlm.config, jlm, dtype, device, on_progress)
    except ValueError as exc:  # its config refused (a field missing or out of range): named with the file
        raise exc if str(exc).startswith(str(jlm.path)) else ValueError(f"{jlm.path}: {exc}") from None

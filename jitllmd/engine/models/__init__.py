"""Model families, one file each, and the registry that picks one by the .jlm's arch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..jlm import JLMFile
from ..kv import RowSpan, SessionKV
from . import bert, llama

__all__ = ["ENCODER_ARCHS", "FAMILIES", "DecoderModel", "EncoderModel", "build_model"]


class DecoderModel(Protocol):
    """What the engine needs of a decoder family: its blocks' parts and how to build each (placement puts them on
    their places and pages the host ones), one forward over a packed batch, and session KV."""

    cfg: Any
    dtype: torch.dtype
    act: torch.dtype  # the dtype of activations and KV
    device: torch.device
    layouts: dict[str, dict[str, list[str]]]
    placement: Any

    def build(self, name: str, parts: dict[str, Any], device: torch.device, once: bool = False) -> Any: ...

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, rows: list[RowSpan], logits_at: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def new_kv(self, capacity: int) -> SessionKV: ...

    def weight_nbytes(self) -> int: ...


class EncoderModel(Protocol):
    """What the engine needs of an encoder family: a batch of token-id lists in, one pooled f32 vector per list out."""

    cfg: Any
    dtype: torch.dtype
    device: torch.device

    def embed(self, batch: list[list[int]]) -> torch.Tensor: ...

    def weight_nbytes(self) -> int: ...


# arch -> (config class, model class)
FAMILIES: dict[str, tuple[Any, Any]] = {arch: (llama.LlamaConfig, llama.LlamaModel) for arch in llama.ARCHS}
FAMILIES.update({arch: (bert.BertConfig, bert.BertModel) for arch in bert.ARCHS})
# the arches whose models embed (EncoderModel) rather than generate (DecoderModel)
ENCODER_ARCHS = frozenset(bert.ARCHS)


def build_model(jlm: JLMFile, dtype: torch.dtype, device: torch.device, on_progress: Callable[[int, int], None] | None = None) -> Any:
    """The model a .jlm describes, computing in `dtype`: an encoder built whole on `device`; a decoder without its
    blocks, which the loader places (engine/placement.py)."""
    if jlm.arch not in FAMILIES:
        raise ValueError(f"{jlm.path}: arch {jlm.arch!r} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    config_cls, model_cls = FAMILIES[jlm.arch]
    if jlm.arch in ENCODER_ARCHS:
        return model_cls(config_cls.from_dict(jlm.config), jlm, dtype, device, on_progress)
    return model_cls(config_cls.from_dict(jlm.config), jlm, dtype)

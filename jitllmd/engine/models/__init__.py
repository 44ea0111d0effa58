"""Model families, one file each, and the registry that picks one by the .jlm's arch."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..jlm import JLMFile
from . import llama

__all__ = ["FAMILIES", "build_model"]

# arch -> (config class, model class)
FAMILIES: dict[str, tuple[type, type]] = {arch: (llama.LlamaConfig, llama.LlamaModel) for arch in llama.ARCHS}


def build_model(
    jlm: JLMFile,
    dtype: torch.dtype,
    device: torch.device,
    on_progress: Callable[[int, int], None] | None = None,
):
    """Build the model a .jlm describes, computing in `dtype` on `device`."""
    if jlm.arch not in FAMILIES:
        raise ValueError(f"{jlm.path}: arch {jlm.arch!r} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    config_cls, model_cls = FAMILIES[jlm.arch]
    return model_cls(config_cls.from_dict(jlm.config), jlm, dtype, device, on_progress)

"""Hugging Face model directory (config.json, *.safetensors, tokenizer files) -> .jlm."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import torch

from ..jlm import TensorSpec
from .source import ConvertError, Source, block_order

__all__ = ["is_hf_dir", "read_hf"]

_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConvertError(f"{path}: cannot read ({exc})") from None


def _token_str(v: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def _config(hf: dict[str, Any], path: Path) -> dict[str, Any]:
    arch = hf.get("model_type")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    # transformers 5 keeps rope settings in rope_parameters; older configs use rope_theta + rope_scaling.
    rope = hf.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    sliding = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "mistral") else None
    return {
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(hf["intermediate_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(hf.get("head_dim") or hidden // heads),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": int(hf.get("max_position_embeddings", 4096)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention_bias": arch == "qwen2" or bool(hf.get("attention_bias", False)),
        "qk_norm": arch == "qwen3",
        "sliding_window": sliding,
    }


def _jlm_name(name: str) -> str | None:
    if name == "model.embed_tokens.weight":
        return "embed.weight"
    if name == "model.norm.weight":
        return "head.norm.weight"
    if name == "lm_head.weight":
        return "head.lm_head.weight"
    if m := _LAYER.fullmatch(name):
        return f"blocks.{m.group(1)}.{m.group(2)}"
    return None


def read_hf(path: Path, dtype: torch.dtype) -> Source:
    """Describe the .jlm a Hugging Face directory becomes; tensors are read from its safetensors when written."""
    from safetensors import safe_open

    hf = _read_json(path / "config.json")
    arch = hf.get("model_type")
    if arch not in _ARCHS:
        raise ConvertError(f"{path}: model_type {arch!r} is not supported (supported: {', '.join(_ARCHS)})")
    try:
        config = _config(hf, path)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConvertError(f"{path}/config.json: missing or bad field {exc}") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{path}: no *.safetensors files")
    specs: list[TensorSpec] = []
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
            names = list(handle.keys())
        except Exception as exc:  # safetensors raises its own error types on a damaged file
            raise ConvertError(f"{file}: not a readable safetensors file ({exc})") from None
        for name in names:
            target = _jlm_name(name)
            if target is None or (target == "head.lm_head.weight" and config["tie_word_embeddings"]):
                continue
            shape = tuple(handle.get_slice(name).get_shape())
            specs.append(
                TensorSpec(target, dtype, shape, functools.partial(_read, handle, name, dtype))
            )
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConvertError(f"{path}: no tokenizer.json")
    tokenizer_json = tokenizer_file.read_text(encoding="utf-8")
    tcfg = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: the default one is the chat template
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    bos, eos = _token_str(tcfg.get("bos_token")), _token_str(tcfg.get("eos_token"))
    vocab = _vocab(tokenizer_json)
    eos_ids = [vocab[eos]] if eos in vocab else []
    gen = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    extra = gen.get("eos_token_id", hf.get("eos_token_id"))
    for i in extra if isinstance(extra, list) else [extra]:
        if isinstance(i, int) and i not in eos_ids:
            eos_ids.append(i)
    if not eos_ids:
        raise ConvertError(f"{path}: no end-of-sequence token (tokenizer_config.json eos_token or generation_config.json)")
    specs.sort(key=block_order)
    return Source(
        arch=arch,
        config=config,
        tensors=specs,
        tokenizer_json=tokenizer_json,
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=eos_ids,
        add_bos_token=bool(tcfg.get("add_bos_token", False)),
        chat_template=template,
        source={"kind": "hf", "dir": path.name, "model_type": arch},
    )


def _vocab(tokenizer_json: str) -> dict[str, int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json).get_vocab(with_added_tokens=True)


def _read(handle, name: str, dtype: torch.dtype) -> torch.Tensor:
    return handle.get_tensor(name).to(dtype)

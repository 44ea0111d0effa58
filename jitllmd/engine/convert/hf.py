"""Hugging Face model directory (config.json, *.safetensors, tokenizer files) -> .jlm; the family maps config and names."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..jlm import TensorSpec
from ..models import Family, family_for_hf
from ..models.family import TensorFix
from .source import ConvertError, Source, block_order, naming

__all__ = ["is_hf_dir", "read_hf"]

# sentence-transformers' 1_Pooling/config.json flags -> the .jlm's pooling
_POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


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


def read_hf(path: Path, dtype: torch.dtype) -> Source:
    """Describe the .jlm a Hugging Face directory becomes; tensors are read from its safetensors when written."""
    hf = _read_json(path / "config.json")
    model_type = hf.get("model_type")
    family = naming(path, lambda: family_for_hf(model_type))
    assert family.hf is not None
    hf_source = family.hf
    config = _config(path, family, hf)

    def fix(name: str) -> TensorFix | None:
        return hf_source.fix(name, config) if hf_source.fix is not None else None

    specs = _tensor_specs(path, dtype, lambda n: hf_source.tensor_name(n, config), fix)
    if hf_source.required is not None:
        have = {s.name for s in specs}
        missing = [n for n in hf_source.required(config) if n not in have]
        if missing:
            raise ConvertError(f"{path}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
    tokenizer_json = _tokenizer_json(path)
    tcfg = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    arch = hf_source.model_types[model_type]
    origin = {"kind": "hf", "dir": path.name, "model_type": model_type}
    if family.embeds:
        tokenizer_json, special = _encoder_tokenizer(path, tokenizer_json, tcfg, pairs=bool(config.get("num_labels")))
        return Source(
            arch=arch,
            config=config,
            tensors=specs,
            tokenizer_json=tokenizer_json,
            bos_token=None,
            eos_token=None,
            eos_token_ids=[],
            add_bos_token=False,
            chat_template=None,
            source=origin,
            special_tokens=special,
            embeds=True,
        )
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
        source=origin,
    )


def _config(path: Path, family: Family, hf: dict[str, Any]) -> dict[str, Any]:
    """The family's .jlm config from config.json (an embedding model's with its sentence-transformers settings), checked."""
    assert family.hf is not None
    try:
        config = family.hf.config(hf)
    except (KeyError, TypeError) as exc:
        raise ConvertError(f"{path}/config.json: missing or bad field {exc}") from None
    except ValueError as exc:
        raise ConvertError(f"{path}/config.json: {exc}") from None
    if family.embeds:
        config |= _sentence_transformers(path, config["max_position_embeddings"])
    try:
        family.config(config)
    except ValueError as exc:
        raise ConvertError(f"{path}: {exc}") from None
    return config


def _tensor_specs(path: Path, dtype: torch.dtype, rename: Callable[[str], str | None], fix: Callable[[str], TensorFix | None]) -> list[TensorSpec]:
    """Every tensor of the directory's safetensors files that `rename` maps to a .jlm name, in block order; one the
    family fixes (`fix`) is fixed in f32 and kept in f32."""
    from safetensors import safe_open

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
            target = rename(name)
            if target is None:
                continue
            shape = tuple(handle.get_slice(name).get_shape())
            change = fix(target)
            if change is None:
                specs.append(TensorSpec(target, dtype, shape, functools.partial(_read, handle, name, dtype)))
            else:
                specs.append(TensorSpec(target, torch.float32, shape, functools.partial(_read_fixed, handle, name, change)))
    specs.sort(key=block_order)
    return specs


def _tokenizer_json(path: Path) -> str:
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConvertError(f"{path}: no tokenizer.json")
    return tokenizer_file.read_text(encoding="utf-8")


# -- embedding models: sentence-transformers settings, an encoder's tokenizer ------------------------------------------


def _sentence_transformers(path: Path, positions: int) -> dict[str, Any]:
    """pooling, normalize and max_seq_length from a sentence-transformers layout (modules.json, 1_Pooling/,
    sentence_bert_config.json); a plain encoder directory (a BertModel's) pools the mean and normalises."""
    modules = _read_json(path / "modules.json") if (path / "modules.json").is_file() else None
    pooling_dir, normalize = path / "1_Pooling", True
    if modules is not None:
        normalize = False
        for m in modules:
            kind = str(m.get("type", "")).rsplit(".", 1)[-1]
            if kind == "Pooling":
                pooling_dir = path / m.get("path", "1_Pooling")
            elif kind == "Normalize":
                normalize = True
            elif kind != "Transformer":
                raise ConvertError(f"{path}/modules.json: module {m.get('type')!r} is not supported (Transformer, Pooling, Normalize)")
    pooling = "mean"
    if (pooling_dir / "config.json").is_file():
        pcfg = _read_json(pooling_dir / "config.json")
        modes = [mode for key, mode in _POOLING_MODES.items() if pcfg.get(key)]
        other = [key for key in _ST_UNSUPPORTED if pcfg.get(key)]
        if len(modes) != 1 or other:
            raise ConvertError(
                f"{pooling_dir}/config.json: pooling {', '.join(modes + other) or 'none'} is not supported "
                "(exactly one of mean, cls, lasttoken)"
            )
        pooling = modes[0]
    limit = positions
    if (path / "sentence_bert_config.json").is_file():
        given = _read_json(path / "sentence_bert_config.json").get("max_seq_length")
        if isinstance(given, int) and given > 0:
            limit = min(given, positions)
    return {"pooling": pooling, "normalize": normalize, "max_seq_length": limit}


def _encoder_tokenizer(path: Path, tokenizer_json: str, tcfg: dict[str, Any], *, pairs: bool = False) -> tuple[str, dict[str, str]]:
    """The tokenizer JSON with padding and truncation off (the engine batches; the API decides about long inputs),
    and the [CLS]/[SEP]/[PAD] tokens it uses. Its post-processor must already wrap a text as [CLS] ... [SEP]; a
    cross-encoder's (`pairs`) a pair as [CLS] a [SEP] b [SEP], b and its [SEP] in segment 1, which is how the
    server puts a pair together from the two texts' own encodings."""
    from tokenizers import Tokenizer

    try:
        doc = json.loads(tokenizer_json)
        doc["padding"] = None
        doc["truncation"] = None
        tokenizer_json = json.dumps(doc, ensure_ascii=False)
        backend = Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # tokenizers raises its own exception type
        raise ConvertError(f"{path}/tokenizer.json: not a tokenizers document ({exc})") from None
    names = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]"}
    special = {}
    for key, default in names.items():
        token = _token_str(tcfg.get(key)) or default
        if backend.token_to_id(token) is not None:
            special[key] = token
    ids = backend.encode("a").ids
    cls, sep = (backend.token_to_id(special.get(k, "")) for k in ("cls_token", "sep_token"))
    if cls is None or sep is None or len(ids) < 2 or ids[0] != cls or ids[-1] != sep:
        raise ConvertError(f"{path}/tokenizer.json: its post-processor does not wrap a text as [CLS] ... [SEP]")
    if pairs:
        pair = backend.encode("a", "b")
        a, b = ids[1:-1], backend.encode("b").ids[1:-1]
        if pair.ids != [cls, *a, sep, *b, sep] or pair.type_ids != [0] * (len(a) + 2) + [1] * (len(b) + 1):
            raise ConvertError(f"{path}/tokenizer.json: its post-processor does not wrap a pair as [CLS] a [SEP] b [SEP] (b in segment 1)")
    return tokenizer_json, special


def _vocab(tokenizer_json: str) -> dict[str, int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json).get_vocab(with_added_tokens=True)


def _read(handle, name: str, dtype: torch.dtype) -> torch.Tensor:
    return handle.get_tensor(name).to(dtype)


def _read_fixed(handle, name: str, fix: TensorFix) -> torch.Tensor:
    return fix(handle.get_tensor(name).float())

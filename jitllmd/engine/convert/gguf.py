"""GGUF file -> .jlm: dequantize every tensor, rename to the .jlm names, undo llama.cpp's q/k permutation."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..jlm import TensorSpec
from .gguf_tokenizer import tokenizer_from_gguf
from .source import ConvertError, Source, block_order

__all__ = ["GGUF_TYPES", "is_gguf", "read_gguf"]

# Quantization types this converter dequantizes (gguf.quants handles each).
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# GGUF tensor names -> .jlm names (the Hugging Face checkpoint's own suffixes inside each block).
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "embed.weight", "output_norm.weight": "head.norm.weight", "output.weight": "head.lm_head.weight"}
_BLK = re.compile(r"blk\.(\d+)\.(.+)")


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows (its 'norm' RoPE) back to Hugging Face's rotate-half order."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: Path, dtype: torch.dtype) -> Source:
    """Open a GGUF file and describe the .jlm it becomes; tensors are dequantized when written."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the gguf package raises many kinds on a damaged file
        raise ConvertError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    size = path.stat().st_size
    arch_name = _field(reader, "general.architecture")
    if arch_name not in _ARCHS:
        raise ConvertError(f"{path}: GGUF architecture {arch_name!r} is not supported (supported: {', '.join(_ARCHS)})")
    arch = _ARCHS[arch_name]
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ConvertError(f"{path}: truncated (tensor {t.name} ends past the end of the file)")
        if t.tensor_type.name not in GGUF_TYPES:
            raise ConvertError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, not one of {', '.join(GGUF_TYPES)}")

    a = arch_name
    num_heads = int(_field(reader, f"{a}.attention.head_count"))
    num_kv = int(_field(reader, f"{a}.attention.head_count_kv", num_heads))
    hidden = int(_field(reader, f"{a}.embedding_length"))
    tok = tokenizer_from_gguf(reader)
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ConvertError(f"{path}: no token_embd.weight tensor")
    rope_scaling = None
    if _field(reader, f"{a}.rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{a}.rope.scaling.factor"))}
    if "rope_freqs.weight" in tensors:  # llama 3.1-style per-frequency factors
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).tolist()
        rope_scaling = {"rope_type": "factors", "factors": factors}
    config = {
        "vocab_size": int(embd.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{a}.feed_forward_length")),
        "num_layers": int(_field(reader, f"{a}.block_count")),
        "num_heads": num_heads,
        "num_kv_heads": num_kv,
        "head_dim": int(_field(reader, f"{a}.attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(_field(reader, f"{a}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "qk_norm": "blk.0.attn_q_norm.weight" in tensors,
    }

    def produce(t: Any, heads: int | None) -> torch.Tensor:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy: F32 data is a read-only map
        if heads is not None:
            w = _unpermute(w, heads)
        return w.to(dtype)

    specs: list[TensorSpec] = []
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        if t.name in _TOP_NAMES:
            name = _TOP_NAMES[t.name]
        elif (m := _BLK.fullmatch(t.name)) and m.group(2) in _BLOCK_NAMES:
            name = f"blocks.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
        else:
            raise ConvertError(f"{path}: unexpected tensor {t.name} for architecture {arch_name}")
        heads = None
        if arch_name == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = num_heads
        elif arch_name == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = num_kv
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        specs.append(TensorSpec(name, dtype, shape, functools.partial(produce, t, heads)))
    specs.sort(key=block_order)
    return Source(
        arch=arch,
        config=config,
        tensors=specs,
        tokenizer_json=tok.tokenizer_json,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        eos_token_ids=tok.eos_token_ids,
        add_bos_token=tok.add_bos_token,
        chat_template=tok.chat_template,
        source={"kind": "gguf", "file": path.name, "name": _field(reader, "general.name"), "file_type": _field(reader, "general.file_type")},
    )


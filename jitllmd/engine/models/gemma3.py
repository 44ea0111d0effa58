"""The Gemma 3 family (gemma3_text, and the text half of a gemma3 checkpoint): Llama's decoder with Gemma's choices,
made through the shared block's hooks and parts (models/llama.py) rather than code of its own:

- the embedding's rows times sqrt(hidden), a tied head over a 262k vocabulary, logits soft-capped where the config
  caps them;
- RMSNorm in the (1 + weight) form: the .jlm keeps 1 + weight (as llama.cpp's GGUF files already do), in f32;
- norms before and after attention and the MLP (`attn_out_norm`, `mlp_out_norm`), and q/k norms;
- GeGLU: GELU's tanh form of the gate (kernels.ops.GATES's "gelu_tanh", folded as silu's is);
- scores scaled by query_pre_attn_scalar^-1/2 (folded into the q norm's weight);
- local layers with a sliding window and RoPE of their own theta, global layers with theirs (and the config's
  scaling), in the pattern the config or the GGUF metadata gives; attention's scores soft-capped where it caps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..jlm import JLMFile
from ..kernels.ops import GATES
from ..layers.rope import rope_inv_freq
from . import llama
from .family import Family, GGUFMeta, GGUFSource, HFSource, SentencePieceQuirks, TensorFix

__all__ = ["ARCHS", "FAMILY", "Gemma3Config", "Gemma3Model"]

ARCHS = ("gemma3",)
SLIDING, FULL = "sliding_attention", "full_attention"  # config.json's layer_types
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}  # config.json's hidden_activation -> kernels.ops.GATES


@dataclass(frozen=True)
class Gemma3Config(llama.LlamaConfig):
    """The .jlm `config` of a Gemma 3 model: Llama's fields (rope_theta and rope_scaling: the global layers'), and these."""

    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_theta: float = 10_000.0  # the sliding-window layers' RoPE (no scaling)
    query_pre_attn_scalar: float = 256.0  # scores scale by its inverse square root
    layer_types: tuple[str, ...] = ()  # one per layer: SLIDING or FULL
    hidden_activation: str = "gelu_tanh"
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    qk_norm: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "layer_types", tuple(self.layer_types) or (FULL,) * self.num_layers)
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {SLIDING, FULL}:
            raise ValueError(f"config.layer_types must name {self.num_layers} layers, each {SLIDING!r} or {FULL!r}")
        if SLIDING in self.layer_types and not (self.sliding_window or 0) >= 1:
            raise ValueError("config.sliding_window must be >= 1 where layers slide")
        if self.hidden_activation not in GATES:
            raise ValueError(f"config.hidden_activation {self.hidden_activation!r} is not supported ({', '.join(sorted(GATES))})")
        if self.query_pre_attn_scalar <= 0:
            raise ValueError(f"config.query_pre_attn_scalar must be > 0, got {self.query_pre_attn_scalar}")

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def rope_index(self, layer: int) -> int:
        return 0 if self.layer_types[layer] == SLIDING else 1  # Gemma3Model.rope_freqs: local, global


def layouts(cfg: llama.LlamaConfig, names: set[str]) -> dict[str, dict[str, list[str]]]:
    """Llama's parts, with the MLP's input norm named as Gemma names it and the two output norms."""
    out = llama.layouts(cfg, names)
    for i in range(cfg.num_layers):
        p = f"blocks.{i}."
        out[f"blocks.{i}"] |= {
            "post_norm": [p + "pre_feedforward_layernorm.weight"],
            "attn_out_norm": [p + "post_attention_layernorm.weight"],
            "mlp_out_norm": [p + "post_feedforward_layernorm.weight"],
        }
    return out


class Gemma3Model(llama.LlamaModel):
    """Llama's model with two RoPE tables (local, global), a scaled embedding, and query_pre_attn_scalar folded into
    the q norm."""

    cfg: Gemma3Config
    block_layouts = staticmethod(layouts)

    @staticmethod
    def rope_freqs(cfg: llama.LlamaConfig) -> list[torch.Tensor]:
        assert isinstance(cfg, Gemma3Config)
        return [rope_inv_freq(cfg.head_dim, cfg.rope_local_theta), rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)]

    def embed_scale(self) -> float | None:
        return float(self.cfg.hidden_size) ** 0.5

    def build(self, name: str, parts: dict[str, Any], device: torch.device, once: bool = False) -> Any:
        scale = (self.cfg.head_dim / self.cfg.query_pre_attn_scalar) ** 0.5  # the kernels scale scores by head_dim^-1/2
        if "q_norm" in parts and scale != 1.0:
            parts = parts | {"q_norm": parts["q_norm"].float() * scale}
        return super().build(name, parts, device, once)


# -- sources: Hugging Face and GGUF --

# a gemma3 checkpoint's text model (transformers 5, then earlier), and a gemma3_text one's
_HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


def hf_config(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json (gemma3_text, or gemma3's text_config) -> the .jlm config."""
    text = hf.get("text_config") if hf.get("model_type") == "gemma3" else hf
    if not isinstance(text, dict):
        raise KeyError("text_config")
    if text.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an embedding model's) is not supported")
    activation = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _ACTIVATIONS:
        raise ValueError(f"hidden_activation {activation!r} is not supported ({', '.join(_ACTIVATIONS)})")
    layers = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if types is None:
        pattern = int(text.get("sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    # transformers 5: rope_parameters per layer type; earlier: rope_theta, rope_local_base_freq, rope_scaling (global)
    rope: dict[str, Any] = text.get("rope_parameters") or {}
    full: dict[str, Any] = rope.get(FULL) or {}
    local: dict[str, Any] = rope.get(SLIDING) or {}
    scaling = text.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    heads = int(text["num_attention_heads"])
    return {
        "vocab_size": int(text["vocab_size"]),
        "hidden_size": int(text["hidden_size"]),
        "intermediate_size": int(text["intermediate_size"]),
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": int(text.get("num_key_value_heads") or heads),
        "head_dim": int(text.get("head_dim") or 256),
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(full.get("rope_theta") or text.get("rope_theta") or 1_000_000.0),
        "rope_local_theta": float(local.get("rope_theta") or text.get("rope_local_base_freq") or 10_000.0),
        "rope_scaling": scaling,
        "max_position_embeddings": int(text.get("max_position_embeddings", 131072)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
        "attention_bias": bool(text.get("attention_bias", False)),
        "sliding_window": int(text.get("sliding_window") or 4096),
        "layer_types": list(types),
        "query_pre_attn_scalar": float(text.get("query_pre_attn_scalar", 256)),
        "hidden_activation": _ACTIVATIONS[activation],
        "attn_logit_softcapping": text.get("attn_logit_softcapping"),
        "final_logit_softcapping": text.get("final_logit_softcapping"),
    }


def hf_tensor_name(name: str, config: dict[str, Any]) -> str | None:
    """A checkpoint name -> its .jlm name; None for what the text model does not read (a vision tower, a tied head)."""
    if name == "lm_head.weight":
        return None if config["tie_word_embeddings"] else "head.lm_head.weight"
    for prefix in _HF_PREFIXES:
        if name.startswith(prefix):
            rest = name.removeprefix(prefix)
            if rest == "embed_tokens.weight":
                return "embed.weight"
            if rest == "norm.weight":
                return "head.norm.weight"
            layer = llama._layer(rest, "layers.")
            return f"blocks.{layer[0]}.{layer[1]}" if layer else None
    return None


def hf_fix(name: str, config: dict[str, Any]) -> TensorFix | None:
    """A norm's weight w -> 1 + w, the factor it multiplies by (made in f32, and kept so)."""
    return (lambda w: 1.0 + w) if name.endswith("norm.weight") else None


def hf_required(config: dict[str, Any]) -> list[str]:
    names = ["embed.weight", "head.norm.weight"] + ([] if config["tie_word_embeddings"] else ["head.lm_head.weight"])
    for i in range(config["num_layers"]):
        names += [f"blocks.{i}.{part}" for part in _BLOCK_PARTS]
    return names


# GGUF tensor names -> .jlm names inside each block (llama.cpp's gemma3 arch)
_GGUF_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_PARTS = tuple(_GGUF_BLOCK_NAMES.values())


def gguf_config(g: GGUFMeta) -> dict[str, Any]:
    """llama.cpp's `gemma3.*` hyperparameters -> the .jlm config. What its files leave out, llama.cpp's loader fixes
    and so does this: 5 local layers to 1 global, local RoPE theta 10000, and scores scaled by head_dim^-1/2 but for
    the 27B model's (62 layers) hidden / heads."""
    a = g.arch
    embd = g.shapes.get("token_embd.weight")
    if embd is None:
        raise ValueError("no token_embd.weight tensor")
    layers, heads, hidden = int(g.field(f"{a}.block_count")), int(g.field(f"{a}.attention.head_count")), int(g.field(f"{a}.embedding_length"))
    head_dim = int(g.field(f"{a}.attention.key_length", 256))
    pattern = g.field(f"{a}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer files: one flag per layer, true where it slides
        types = [SLIDING if bool(p) else FULL for p in pattern]
    else:
        types = [SLIDING if (i + 1) % int(pattern) else FULL for i in range(layers)]
    scaling = None
    if g.field(f"{a}.rope.scaling.type", None) == "linear":
        scaling = {"rope_type": "linear", "factor": float(g.field(f"{a}.rope.scaling.factor"))}
    return {
        "vocab_size": int(embd[0]),
        "hidden_size": hidden,
        "intermediate_size": int(g.field(f"{a}.feed_forward_length")),
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": int(g.field(f"{a}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(g.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g.field(f"{a}.rope.freq_base", 1_000_000.0)),
        "rope_local_theta": float(g.field(f"{a}.rope.freq_base_swa", 10_000.0)),
        "rope_scaling": scaling,
        "max_position_embeddings": int(g.field(f"{a}.context_length", 131072)),
        "tie_word_embeddings": "output.weight" not in g.shapes,
        "sliding_window": int(g.field(f"{a}.attention.sliding_window", 4096)),
        "layer_types": types,
        "query_pre_attn_scalar": float(hidden // heads if layers == 62 else head_dim),
        "hidden_activation": "gelu_tanh",
        "attn_logit_softcapping": g.field(f"{a}.attn_logit_softcapping", None),
        "final_logit_softcapping": g.field(f"{a}.final_logit_softcapping", None),
    }


def gguf_tensor_name(name: str) -> str | None:
    if name in llama._GGUF_TOP_NAMES:
        return llama._GGUF_TOP_NAMES[name]
    if (layer := llama._layer(name, "blk.")) and layer[1] in _GGUF_BLOCK_NAMES:
        return f"blocks.{layer[0]}.{_GGUF_BLOCK_NAMES[layer[1]]}"
    return None


def build(config: dict[str, Any], jlm: JLMFile, dtype: torch.dtype, device: torch.device, on_progress: Any = None) -> Gemma3Model:
    """The decoder without its blocks: the loader places them (engine/memory/placement.py)."""
    return Gemma3Model(Gemma3Config.from_dict(config), jlm, dtype)


FAMILY = Family(
    archs=ARCHS,
    embeds=False,
    config=Gemma3Config.from_dict,
    build=build,
    hf=HFSource(model_types={"gemma3_text": "gemma3", "gemma3": "gemma3"}, config=hf_config, tensor_name=hf_tensor_name, required=hf_required,
                fix=hf_fix),
    # Gemma's files spell their SentencePiece vocabulary with literal spaces, and rank merges by position
    gguf=GGUFSource(archs={"gemma3": "gemma3"}, config=gguf_config, tensor_name=gguf_tensor_name,
                    tokenizer=SentencePieceQuirks(literal_spaces=True, ranked_by_position=True)),
)

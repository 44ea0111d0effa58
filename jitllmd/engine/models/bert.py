"""The BERT encoder family (all-MiniLM, bge, e5, ...): token ids -> one pooled, optionally normalised, vector; or, for a
cross-encoder (BertForSequenceClassification with one label), a query-document pair -> its relevance score."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..jlm import JLMFile
from ..memory.devices import bf16_matmul_native
from .family import Family, HFSource, config_from_dict

__all__ = ["ARCHS", "FAMILY", "POOLINGS", "SCORE_ACTIVATIONS", "BertConfig", "BertModel"]

ARCHS = ("bert",)
POOLINGS = ("mean", "cls", "last")
SCORE_ACTIVATIONS = ("sigmoid", "identity")  # what a cross-encoder applies to its logit (vLLM's and sentence-transformers')
# sentence-transformers' CrossEncoder names its activation by class path in config.json
_ST_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity"}
# Hugging Face's names for the activation: gelu is exact (erf); the others are the tanh approximation.
_ACTS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True)
class BertConfig:
    """The .jlm `config` of a BERT encoder (names as in docs/format.md)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    pooling: str = "mean"
    normalize: bool = True
    max_seq_length: int | None = None  # None: max_position_embeddings
    num_labels: int = 0  # 0: an embedding model; 1: a cross-encoder, whose pooler and classifier score a pair
    score_activation: str = "sigmoid"  # a cross-encoder's, on its logit

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"config.hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"config.layer_norm_eps must be > 0, got {self.layer_norm_eps}")
        if self.hidden_act not in _ACTS:
            raise ValueError(f"config.hidden_act {self.hidden_act!r} is not supported ({', '.join(_ACTS)})")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"config.pad_token_id {self.pad_token_id} is outside the vocabulary (size {self.vocab_size})")
        if self.pooling not in POOLINGS:
            raise ValueError(f"config.pooling {self.pooling!r} is not one of {', '.join(POOLINGS)}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"config.normalize must be true or false, got {self.normalize!r}")
        if self.num_labels not in (0, 1):
            raise ValueError(f"config.num_labels must be 0 (an embedding model) or 1 (a cross-encoder), got {self.num_labels!r}")
        if self.score_activation not in SCORE_ACTIVATIONS:
            raise ValueError(f"config.score_activation {self.score_activation!r} is not one of {', '.join(SCORE_ACTIVATIONS)}")
        if self.num_labels and self.type_vocab_size < 2:
            raise ValueError(f"config.type_vocab_size must be >= 2 for a cross-encoder (it embeds two segments), got {self.type_vocab_size}")
        if self.max_seq_length is None:
            object.__setattr__(self, "max_seq_length", self.max_position_embeddings)
        elif not 1 <= self.max_seq_length <= self.max_position_embeddings:
            raise ValueError(
                f"config.max_seq_length must be in [1, max_position_embeddings={self.max_position_embeddings}], "
                f"got {self.max_seq_length}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BertConfig:
        return config_from_dict(cls, d)


class EncoderBlock:
    """One post-norm BERT layer: self-attention over the whole sequence, then the GELU MLP. Names as the checkpoint's."""

    def __init__(self, cfg: BertConfig, t: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        put = lambda w: w.to(device=device, dtype=dtype)
        a = "attention.self."
        # q, k and v in one projection: one GEMM instead of three.
        self.qkv_w = put(torch.cat([t[a + "query.weight"], t[a + "key.weight"], t[a + "value.weight"]]))  # [3*hidden, hidden]
        self.qkv_b = put(torch.cat([t[a + "query.bias"], t[a + "key.bias"], t[a + "value.bias"]]))
        self.o_w, self.o_b = put(t["attention.output.dense.weight"]), put(t["attention.output.dense.bias"])
        self.attn_norm = (put(t["attention.output.LayerNorm.weight"]), put(t["attention.output.LayerNorm.bias"]))
        self.up_w, self.up_b = put(t["intermediate.dense.weight"]), put(t["intermediate.dense.bias"])
        self.down_w, self.down_b = put(t["output.dense.weight"]), put(t["output.dense.bias"])
        self.out_norm = (put(t["output.LayerNorm.weight"]), put(t["output.LayerNorm.bias"]))
        self.num_heads, self.head_dim, self.eps = cfg.num_heads, cfg.head_dim, cfg.layer_norm_eps
        self.approximate = _ACTS[cfg.hidden_act]

    def tensors(self) -> list[torch.Tensor]:
        return [self.qkv_w, self.qkv_b, self.o_w, self.o_b, *self.attn_norm, self.up_w, self.up_b,
                self.down_w, self.down_b, *self.out_norm]

    def __call__(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """x: [T, hidden], the batch's sequences packed one after another; spans: each one's (start, num_tokens)."""
        T, hidden = x.shape
        H, D = self.num_heads, self.head_dim
        qkv = F.linear(x, self.qkv_w, self.qkv_b).view(T, 3, H, D)  # [T, 3, H, D]
        if len(spans) == 1:
            attn = self.attend(qkv)
        else:
            attn = torch.empty((T, hidden), dtype=x.dtype, device=x.device)
            for s, n in spans:
                attn[s : s + n] = self.attend(qkv[s : s + n])
        x = F.layer_norm(x + F.linear(attn, self.o_w, self.o_b), (hidden,), *self.attn_norm, self.eps)
        h = F.gelu(F.linear(x, self.up_w, self.up_b), approximate=self.approximate)  # [T, intermediate]
        return F.layer_norm(x + F.linear(h, self.down_w, self.down_b), (hidden,), *self.out_norm, self.eps)

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """One sequence's bidirectional attention. qkv: [n, 3, H, D] -> [n, H*D]"""
        n = qkv.shape[0]
        q, k, v = qkv.permute(1, 2, 0, 3)[:, None]  # 3 x [1, H, n, D]: 4-D inputs take the fused CPU kernel
        return F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(n, -1)


class BertModel:
    """embed -> encoder blocks -> pooling, on one device; a cross-encoder's head block (pooler, classifier) scores
    [CLS] instead of pooling. There is no KV: a batch is run whole."""

    def __init__(self, cfg: BertConfig, jlm: JLMFile, dtype: torch.dtype, device: str | torch.device = "cpu", progress=None):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        # Where bf16 GEMM is emulated (AVX2-only CPUs) the weights are upcast once, here: an encoder multiplies
        # many tokens at once, so it is compute-bound, and f32 is both faster there and exact.
        upcast = dtype == torch.bfloat16 and not bf16_matmul_native(self.device)
        self.act = torch.float32 if upcast else dtype
        put = lambda w: w.to(device=self.device, dtype=self.act)
        e = jlm.block("embed")
        self.word = put(e["word_embeddings.weight"])  # [V, hidden]
        self.position = put(e["position_embeddings.weight"])  # [P, hidden]
        self.token_type0 = put(e["token_type_embeddings.weight"][0])  # [hidden]: every token is segment 0
        self.embed_norm = (put(e["LayerNorm.weight"]), put(e["LayerNorm.bias"]))
        self.head: list[torch.Tensor] = []  # a cross-encoder's: pooler weight, bias, classifier weight, bias (f32)
        self.sep_token_id: int | None = None  # a cross-encoder's second segment starts after the first [SEP]
        if cfg.num_labels:
            self.token_types = put(e["token_type_embeddings.weight"][:2])  # [2, hidden]
            h = jlm.block("head")
            if missing := [n for n in _HEAD_NAMES if n not in h]:
                raise ValueError(f"{jlm.path}: a cross-encoder's tensor head.{missing[0]} is missing")
            self.head = [h[n].to(device=self.device, dtype=torch.float32) for n in _HEAD_NAMES]
            sep = (jlm.meta.get("special_tokens") or {}).get("sep_token_id")
            if not isinstance(sep, int) or not 0 <= sep < cfg.vocab_size:
                raise ValueError(f"{jlm.path}: a cross-encoder needs its [SEP] token (special_tokens.sep_token_id), got {sep!r}")
            self.sep_token_id = sep
        self.blocks: list[EncoderBlock] = []
        for i in range(cfg.num_layers):
            self.blocks.append(EncoderBlock(cfg, jlm.block(f"blocks.{i}"), self.act, self.device))
            if progress is not None:
                progress(i + 1, cfg.num_layers)

    @property
    def scores_pairs(self) -> bool:
        """A cross-encoder: its inputs are pairs ([CLS] query [SEP] document [SEP]) and its vectors their scores."""
        return self.sep_token_id is not None

    def weight_nbytes(self) -> int:
        ts = [self.word, self.position, self.token_type0, *self.embed_norm, *self.head] + [t for b in self.blocks for t in b.tensors()]
        return sum(t.numel() * t.element_size() for t in ts)

    def check(self, batch: list[list[int]]) -> None:
        """Raise ValueError (naming the sequence) for an empty batch or sequence, one too long, or an unknown id."""
        if not batch:
            raise ValueError("nothing to embed: the batch is empty")
        limit, vocab = self.cfg.max_seq_length or self.cfg.max_position_embeddings, self.cfg.vocab_size
        for i, ids in enumerate(batch):
            if not ids:
                raise ValueError(f"input {i} has no tokens")
            if len(ids) > limit:
                raise ValueError(f"input {i} has {len(ids)} tokens; this model embeds at most {limit}")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"input {i} has a token id outside the vocabulary (size {vocab})")

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """Embed each token-id list (special tokens included, as the tokenizer adds them). -> f32 [B, hidden]; a
        cross-encoder's lists are pairs, [CLS] query [SEP] document [SEP], and it gives their scores, f32 [B, 1].

        The batch runs packed: every projection over all its real tokens at once, attention per sequence.
        Measured against one right-padded batch with a key mask (all-MiniLM-L6-v2, f32, 2 threads): within 4%
        for 1, 8 and 64 sentences of ~20 tokens (8.0/28.9/224 ms vs 7.9/27.8/223), 1.5x and 2.0x faster for 8
        and 64 sentences of 3 to 60 words (43/358 ms vs 66/728), where padding doubles the tokens multiplied.
        """
        self.check(batch)
        lengths = [len(ids) for ids in batch]
        spans, start = [], 0
        for n in lengths:
            spans.append((start, n))
            start += n
        ids = torch.tensor([t for row in batch for t in row], device=self.device)  # [T]
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])  # [T]
        types = self.token_type0 if self.sep_token_id is None else self.token_types[self.segments(batch)]  # [hidden] or [T, hidden]
        x = F.embedding(ids, self.word) + self.position[positions] + types  # [T, hidden]
        x = F.layer_norm(x, (x.shape[-1],), *self.embed_norm, self.cfg.layer_norm_eps)
        for block in self.blocks:
            x = block(x, spans)
        return self.pool(x.float(), spans) if self.sep_token_id is None else self.score(x.float(), spans)

    def segments(self, batch: list[list[int]]) -> torch.Tensor:
        """Each token's segment, as BERT's pair template gives it: 0 up to the first [SEP], 1 after it. -> [T]"""
        out = []
        for ids in batch:
            first = ids.index(self.sep_token_id) + 1 if self.sep_token_id in ids else len(ids)
            out += [0] * first + [1] * (len(ids) - first)
        return torch.tensor(out, device=self.device)

    def score(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """A cross-encoder's head: [CLS] through the pooler (dense, tanh) and the classifier, then the activation.
        x: [T, hidden] f32 -> [B, 1]"""
        pool_w, pool_b, cls_w, cls_b = self.head
        cls = x[torch.tensor([s for s, _ in spans], device=x.device)]  # [B, hidden]
        logits = F.linear(torch.tanh(F.linear(cls, pool_w, pool_b)), cls_w, cls_b)  # [B, 1]
        return torch.sigmoid(logits) if self.cfg.score_activation == "sigmoid" else logits

    def pool(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """x: [T, hidden] f32 -> [B, hidden], by the config's pooling, L2-normalised when the config says so."""
        dev = x.device
        if self.cfg.pooling == "mean":  # over every token, [CLS] and [SEP] included, as sentence-transformers does
            lengths = torch.tensor([n for _, n in spans], device=dev)
            row = torch.repeat_interleave(torch.arange(len(spans), device=dev), lengths)  # [T]: each token's sequence
            out = x.new_zeros(len(spans), x.shape[1]).index_add_(0, row, x) / lengths[:, None]
        elif self.cfg.pooling == "cls":
            out = x[torch.tensor([s for s, _ in spans], device=dev)]
        else:  # last: each sequence's last token
            out = x[torch.tensor([s + n - 1 for s, n in spans], device=dev)]
        return F.normalize(out, p=2.0, dim=-1) if self.cfg.normalize else out


# -- sources: Hugging Face (plain BertModel directories and sentence-transformers models) ----------------------------

_LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.+)")
_EMBED_NAMES = ("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight",
                "LayerNorm.weight", "LayerNorm.bias")
_HEAD_NAMES = ("pooler.dense.weight", "pooler.dense.bias", "classifier.weight", "classifier.bias")  # a cross-encoder's
_LAYER_NAMES = tuple(
    f"{m}.{p}" for m in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                         "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm")
    for p in ("weight", "bias")
)


def hf_config(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json -> the .jlm config; convert/hf.py adds pooling, normalize and max_seq_length from the
    sentence-transformers files beside it. A BertForSequenceClassification with one label is a cross-encoder."""
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {hf['position_embedding_type']!r} is not supported (absolute)")
    config: dict[str, Any] = {
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": int(hf["hidden_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "num_heads": int(hf["num_attention_heads"]),
        "intermediate_size": int(hf["intermediate_size"]),
        "max_position_embeddings": int(hf.get("max_position_embeddings", 512)),
        "type_vocab_size": int(hf.get("type_vocab_size", 2)),
        "layer_norm_eps": float(hf.get("layer_norm_eps", 1e-12)),
        "hidden_act": str(hf.get("hidden_act", "gelu")),
        "pad_token_id": int(hf.get("pad_token_id") or 0),
    }
    if "BertForSequenceClassification" in (hf.get("architectures") or []):
        config |= _cross_encoder(hf)
    return config


def _cross_encoder(hf: dict[str, Any]) -> dict[str, Any]:
    """A sequence classifier's config: one label, and the activation on it as vLLM and sentence-transformers take it
    (the CrossEncoder's own, where config.json names one; else a sigmoid)."""
    labels = hf.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) else int(hf.get("num_labels", 2))
    if num_labels != 1:
        raise ValueError(f"BertForSequenceClassification with {num_labels} labels is not supported (a cross-encoder has one: num_labels 1)")
    st = hf.get("sentence_transformers")
    named = (st.get("activation_fn") if isinstance(st, dict) else None) or hf.get("sbert_ce_default_activation_function")
    if named is not None and named not in _ST_ACTIVATIONS:
        raise ValueError(f"activation_fn {named!r} is not supported ({', '.join(_ST_ACTIVATIONS)})")
    return {"num_labels": 1, "score_activation": _ST_ACTIVATIONS[named] if named is not None else "sigmoid"}


def hf_tensor_name(name: str, config: dict[str, Any]) -> str | None:
    """A BERT checkpoint name -> its .jlm name; None for what the model does not use (an embedding model's pooler, an
    MLM head). A cross-encoder's pooler and classifier are its head block."""
    name = name.removeprefix("bert.")
    name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name))
    if name.startswith("embeddings.") and name.removeprefix("embeddings.") in _EMBED_NAMES:
        return "embed." + name.removeprefix("embeddings.")
    if m := _LAYER.fullmatch(name):
        return f"blocks.{m.group(1)}.{m.group(2)}"
    if config.get("num_labels") and name in _HEAD_NAMES:
        return "head." + name
    return None


def required_tensors(config: dict[str, Any]) -> list[str]:
    """Every tensor `BertModel` reads."""
    head = [f"head.{n}" for n in _HEAD_NAMES] if config.get("num_labels") else []
    return [f"embed.{n}" for n in _EMBED_NAMES] + [f"blocks.{i}.{n}" for i in range(config["num_layers"]) for n in _LAYER_NAMES] + head


def build(config: dict[str, Any], jlm: JLMFile, dtype: torch.dtype, device: torch.device,
          on_progress: Callable[[int, int], None] | None = None) -> BertModel:
    """The encoder, built whole on `device`."""
    return BertModel(BertConfig.from_dict(config), jlm, dtype, device, on_progress)


FAMILY = Family(
    archs=ARCHS,
    embeds=True,
    config=BertConfig.from_dict,
    build=build,
    hf=HFSource(model_types={"bert": "bert"}, config=hf_config, tensor_name=hf_tensor_name, required=required_tensors),
)

"""The Llama family (llama, mistral, qwen2, qwen3, SmolLM): its config, its tensor layout and its maths over a packed
token dimension. Operations come from engine/layers; where a block lives is the model runner's business."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..jlm import JLMFile
from ..kernels.ops import GATES, KV_DTYPES, QuantLayer, bf16_round
from ..kv import RowSpan
from ..layers import fused
from ..layers.activation import GatedAct
from ..layers.attention import Attention
from ..layers.linear import make_linear
from ..layers.norm import RMSNorm
from ..layers.quant import QuantLinear, QuantTable, Segment, chunk_tokens, flag_runs, segments_for, take_rows
from ..layers.rope import Rope, RopeCache, RopeTables, rope_inv_freq
from ..memory.devices import bf16_matmul_native
from ..pages import PagePool
from .family import Family, GGUFMeta, GGUFSource, HFSource, TensorFix, config_from_dict

__all__ = ["ARCHS", "FAMILY", "STREAM", "DecoderBlock", "Embed", "Head", "LlamaConfig", "LlamaModel", "layouts"]

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# The residual stream between blocks, and the norms that read it, in f32 whatever the weights (as llama.cpp keeps it):
# a bf16 stream rounds every block's sum, and on SmolLM2 that flipped a near tie of greedy tokens between a prompt fed
# whole and the same prompt fed after a cached prefix.
STREAM = torch.float32
# A prompt chunk's MLP runs this many rows at a time: its [rows, 2 * intermediate] product and the weight panels'
# products are the largest buffers of a step (a 512-token chunk of SmolLM2 held ~20 MB more at its peak than 128)
MLP_ROWS = 128
# A prompt chunk in bf16 runs its MLP over every row at once, this many of the intermediate's columns at a time: the
# [rows, 2 * columns] bound on memory, and each weight dequantized and packed once a chunk, not once per MLP_ROWS
# rows (the packing is ~half of a 128-row product's time for Qwen2.5-0.5B's 4864-wide MLP). A multiple of the
# K-formats' 256. 1024 against 512: +8-13% prompt on Qwen2.5-0.5B, +6% on SmolLM2 (fewer passes of down's sums over
# the stream; interleaved runs); 1536 no quicker on Qwen, and wider slices slower (the product outgrows the caches)
MLP_COLUMNS = 1024


@dataclass(frozen=True)
class LlamaConfig:
    """The .jlm `config` of a Llama-family model (names as in docs/format.md)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # what a family's config may set otherwise (models/gemma3.py's does): the gated MLP's activation (kernels.ops.GATES),
    # attention's and the head's logit caps (tanh(x / cap) * cap)
    hidden_activation: str = "silu"
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def window(self, layer: int) -> int | None:
        """Layer's sliding window: a query at q sees keys in (q - window, q]; None: every earlier key."""
        return self.sliding_window

    def rope_index(self, layer: int) -> int:
        """Which of a forward's RoPE tables (`LlamaModel.begin`) layer reads."""
        return 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"config.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "linear", "factors", "default"):
                raise ValueError(f"config.rope_scaling type {kind!r} is not supported (llama3, linear, factors)")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        return config_from_dict(cls, d)


class DecoderBlock:
    """One transformer layer: attention with its session KV, then the gated MLP. Built from the parts
    `layouts` names (q, k and v stacked into qkv; gate and up into gate_up: fewer, wider GEMVs). `quant`: the
    parts stored quantized, as segments. What a family varies is in its config (`LlamaConfig`'s hooks: a layer's
    window, RoPE table, activation, logit caps) and in optional parts: q/k norms, and norms of attention's and the
    MLP's outputs before they join the stream (`attn_out_norm`, `mlp_out_norm`: Gemma's "sandwich")."""

    def __init__(self, cfg: LlamaConfig, index: int, t: dict[str, torch.Tensor], dtype: torch.dtype, act: torch.dtype, device: torch.device,
                 panels: bool, quant: dict[str, list[Segment]]):
        self.act = act  # q, k, v, RoPE, attention and KV; projections run in the weights' dtype, the stream in f32
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        cast = lambda w: w if w.dtype == dtype else w.to(dtype)
        project = lambda part, bias=None: make_linear(t[part] if part in quant else cast(t[part]), bias, panels=panels, segments=quant.get(part))
        norm = lambda part, dt=STREAM: RMSNorm(t[part], eps, dt) if part in t else None  # the norms read the f32 stream
        self.input_norm, self.post_norm = RMSNorm(t["input_norm"], eps, STREAM), RMSNorm(t["post_norm"], eps, STREAM)
        self.attn_out_norm, self.mlp_out_norm = norm("attn_out_norm"), norm("mlp_out_norm")
        bias = cast(t["qkv_bias"]) if "qkv_bias" in t else None
        self.qkv = project("qkv", bias)
        self.o = project("o")
        self.q_norm, self.k_norm = norm("q_norm", act), norm("k_norm", act)
        self.gate_up = project("gate_up")
        self.down = project("down")
        self.rope = Rope(cfg.head_dim, act, device)
        self.rope_index = cfg.rope_index(index)  # which of the forward's RoPE tables this layer reads
        # quantized projections that multiply prompt chunks in bf16 (the CPU's bf16 units): the MLP by column slices
        self.bf16_chunks = all(isinstance(p, QuantLinear) and p.bf16_chunks for p in (self.qkv, self.o, self.gate_up, self.down))
        self.attn = Attention(index, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, act, device, cfg.window(index), bf16=self.bf16_chunks,
                              softcap=cfg.attn_logit_softcapping)
        self.gate = cfg.hidden_activation
        self.gated = GatedAct(cfg.intermediate_size, device, self.gate)
        # f32 panels and quantized rows: the norms and act(gate) * up are made as the projections pack or quantize
        # their rows, not passes of their own
        self.fold = (
            self.qkv.folds and self.gate_up.folds and self.down.folds and act == torch.float32 and cfg.hidden_size % 8 == 0
            and cfg.intermediate_size % 8 == 0
        )
        # quantized on the CPU with the kernels: a step's single-token rows go through the whole layer in one call
        # (layer.c's layer: Llama's, or Gemma's with its four extra norms and gelu)
        norms = [n for n in (self.q_norm, self.k_norm, self.attn_out_norm, self.mlp_out_norm) if n is not None]
        kernel_norms = all(n.kernel and n.eps == eps for n in norms)  # the kernels the Python path calls on them
        self.fused = (
            self._fused(cfg) if self.fold and kernel_norms and self.gate in GATES and self.rope.kernel and self.attn.decode_kernel else None
        )

    def _fused(self, cfg: LlamaConfig) -> QuantLayer | None:
        """layer.c's view of this layer, where every projection is quantized rows the kernels multiply (no bias but
        qkv's, a few runs of rows each)."""
        parts = [self.qkv, self.o, self.gate_up, self.down]
        quant = [p for p in parts if isinstance(p, QuantLinear) and p.kernel and len(p.runs) <= 4 and (p is self.qkv or p.bias is None)]
        if len(quant) < len(parts):
            return None
        qkv, o, gate_up, down = ((p.runs, p.segments[0].k) for p in quant)
        weight = lambda n: None if n is None else n.weight.contiguous()
        return QuantLayer(qkv, o, gate_up, down, quant[0].bias, self.input_norm.weight, self.post_norm.weight, cfg.rms_norm_eps, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, q_norm=weight(self.q_norm), k_norm=weight(self.k_norm),
                          attn_out_norm=weight(self.attn_out_norm), mlp_out_norm=weight(self.mlp_out_norm), gate=self.gate)

    def __call__(self, x: torch.Tensor, rope: tuple[RopeTables, ...], rows: list[RowSpan], keep: list[int] | None = None) -> torch.Tensor:
        """x [T, hidden] f32 -> the new hidden states [T, hidden]; with `keep` (ascending token indices) only those
        tokens' [len(keep), hidden]: every token's K/V still goes to its session, but attention and the MLP run for the
        kept ones only (the last block of a prompt step, whose other tokens' outputs nothing reads). `rope`: the
        forward's RoPE tables (`LlamaModel.begin`)."""
        T = x.shape[0]
        tables = rope[self.rope_index]
        if self.fuses(rows):
            return fused.run([self], x, rope, rows, keep)  # decode rows and short feeds (but AMX's bf16 prompt attention): one kernel call
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        chunk = chunk_tokens(rows, T)  # prompt chunks' tokens: quantized projections' prompt path (bf16 or int8 GEMM)
        if self.fold:
            qkv = self.qkv(x, norm=(self.input_norm.weight, self.input_norm.eps), chunk=chunk)  # [T, (H + 2*Hkv) * D]
        else:
            qkv = self.qkv(self.input_norm(x), chunk=chunk).to(self.act)
        qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
        v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
        if self.q_norm is not None and self.k_norm is not None:  # in place, in qkv's own rows where the kernel runs
            self.q_norm.heads_(qk[:, :H])
            self.k_norm.heads_(qk[:, H:])
        qk = self.rope(qk, *tables.on(x.device))  # q and k rotated in one pass (in qkv's own rows where it can)
        attn = self.attn(qk[:, :H], qk[:, H:], v, rows, keep)  # [T or len(keep), H*D]
        if keep is not None:
            x = take_rows(x, keep)
            chunk = None if chunk is None else take_rows(chunk, keep)
        if self.attn_out_norm is None:
            x = self.o(attn, residual=x, chunk=chunk)  # [T, hidden] f32: the stream
        else:
            x = self.attn_out_norm.add_to(x, self.o(attn, chunk=chunk).float())
        if self.bf16_chunks and chunk is not None:  # a prompt row's MLP the same way whatever rows share its step
            if bool(chunk.all()):
                return self.mlp_columns(x)
            out = torch.empty_like(x)
            for lo, hi, long in flag_runs(chunk):
                if long:
                    out[lo:hi] = self.mlp_columns(x[lo:hi])
                else:
                    self.mlp(x[lo:hi], None, out=out[lo:hi])  # decode rows: the integer kernel
            return out
        if x.shape[0] > MLP_ROWS:  # each row's MLP is its own (a GEMM may round a tile's rows in another order)
            out = torch.empty_like(x)
            for t in range(0, x.shape[0], MLP_ROWS):
                self.mlp(x[t : t + MLP_ROWS], None if chunk is None else chunk[t : t + MLP_ROWS], out=out[t : t + MLP_ROWS])
            return out
        return self.mlp(x, chunk)

    def fuses(self, rows: list[RowSpan]) -> bool:
        """Whether these rows take the layer's one kernel call (layers/fused.py: decode rows and short feeds; not prompt
        chunks, nor AMX's bf16 prompt attention; and a cache the kernels read)."""
        return self.fused is not None and rows[0].kv.dtype in KV_DTYPES and not any(r.exact or (r.prompt and self.attn.bf16) for r in rows)

    def mlp_columns(self, x: torch.Tensor) -> torch.Tensor:
        """x + the MLP of a prompt chunk's rows [T, hidden] f32 in bf16, MLP_COLUMNS of the intermediate at a time: gate
        and up's columns [j, j + c) (the bits the whole product gives them), then down's inputs [j, j + c) added on.
        The normed rows are rounded to bf16 once for every slice. Down's sums are f32 partial sums per slice, added in
        order (onto x, or onto zeros where the MLP's output is normed before it joins x)."""
        assert isinstance(self.gate_up, QuantLinear) and isinstance(self.down, QuantLinear)
        inter = self.gate_up.out_features // 2
        xb = bf16_round(x, norm=(self.post_norm.weight, self.post_norm.eps))
        y = x if self.mlp_out_norm is None else torch.zeros_like(x)
        for j in range(0, inter, MLP_COLUMNS):
            c = min(MLP_COLUMNS, inter - j)
            gate_up = self.gate_up.rows_bf16(xb, [(j, j + c), (inter + j, inter + j + c)])  # [T, 2c]: gate, up
            y = self.down.columns_bf16(gate_up, j, j + c, gated=self.gate, add=y)
        return y if self.mlp_out_norm is None else self.mlp_out_norm.add_to(x, y)

    def mlp(self, x: torch.Tensor, chunk: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x + the MLP of x's rows [T, hidden] f32 (`chunk`: which rows are a prompt's, multiplied exactly), written
        into `out` where given (by the down projection's kernel where it can: no copy after it)."""
        residual = x if self.mlp_out_norm is None else None
        into = out if self.mlp_out_norm is None else None
        if self.fold:
            gate_up = self.gate_up(x, norm=(self.post_norm.weight, self.post_norm.eps), chunk=chunk)
            y = self.down(gate_up, residual=residual, gated=self.gate, chunk=chunk, out=into)
        else:
            y = self.down(self.gated(self.gate_up(self.post_norm(x), chunk=chunk)), residual=residual, chunk=chunk, out=into)
        y = y if self.mlp_out_norm is None else self.mlp_out_norm.add_to(x, y.float(), out=out)
        if out is not None and y is not out:
            out.copy_(y)
            return out
        return y


class Embed:
    """The token embedding: a table on its place, or a paged one that reads only a step's rows from the file; a
    quantized one (`quant`) dequantizes the rows it reads."""

    def __init__(self, table: Any, dtype: torch.dtype, quant: Segment | None = None, scale: float | None = None):
        self.paged = hasattr(table, "rows")
        self.quant = None if quant is None else QuantTable(table, quant.fmt, quant.k)
        self.table = table if self.paged or quant is not None or table.dtype == dtype else table.to(dtype)  # [V, hidden]
        self.dtype = dtype
        # rows times `scale` (Gemma's sqrt(hidden)), in the weights' dtype as transformers multiplies them
        self.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32 if quant is not None else dtype)

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            rows = self.quant.rows(token_ids)  # [T, hidden] f32, exact
        else:
            rows = (self.table.rows(token_ids) if self.paged else torch.nn.functional.embedding(token_ids, self.table)).to(self.dtype)  # [T, hidden]
        if self.scale is not None:
            rows = rows * self.scale.to(rows.device)
        return rows.to(STREAM)  # the stored dtype, as resident rows go, then the f32 stream


class Head:
    """Final norm and LM head: hidden states -> f32 logits."""

    def __init__(self, norm: torch.Tensor, lm: torch.Tensor, eps: float, dtype: torch.dtype, quant: list[Segment] | None = None,
                 softcap: float | None = None):
        self.norm = RMSNorm(norm, eps, STREAM)
        lm = lm if quant is not None or lm.dtype == dtype else lm.to(dtype)
        self.lm = make_linear(lm, None, segments=quant)  # a tied table's bytes are shared: no panels
        self.softcap = softcap  # logits -> tanh(logits / cap) * cap, where the config caps them

    def __call__(self, x: torch.Tensor, chunk: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> f32 logits [T, V]; `chunk` marks the tokens of prompt chunks (see DecoderBlock)."""
        if self.lm.folds and x.dtype == torch.float32:  # quantized rows: the norm made as the kernel quantizes x
            logits = self.lm(x, norm=(self.norm.weight, self.norm.eps), chunk=chunk)
        else:
            logits = self.lm(self.norm(x), chunk=chunk).float()  # [T, V]
        return logits if self.softcap is None else torch.tanh(logits / self.softcap).mul_(self.softcap)


def layouts(cfg: LlamaConfig, names: set[str]) -> dict[str, dict[str, list[str]]]:
    """Each block's parts as the modules want them, from the .jlm's tensor names (stacked along dim 0)."""
    out: dict[str, dict[str, list[str]]] = {"embed": {"table": ["embed.weight"]}}
    for i in range(cfg.num_layers):
        p, a = f"blocks.{i}.", f"blocks.{i}.self_attn."
        block = {
            "input_norm": [p + "input_layernorm.weight"],
            "post_norm": [p + "post_attention_layernorm.weight"],
            "qkv": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
            "o": [a + "o_proj.weight"],
            "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            "down": [p + "mlp.down_proj.weight"],
        }
        if a + "q_proj.bias" in names:
            block["qkv_bias"] = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
        if cfg.qk_norm:
            block["q_norm"], block["k_norm"] = [a + "q_norm.weight"], [a + "k_norm.weight"]
        out[f"blocks.{i}"] = block
    untied = not cfg.tie_word_embeddings and "head.lm_head.weight" in names
    out["head"] = {"norm": ["head.norm.weight"], "lm": ["head.lm_head.weight" if untied else "embed.weight"]}
    return out


class LlamaModel:
    """embed -> blocks -> head, computing in `dtype`: builds each block from its parts on the device it is given
    (engine/runner.py runs them where the placement holds them)."""

    block_layouts = staticmethod(layouts)  # (config, the .jlm's tensor names) -> each block's parts
    stack = staticmethod(fused.stack)  # (layer blocks, rows) -> a step's layers in one call where they fuse, or None (runner.py)

    def __init__(self, cfg: LlamaConfig, jlm: JLMFile, dtype: torch.dtype):
        self.cfg = cfg
        self.dtype = dtype
        # Where bf16 is emulated on the CPU (host blocks always run there), everything but the projections runs in
        # f32 (K/V included): fewer conversions, faster there, never less exact. Elsewhere attention and KV follow the
        # weights, and the residual stream stays f32 whatever the weights (STREAM).
        self.act = torch.float32 if dtype == torch.bfloat16 and not bf16_matmul_native("cpu") else dtype
        self.layouts = self.block_layouts(cfg, set(jlm.names))
        quantization = jlm.meta.get("quantization") or {}
        self.quant = {  # block -> part -> its segments, for the parts stored quantized
            block: {part: seg for part, names in parts.items() if (seg := segments_for(names, quantization)) is not None}
            for block, parts in self.layouts.items()
        }
        self.rope_caches = [RopeCache(inv, self.act) for inv in self.rope_freqs(cfg)]  # a forward's RoPE tables are rows of these
        # A kept-quantized model keeps K/V in f16, as llama.cpp does: half an f32 cache's bytes to hold and to read
        # at every step; each value rounds to f16's 11 significant bits once, as it is written, and is read exactly.
        self.kv_dtype = torch.float16 if quantization and self.act == torch.float32 else self.act

    @staticmethod
    def rope_freqs(cfg: LlamaConfig) -> list[torch.Tensor]:
        """The inverse frequencies of each RoPE table a forward makes (`cfg.rope_index` picks a layer's)."""
        return [rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)]

    def embed_scale(self) -> float | None:
        """What the token embedding's rows are multiplied by (None: nothing)."""
        return None

    def build(self, name: str, parts: dict[str, Any], device: torch.device, once: bool = False) -> Any:
        """The runnable block `name` from its parts, already on `device`. `once`: built for one turn from a paged
        block's buffers, so its weights stay as read (rewriting them into panels would cost a pass every step);
        a block that stays takes its f32 projections as panels (`Linear`), its parts rewritten in place."""
        quant = self.quant[name]
        if name == "embed":
            return Embed(parts["table"], self.dtype, quant["table"][0] if "table" in quant else None, self.embed_scale())
        if name == "head":
            return Head(parts["norm"], parts["lm"], self.cfg.rms_norm_eps, self.dtype, quant.get("lm"), self.cfg.final_logit_softcapping)
        index = int(name.split(".", 1)[1])
        return DecoderBlock(self.cfg, index, parts, self.dtype, self.act, device, panels=not once, quant=quant)

    def begin(self, positions: torch.Tensor) -> tuple[RopeTables, ...]:
        """What every block of a forward over `positions` [T] reads: the RoPE tables, one per `rope_freqs`."""
        return tuple(cache.tables(positions) for cache in self.rope_caches)

    def kv_pool(self, devices: list[torch.device] | None = None, pages: list[int] | None = None, limit: int | None = None) -> PagePool:
        """The pages sessions' K/V live in, each layer's on its block's place (`devices`, one per layer; default the
        CPU), `pages` per group of layers to start with, at most `limit` bytes held and cached (engine/pages.py)."""
        c = self.cfg
        return PagePool(c.num_kv_heads, c.head_dim, self.kv_dtype, devices or [torch.device("cpu")] * c.num_layers,
                        [c.window(i) for i in range(c.num_layers)], pages, limit)


# -- sources: Hugging Face and GGUF --

# GGUF tensor names -> .jlm names (the Hugging Face checkpoint's own suffixes inside each block).
_GGUF_BLOCK_NAMES = {
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
_GGUF_TOP_NAMES = {"token_embd.weight": "embed.weight", "output_norm.weight": "head.norm.weight", "output.weight": "head.lm_head.weight"}
_HF_TOP_NAMES = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "head.norm.weight", "lm_head.weight": "head.lm_head.weight"}


def _layer(name: str, prefix: str) -> tuple[str, str] | None:
    """`{prefix}{i}.{rest}` -> (i, rest)."""
    index, _, rest = name.removeprefix(prefix).partition(".")
    return (index, rest) if name.startswith(prefix) and index.isdecimal() and rest else None


def hf_config(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json -> the .jlm config."""
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


def hf_tensor_name(name: str, config: dict[str, Any]) -> str | None:
    """A checkpoint name -> its .jlm name; None for what the model does not read (a tied head's copy, rotary buffers)."""
    if name == "lm_head.weight" and config["tie_word_embeddings"]:
        return None
    if name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[name]
    if layer := _layer(name, "model.layers."):
        return f"blocks.{layer[0]}.{layer[1]}"
    return None


def gguf_config(g: GGUFMeta) -> dict[str, Any]:
    """llama.cpp's `{arch}.*` hyperparameters and the tensors present -> the .jlm config."""
    a = g.arch
    num_heads = int(g.field(f"{a}.attention.head_count"))
    hidden = int(g.field(f"{a}.embedding_length"))
    embd = g.shapes.get("token_embd.weight")
    if embd is None:
        raise ValueError("no token_embd.weight tensor")
    rope_scaling = None
    if g.field(f"{a}.rope.scaling.type", None) == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(g.field(f"{a}.rope.scaling.factor"))}
    if "rope_freqs.weight" in g.shapes:  # llama 3.1-style per-frequency factors
        rope_scaling = {"rope_type": "factors", "factors": g.values("rope_freqs.weight")}
    return {
        "vocab_size": int(embd[0]),
        "hidden_size": hidden,
        "intermediate_size": int(g.field(f"{a}.feed_forward_length")),
        "num_layers": int(g.field(f"{a}.block_count")),
        "num_heads": num_heads,
        "num_kv_heads": int(g.field(f"{a}.attention.head_count_kv", num_heads)),
        "head_dim": int(g.field(f"{a}.attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(g.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g.field(f"{a}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(g.field(f"{a}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in g.shapes,
        "attention_bias": "blk.0.attn_q.bias" in g.shapes,
        "qk_norm": "blk.0.attn_q_norm.weight" in g.shapes,
    }


def gguf_tensor_name(name: str) -> str | None:
    """A GGUF tensor name -> its .jlm name; None for one this family does not know."""
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    if (layer := _layer(name, "blk.")) and layer[1] in _GGUF_BLOCK_NAMES:
        return f"blocks.{layer[0]}.{_GGUF_BLOCK_NAMES[layer[1]]}"
    return None


def gguf_fix(g: GGUFMeta, name: str, config: dict[str, Any]) -> TensorFix | None:
    """llama.cpp interleaves the q/k rows of its `llama` arch (its 'norm' RoPE), not of qwen2/qwen3: undo that."""
    if g.arch != "llama":
        return None
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        heads = int(config["num_heads"])
    elif name.endswith(("k_proj.weight", "k_proj.bias")):
        heads = int(config["num_kv_heads"])
    else:
        return None
    return lambda w: _unpermute(w, heads)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows back to Hugging Face's rotate-half order."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def build(config: dict[str, Any], jlm: JLMFile, dtype: torch.dtype, device: torch.device, on_progress: Any = None) -> LlamaModel:
    """The decoder without its blocks: the loader places them (engine/memory/placement.py), so `device` and `on_progress`
    are the placement's business."""
    return LlamaModel(LlamaConfig.from_dict(config), jlm, dtype)


FAMILY = Family(
    archs=ARCHS,
    embeds=False,
    config=LlamaConfig.from_dict,
    build=build,
    hf=HFSource(model_types={arch: arch for arch in ARCHS}, config=hf_config, tensor_name=hf_tensor_name),
    # Mistral's GGUF files say `llama`.
    gguf=GGUFSource(archs={"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}, config=gguf_config,
                    tensor_name=gguf_tensor_name, fix=gguf_fix, config_tensors=("rope_freqs.weight",)),
)

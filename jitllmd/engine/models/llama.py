"""The Llama family (llama, mistral, qwen2, qwen3, SmolLM): one forward over a packed token dimension."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from ..devices import bf16_matmul_native
from ..jlm import JLMFile
from ..kernels import (
    MAX_ROWS,
    attend_chunk,
    attend_rows,
    pack_panels,
    panel_linear,
    rms_norm_rows,
    rope_rows,
    rows_kernel,
    rows_linear,
    silu_mul_rows,
)
from ..kv import RowSpan, SessionKV
from ..placement import Placement

__all__ = ["ARCHS", "DecoderBlock", "Embed", "Head", "LlamaConfig", "LlamaModel", "layouts"]

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# Up to this many tokens (decode rows of a batched step), f32 projections stay weight-stationary row-block GEMMs:
# MKL's sgemm with a transposed weight and a small M reads the weight far slower (measured, SmolLM2 f32 step:
# 2 rows 86 ms as F.linear against 28 ms for 1 row as row blocks).
ROW_BLOCK_MAX_TOKENS = 32
_UPCAST_MIN_TOKENS = 8  # below this an emulated bf16 GEMV beats upcasting the weight
# The residual stream between blocks, and the norms that read it, in f32 whatever the weights (as llama.cpp keeps it):
# a bf16 stream rounds every block's sum, and on SmolLM2 that flipped a near tie of greedy tokens between a prompt fed
# whole and the same prompt fed after a cached prefix.
STREAM = torch.float32


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
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in f32, with llama3 or linear scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if not s:
        return inv
    kind = s.get("rope_type", s.get("type"))
    factor = float(s.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    if kind == "factors":  # per-frequency divisors, as GGUF's rope_freqs tensor stores llama3 scaling
        return inv / torch.tensor(s["factors"], dtype=torch.float32)
    if kind == "llama3":
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, smoothed, scaled)
    return inv


class Linear:
    """A projection, run the way the device runs it fastest (measured on 2-core AVX2 CPUs, bench/decode.py).

    f32 weights a block keeps on the CPU (`panels`): rewritten once, in place, into column panels that one compiled
    kernel multiplies for any number of rows, ~185 GFLOP/s on a prompt where MKL's sgemm reaches ~145 (it repacks
    the weight every call), and one pass over the weights for a decode step's rows. Other f32 weights on the CPU
    (a paged block's, read for one turn; a tied head's, shared with the embedding): the few-row kernel, else one
    batched GEMV per thread over row blocks of the weight (a view, no copy), ~20 GB/s where one sgemv call reaches
    ~13. bf16 on a CPU without bf16 units: many-token batches multiply in f32 (the weight upcast per call, the
    result rounded to bf16 as a bf16 GEMM's is); single tokens run the emulated bf16 GEMV, which is still
    memory-bound.
    """

    __slots__ = ("bias", "chunks", "panels", "row_blocks", "rows", "upcast", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, upcast: bool = False, chunks: int = 1, panels: bool = False):
        self.panels = (
            panels and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.is_contiguous() and weight.dim() == 2
            and rows_kernel() is not None
        )
        self.weight = pack_panels(weight) if self.panels else weight  # [out, in]; panels: same bytes, panel order
        self.bias = bias
        self.upcast = upcast
        self.chunks = chunks if chunks > 1 and weight.shape[0] % chunks == 0 and not self.panels else 1
        o, i = weight.shape
        self.row_blocks = weight.view(self.chunks, o // self.chunks, i)  # [chunks, out/chunks, in], a view
        self.rows = (  # the few-row kernel (engine/kernels): each weight row read once for all of a step's rows
            not self.panels and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.is_contiguous() and i % 8 == 0 and rows_kernel() is not None
        )

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, norm: tuple[torch.Tensor, float] | None = None,
                 gated: bool = False) -> torch.Tensor:
        """x @ W.T (+ bias), added to `residual` where one is given (by the panel kernel, in its first pass). Panels
        only: with `norm` (weight, eps) the product is of RMSNorm(x) * weight, with `gated` of silu(gate) * up of x
        [T, 2 * in], made as the kernel packs its rows."""
        if self.panels:
            y = panel_linear(x, self.weight, residual, norm=norm, gated=gated)
            return y if self.bias is None else y + self.bias
        assert norm is None and not gated, "only the panel kernel folds a norm or the gate into its input"
        y = self.project(x)
        # the stream keeps its dtype: a bf16 stream adds the product rounded to bf16, as a bf16 GEMM's would be
        return y if residual is None else residual + y.to(residual.dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T (+ bias) where the weight keeps its [out, in] layout."""
        T = x.shape[0]
        if self.rows and 0 < T <= MAX_ROWS:
            y = rows_linear(x, self.weight)  # [T, out] f32, bf16 weights widened exactly: kept in f32, never less exact
            return y if self.bias is None else y + self.bias
        if self.chunks > 1 and 0 < T <= ROW_BLOCK_MAX_TOKENS:
            c = self.chunks
            y = torch.bmm(x.expand(c, T, x.shape[1]), self.row_blocks.transpose(1, 2))  # [c, T, o/c]: each thread reads its rows once
            y = y.view(1, -1) if T == 1 else y.transpose(0, 1).reshape(T, -1)  # [T, o]
            return y if self.bias is None else y + self.bias
        if self.upcast and x.shape[0] >= _UPCAST_MIN_TOKENS:
            b = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), b).to(self.weight.dtype)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face computes it: in f32, cast back, then scaled by the weight."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2 and _kernel_norm(x):
        return rms_norm_rows(x, weight, eps)  # one kernel call (engine/kernels): a step's few rows or a prompt's
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def _kernel_norm(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.shape[1] % 8 == 0 and rows_kernel() is not None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, D]; cos: [T, 1, D]; sin: [T, 1, D] with its first half negated,
    so rotate_half(x) * sin becomes cat(x2, x1) * sin: three kernels instead of six."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


class DecoderBlock:
    """One transformer layer: attention with its session KV, then the gated MLP. Built from the parts
    `LlamaModel.layouts` names (q, k and v stacked into qkv; gate and up into gate_up: fewer, wider GEMVs)."""

    def __init__(
        self, cfg: LlamaConfig, index: int, t: dict[str, torch.Tensor], dtype: torch.dtype, act: torch.dtype, upcast: bool, chunks: int, panels: bool
    ):
        self.index = index
        self.act = act  # q, k, v, RoPE, attention and KV; projections run in the weights' dtype, the stream in f32
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.window = cfg.sliding_window
        cast = lambda w: w if w.dtype == dtype else w.to(dtype)
        self.input_norm = t["input_norm"].to(STREAM)  # the norms read the f32 stream
        self.post_norm = t["post_norm"].to(STREAM)
        bias = cast(t["qkv_bias"]) if "qkv_bias" in t else None
        self.qkv = Linear(cast(t["qkv"]), bias, upcast=upcast, chunks=chunks, panels=panels)
        self.o = Linear(cast(t["o"]), None, upcast=upcast, chunks=chunks, panels=panels)
        self.q_norm = t["q_norm"].to(act) if cfg.qk_norm else None
        self.k_norm = t["k_norm"].to(act) if cfg.qk_norm else None
        self.gate_up = Linear(cast(t["gate_up"]), None, upcast=upcast, chunks=chunks, panels=panels)
        self.down = Linear(cast(t["down"]), None, upcast=upcast, chunks=chunks, panels=panels)
        self.intermediate = cfg.intermediate_size
        cpu_kernels = self.input_norm.device.type == "cpu" and rows_kernel() is not None
        self.silu_kernel = cpu_kernels and self.intermediate % 8 == 0  # silu(gate) * up in one pass (engine/kernels)
        # the decode-attention kernel (engine/kernels) takes f32 caches on the CPU, for head sizes it vectorises
        self.decode_kernel = act == torch.float32 and self.head_dim % 8 == 0 and cpu_kernels
        self.chunk_kernel = act == torch.float32 and self.head_dim % 4 == 0 and cpu_kernels  # a prompt chunk's attention
        self.rope_kernel = act == torch.float32 and self.head_dim % 16 == 0 and cpu_kernels
        # f32 panels: the norms and silu(gate) * up are made by the projections' own row packing, not passes of their own
        self.fold = (
            self.qkv.panels and self.gate_up.panels and self.down.panels and act == torch.float32 and cfg.hidden_size % 8 == 0
            and self.intermediate % 8 == 0
        )

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: list[RowSpan], keep: list[int] | None = None) -> torch.Tensor:
        """-> the new hidden states [T, hidden]; with `keep` (ascending token indices) only those tokens' [len(keep),
        hidden]: every token's K/V still goes to its session, but attention and the MLP run for the kept ones only
        (the last block of a prompt step, whose other tokens' outputs nothing reads)."""
        T = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.fold:
            qkv = self.qkv(x, norm=(self.input_norm, self.eps))  # [T, (H + 2*Hkv) * D]
        else:
            qkv = self.qkv(rms_norm(x, self.input_norm, self.eps)).to(self.act)
        qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
        v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((rms_norm(qk[:, :H], self.q_norm, self.eps), rms_norm(qk[:, H:], self.k_norm, self.eps)), dim=1)
        if self.rope_kernel and qk.dtype == torch.float32 and cos.device.type == "cpu":
            rope_rows(qk, cos, sin)  # in place, in qkv's own rows: one pass
        else:
            qk = apply_rope(qk, cos, sin)  # q and k rotated in one pass
        q, k = qk[:, :H], qk[:, H:]  # [T, H, D], [T, Hkv, D]
        if keep is not None:
            attn = torch.cat([
                self.attend(q[r.start : r.start + r.num_tokens], k[r.start : r.start + r.num_tokens], v[r.start : r.start + r.num_tokens], r,
                            [i - r.start for i in keep if r.start <= i < r.start + r.num_tokens])
                for r in rows
            ])
            x = x[keep]
        elif T == len(rows) and self.decode_kernel:  # every row feeds one token: one call for all their attention
            attn = attend_rows(q, k, v, [r.kv.k[self.index] for r in rows], [r.kv.v[self.index] for r in rows],
                               [r.kv.length + 1 for r in rows], [r.key_start for r in rows])
        elif len(rows) == 1:
            attn = self.attend(q, k, v, rows[0])
        else:
            attn = torch.empty((T, H * D), dtype=self.act, device=x.device)
            for row in rows:
                s, n = row.start, row.num_tokens
                attn[s : s + n] = self.attend(q[s : s + n], k[s : s + n], v[s : s + n], row)
        x = self.o(attn, residual=x)  # [T, hidden] f32: the stream
        if self.fold:
            return self.down(self.gate_up(x, norm=(self.post_norm, self.eps)), residual=x, gated=True)
        h = rms_norm(x, self.post_norm, self.eps)
        gu = self.gate_up(h)  # [T, 2*I]
        if self.silu_kernel and gu.dtype == torch.float32:
            return self.down(silu_mul_rows(gu), residual=x)
        return self.down(F.silu(gu[:, : self.intermediate]).mul_(gu[:, self.intermediate :]), residual=x)  # in place: one pass fewer

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: RowSpan, only: list[int] | None = None) -> torch.Tensor:
        """Write this chunk's K/V at the row's position and attend over its whole history. -> [n, H*D], or with
        `only` (ascending indices into the chunk) just those queries' [len(only), H*D]."""
        kv: SessionKV = row.kv
        n, p = row.num_tokens, kv.length
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        g = H // Hkv
        kc, vc = kv.k[self.index], kv.v[self.index]  # [Hkv, cap, D], on this block's place
        kc[:, p : p + n] = k.transpose(0, 1)
        vc[:, p : p + n] = v.transpose(0, 1)
        if only is not None:
            return torch.cat([self.attend_one(q[i], kc, vc, p + i, row.key_start) for i in only]) if only else q.new_empty((0, H * D))
        ks = row.key_start
        if self.chunk_kernel and kc.device.type == "cpu":  # flash-style in C: no mask, no score matrix
            return attend_chunk(q, kc, vc, p, ks, self.window)
        if p == 0 and ks == 0 and (self.window is None or n <= self.window):
            # A prompt's first chunk: plain causal attention over its own keys, no mask to build or read.
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[None, :, :n], vc[None, :, :n], is_causal=True, enable_gqa=True)
            return out[0].transpose(0, 1).reshape(n, H * D)
        # GQA without copying K/V: the g query heads of one kv head become g*n query rows.
        qg = q.view(n, Hkv, g, D).permute(1, 2, 0, 3).reshape(1, Hkv, g * n, D)
        # 4-D inputs take the fused CPU kernel; 3-D ones fall back to the math path.
        out = F.scaled_dot_product_attention(qg, kc[None, :, ks : p + n], vc[None, :, ks : p + n], attn_mask=row.mask_on(kc.device))
        return out.view(Hkv, g, n, D).permute(2, 0, 1, 3).reshape(n, H * D)

    def attend_one(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: int, key_start: int) -> torch.Tensor:
        """One query q [H, D] at `pos`, its K/V already in the cache, over the keys it sees. -> [1, H*D]"""
        if self.chunk_kernel and kc.device.type == "cpu":
            return attend_chunk(q[None], kc, vc, pos, key_start, self.window)
        lo = max(key_start, pos - self.window + 1) if self.window else key_start
        out = F.scaled_dot_product_attention(q[:, None, :][None], kc[None, :, lo : pos + 1], vc[None, :, lo : pos + 1], enable_gqa=True)
        return out.reshape(1, -1)


class Embed:
    """The token embedding: a table on its place, or a paged one that reads only a step's rows from the file."""

    def __init__(self, table: Any, dtype: torch.dtype, act: torch.dtype):
        self.paged = hasattr(table, "rows")
        self.table = table if self.paged or table.dtype == dtype else table.to(dtype)  # [V, hidden]
        self.dtype, self.act = dtype, act

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.rows(token_ids) if self.paged else F.embedding(token_ids, self.table)  # [T, hidden]
        return rows.to(self.dtype).to(STREAM)  # the stored dtype, as resident rows go, then the f32 stream


class Head:
    """Final norm and LM head: hidden states -> f32 logits."""

    def __init__(self, norm: torch.Tensor, lm: torch.Tensor, eps: float, dtype: torch.dtype, act: torch.dtype, upcast: bool, chunks: int):
        self.norm = norm.to(STREAM)
        self.lm = Linear(lm if lm.dtype == dtype else lm.to(dtype), None, upcast=upcast, chunks=chunks)
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(rms_norm(x, self.norm, self.eps)).float()  # [T, V]


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
    """embed -> blocks -> head, each block on its place (engine/placement.py), computing in `dtype`."""

    def __init__(self, cfg: LlamaConfig, jlm: JLMFile, dtype: torch.dtype):
        self.cfg = cfg
        self.dtype = dtype
        # Where bf16 is emulated on the CPU (host blocks always run there), everything but the projections runs in
        # f32 (K/V included): fewer conversions, faster there, never less exact. Elsewhere attention and KV follow the
        # weights, and the residual stream stays f32 whatever the weights (STREAM).
        self.act = torch.float32 if dtype == torch.bfloat16 and not bf16_matmul_native("cpu") else dtype
        self.layouts = layouts(cfg, set(jlm.names))
        self.inv_freq = rope_inv_freq(cfg)
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.placement: Placement | None = None  # set by the loader

    def build(self, name: str, parts: dict[str, Any], device: torch.device, once: bool = False) -> Any:
        """The runnable block `name` from its parts, already on `device`. `once`: built for one turn from a paged
        block's buffers, so its weights stay as read (rewriting them into panels would cost a pass every step);
        a block that stays takes its f32 projections as panels (`Linear`), its parts rewritten in place."""
        upcast = self.dtype == torch.bfloat16 and not bf16_matmul_native(device.type)
        chunks = torch.get_num_threads() if device.type == "cpu" and self.dtype == torch.float32 else 1
        if name == "embed":
            return Embed(parts["table"], self.dtype, self.act)
        if name == "head":
            return Head(parts["norm"], parts["lm"], self.cfg.rms_norm_eps, self.dtype, self.act, upcast, chunks)
        index = int(name.split(".", 1)[1])
        return DecoderBlock(self.cfg, index, parts, self.dtype, self.act, upcast, chunks, panels=not once)

    @property
    def device(self) -> torch.device:
        """Where a forward's inputs go: the token embedding's place."""
        assert self.placement is not None
        return self.placement.device_of(0)

    def new_kv(self, capacity: int) -> SessionKV:
        c = self.cfg
        devices = self.placement.kv_devices() if self.placement is not None else [torch.device("cpu")] * c.num_layers
        return SessionKV(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.act, devices)

    def weight_nbytes(self) -> int:
        """Weight bytes a decode step reads (every block but the embedding table, of which it reads a row)."""
        assert self.placement is not None
        return self.placement.decode_bytes()

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: list[RowSpan],
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run a packed batch. token_ids, positions: [T]; rows cover [0, T) in order.

        Each row's K/V are written at its session position, which then advances by the row's tokens. The hidden
        state crosses each seam to the next block's device. Returns f32 logits [len(logits_at), V] (every token
        when logits_at is None).
        """
        assert self.placement is not None
        for row in rows:
            row.kv.reserve(row.kv.length + row.num_tokens)
            row.begin(self.group, self.cfg.sliding_window)
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        half = emb.shape[-1] // 2
        sin = emb.sin()
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # the sign rotate_half puts on x2
        rope = {positions.device: (emb.cos().to(self.act), sin.to(self.act))}
        walk = self.placement.walk()
        try:
            embed, dev = next(walk)
            x = embed(token_ids.to(dev))  # [T, hidden]
            # The last block computes only the tokens whose logits are asked for (a prompt's last), as llama.cpp does.
            at = logits_at.tolist() if logits_at is not None else None
            keep = at if at is not None and len(at) < x.shape[0] and at == sorted(set(at)) else None
            for layer in range(self.cfg.num_layers):
                block, dev = next(walk)
                x = x.to(dev)  # over a seam, if there is one
                if dev not in rope:
                    cos, sin = next(iter(rope.values()))
                    rope[dev] = (cos.to(dev), sin.to(dev))
                x = block(x, *rope[dev], rows, keep if layer == self.cfg.num_layers - 1 else None)
            for row in rows:
                row.kv.length += row.num_tokens
            if logits_at is not None and keep is None:
                x = x[logits_at.to(x.device)]
            head, dev = next(walk)
            return head(x.to(dev))
        finally:
            walk.close()

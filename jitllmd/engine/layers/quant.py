"""Quantized weights kept in GGUF's own block layouts: the formats, a torch reference of each (dequantize a block,
then multiply: runs on any device), round-to-nearest quantizers for `convert -dtype`, and the projection and
embedding table that read the blocks through the compiled kernels where they run.

A quantized weight [N, K] is N rows of bytes, each row K / block_elems blocks back to back (docs/format.md). Rows are
independent, so q, k and v (or gate and up) stack by concatenating their bytes, even where their types differ (a
Q4_K_M file mixes Q4_K and Q6_K rows): a projection is a list of segments, one per stacked tensor.

Where rounding happens: the tokens of a step's single-token rows (decode rows) are multiplied llama.cpp's way (kernels/quant.c), each x row quantized to int8 per 32 inputs and dotted in integers, so
|y - x @ W.T| <= sum_k |W[o, k]| * d_k / 2 with d_k that block's amax / 127, nothing else rounding but f32 sums; the
tokens of a longer row (a prompt chunk, whatever its size: a server's prompt chunk must not change a prompt's
numbers) are multiplied against the weights dequantized a panel at a time, unless the row's prompt feeds so few new
tokens (a follow-up turn) that the integer kernel is the faster (QFormat.short, short_feed): then they are multiplied as
decode rows are, decided from that row's own feed: where the kernels have bf16 units
(kernels.bf16_units: AMX or AVX512_BF16) x and those weights are rounded to bf16 (to nearest even) and the products
summed in f32, a bf16 model's rounding at 3-4x f32's speed; elsewhere in f32, exact up to f32 sums. A token's path
depends on its own row only, never on the rows beside it. The reference path (no kernels, or not the CPU)
dequantizes and multiplies in f32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..kernels import (
    QUANT_TYPES,
    BF16Rows,
    Gate,
    bf16_runs,
    bf16_units,
    check_quant_weight,
    dequant_rows,
    gated_rows,
    quant_runs,
    rms_norm_rows,
    rows_kernel,
)
from ..kv import RowSpan

__all__ = ["FORMATS", "QFormat", "QuantLinear", "QuantTable", "Segment", "chunk_tokens", "dequantize", "quantize", "quantizable", "segments_for", "short_feed"]


@dataclass(frozen=True)
class QFormat:
    """A GGUF block format: `block` weights in `nbytes` bytes; `ggml` is ggml's type id (the kernels' too). `short`:
    per kernel variant, the most tokens of a prompt feed whose product the decode rows' integer kernel still runs no
    slower than the prompt chunks' exact path (bench/short_prompt.py measures them; see short_feed)."""

    name: str
    ggml: int
    block: int
    nbytes: int
    short: dict[str, int] = field(default_factory=dict, compare=False, hash=False)

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.nbytes


def _short(avx2: int, vnni: int, bf16: int, amx: int) -> dict[str, int]:
    return {"avx2+fma": avx2, "avx512+vnni": vnni, "avx512+bf16": bf16, "avx512+amx": amx}


# `short` from bench/short_prompt.py on 2 Zen 5 cores (avx2+fma forced, avx512+vnni forced, avx512+bf16), 2026-12-01:
# a projection's crossover, the lesser of two runs, rounded down to the token counts measured. Without bf16 units the
# exact path dequantizes f32 panels, so the integer kernel wins far longer. With them a projection alone crosses at
# 8-16 tokens, but a short feed runs the fused layer (no per-op dispatch): at the model (--followup) 16 tokens still
# won on SmolLM2 Q4_1/Q8_0 (2.9 decode steps against 4.8) and Qwen Q4_K_M (2.9 against 6.2), 24 tied, so bf16 takes
# 16. AMX was not on that CPU: its tiles are faster than vdpbf16ps (and the fused layer is off for its bf16 prompt
# attention), so it takes the projections' 8.
FORMATS: dict[str, QFormat] = {
    f.name: f
    for f in (
        QFormat("Q4_0", 2, 32, 18, _short(48, 32, 16, 8)),
        QFormat("Q4_1", 3, 32, 20, _short(64, 64, 16, 8)),
        QFormat("Q5_0", 6, 32, 22, _short(32, 64, 16, 8)),
        QFormat("Q5_1", 7, 32, 24, _short(32, 48, 16, 8)),
        QFormat("Q8_0", 8, 32, 34, _short(24, 64, 16, 8)),
        QFormat("Q4_K", 12, 256, 144, _short(32, 64, 16, 8)),
        QFormat("Q5_K", 13, 256, 176, _short(32, 48, 16, 8)),
        QFormat("Q6_K", 14, 256, 210, _short(32, 64, 16, 8)),
    )
}


def short_feed(types: set[str] | list[str], variant: str | None) -> int:
    """The most new prompt tokens a row may feed and still take the decode rows' integer kernel, for a model whose
    quantized tensors are of `types`, under kernel `variant` (None: no kernels, 0): the least of its formats' figures,
    so no projection runs a short feed slower than its exact path would. A float model: 0 (its few-row kernels need
    no marking)."""
    kinds = [FORMATS[t] for t in types if t in FORMATS]
    if variant is None or not kinds:
        return 0
    return min(f.short.get(variant, 0) for f in kinds)


@dataclass(frozen=True)
class Segment:
    """One stacked tensor of a quantized part: `rows` rows of `k` inputs in format `fmt`."""

    fmt: QFormat
    rows: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.fmt.row_bytes(self.k)


# -- the torch reference: blocks -> f32 --------------------------------------------------------------------------


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row -> [n, 1] f32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat((qs & 15, qs >> 4), dim=-1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """[n, count / 8] little-endian bytes -> [n, count] bits, bit j of the word as element j."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], count)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> 8 six-bit scales and 8 six-bit mins, [n, 8] each."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=-1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=-1)
    return sc.float(), mn.float()


def _dequant_blocks(b: torch.Tensor, fmt: QFormat) -> torch.Tensor:
    """Blocks [n, nbytes] uint8 -> [n, block] f32, in the order of operations gguf's reference uses."""
    n = b.shape[0]
    if fmt.name == "Q8_0":
        return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()
    if fmt.name == "Q4_0":
        return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()
    if fmt.name == "Q4_1":
        return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])
    if fmt.name in ("Q5_0", "Q5_1"):
        lo = 2 if fmt.name == "Q5_0" else 4
        q = (_nibbles(b[:, lo + 4 :]) | (_bits(b[:, lo : lo + 4], 32) << 4)).float()
        if fmt.name == "Q5_0":
            return _f16(b[:, :2]) * (q - 16)
        return _f16(b[:, :2]) * q + _f16(b[:, 2:4])
    if fmt.name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b[:, 4:16])
        d = (_f16(b[:, :2]) * sc).unsqueeze(-1)  # [n, 8, 1]
        dm = (_f16(b[:, 2:4]) * mn).unsqueeze(-1)
        qs = b[:, 16:] if fmt.name == "Q4_K" else b[:, 48:]
        q = torch.stack((qs.reshape(n, 4, 32) & 15, qs.reshape(n, 4, 32) >> 4), dim=2).reshape(n, 8, 32)
        if fmt.name == "Q5_K":
            qh = b[:, 16:48].unsqueeze(1) >> torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 8, 1)  # [n, 8, 32]
            q = q | ((qh & 1) << 4)
        return (d * q.float() - dm).reshape(n, 256)
    if fmt.name == "Q6_K":
        ql, qh = b[:, :128], b[:, 128:192]
        d = (_f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)  # [n, 16, 1]
        low = torch.stack((ql.reshape(n, 2, 64) & 15, ql.reshape(n, 2, 64) >> 4), dim=2).reshape(n, 8, 32)
        high = (qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)) & 3
        q = (low | (high.reshape(n, 8, 32) << 4)).to(torch.int8) - 32
        return (d * q.reshape(n, 16, 16).float()).reshape(n, 256)
    raise ValueError(f"no reference for {fmt.name}")


def dequantize(w: torch.Tensor, fmt: QFormat, n: int, k: int) -> torch.Tensor:
    """n rows of `fmt` blocks (w's bytes, any shape) -> [n, k] f32, on w's device."""
    blocks = w.reshape(-1)[: n * fmt.row_bytes(k)].view(-1, fmt.nbytes)
    return _dequant_blocks(blocks, fmt).reshape(n, k)


# -- quantizers (convert -dtype): round to nearest per block, as llama.cpp's quantizers without an importance matrix --


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (torch.round rounds them to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[n, 1] f32 -> [n, 2] bytes of its f16."""
    return x.to(torch.float16).view(torch.uint8).reshape(x.shape[0], 2)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[n, 32] values < 16 -> [n, 16] bytes: element j low, element j + 16 high."""
    return q[:, :16] | (q[:, 16:] << 4)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _quant_q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(dim=1, keepdim=True) / 127
    q = _roundf(x * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat((_f16_bytes(d), q), dim=1)


def _signed_max(x: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude in each row, with its sign: [n, 1]."""
    return torch.gather(x, 1, x.abs().argmax(dim=1, keepdim=True))


def _quant_q4_0(x: torch.Tensor) -> torch.Tensor:
    d = _signed_max(x) / -8
    q = torch.trunc(x * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat((_f16_bytes(d), _pack_nibbles(q)), dim=1)


def _quant_q5_0(x: torch.Tensor) -> torch.Tensor:
    d = _signed_max(x) / -16
    q = torch.trunc(x * _inverse(d) + 16.5).clamp(0, 31).to(torch.uint8)
    high = ((q >> 4) & 1).reshape(-1, 4, 8) << torch.arange(8, dtype=torch.uint8)
    qh = high.sum(dim=-1, dtype=torch.uint8)  # [n, 4]: bit j of the little-endian word is element j's fifth bit
    return torch.cat((_f16_bytes(d), qh, _pack_nibbles(q & 15)), dim=1)


def _fit_scale_min(x: torch.Tensor, weights: torch.Tensor, nmax: int, steps: int = 20, rmin: float = -1.0, rdelta: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's make_qkx2_quants over rows of sub-blocks x [n, 32]: the scale and (non-positive) min whose
    weighted squared error is least among a few candidates. -> scale [n], min [n] (x ~ scale * q + min)."""
    lo = x.min(dim=1).values.clamp(max=0)
    hi = x.max(dim=1).values
    span = hi - lo
    flat = span <= 0
    span = torch.where(flat, torch.ones_like(span), span)
    sw, swx = weights.sum(1), (weights * x).sum(1)
    best_scale, best_min = span / nmax, lo
    q = torch.round((x - lo[:, None]) * (nmax / span)[:, None]).clamp(0, nmax)  # nearest_int: halves to even
    best_err = (weights * (best_scale[:, None] * q + lo[:, None] - x) ** 2).sum(1)
    for step in range(steps + 1):
        iscale = (rmin + rdelta * step + nmax) / span
        q = torch.round(iscale[:, None] * (x - lo[:, None])).clamp(0, nmax)
        swl, swll, swlx = (weights * q).sum(1), (weights * q * q).sum(1), (weights * q * x).sum(1)
        det = sw * swll - swl * swl
        ok = det > 0
        safe = torch.where(ok, det, torch.ones_like(det))
        scale = (sw * swlx - swx * swl) / safe
        mn = (swll * swx - swl * swlx) / safe
        # a positive min is pinned to 0, the scale refit for it
        pos = mn > 0
        scale = torch.where(pos, swlx / torch.where(swll > 0, swll, torch.ones_like(swll)), scale)
        mn = torch.where(pos, torch.zeros_like(mn), mn)
        err = (weights * (scale[:, None] * q + mn[:, None] - x) ** 2).sum(1)
        better = ok & (err < best_err)
        best_scale, best_min, best_err = (torch.where(better, scale, best_scale), torch.where(better, mn, best_min),
                                          torch.where(better, err, best_err))
    best_scale = torch.where(flat, torch.zeros_like(best_scale), best_scale)
    return best_scale, best_min


def _quant_q4_k(x: torch.Tensor) -> torch.Tensor:
    """[n, 256] -> Q4_K blocks, as llama.cpp's quantize_row_q4_K_ref: per 32, a scale and min fitted by
    make_qkx2_quants; both quantized to 6 bits against the block's largest; the weights requantized with them."""
    n = x.shape[0]
    sub = x.reshape(n * 8, 32)
    av = torch.sqrt((sub * sub).sum(1, keepdim=True) / 32)  # [n * 8, 1]
    scale, mn = _fit_scale_min(sub, av + sub.abs(), 15)
    scale, neg_min = scale.reshape(n, 8), (-mn).reshape(n, 8)
    max_scale, max_min = scale.amax(1, keepdim=True), neg_min.amax(1, keepdim=True)
    ls = torch.round(scale * torch.where(max_scale > 0, 63 / max_scale, 0)).clamp(0, 63).to(torch.uint8)
    lm = torch.round(neg_min * torch.where(max_min > 0, 63 / max_min, 0)).clamp(0, 63).to(torch.uint8)
    d16, dmin16 = (max_scale / 63).to(torch.float16), (max_min / 63).to(torch.float16)
    scales = torch.cat((ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6), (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)), dim=1)
    d = (d16.float() * ls.float()).unsqueeze(-1)  # [n, 8, 1]: what dequantization will use
    dm = (dmin16.float() * lm.float()).unsqueeze(-1)
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.where(d == 0, 0, torch.round((x.reshape(n, 8, 32) + dm) / safe)).clamp(0, 15).to(torch.uint8)  # [n, 8, 32]
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)  # sub-block 2c low nibbles, 2c + 1 high
    return torch.cat((d16.view(torch.uint8).reshape(n, 2), dmin16.view(torch.uint8).reshape(n, 2), scales, qs), dim=1)


_QUANTIZERS = {"Q8_0": _quant_q8_0, "Q4_0": _quant_q4_0, "Q5_0": _quant_q5_0, "Q4_K": _quant_q4_k}


def quantizable(name: str, k: int) -> bool:
    """Whether this project can write `name` (a quantizer exists) for rows of k inputs."""
    return name in _QUANTIZERS and k % FORMATS[name].block == 0


def quantize(w: torch.Tensor, name: str) -> torch.Tensor:
    """w [N, K] (any float dtype) -> [N, row bytes] uint8 in format `name`: Q8_0, Q4_0, Q5_0 or Q4_K."""
    fmt = FORMATS[name]
    n, k = w.shape
    if not quantizable(name, k):
        raise ValueError(f"{name}: {k} inputs per row is not a multiple of its {fmt.block}-weight block")
    out = []
    for start in range(0, n, 4096):  # bounded working memory on a 150k-row embedding
        rows = w[start : start + 4096].float()
        out.append(_QUANTIZERS[name](rows.reshape(-1, fmt.block)).reshape(rows.shape[0], fmt.row_bytes(k)))
    return torch.cat(out) if out else torch.empty((0, fmt.row_bytes(k)), dtype=torch.uint8)


# -- running them --------------------------------------------------------------------------------------------------

_PANEL_FLOATS = 1 << 20  # a prompt chunk's product dequantizes this many weights at a time (4 MB of f32)


def chunk_tokens(rows: list[RowSpan], num_tokens: int) -> torch.Tensor | None:
    """bool [T]: the tokens of prompt rows (a row of more than one token, or one marked `prompt`: a chunk's last
    token alone), which quantized projections multiply exactly, but a short feed's (RowSpan.exact); None where there
    are none."""
    long = [r for r in rows if r.exact]
    if not long:
        return None
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    for r in long:
        mask[r.start : r.start + r.num_tokens] = True
    return mask


class QuantLinear:
    """A projection over quantized rows: x [T, in] -> [T, out] f32 (+ bias), added to `residual` where given.

    On the CPU with the kernels: the integer kernel for short rows' tokens (each block read once for all of them),
    with the norm or the gate folded into its quantizing of x and the residual or bias into its sums, one call per
    run of same-format rows; for the tokens `chunk` marks (prompt chunks), the bf16 product where the CPU has bf16
    units, else the exact f32 product over panels dequantized in turn (a prompt's logits are the dequantized weights'). Elsewhere (another device, no kernels): the
    reference, each segment dequantized whole per call."""

    __slots__ = ("bf16_chunks", "bias", "folds", "kernel", "out_features", "runs", "segments", "views")
    panels = False  # the f32 panel kernel's: not this

    def __init__(self, weight: torch.Tensor, segments: list[Segment], bias: torch.Tensor | None):
        flat = weight.reshape(-1)
        if flat.numel() != sum(s.nbytes for s in segments):
            raise ValueError(f"quantized part holds {flat.numel()} bytes, its segments {sum(s.nbytes for s in segments)}")
        merged: list[Segment] = []  # stacked tensors of one format and width are one run of rows: one kernel call
        for s in segments:
            if merged and (merged[-1].fmt, merged[-1].k) == (s.fmt, s.k):
                merged[-1] = Segment(s.fmt, merged[-1].rows + s.rows, s.k)
            else:
                merged.append(s)
        self.segments = merged
        self.views, at = [], 0
        for s in merged:
            self.views.append(flat[at : at + s.nbytes].view(s.rows, s.fmt.row_bytes(s.k)))  # [rows, row bytes]
            at += s.nbytes
        self.out_features = sum(s.rows for s in merged)
        self.bias = None if bias is None else bias.float().contiguous()
        self.kernel = weight.device.type == "cpu" and rows_kernel() is not None and all(s.fmt.ggml in QUANT_TYPES for s in merged)
        self.folds = self.kernel and all(s.k % 8 == 0 for s in merged)  # a norm or the gate made as x rows are quantized
        self.bf16_chunks = self.kernel and bf16_units() is not None  # prompt chunks multiply in bf16 (bf16_runs)
        self.runs = [(w, s.fmt.ggml, s.rows) for s, w in zip(merged, self.views)] if self.kernel else []
        for w, qtype, rows in self.runs:
            check_quant_weight(w, qtype, rows, merged[0].k)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, norm: tuple[torch.Tensor, float] | None = None,
                 gated: Gate = False, chunk: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias), added to `residual` where given. With `norm` (weight, eps) the product is of RMSNorm(x) *
        weight, with `gated` of act(gate) * up (silu, or `gated` names it) of x [T, 2 * in]: folded into the kernel's reading of x rows for decode
        rows and for a prompt chunk's bf16 product, made first (the same f32 values) where the rows mix or the product
        is f32."""
        whole = chunk is None or (self.bf16_chunks and bool(chunk.all()))  # one kernel call for every row
        if (norm is not None or gated) and not (self.folds and whole):
            x = rms_norm_rows(x.float(), norm[0], norm[1]) if norm is not None else gated_rows(x.float(), gated)
            norm, gated = None, False
        if self.kernel and whole and (residual is None or (residual.dtype == torch.float32 and residual.is_contiguous())):
            # decode rows, or a prompt chunk in bf16: one kernel call per run, the bias or else the residual added in it
            y = self._run(x.float(), chunk is not None, norm, gated, self.bias if self.bias is not None or residual is None else residual)
            return y if residual is None or self.bias is None else residual + y
        y = self.project(x, chunk, norm=norm, gated=gated)
        return y if residual is None else residual + y.to(residual.dtype)

    def rows_bf16(self, x: BF16Rows, spans: list[tuple[int, int]]) -> torch.Tensor:
        """A prompt chunk's bf16 product (`bf16_chunks`) of rows made and rounded once (`bf16_round`) with output rows
        [a, b) of each span only, side by side: [T, sum of the spans' rows], each column the bits the whole product
        gives it."""
        runs, at = [], 0
        for w, qtype, rows in self.runs:
            for a, b in spans:
                lo, hi = max(a, at), min(b, at + rows)
                if lo < hi:
                    runs.append((w[lo - at : hi - at], qtype, hi - lo))
            at += rows
        return bf16_runs(x, runs, sum(b - a for a, b in spans))

    def columns_bf16(self, x: torch.Tensor, k0: int, k1: int, *, gated: Gate = False, add: torch.Tensor | None = None) -> torch.Tensor:
        """add + a prompt chunk's bf16 product over inputs [k0, k1) of every row (k0, k1 on its runs' block
        boundaries): x [T, k1 - k0] (or [T, 2 (k1 - k0)] gated) -> [T, out]."""
        runs = []
        for (w, qtype, rows), s in zip(self.runs, self.segments):
            assert k0 % s.fmt.block == 0 and k1 % s.fmt.block == 0
            runs.append((w[:, k0 // s.fmt.block * s.fmt.nbytes : k1 // s.fmt.block * s.fmt.nbytes], qtype, rows))
        return bf16_runs(x, runs, self.out_features, gated=gated, add=add)

    def project(self, x: torch.Tensor, chunk: torch.Tensor | None = None, *, norm: tuple[torch.Tensor, float] | None = None,
                gated: Gate = False) -> torch.Tensor:
        x = x.float()
        if chunk is None or not self.kernel:
            return self._run(x, False, norm, gated, self.bias)
        if bool(chunk.all()):  # norm or gated given only where the bf16 product folds them
            return self._run(x, True, norm, gated, self.bias)
        long, short = chunk.nonzero().squeeze(1), (~chunk).nonzero().squeeze(1)
        y = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
        y[long] = self._run(x[long], True, add=self.bias)
        y[short] = self._run(x[short], False, add=self.bias)
        return y

    def _run(self, x: torch.Tensor, exact: bool, norm: tuple[torch.Tensor, float] | None = None, gated: Gate = False,
             add: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] f32 -> add + x @ W.T [T, out] (`add`: a residual [T, out] or a bias [out], or None): the integer
        kernel (which may fold `norm` or `gated` in, and adds `add` in its sums), or a prompt chunk's product (bf16
        panels where the CPU has bf16 units, which fold them too; else exactly: dequantized f32 panels, or the
        reference, given x made)."""
        if self.kernel and not exact:
            return quant_runs(x, self.runs, self.out_features, norm=norm, gated=gated, add=add)
        if self.bf16_chunks:
            return bf16_runs(x, self.runs, self.out_features, norm=norm, gated=gated, add=add)
        T = x.shape[0]
        y = torch.empty((T, self.out_features), dtype=torch.float32, device=x.device)
        col = 0
        for s, w in zip(self.segments, self.views):
            out = y[:, col : col + s.rows]
            if not self.kernel:
                out.copy_(F.linear(x, dequantize(w, s.fmt, s.rows, s.k)))
            else:
                step = max(1, _PANEL_FLOATS // s.k)
                for r in range(0, s.rows, step):
                    panel = dequant_rows(w[r : r + step], s.fmt.ggml, min(step, s.rows - r), s.k)  # [rows, in] f32
                    out[:, r : r + panel.shape[0]] = x @ panel.t()
                    del panel  # gone before the next is made: one panel at a time (4 MB), not two
            col += s.rows
        return y if add is None else y.add_(add)  # add + y, in y's own storage


class QuantTable:
    """A quantized token-embedding table [V, hidden], resident (a tensor of row bytes) or paged (rows read from the
    file): a lookup dequantizes only the rows it needs. Also the tied head's weight (`linear`)."""

    def __init__(self, table: Any, fmt: QFormat, k: int):
        self.table, self.fmt, self.k = table, fmt, k
        self.paged = hasattr(table, "rows")

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids [T] -> [T, hidden] f32."""
        raw = self.table.rows(token_ids) if self.paged else self.table.reshape(-1, self.fmt.row_bytes(self.k))[token_ids]  # [T, row bytes]
        n = raw.shape[0]
        if raw.device.type == "cpu" and rows_kernel() is not None and self.fmt.ggml in QUANT_TYPES:
            return dequant_rows(raw.contiguous(), self.fmt.ggml, n, self.k)
        return dequantize(raw, self.fmt, n, self.k)


def segments_for(names: list[str], quantization: dict[str, Any]) -> list[Segment] | None:
    """The segments of a part stacked from `names`, from the .jlm's `quantization` entries ({"type", "shape"});
    None where none of them is quantized. A part that mixes quantized and float tensors cannot stack."""
    entries = [quantization.get(n) for n in names]
    if all(e is None for e in entries):
        return None
    if any(e is None for e in entries):
        raise ValueError(f"{', '.join(names)}: quantized and float tensors cannot stack into one projection")
    out = []
    for n in names:
        e = quantization[n]
        fmt = FORMATS.get(str(e.get("type"))) if isinstance(e, dict) else None
        shape = e.get("shape") if isinstance(e, dict) else None
        if fmt is None or not (isinstance(shape, list) and len(shape) == 2) or shape[1] % fmt.block:
            raise ValueError(f"{n}: bad quantization entry {e!r}")
        out.append(Segment(fmt, int(shape[0]), int(shape[1])))
    return out

"""The quantization formats, one record each (`QFormat`): ggml's type id (the kernels' too), the block's geometry, its
torch reference (blocks -> f32, on any device), its round-to-nearest quantizer for `convert -dtype` where the project
has one, and its figure per kernel variant for short feeds. Every table of formats derives from `_RECORDS`: `FORMATS`
by name, `BY_GGML` by ggml id (kernels/ops.py's checks read it).

A new kind of weight is one record here plus its kernels (quant.c's dequantization and dot products under the same
ggml id); a format without kernels has no place here, since every record is one the kernels multiply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["BY_GGML", "FORMATS", "QFormat", "dequantize", "quantizable", "lanes_", "quantize", "to_lanes"]

Blocks = Callable[[torch.Tensor], torch.Tensor]  # [n, nbytes] uint8 -> [n, block] f32, or [n, block] f32 -> [n, nbytes] uint8


@dataclass(frozen=True)
class QFormat:
    """A GGUF block format: `block` weights in `nbytes` bytes; `ggml` is ggml's type id (the kernels' too). `short`:
    per kernel variant, the most tokens of a short prompt feed whose product the decode rows' few-row kernel still
    runs no slower than the int8 GEMM (bench/short_prompt.py measures them; see layers/quant.py's short_feed).
    `dequant`: blocks [n, nbytes] uint8 -> [n, block] f32, the reference; `quant`: [n, block] f32 -> blocks, rounding
    to nearest, or None where the project writes no such blocks. `lanes`: where a K-format block's 128 code bytes
    start, the bytes a .jlm and the engine hold in lane order (`to_lanes`), or -1 (ggml's order throughout)."""

    name: str
    ggml: int
    block: int
    nbytes: int
    short: dict[str, int] = field(compare=False, hash=False)
    dequant: Blocks = field(compare=False, hash=False, repr=False)
    quant: Blocks | None = field(default=None, compare=False, hash=False, repr=False)
    lanes: int = -1

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.nbytes


# -- lane order: a K-format's code bytes as the kernels read them ----------------------------------------------------

# The 128 code bytes of a Q4_K / Q5_K superblock (its qs) or a Q6_K's (its ql) are four 32-byte vectors y0..y3 in
# ggml's order; the kernels want vector i to hold, in 32-bit lane k of each 128-bit half, y_k's dword i of that half
# (so that lane k only ever holds one pair of sub-blocks, whose scales apply per lane). A .jlm (format version 2)
# stores them so and the engine holds them so: byte 32 i + 16 h + 4 k + e is ggml's 32 k + 16 h + 4 i + e. Swapping
# i and k is its own inverse, so the one map goes both ways.


def lanes_(blocks: torch.Tensor, fmt: QFormat) -> None:
    """blocks [n, nbytes] of `fmt` (a view of its rows) with their code bytes swapped, in place, between ggml's order
    and lane order (either way: the map is its own inverse); nothing where `fmt` keeps ggml's order."""
    if fmt.lanes < 0:
        return
    for at in range(0, blocks.shape[0], 1 << 14):  # 2-3 MB at a time: the copy below stays in cache, not a tensor's size
        codes = blocks[at : at + (1 << 14), fmt.lanes : fmt.lanes + 128]
        codes.copy_(codes.reshape(-1, 4, 2, 4, 4).transpose(1, 3).reshape(-1, 128))  # reshaped strided: a copy, then written back


def to_lanes(blocks: torch.Tensor, fmt: QFormat) -> torch.Tensor:
    """`lanes_` on a copy (the blocks themselves where `fmt` keeps ggml's order)."""
    if fmt.lanes < 0:
        return blocks
    out = blocks.clone()
    lanes_(out, fmt)
    return out


# -- the torch reference: blocks -> f32, in the order of operations gguf's reference uses ----------------------------


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


def _dequant_q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _dequant_q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _dequant_q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _five_bits(b: torch.Tensor, lo: int) -> torch.Tensor:
    """Q5_0/Q5_1's 32 five-bit quants as f32 [n, 32]: the fifth bits at bytes lo .. lo + 3, the nibbles after them."""
    return (_nibbles(b[:, lo + 4 :]) | (_bits(b[:, lo : lo + 4], 32) << 4)).float()


def _dequant_q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_five_bits(b, 2) - 16)


def _dequant_q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _five_bits(b, 4) + _f16(b[:, 2:4])


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 quant bytes [n, 128] -> [n, 8, 32]: sub-block 2c the low nibbles of 32 bytes, 2c + 1 the high."""
    n = qs.shape[0]
    return torch.stack((qs.reshape(n, 4, 32) & 15, qs.reshape(n, 4, 32) >> 4), dim=2).reshape(n, 8, 32)


def _k_scaled(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's quants q [n, 8, 32] scaled and offset by their sub-block's scale and min -> [n, 256] f32."""
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc).unsqueeze(-1)  # [n, 8, 1]
    dm = (_f16(b[:, 2:4]) * mn).unsqueeze(-1)
    return (d * q.float() - dm).reshape(b.shape[0], 256)


def _dequant_q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_scaled(b, _k_nibbles(b[:, 16:]))


def _dequant_q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 16:48].unsqueeze(1) >> torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 8, 1)  # [n, 8, 32]
    return _k_scaled(b, _k_nibbles(b[:, 48:]) | ((qh & 1) << 4))


def _dequant_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    d = (_f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)  # [n, 16, 1]
    low = torch.stack((ql.reshape(n, 2, 64) & 15, ql.reshape(n, 2, 64) >> 4), dim=2).reshape(n, 8, 32)
    high = (qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)) & 3
    q = (low | (high.reshape(n, 8, 32) << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, 16).float()).reshape(n, 256)


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


# -- the records -----------------------------------------------------------------------------------------------------


def _short(avx2: int, avx_vnni: int, vnni: int, bf16: int, amx: int) -> dict[str, int]:
    return {"avx2+fma": avx2, "avx2+vnni": avx_vnni, "avx512+vnni": vnni, "avx512+bf16": bf16, "avx512+amx": amx}


# `short` from bench/short_prompt.py on 2 Zen 4 cores (avx2+fma forced, avx512+vnni forced, avx512+bf16), 2026-12-02:
# a [3072, 1024] projection's crossover, the few-row kernel against a prompt chunk's product (the int8 GEMM; bf16 on
# the bf16 variant) on weights read from memory (96 MB of copies a pass: warm in the caches the GEMM won from 1
# token), rounded down to the token counts measured and to where --followup agreed at the model (Qwen 0.5B's Q5_0
# rows: the few-row kernel no slower up to 16 tokens on avx2+fma). Noisy figures (a shared machine): the orders of
# magnitude hold, a step either way does not. AMX was not on that CPU: there a short feed's prompt rows take the Python
# path (bf16 attention), whose many-row product is AMX's bf16 tiles, which crossed the few-row kernel at 8 tokens (a
# Sapphire Rapids session, 2026-11). avx2+vnni's from the same bench on 2 Sapphire Rapids cores (the forced variant),
# 2026-12-05: its GEMM near the few-row kernel for Q8_0 up to 24 tokens (16 taken), Q5_1 tied at 1 (8 taken).
_RECORDS = (
    QFormat("Q4_0", 2, 32, 18, _short(4, 8, 8, 24, 8), _dequant_q4_0, _quant_q4_0),
    QFormat("Q4_1", 3, 32, 20, _short(4, 8, 8, 24, 8), _dequant_q4_1),
    QFormat("Q5_0", 6, 32, 22, _short(16, 8, 12, 24, 8), _dequant_q5_0, _quant_q5_0),
    QFormat("Q5_1", 7, 32, 24, _short(8, 8, 0, 16, 8), _dequant_q5_1),
    QFormat("Q8_0", 8, 32, 34, _short(8, 16, 32, 32, 8), _dequant_q8_0, _quant_q8_0),
    QFormat("Q4_K", 12, 256, 144, _short(8, 16, 8, 32, 8), _dequant_q4_k, _quant_q4_k, lanes=16),
    QFormat("Q5_K", 13, 256, 176, _short(8, 8, 12, 32, 8), _dequant_q5_k, lanes=48),
    QFormat("Q6_K", 14, 256, 210, _short(16, 48, 64, 32, 8), _dequant_q6_k, lanes=0),
)
FORMATS: dict[str, QFormat] = {f.name: f for f in _RECORDS}
BY_GGML: dict[int, QFormat] = {f.ggml: f for f in _RECORDS}


def dequantize(w: torch.Tensor, fmt: QFormat, n: int, k: int) -> torch.Tensor:
    """n rows of `fmt` blocks as the engine holds them (w's bytes, any shape; K-formats' codes in lane order) -> [n, k]
    f32, on w's device."""
    blocks = w.reshape(-1)[: n * fmt.row_bytes(k)].view(-1, fmt.nbytes)
    return fmt.dequant(to_lanes(blocks, fmt)).reshape(n, k)


def quantizable(name: str, k: int) -> bool:
    """Whether this project can write `name` (a quantizer exists) for rows of k inputs."""
    fmt = FORMATS.get(name)
    return fmt is not None and fmt.quant is not None and k % fmt.block == 0


def quantize(w: torch.Tensor, name: str) -> torch.Tensor:
    """w [N, K] (any float dtype) -> [N, row bytes] uint8 in format `name`: one with a quantizer (Q8_0, Q4_0, Q5_0,
    Q4_K), in ggml's order (a GGUF's; `to_lanes` gives the engine's)."""
    fmt = FORMATS[name]
    n, k = w.shape
    if fmt.quant is None:
        raise ValueError(f"{name}: this project reads it but does not write it (it writes {', '.join(f.name for f in _RECORDS if f.quant)})")
    if k % fmt.block:
        raise ValueError(f"{name}: {k} inputs per row is not a multiple of its {fmt.block}-weight block")
    out = []
    for start in range(0, n, 4096):  # bounded working memory on a 150k-row embedding
        rows = w[start : start + 4096].float()
        out.append(fmt.quant(rows.reshape(-1, fmt.block)).reshape(rows.shape[0], fmt.row_bytes(k)))
    return torch.cat(out) if out else torch.empty((0, fmt.row_bytes(k)), dtype=torch.uint8)

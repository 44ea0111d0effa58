"""Attention of one layer: writes a step's K/V into each row's session cache and attends every row against its own
history, with the layer's own sliding window; the kernel (decode rows, prompt chunks) or SDPA is chosen at build. A
layer whose prompt chunks multiply in bf16 (`bf16`) attends them in bf16 too where AMX runs (`bf16_attention`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..kernels import rows_kernel
from ..kernels.ops import KV_DTYPES, attend_chunk, attend_rows, bf16_attention
from ..kv import RowSpan, SessionKV
from .quant import take_rows

__all__ = ["Attention"]


class Attention:
    """Layer `layer`'s attention over packed rows: q [T, H, D], k and v [T, Hkv, D] -> [T, H*D] in `dtype`."""

    def __init__(self, layer: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 window: int | None = None, bf16: bool = False, softcap: float | None = None):
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.dtype = dtype
        self.window = window  # a key at position k is seen from q when q - window < k <= q; None: every earlier key
        self.softcap = softcap  # scores -> tanh(scores / cap) * cap before the softmax: torch's ops, no kernel
        kernels = device.type == "cpu" and rows_kernel() is not None and softcap is None
        # the kernels take f32 rows and the caches of KV_DTYPES on the CPU, for the head sizes they vectorise; a bf16
        # model's decode rows widened (its attention then sums in f32, as SDPA's does), its prompt chunks not (SDPA's
        # bf16 flash attention over them is the faster: 256-token prompts 1.15x the f32 kernel's)
        self.decode_kernel = kernels and dtype in (torch.float32, torch.bfloat16) and head_dim % 8 == 0  # decode rows, one call
        self.chunk_kernel = kernels and dtype == torch.float32 and head_dim % 4 == 0  # a prompt chunk, flash-style
        # prompt rows (a chunk, or a prompt's last token alone) on AMX tiles in bf16, the rounding their projections
        # make: decode rows stay f32 wherever they run
        self.bf16 = self.chunk_kernel and bf16 and bf16_attention(head_dim)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[RowSpan], keep: list[int] | None = None) -> torch.Tensor:
        """With `keep` (ascending token indices) only those tokens' outputs [len(keep), H*D]; every token's K/V is
        still written. Decode rows, short feeds and guesses attend token by token through the decode kernel whatever
        else the step holds (a token's bits are its own row's: layer.c's fused call attends them so too); prompt
        chunks chunk by chunk."""
        flat = [self.as_rows(r) for r in rows]
        if all(flat) and keep is None:  # one call writes and attends them all
            return self.attend_tokens(q, k, v, rows)
        tokens: Iterator[torch.Tensor] = iter(())  # the decode-row tokens' outputs, row by row
        if any(flat):
            mine = [r for r, f in zip(rows, flat) if f]
            take = lambda t: torch.cat([t[r.start : r.start + r.num_tokens] for r in mine])  # slices, not a torch index (its threads)
            tokens = iter(self.attend_tokens(take(q), take(k), take(v), mine).split([r.num_tokens for r in mine]))
        parts = []
        for r, f in zip(rows, flat):
            s, n = r.start, r.num_tokens
            only = None if keep is None else [i - s for i in keep if s <= i < s + n]
            if f:
                out = next(tokens)
                parts.append(out if only is None else take_rows(out, only))
            else:
                parts.append(self.attend(q[s : s + n], k[s : s + n], v[s : s + n], r, only))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def as_rows(self, row: RowSpan) -> bool:
        """Whether the row's tokens attend as decode rows (attend_tokens): those that are not a prompt chunk's (nor a
        prompt's on AMX's bf16 attention), where the decode kernel reads the cache."""
        return self.decode_kernel and row.kv.dtype in KV_DTYPES and not row.exact and not (row.prompt and self.bf16)

    def attend_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[RowSpan]) -> torch.Tensor:
        """The rows' tokens (q [T, H, D], k and v [T, Hkv, D]: the rows' tokens in order) each a row of attend_rows:
        every K/V written first, then each token attends up to its own position. -> [T, H*D]"""
        i = self.layer
        K, V = rows[0].kv.storage(i)  # every row's pages are the model's
        pos = [p for r in rows for p in range(r.kv.length, r.kv.length + r.num_tokens)]
        tables = [r.kv.table(i) for r in rows for _ in range(r.num_tokens)]
        starts = [max(0, p - self.window + 1) for p in pos] if self.window else [0] * len(pos)
        out = attend_rows(q.float(), k.float(), v.float(), [K] * len(pos), [V] * len(pos), [p + 1 for p in pos], starts, tables)
        return out.to(self.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: RowSpan, only: list[int] | None = None) -> torch.Tensor:
        """Write this chunk's K/V at the row's position and attend over its whole history. -> [n, H*D], or with
        `only` (ascending indices into the chunk) just those queries' [len(only), H*D]. The kernels read the session's
        pages through its page table; torch's attention reads them gathered."""
        kv, layer = row.kv, self.layer
        n, p = row.num_tokens, kv.length
        H, Hkv, D, g = self.num_heads, self.num_kv_heads, self.head_dim, self.group
        kv.write(layer, p, k, v)
        ks = row.key_start(self.window)
        bf16 = self.bf16 and (n > 1 or row.prompt)
        kernel = self.chunk_kernel and kv.devices[layer].type == "cpu" and kv.dtype in KV_DTYPES  # flash-style in C: no mask, no score matrix
        if self.softcap is not None:
            kc, vc = kv.read(layer, ks, p + n)
            out = self.capped(q, kc, vc, row.mask_on(kc.device, 1, self.window))
            return out if only is None else take_rows(out, only)
        if only is not None:
            return torch.cat([self.attend_one(q[i], kv, p + i, ks, bf16, kernel) for i in only]) if only else q.new_empty((0, H * D))
        if kernel:
            return attend_chunk(q, *kv.storage(layer), kv.table(layer), p, ks, self.window, bf16)
        first = p == 0 and ks == 0 and (self.window is None or n <= self.window)
        if first and kv.dtype == q.dtype:  # its own keys are what the cache holds: not read back
            kc, vc = k.transpose(0, 1), v.transpose(0, 1)
        else:
            kc, vc = kv.read(layer, ks, p + n)  # [Hkv, keys, D]
            kc, vc = kc.to(q.dtype), vc.to(q.dtype)  # a cast where the cache is narrower (f16 beside f32): SDPA takes one dtype
        if first:
            # A prompt's first chunk: plain causal attention over its own keys, no mask to build or read.
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[None], vc[None], is_causal=True, enable_gqa=True)
            return out[0].transpose(0, 1).reshape(n, H * D)
        # GQA without copying K/V: the g query heads of one kv head become g*n query rows.
        qg = q.view(n, Hkv, g, D).permute(1, 2, 0, 3).reshape(1, Hkv, g * n, D)
        # 4-D inputs take the fused CPU kernel; 3-D ones fall back to the math path.
        mask = row.mask_on(kc.device, g, self.window)
        out = F.scaled_dot_product_attention(qg, kc[None], vc[None], attn_mask=mask)
        return out.view(Hkv, g, n, D).permute(2, 0, 1, 3).reshape(n, H * D)

    def attend_one(self, q: torch.Tensor, kv: SessionKV, pos: int, key_start: int, bf16: bool, kernel: bool) -> torch.Tensor:
        """One query q [H, D] at `pos`, its K/V already in the session's pages, over the keys it sees (a prompt row's in
        bf16 where `bf16`: the bits the whole chunk gives it). -> [1, H*D]"""
        if kernel:
            K, V = kv.storage(self.layer)
            return attend_chunk(q[None], K, V, kv.table(self.layer), pos, key_start, self.window, bf16)
        lo = max(key_start, pos - self.window + 1) if self.window else key_start
        keys, values = kv.read(self.layer, lo, pos + 1)
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # a cast where the cache is narrower
        out = F.scaled_dot_product_attention(q[:, None, :][None], keys[None], values[None], enable_gqa=True)
        return out.reshape(1, -1)

    def capped(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention with soft-capped scores, as eager attention computes it: q [n, H, D] against keys and values
        [Hkv, L, D] (the chunk's queries the last n of L, `mask` [n, L] or None for one query) -> [n, H*D]."""
        n, H, D = q.shape
        keys, values = keys.to(q.dtype).repeat_interleave(self.group, 0), values.to(q.dtype).repeat_interleave(self.group, 0)  # [H, L, D]
        scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * D**-0.5  # [H, n, L]
        cap = self.softcap
        assert cap is not None
        scores = torch.tanh(scores / cap) * cap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return torch.matmul(weights, values).transpose(0, 1).reshape(n, H * D)

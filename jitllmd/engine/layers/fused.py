"""Decoder layers' decode steps in one kernel call each, or every layer of a step in one (kernels/layer.c): decode
rows and short feeds, each token a row attending up to its own position in its session's cache (every K/V is written
before any attends), with the layer's own window and RoPE table. A family's block takes part by holding `fused` (its
ops.QuantLayer, or None), `attn` (its Attention: layer index, window, bf16), `rope_index`, and `fuses(rows)`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..kernels.ops import QuantLayer, decode_stack
from ..kv import RowSpan
from .quant import take_rows
from .rope import RopeTables

__all__ = ["FusedBlock", "run", "stack"]


class FusedBlock(Protocol):
    fused: QuantLayer | None
    attn: Any
    rope_index: int

    def fuses(self, rows: list[RowSpan]) -> bool: ...


def run(blocks: Sequence[FusedBlock], x: torch.Tensor, rope: tuple[RopeTables, ...], rows: list[RowSpan], keep: list[int] | None) -> torch.Tensor:
    """`blocks` in one decode_stack call over the rows' tokens x [T, hidden] f32 -> [T, hidden], or the `keep` tokens':
    the bits of the blocks called one by one."""
    tokens = [(r.kv, pos) for r in rows for pos in range(r.kv.length, r.kv.length + r.num_tokens)]
    many = [r.many for r in rows for _ in range(r.num_tokens)] if any(r.many for r in rows) else None
    layers, keys, values, lengths, starts, tables = [], [], [], [], [], []
    lengths_all = [pos + 1 for _, pos in tokens]  # its own K/V goes last
    for b in blocks:
        assert b.fused is not None  # callers check fuses() first
        layers.append(b.fused)
        i, window = b.attn.layer, b.attn.window
        K, V = tokens[0][0].storage(i)  # every row's pages are the model's
        keys.append([K] * len(tokens))
        values.append([V] * len(tokens))
        lengths.append(lengths_all)
        starts.append([max(0, pos - window + 1) for _, pos in tokens] if window else [0] * len(tokens))
        tables.append([kv.table(i) for kv, _ in tokens])
    y = decode_stack(layers, x.contiguous(), [rope[b.rope_index].on(x.device) for b in blocks], keys, values, lengths, starts,
                     tables, many)
    return y if keep is None else take_rows(y, keep)


def stack(blocks: Sequence[Any], rows: list[RowSpan]) -> Callable[[torch.Tensor, tuple[RopeTables, ...], list[int] | None], torch.Tensor] | None:
    """A step's layers in one call where every block fuses these rows: a function of (x, the forward's RoPE tables,
    keep) that runs them all, or None (block by block)."""
    if not blocks or not all(getattr(b, "fused", None) is not None and b.fuses(rows) for b in blocks):
        return None
    return lambda x, rope, keep: run(blocks, x, rope, rows, keep)

"""Rotary position embeddings: the inverse frequencies (with llama3, linear or per-frequency scaling), the cos/sin
tables of a forward's positions on each device they are used on, and the rotation of q and k."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..kernels import rows_kernel
from ..kernels.ops import rope_rows

__all__ = ["Rope", "RopeCache", "RopeTables", "rope_inv_freq", "rotate"]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in f32, with llama3, linear or per-frequency ("factors") scaling applied."""
    d = head_dim
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = scaling
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


class RopeTables:
    """cos and sin [T, 1, D] of one forward's positions, on the positions' device and copied to each other device a
    block runs on. sin has its first half negated: rotate_half(x) * sin becomes cat(x2, x1) * sin."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self._on = {cos.device: (cos, sin)}

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on:
            cos, sin = next(iter(self._on.values()))
            self._on[device] = (cos.to(device), sin.to(device))
        return self._on[device]


class RopeCache:
    """The cos and sin rows of every position up to the furthest one seen, for one set of inverse frequencies: a
    forward's tables are rows read from it. Made afresh per forward, sin and cos of a few positions run on MKL's vector
    maths over torch's OpenMP threads, which then spin and take a core from the kernels' own threads for the rest of
    the step (a 16-token feed took 1.4x as long on 2 cores). Each element is the same f32 op on the same input either
    way, so the rows are the bits a per-forward table had."""

    GROW = 1024  # positions added at least per growth (the table then doubles)

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype):
        self.inv_freq, self.dtype = inv_freq, dtype
        self._rows: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, positions: torch.Tensor) -> RopeTables:
        """The tables of `positions` [T] (any order, repeats allowed)."""
        device = positions.device
        cos, sin = self._rows.get(device, (None, None))
        need = int(positions.max()) + 1 if positions.numel() else 0
        if cos is None or sin is None or need > cos.shape[0]:
            have = 0 if cos is None else cos.shape[0]
            cos, sin = self._grow(device, max(need, 2 * have, self.GROW))
        return RopeTables(cos.index_select(0, positions), sin.index_select(0, positions))

    def _grow(self, device: torch.device, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(size, device=device).float()[:, None] * self.inv_freq.to(device)[None, :]  # [size, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [size, 1, D]
        half = emb.shape[-1] // 2
        sin = emb.sin()
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # the sign rotate_half puts on x2
        rows = (emb.cos().to(self.dtype), sin.to(self.dtype))
        self._rows[device] = rows  # one assignment: a reader sees the old rows or the new, whole
        return rows


class Rope:
    """Rotates q and k together, [T, heads, D]: in place in qkv's own rows by one kernel pass where it applies (f32 on
    the CPU, D a multiple of 16), else as three torch ops."""

    __slots__ = ("kernel",)

    def __init__(self, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.kernel = dtype == torch.float32 and head_dim % 16 == 0 and device.type == "cpu" and rows_kernel() is not None

    def __call__(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.kernel and qk.dtype == torch.float32 and cos.device.type == "cpu":
            rope_rows(qk, cos, sin)
            return qk
        return rotate(qk, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in torch ops (the kernel's reference). x: [T, heads, D]; cos, sin: [T, 1, D], sin with its
    first half negated, so rotate_half(x) * sin becomes cat(x2, x1) * sin: three ops instead of six."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)

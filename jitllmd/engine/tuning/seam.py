"""TuneSeam: decode speed timed for candidate counts of device blocks, and the seam left at the fastest."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kv import RowSpan, SessionKV
from ..memory.placement import HOST
from ..runner import ModelRunner

__all__ = ["SeamCandidate", "candidate_counts", "decode_rate", "tune_seam"]


@dataclass(frozen=True)
class SeamCandidate:
    """What TuneSeam measured for one count of device blocks."""

    device_blocks: int
    decode_tokens_per_second: float


def candidate_counts(most: int) -> list[int]:
    """None, a quarter, half, three quarters and all of the device blocks that fit."""
    return sorted({0, most // 4, most // 2, (3 * most) // 4, most})


def decode_rate(runner: ModelRunner, prompt: int = 8, steps: int = 12) -> float:
    """Decode tokens/s of one row on a scratch KV cache under the model's current placement (median step)."""
    dev = runner.device
    settle = runner.placement.synchronize  # a split forward queues work on each of its devices
    kv = runner.new_kv(prompt + steps + 1)
    runner.forward(torch.zeros(prompt, dtype=torch.long, device=dev), torch.arange(prompt, device=dev), [RowSpan(0, prompt, kv)], torch.tensor([prompt - 1], device=dev))
    times = []
    for i in range(steps):
        settle()
        t0 = time.perf_counter()
        runner.forward(torch.zeros(1, dtype=torch.long, device=dev), torch.tensor([prompt + i], device=dev), [RowSpan(0, 1, kv)])
        settle()
        times.append(time.perf_counter() - t0)
    return round(1.0 / statistics.median(times[2:]), 2)


def tune_seam(runner: ModelRunner, kvs: list[SessionKV], spendable: Callable[[str], int]) -> list[SeamCandidate]:
    """Place each candidate count of device blocks (with every session's KV), time decode, keep the fastest.
    Runs on the engine thread, between steps."""
    placement = runner.placement
    devices = placement.device_ids or placement.devices
    if not devices:
        raise ValueError("the model was loaded without devices: it has no seam to move")
    most = sum(p != HOST for p in placement.plan(devices, -1, spendable))
    out: list[SeamCandidate] = []
    for n in candidate_counts(most):
        placement.apply(placement.plan(devices, n, spendable), kvs)
        out.append(SeamCandidate(n, decode_rate(runner)))
    best = max(out, key=lambda c: c.decode_tokens_per_second)
    placement.apply(placement.plan(devices, best.device_blocks, spendable), kvs)
    placement.gpu_layers = best.device_blocks  # relocation keeps to the seam measured fastest
    return out

"""Measuring a device model's own step limits at load: the widest decode step worth running, and its prefill chunk.

-max-batch 0 and -prompt-chunk 0 ask for these instead of a guess. Both time real forwards of the loaded model on
its engine thread, against throwaway KV caches, in a couple of seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .devices import synchronize
from .kv import RowSpan
from .runner import ModelRunner

__all__ = ["Calibration", "calibrate", "prefill_chunk", "widest_step"]

CONTEXT = 64  # positions of history each measured row attends to
GAIN = 1.10  # a wider step must beat the narrower one's tokens/s by this much to be worth its latency
CHUNKS = (32, 64, 128, 256, 512)
ENOUGH = 0.90  # the smallest chunk reaching this fraction of the best prefill tokens/s wins: short steps, little loss


@dataclass(frozen=True)
class Calibration:
    max_rows: int
    prompt_chunk: int
    decode_tokens_per_second: dict[int, float]  # rows -> tokens/s of a decode step
    prefill_tokens_per_second: dict[int, float]  # chunk -> tokens/s


def _median_seconds(fn, device: torch.device, reps: int = 3) -> float:
    """Median wall time of `fn` on `device`, waiting for its queued work before each clock read (a GPU returns early)."""
    fn()  # warm up
    times = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def widest_step(runner: ModelRunner, limit: int) -> tuple[int, dict[int, float]]:
    """The widest power-of-two row count up to `limit` whose decode step still gains GAIN in tokens/s."""
    dev = runner.device
    rates: dict[int, float] = {}
    best = 1
    n = 1
    while n <= limit:
        kvs = [runner.new_kv(CONTEXT + 1) for _ in range(n)]
        for kv in kvs:  # a short history per row
            runner.forward(torch.zeros(CONTEXT, dtype=torch.long, device=dev), torch.arange(CONTEXT, device=dev), [RowSpan(0, CONTEXT, kv)], torch.tensor([CONTEXT - 1], device=dev))

        def step(kvs=kvs, n=n) -> None:
            runner.forward(
                torch.zeros(n, dtype=torch.long, device=dev),
                torch.full((n,), CONTEXT, dtype=torch.long, device=dev),
                [RowSpan(i, 1, kv) for i, kv in enumerate(kvs)],
                torch.arange(n, device=dev),
            )
            for kv in kvs:
                kv.truncate(CONTEXT)

        rates[n] = n / _median_seconds(step, dev)
        if n > 1 and rates[n] < GAIN * rates[best]:
            break
        best = n
        n *= 2
    return best, rates


def prefill_chunk(runner: ModelRunner, limit: int) -> tuple[int, dict[int, float]]:
    """The smallest chunk (tokens a joining prompt feeds per step) reaching ENOUGH of the best prefill tokens/s."""
    dev = runner.device
    rates: dict[int, float] = {}
    for chunk in (c for c in CHUNKS if c <= limit):
        kv = runner.new_kv(chunk)

        def run(kv=kv, chunk=chunk) -> None:
            runner.forward(torch.zeros(chunk, dtype=torch.long, device=dev), torch.arange(chunk, device=dev), [RowSpan(0, chunk, kv)], torch.tensor([chunk - 1], device=dev))
            kv.truncate(0)

        rates[chunk] = chunk / _median_seconds(run, dev, reps=1)
    if not rates:
        return max(1, limit), rates
    top = max(rates.values())
    return min(c for c, r in rates.items() if r >= ENOUGH * top), rates


def calibrate(runner: ModelRunner, *, max_rows: int, row_limit: int, prompt_chunk: int, chunk_limit: int) -> Calibration:
    """Fill in whichever of max_rows and prompt_chunk is 0 by measuring; the other is kept as given."""
    decode: dict[int, float] = {}
    prefill: dict[int, float] = {}
    if max_rows == 0:
        max_rows, decode = widest_step(runner, max(1, row_limit))
    if prompt_chunk == 0:
        prompt_chunk, prefill = prefill_chunk(runner, max(1, chunk_limit))
    return Calibration(max_rows, prompt_chunk, decode, prefill)

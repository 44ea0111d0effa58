"""Engine counters that telemetry reads: written only by the engine thread, read by anyone (plain numbers)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["EngineStats"]

_RECENT = 0.1  # weight of the newest step in the running means (about the last ten steps)


@dataclass
class EngineStats:
    requests: int = 0  # finished, every outcome
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0  # fed (tokens reused from a session's cache are not)
    generated_tokens: int = 0
    steps: int = 0
    rows_per_step: float = 0.0  # running mean
    prompt_tokens_per_step: float = 0.0  # running mean
    started: float = field(default_factory=time.monotonic)

    def step(self, num_rows: int, num_prompt_tokens: int) -> None:
        self.steps += 1
        self.prompt_tokens += num_prompt_tokens
        a = 1.0 if self.steps == 1 else _RECENT
        self.rows_per_step += a * (num_rows - self.rows_per_step)
        self.prompt_tokens_per_step += a * (num_prompt_tokens - self.prompt_tokens_per_step)

    def finished(self, cancelled: bool = False, failed: bool = False) -> None:
        self.requests += 1
        self.cancelled += cancelled
        self.failed += failed

"""Engine counters that telemetry and /metrics read: written only by the engine thread, read by anyone (plain numbers)."""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field

__all__ = ["E2E_BUCKETS", "TPOT_BUCKETS", "TTFT_BUCKETS", "EngineStats", "Histogram"]

_RECENT = 0.1  # weight of the newest step in the running means (about the last ten steps)

# vLLM's bucket bounds (seconds) for the same three histograms, so dashboards made for it read these
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    """Observations counted per bucket (a value goes to the first bound it does not exceed; the last bucket, past
    every bound, is +Inf), and their sum. Counts are per bucket, not cumulative: a reader sums them."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


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
    # finished requests by how they ended; every key is there from the start, so a reader never sees the dict grow
    finish_reasons: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("stop", "length", "cancelled", "failed"), 0))
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))  # arrival -> first sampled token
    time_per_output_token: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))  # each later token's gap
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))  # arrival -> end, generations

    def step(self, num_rows: int, num_prompt_tokens: int) -> None:
        self.steps += 1
        self.prompt_tokens += num_prompt_tokens
        a = 1.0 if self.steps == 1 else _RECENT
        self.rows_per_step += a * (num_rows - self.rows_per_step)
        self.prompt_tokens_per_step += a * (num_prompt_tokens - self.prompt_tokens_per_step)

    def token(self, seconds: float, first: bool) -> None:
        """A row sampled a token `seconds` after its request arrived (`first`) or after its previous token."""
        (self.time_to_first_token if first else self.time_per_output_token).observe(seconds)

    def finished(self, cancelled: bool = False, failed: bool = False, reason: str = "stop", seconds: float | None = None) -> None:
        """A request ended: failed, cancelled, or for `reason` (stop, length); a generation's `seconds` since it arrived."""
        self.requests += 1
        self.cancelled += cancelled
        self.failed += failed
        key = "failed" if failed else "cancelled" if cancelled else reason
        self.finish_reasons[key] = self.finish_reasons.get(key, 0) + 1
        if seconds is not None:
            self.e2e_request_latency.observe(seconds)

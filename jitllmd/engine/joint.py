"""Joint steps: whether a step runs its rows as one packed forward or one after another, per row count.

`auto` times both for each row count it meets (decode-only steps, a few of each, interleaved) and runs the rows one
after another only where that is clearly faster: a joint step reads the weights once for every row, so it wins
wherever a step is bound by its weights, and a noisy second on a shared machine must not turn a server's batching off
for good. `always` and `never` force it. One row is always a single forward.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = ["JointSteps", "Timing"]

SAMPLES = 5  # timed steps of each kind per row count before auto decides (medians: one descheduled step moves nothing)
SEQUENTIAL_WINS = 0.75  # the rows one after another are chosen only at this fraction of the joint step's median time or less


@dataclass
class Timing:
    """What auto measured for one row count (ms per step), and what it chose."""

    joint_ms: list[float] = field(default_factory=list)
    sequential_ms: list[float] = field(default_factory=list)
    choice: str = ""  # "joint" or "sequential" once decided

    def summary(self) -> tuple[float, float]:
        med = lambda xs: statistics.median(xs) if xs else 0.0
        return med(self.joint_ms), med(self.sequential_ms)


class JointSteps:
    def __init__(self, mode: str = "auto"):
        if mode not in ("auto", "always", "never"):
            raise ValueError(f"joint_steps must be auto, always or never, got {mode!r}")
        self.mode = mode
        self.timings: dict[int, Timing] = {}

    def joint(self, num_rows: int, decode_only: bool) -> bool:
        """Run this step's rows jointly? Undecided row counts alternate while auto measures decode-only steps."""
        if num_rows <= 1 or self.mode == "always":
            return True
        if self.mode == "never":
            return False
        t = self.timings.get(num_rows)
        if t is not None and t.choice:
            return t.choice == "joint"
        if not decode_only:
            return True  # prompt chunks make a step's time incomparable; measure on plain decode steps
        t = self.timings.setdefault(num_rows, Timing())
        return len(t.joint_ms) <= len(t.sequential_ms)

    def record(self, num_rows: int, joint: bool, seconds: float, decode_only: bool) -> None:
        """A step's wall time; auto decides once it has SAMPLES of each kind for this row count: joint unless the rows
        one after another took at most SEQUENTIAL_WINS of its median."""
        if self.mode != "auto" or num_rows <= 1 or not decode_only:
            return
        t = self.timings.setdefault(num_rows, Timing())
        if t.choice:
            return
        (t.joint_ms if joint else t.sequential_ms).append(seconds * 1000)
        if len(t.joint_ms) >= SAMPLES and len(t.sequential_ms) >= SAMPLES:
            joint_ms, sequential_ms = t.summary()
            t.choice = "sequential" if sequential_ms <= SEQUENTIAL_WINS * joint_ms else "joint"

    def choices(self) -> dict[int, tuple[str, float, float]]:
        """Row count -> (choice or "measuring", joint ms, sequential ms)."""
        return {n: (t.choice or "measuring", *t.summary()) for n, t in sorted(self.timings.items())}

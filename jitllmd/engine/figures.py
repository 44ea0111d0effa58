"""The `jitllm` figures of a response, typed: where its model ran, how long it waited and took, and the bytes per
token. One builder (`Figures.build`) makes them for a generation and for an embedding job; the dialects render
`to_json()` and the Connect service the same fields into protobuf."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["Figures", "Where"]


@dataclass(frozen=True)
class Where:
    """A model's blocks now: on devices or the host, and which devices (LoadedModel.where)."""

    device_blocks: int
    host_blocks: int
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class Figures:
    """The figures of one finished request, in the order the spec's `jitllm` object lists them."""

    session_id: str
    queued_ms: float
    queue_depth_on_entry: int
    device_blocks: int
    host_blocks: int
    device_ids: tuple[str, ...]
    prefill_ms: float
    decode_ms: float
    decode_tokens_per_second: float
    bytes_per_token: int
    drafted_tokens: int = 0  # speculative decoding: tokens guessed for it and fed to check
    accepted_tokens: int = 0  # ... and those its sampler took

    @classmethod
    def build(cls, where: Where, *, session_id: str, arrival: float, first_step: float | None, first_token: float | None,
              last_token: float | None, queue_depth: int, generated: int, bytes_per_token: int, drafted: int = 0, accepted: int = 0) -> Figures:
        """From a request's times (time.perf_counter(); None: it never got there): queued from arrival to its first
        step, prefill to its first token, decode from there to its last, over the `generated` tokens after the first;
        `drafted` and `accepted`: its speculative decoding's guesses."""
        ms = lambda a, b: round((b - a) * 1000, 3) if a is not None and b is not None else 0.0
        decode_s = (last_token - first_token) if first_token and last_token else 0.0
        after_first = max(0, generated - 1)
        return cls(
            session_id=session_id,
            queued_ms=ms(arrival, first_step),
            queue_depth_on_entry=queue_depth,
            device_blocks=where.device_blocks,
            host_blocks=where.host_blocks,
            device_ids=where.device_ids,
            prefill_ms=ms(first_step, first_token),
            decode_ms=round(decode_s * 1000, 3),
            decode_tokens_per_second=round(after_first / decode_s, 2) if decode_s > 0 else 0.0,
            bytes_per_token=bytes_per_token,
            drafted_tokens=drafted,
            accepted_tokens=accepted,
        )

    def to_json(self) -> dict[str, Any]:
        """The `jitllm` object of a response body."""
        out = dataclasses.asdict(self)
        out["device_ids"] = list(self.device_ids)
        return out

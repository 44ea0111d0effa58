"""A generation request, its states, and the events the engine hands out for it."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

from .figures import Figures
from .grammar import Constraint
from .sampler import Sampler, SamplingParams, Thinking, TokenLogprobs
from .sessions import Session
from .speculative import RowSpec
from .tokenizer import Detokenizer

__all__ = ["Generation", "Delta", "Done", "Embedded", "Event", "Failed", "FinishReason", "Request", "RequestState"]

_ids = itertools.count(1)


class RequestState(Enum):
    """WAITING -> PREFILL -> DECODE -> FINISHED; any state -> FINISHED on cancel or error."""

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class FinishReason(StrEnum):
    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens, or the session's room is full
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Delta:
    """New text (possibly empty while a character is incomplete) and the token ids that produced it; with logprobs
    asked, each token's (`logprobs`, one per id); the first event after the prompt carries its `prompt_logprobs`
    when they were asked (None for its first token, which nothing precedes)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(frozen=True)
class Done:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    fed_tokens: int  # prompt tokens actually run (the rest came from the session's cache)
    stop: str | None  # the stop string that ended it, if one did
    figures: Figures  # the `jitllm` figures
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when no Delta carried them (see Delta)
    reasoning_tokens: int = 0  # of completion_tokens, those of a thought: up to and including its close marker


@dataclass(frozen=True)
class Failed:
    message: str
    unavailable: bool = False  # the model cannot run now (another rank of its blocks is gone): a 503, not a bug


@dataclass(frozen=True)
class Embedded:
    """An embedding job's result: one pooled vector per input, float32 [num_inputs, width], on the CPU."""

    vectors: Any  # numpy.ndarray
    num_tokens: int
    figures: Figures


Event = Delta | Done | Failed | Embedded


@dataclass(frozen=True)
class Generation:
    """What a dialect asks the engine for (the generation spec: OpenAI, Anthropic, Connect and `run` each build one).
    `max_tokens` None: up to the session's room (0 runs the prompt alone: with prompt_logprobs, it scores each prompt
    token with that many alternatives). `session`: a named session to run in (None: an ephemeral one, pooled for prefix
    reuse). `constraint`: a grammar the reply follows (engine/grammar.py), this request's own. `thinking`: a thinking
    model's thought (sampler.Thinking): its markers, whether the prompt opened it, its budget."""

    prompt_ids: Sequence[int]  # kept as a tuple
    params: SamplingParams
    max_tokens: int | None = None
    stop: Sequence[str] = ()  # kept as a tuple, empty strings left out
    session: Session | None = None
    ignore_eos: bool = False  # keep going past end-of-sequence (benchmarks)
    request_id: str = ""  # the caller's name for it (Cancel); r-<id> when not given
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None
    thinking: Thinking | None = None
    speculative: bool | None = None  # False: no speculative decoding for this request (None: the server's choice)
    draft_max: int | None = None  # the most tokens it guesses a step (None: the server's -draft-max)

    def __post_init__(self) -> None:
        if self.draft_max is not None and self.draft_max < 0:
            raise ValueError(f"draft_max must be >= 0, got {self.draft_max}")
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))


@dataclass(eq=False)
class Request:
    """One generation. `emit` is called from the engine thread with each event; Done or Failed is last."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    session: Session
    max_tokens: int  # already cut to the session's room
    sampler: Sampler
    detok: Detokenizer
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # keep going past end-of-sequence (benchmarks)
    prompt_logprobs: int | None = None  # score every prompt token, with this many alternatives (echo + logprobs)
    id: int = field(default_factory=lambda: next(_ids))
    request_id: str = ""  # the caller's name for it (Cancel); r-<id> when not given

    # engine-side state
    state: RequestState = RequestState.WAITING
    fed: int = 0  # prompt tokens in the KV cache (cached prefix included)
    cached: int = 0  # prompt tokens the session already held
    output_ids: list[int] = field(default_factory=list)
    next_token: int = -1  # sampled, not yet fed
    held: str = ""  # text held back while it may be the start of a stop string
    cancel_requested: bool = False
    queue_depth_on_entry: int = 0
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_step: float | None = None
    t_first_token: float | None = None
    t_last_token: float | None = None
    decode_steps: int = 0  # tokens decoded (a verifying step counts each it took): bytes_per_token divides by it
    decode_bytes: float = 0.0
    prompt_scores: list[TokenLogprobs | None] = field(default_factory=list)  # with prompt_logprobs: the prompt's so far
    prompt_scores_sent: bool = False
    leader: Request | None = None  # a row that shares this prompt and runs it once: this one waits for its KV (n > 1)
    followers: list[Request] = field(default_factory=list)  # the rows waiting for this one's prompt
    forked: bool = False  # a follower whose prompt KV and first token came from its leader
    spec: RowSpec | None = None  # its speculative decoding (engine/speculative.py), where the engine drafts for it

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"r-{self.id}"

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def prompt_left(self) -> int:
        return len(self.prompt_ids) - self.fed

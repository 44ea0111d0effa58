"""Speculative decoding: a decode row feeds its sampled token and k guessed ones in one step (a short feed: each token
multiplies and attends as a decode row does, so on the kernels' path its logits are decode's, bit for bit), keeps the
guesses the sampler accepts plus one token of its own, and rolls its KV back past the first rejection (Outputs.verify).

Drafters guess: `ngram` (prompt lookup: the most recent earlier occurrence of the last few tokens of the prompt and
output, and what followed it; no model) and `draft` (a small model of the same vocabulary, greedy, with its own KV per
session: engine/draft.py). Each row keeps its own acceptance rate and drafts the k that pays most by it (Adaptive),
none where none pays; a row that stopped drafting probes again now and then.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from .config import SPEC_MODES

if TYPE_CHECKING:
    from .request import Request
    from .scheduler import Row

__all__ = ["SPEC_MODES", "Adaptive", "Drafter", "NgramIndex", "RowSpec", "SpecConfig", "Speculator", "expected_gain"]

DRAFT_MAX = 8  # the most tokens a row guesses a step (-draft-max)
NGRAM_MIN, NGRAM_MAX = 2, 4  # the lengths of the suffix prompt lookup matches, longest first
# What one more token in a verifying row costs, as a fraction of a decode step: a row of k + 1 tokens reads the weights
# once, its products and attention grow with k (measured on 2 cores, SmolLM2 and Qwen2.5 Q8_0/Q4_K_M: bench/speculative.py)
TOKEN_COST = {"ngram": 0.12, "draft": 0.12}
DRAFT_COST = 0.08  # ... and a drafted token of a draft model, as a fraction of the target's step (its own forward)
PRIOR = 0.6  # a new row's acceptance rate before it has drafted
RATE_WEIGHT = 0.15  # weight of the newest observation in a row's running acceptance rate
PROBE_EVERY = 16  # a row that stopped drafting drafts again after this many steps (what it guesses may have changed)


def expected_gain(rate: float, k: int, cost: float) -> float:
    """Tokens a step of k guesses yields per step-time of a plain decode step, each guess accepted with probability
    `rate` given the ones before it were: (1 + r + ... + r^k) / (1 + cost * k)."""
    tokens = k + 1.0 if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)
    return tokens / (1.0 + cost * k)


class Adaptive:
    """One row's k: the one of 1..most whose expected gain is best at the row's running acceptance rate, or 0 where
    none beats a plain step; after PROBE_EVERY steps without drafting, one guess to learn the rate again."""

    def __init__(self, most: int, cost: float):
        self.most = most
        self.cost = cost
        self.rate = PRIOR
        self._idle = 0  # steps since the row last drafted

    def k(self) -> int:
        if self.most <= 0:
            return 0
        best, gain = 0, 1.0
        for k in range(1, self.most + 1):
            g = expected_gain(self.rate, k, self.cost)
            if g > gain * 1.02:  # a longer draft must pay a little more than noise
                best, gain = k, g
        if best == 0:
            self._idle += 1
            if self._idle >= PROBE_EVERY:
                self._idle = 0
                return 1
        return best

    def record(self, drafted: int, accepted: int) -> None:
        """A verified draft: `accepted` of its first guesses taken, then (if fewer than `drafted`) one refused."""
        if drafted <= 0:
            return
        self._idle = 0
        observations = [1.0] * accepted + ([0.0] if accepted < drafted else [])
        for x in observations:
            self.rate += RATE_WEIGHT * (x - self.rate)


class NgramIndex:
    """Prompt lookup over one request's tokens (prompt, then output as it grows): for each n-gram, the start of its
    latest occurrence that some token follows. `propose` continues the longest suffix found earlier."""

    def __init__(self, tokens: list[int], min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        h, last = self.tokens, self._last
        for t in tokens:
            h.append(t)
            p = len(h) - 1  # the n-grams ending just before p are now followed (by t)
            for n in range(self.min_n, self.max_n + 1):
                if p - n >= 0:
                    last[tuple(h[p - n : p])] = p - n

    def propose(self, k: int) -> list[int]:
        h = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(h) <= n:
                continue
            start = self._last.get(tuple(h[-n:]))
            if start is not None:
                return h[start + n : start + n + k]
        return []


@dataclass(frozen=True)
class SpecConfig:
    """The server's speculative decoding: `mode` (auto: the draft model where one is given, else ngram), `draft`: the
    draft model's file, `draft_max`: the most guesses a row makes a step."""

    mode: str = "auto"
    draft: str | None = None
    draft_max: int = DRAFT_MAX

    def __post_init__(self) -> None:
        if self.mode not in SPEC_MODES:
            raise ValueError(f"spec must be one of {', '.join(SPEC_MODES)}, got {self.mode!r}")
        if self.mode == "draft" and not self.draft:
            raise ValueError("-spec draft needs a draft model: give -draft FILE")
        if not 0 <= self.draft_max <= 64:
            raise ValueError(f"draft_max must be between 0 and 64, got {self.draft_max}")

    @property
    def kind(self) -> str:
        """What drafts: draft, ngram or off."""
        if self.mode == "auto":
            return "draft" if self.draft else "ngram"
        return self.mode


@dataclass
class RowSpec:
    """A request's speculation: its adaptive k, what it drafted and had accepted, and its prompt lookup index."""

    adaptive: Adaptive
    index: NgramIndex | None = None
    drafted: int = 0
    accepted: int = 0
    draft: list[int] = field(default_factory=list)  # this step's guesses, verified by Outputs

    def history(self, req: Request) -> NgramIndex:
        """The request's prompt lookup index, brought up to date with its output."""
        seen = len(req.prompt_ids) + len(req.output_ids)
        if self.index is None:
            self.index = NgramIndex(list(req.prompt_ids) + req.output_ids)
        elif len(self.index.tokens) < seen:
            self.index.extend(req.output_ids[len(self.index.tokens) - len(req.prompt_ids) :])
        return self.index


class Drafter(Protocol):
    """Guesses for a step's rows: for each (request, k), up to k tokens to follow its history (prompt, output)."""

    def propose(self, asks: list[tuple[Request, int]]) -> list[list[int]]: ...


class NgramDrafter:
    def propose(self, asks: list[tuple[Request, int]]) -> list[list[int]]:
        return [req.spec.history(req).propose(k) if req.spec is not None else [] for req, k in asks]


class Speculator:
    """A model's speculative decoding: each step, the guesses of its decode rows that draft (Speculator.draft)."""

    def __init__(self, config: SpecConfig, drafter: Drafter, cost: float):
        self.config = config
        self.drafter = drafter
        self.cost = cost
        self.drafted = 0  # over the engine's life: guesses fed, and those accepted (stats)
        self.accepted = 0

    def row(self, draft_max: int | None) -> RowSpec:
        """A new request's state; `draft_max` its own limit (None: the server's)."""
        most = self.config.draft_max if draft_max is None else min(draft_max, self.config.draft_max)
        return RowSpec(Adaptive(most, self.cost))

    def draft(self, rows: list[Row], budget: int) -> list[Row]:
        """The step's rows with each drafting decode row's guesses after its token (fed as a short feed: decode's
        products and attention per token), taking at most `budget` tokens in all."""
        asks: list[tuple[int, Request, int]] = []
        for i, row in enumerate(rows):
            req = row.req
            spec = req.spec
            if spec is None or row.prompt or not row.ids or req.cancel_requested:
                continue
            spec.draft = []
            # never past max_tokens (k + 1 tokens may come of it) nor the session's room
            room = min(req.max_tokens - len(req.output_ids) - 1, req.session.kv.capacity - row.pos - 1, budget)
            k = min(spec.adaptive.k(), room)
            if k > 0:
                asks.append((i, row.req, k))
                budget -= k
        if not asks:
            return rows
        guesses = self.drafter.propose([(req, k) for _, req, k in asks])
        out = list(rows)
        for (i, req, _), guess in zip(asks, guesses):
            if not guess:
                continue
            assert req.spec is not None
            req.spec.draft = list(guess)
            req.session.token_ids.extend(guess)  # the session's tokens are its KV's: Outputs.verify trims what is refused
            row = rows[i]
            out[i] = replace(row, ids=row.ids + list(guess), short=True, logits=1 + len(guess), draft=tuple(guess))
        return out

    def describe(self) -> str:
        """What drafts: ngram, or the draft model's file name."""
        loaded = getattr(self.drafter, "loaded", None)
        return f"draft {loaded.path.name}" if loaded is not None else "ngram"

    def close(self) -> None:
        """Let go of what the drafter holds (a draft model's weights and KV)."""
        close = getattr(self.drafter, "close", None)
        if close is not None:
            close()

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        assert req.spec is not None
        req.spec.adaptive.record(drafted, accepted)
        req.spec.drafted += drafted
        req.spec.accepted += accepted
        self.drafted += drafted
        self.accepted += accepted

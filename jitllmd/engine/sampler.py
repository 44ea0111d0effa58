"""Per-row sampling on the logits' device: penalties, temperature, top-k, top-p, min-p, a seeded generator per request,
and a thinking model's thought (its budget forces the close marker)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

from .kernels import rows_kernel
from .kernels.ops import top_k

if TYPE_CHECKING:
    from .grammar import Constraint

__all__ = ["MAX_LOGPROBS", "NUCLEUS_CANDIDATES", "Sampler", "SamplingParams", "Thinking", "Thought", "TokenLogprobs", "logprobs_of"]

NUCLEUS_CANDIDATES = 1024  # top-p sorts this many likeliest tokens first, all of them only where they hold less than top_p
MAX_LOGPROBS = 20  # alternatives a token's log probabilities may list
_BIAS = 100.0  # logit_bias values lie in [-_BIAS, _BIAS]
_GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (as vLLM's _SAMPLING_EPS)


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log probability and the `top` likeliest tokens' (id, logprob), most likely first, under the model's
    own distribution: log_softmax of its logits before logit_bias, penalties, temperature and top-k/p/min-p (vLLM's
    raw_logprobs)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """`token`'s log probability under f32 logits [V], and the `top` likeliest tokens'."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(lp, min(top, lp.shape[-1]))
        best = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token, float(lp[token]), best)


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler. temperature 0 is greedy; 0/1.0 disable top_k/top_p."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), sorted by id
    logprobs: int | None = None  # each sampled token's log probability and this many alternatives' (None: none)

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be between 0 and 2, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be between 0 and 1, got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 64):
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias: token id {token} is negative")
            if not -_BIAS <= bias <= _BIAS:
                raise ValueError(f"logit_bias: the bias of token {token} must be between -100 and 100, got {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        """temperature 0 (or one so small that dividing by it overflows float32: below vLLM's 1e-5 it is greedy too),
        or top_k 1."""
        return self.temperature < _GREEDY_BELOW or self.top_k == 1


@dataclass(frozen=True)
class Thinking:
    """A row of a model that thinks: its thought's markers (one token each), whether the prompt already opened the
    thought (`inside`: the reply starts in it), and `budget`: tokens generated inside the thought before its close
    marker is forced, then `after_ids` (the whitespace the template writes after it); None: unbounded."""

    open_id: int
    close_id: int
    after_ids: tuple[int, ...] = ()
    inside: bool = False
    budget: int | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"thinking budget must be >= 0, got {self.budget}")


class _Phase(Enum):
    """START -> INSIDE (the first token opened the thought) or ANSWER; INSIDE -> CLOSING (the budget is spent) ->
    ANSWER, or INSIDE -> ANSWER (the model closed it)."""

    START = "start"
    INSIDE = "inside"
    CLOSING = "closing"
    ANSWER = "answer"


class Thought:
    """One row's thought as it is generated: where the row is, what the budget forces next, and the reasoning tokens
    so far (those up to and including the close marker, markers included). A grammar governs the answer only: it starts
    after the close marker (forced without the template's whitespace, which the grammar would refuse), and a row that
    may think may open its thought with its first token whatever the grammar allows there."""

    def __init__(self, spec: Thinking, *, grammar: bool = False):
        self.spec = spec
        self.phase = _Phase.INSIDE if spec.inside else _Phase.START
        self.inside_tokens = 0  # generated inside the thought, markers left out: what the budget counts
        self.reasoning_tokens = 0
        self._forced: list[int] = []
        self._after = () if grammar else spec.after_ids

    @property
    def may_open(self) -> bool:
        """Whether the next token may open the thought: the reply's first, where thinking is not off (budget 0)."""
        return self.phase is _Phase.START and self.spec.budget != 0

    @property
    def free(self) -> bool:
        """Inside the thought (or forcing its end): no grammar applies."""
        return self.phase in (_Phase.INSIDE, _Phase.CLOSING)

    def forced(self) -> int | None:
        """The token the budget makes this row take next, if any."""
        budget = self.spec.budget
        if self.phase is _Phase.INSIDE and budget is not None and self.inside_tokens >= budget:
            self.phase = _Phase.CLOSING
            self._forced = [self.spec.close_id, *self._after]
        return self._forced[0] if self._forced else None

    def accept(self, token: int) -> bool:
        """Take a generated token; True where it is the answer's (the grammar's to follow)."""
        forced = bool(self._forced) and token == self._forced[0]
        if forced:
            self._forced.pop(0)
        if self.phase is _Phase.START:
            if token != self.spec.open_id:
                self.phase = _Phase.ANSWER
                return True
            self.phase = _Phase.INSIDE
            self.reasoning_tokens += 1
            return False
        if self.phase is _Phase.ANSWER:
            return not forced  # the whitespace forced after the close marker is no grammar's
        self.reasoning_tokens += 1
        if token == self.spec.close_id:
            self.phase = _Phase.ANSWER
        else:
            self.inside_tokens += 1
        return False


class Sampler:
    """One row's sampler. Presence/frequency penalties count generated tokens (OpenAI's definition);
    the repetition penalty covers prompt and generated tokens (the CTRL / Hugging Face definition).

    Everything runs on the logits' device; the one move to the host is the chosen token id. The same seed gives the
    same tokens on the same device (each device kind has its own random algorithm, so a CPU and a GPU differ).
    """

    def __init__(self, params: SamplingParams, prompt_ids: list[int], constraint: Constraint | None = None, thinking: Thinking | None = None):
        self.params = params
        self.constraint = constraint  # a grammar the reply must follow: its mask comes before everything else
        self.thought = Thought(thinking, grammar=constraint is not None) if thinking is not None else None
        self.seed = params.seed if params.seed is not None else random.getrandbits(63)
        self._generators: dict[torch.device, torch.Generator] = {}
        self.counts: dict[int, int] = {}  # generated token -> times
        self.seen: set[int] = set(prompt_ids) if params.repetition_penalty != 1.0 else set()
        self.last: TokenLogprobs | None = None  # the last sampled token's, when params.logprobs asks for them
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias as (ids, values), on the logits' device

    def generator(self, device: torch.device) -> torch.Generator:
        """This row's generator on `device`, made on first use and seeded with the row's seed.

        One per device: if relocation moves the head, each device keeps its own stream rather than restarting one.
        """
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen

    def accept(self, token_id: int) -> None:
        answer = self.thought.accept(token_id) if self.thought is not None else True
        if self.constraint is not None and answer:
            self.constraint.accept(token_id)
        self.counts[token_id] = self.counts.get(token_id, 0) + 1
        if self.params.repetition_penalty != 1.0:
            self.seen.add(token_id)

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply logit_bias and the penalties to f32 logits [V] (in place on a copy, on the logits' device)."""
        p = self.params
        rep = p.repetition_penalty != 1.0 and self.seen
        pf = (p.presence_penalty or p.frequency_penalty) and self.counts
        if not (rep or pf or p.logit_bias):
            return logits
        logits = logits.clone()
        dev = logits.device
        if p.logit_bias:
            if self._bias is None or self._bias[0].device != dev:
                ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=dev)
                self._bias = ids, torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32, device=dev)
            logits.index_add_(0, *self._bias)
        if rep:
            ids = torch.tensor(sorted(self.seen), dtype=torch.long, device=dev)
            picked = logits[ids]
            logits[ids] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if pf:
            ids = torch.tensor(list(self.counts), dtype=torch.long, device=dev)
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32, device=dev)
            logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
        return logits

    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token from f32 logits [V], on their device (and its log probabilities into `last`); a thought
        whose budget is spent takes its close marker instead. A drafting row's guess is taken where the pick is the
        guess (Outputs.verify): the guesses are deterministic proposals (prompt lookup, a draft model's greedy token),
        for which speculative sampling's rule takes a guess with probability p(guess) under this row's distribution
        and else draws from p without it, which is exactly the law of this pick told apart by whether it is the guess.
        One uniform draw a sampled token either way: a seed gives the same tokens whether or not guesses were made."""
        token = self.thought.forced() if self.thought is not None else None
        if token is None:
            token = self._sample(self._masked(logits))
        if self.params.logprobs is not None:
            self.last = logprobs_of(logits, token, self.params.logprobs)
        return token

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits under the grammar, where one applies: not inside a thought; at the reply's first token of a row that
        may think, the open marker keeps its own logit too (the grammar then starts after the thought)."""
        c, thought = self.constraint, self.thought
        if c is None or (thought is not None and thought.free):
            return logits
        masked = c.mask(logits)
        if thought is not None and thought.may_open:
            masked[thought.spec.open_id] = logits[thought.spec.open_id]
        return masked

    def _sample(self, logits: torch.Tensor) -> int:
        """The row's pick under its distribution p (temperature, top-k/top-p/min-p, penalties, bias, grammar), or the
        argmax where it is greedy."""
        p = self.params
        logits = self.penalize(logits)
        if p.greedy:
            if logits.device.type == "cpu":  # numpy's argmax: ~17 us over a 262k vocabulary where torch's takes ~500
                return int(logits.numpy().argmax())  # the first of equal maxima, as torch.argmax
            return int(torch.argmax(logits))  # the token id to the host
        vocab = logits.shape[-1]
        ids: torch.Tensor | None = None  # the candidates' token ids, most likely first; None: every token, in id order
        if 0 < p.top_k < vocab:
            values, ids = _top_k(logits, p.top_k)  # sorted, descending; the temperature divides these k alone
            probs = torch.softmax(values / p.temperature, dim=-1)
        elif p.top_p < 1.0:
            logits = logits / p.temperature
            # The nucleus lies among the likeliest few unless the distribution is flat: sort those only (a sort of a
            # 262k vocabulary costs ~25 ms on two cores), with their probabilities in the whole distribution.
            values, ids = torch.topk(logits, min(vocab, NUCLEUS_CANDIDATES))
            probs = torch.exp(values - torch.logsumexp(logits, dim=-1))
            if float(probs.sum()) < p.top_p:  # flat: it may reach further
                values, ids = torch.sort(logits, descending=True)
                probs = torch.softmax(values, dim=-1)
        else:
            probs = torch.softmax(logits / p.temperature, dim=-1)  # temperature (and min-p) alone: nothing to sort
        if p.top_p < 1.0 or p.min_p > 0.0:
            keep = torch.ones_like(probs, dtype=torch.bool)
            if p.top_p < 1.0:
                # keep the smallest prefix whose mass reaches top_p (the first token always stays)
                before = torch.cumsum(probs, dim=-1) - probs
                keep &= before < p.top_p
                keep[0] = True  # a top_p too small for float32 (it rounds to 0) still keeps the likeliest
            if p.min_p > 0.0:
                keep &= probs >= p.min_p * probs.max()
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        gen = self.generator(probs.device)
        # inverse transform sampling: the first candidate whose cumulative mass passes a uniform draw of their total
        # (torch.multinomial takes ~7 ms over a 262k vocabulary; this is a cumsum and a search)
        cdf = torch.cumsum(probs, dim=-1)
        u = torch.rand(1, generator=gen, device=probs.device, dtype=cdf.dtype) * cdf[-1]
        choice = int(torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1))
        if float(probs[choice]) == 0.0:  # u at the very top of the mass: the last candidate that has any
            choice = int(probs.nonzero()[-1])
        return choice if ids is None else int(ids[choice])  # the token id to the host


def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits [V] and their ids, descending: the kernels' one pass on the CPU (torch.topk's ~75 us over
    49k logits is most of a top-k row's sampling), torch.topk elsewhere or where NaNs leave fewer than k numbers."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and rows_kernel() is not None:
        values, ids = top_k(logits, k)
        if values.shape[0] == k:
            return values, ids
    return torch.topk(logits, k)

"""Speculative decoding: a decode row feeds its sampled token and k guessed ones in one step (a short feed: each token
multiplies and attends as a decode row does, so on the kernels' path its logits are decode's, bit for bit), keeps the
guesses the sampler accepts plus one token of its own, and rolls its KV back past the first rejection (Outputs.verify).

This module: the settings, a row's state and how many tokens it guesses. Each row keeps its own acceptance rate and
drafts the k that pays most by it (Adaptive), none where none pays; a row that stopped drafting probes again now and
then. Prompt lookup (`ngram`: the most recent earlier occurrence of the last few tokens of the prompt and output, and
what followed it) is NgramIndex. engine/draft.py fills a step's guesses (Speculator) from it or from a draft model.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .config import SPEC_MODES

__all__ = ["MIN_GAIN", "PROBE_GAIN", "PROBE_SHARE", "SPEC_MODES", "Adaptive", "NgramIndex", "RowSpec", "SpecConfig", "StepCost", "expected_gain", "token_cost"]

DRAFT_MAX = 8  # the most tokens a row guesses a step (-draft-max)
NGRAM_MIN, NGRAM_MAX = 2, 4  # the lengths of the suffix prompt lookup matches, longest first
# A step's time as a + b * tokens: b / a before the engine has fitted its own (StepCost). A row of k + 1 tokens reads
# the weights once, but on a CPU's few cores its products are much of a step: measured 0.21-0.28 a token on 2 Zen 4
# cores for Qwen2.5-Coder 0.5B and 1.5B Q4_K_M (0.12-0.29 for SmolLM2 Q8_0; the AVX2 kernels the dearer), i.e. b / a
# about 0.33 (bench/speculative.py prints it)
PRIOR_PER_TOKEN = 0.33
# A draft model's guess costs besides its share of the weight bytes a target step reads (engine.py): its forward's
# fixed work (a step of its own, in Python and the kernels' calls)
DRAFT_STEP = 0.05
PRIOR = 0.6  # a new row's acceptance rate before it has drafted
# After a draft taken whole, each guess's chance to be taken while the run goes on, at least: a run ends somewhere, so
# where a longer draft costs more a token (StepCost) a shorter one can yield more
RUN_RATE = 0.9
RATE_WEIGHT = 0.15  # weight of the newest observation in a row's running acceptance rate
PROBE_EVERY = 16  # a row that stopped drafting guesses once again after this many steps (twice as many after a refused probe)
# A row drafts only where the best k's expected gain reaches this: below it, what the cost model leaves out (sampling
# each guessed row, noise) eats it (Qwen2.5-Coder-0.5B drafting for the 1.5B in a chat at 61% taken, where 1.02 was
# asked: 0.91x plain decoding; 1.1 held the same pair's code edit back to 1.07x from 1.29x).
MIN_GAIN = 1.05
# What a row's probes may cost after its first: their drafter's seconds (a draft model reads every token since its last
# guess first, ~5% of a target step a token for the 0.5B beside the 1.5B) within this share of the row's steps so far
PROBE_SHARE = 0.03
# A row's drafting steps checked against plain ones (the step, its sampling and the drafter's pass, a token at a time,
# where the row runs alone): each that lost makes its guesses dearer by PENALTY_UP, each that won cheaper by
# PENALTY_DOWN, each plain step by PENALTY_EASE, never below the model's own. The model misses what it does not time
# (sampling k + 1 rows, the draft's Python); Qwen2.5-Coder-0.5B for the 1.5B drafted a chat at 73% taken for 0.93x.
PENALTY_UP, PENALTY_DOWN, PENALTY_EASE = 1.15, 0.95, 0.99
# A row probes only where guesses can pay well: `most` of them, every one taken, would yield at least this many plain
# steps' tokens in a step's time. Each probe of a draft model costs the row's tokens read through it since the last
# (the prompt too, at the first), and real rates fall short of every guess taken: where the cost model said 1.2-1.3x
# at a perfect rate, drafting measured at or below plain decoding (Qwen2.5-Coder-0.5B for the 1.5B, 2 Zen 4 cores).
PROBE_GAIN = 1.3


def expected_gain(rate: float, k: int, cost: float) -> float:
    """Tokens a step of k guesses yields per step-time of a plain decode step, each guess accepted with probability
    `rate` given the ones before it were: (1 + r + ... + r^k) / (1 + cost * k)."""
    tokens = k + 1.0 if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)
    return tokens / (1.0 + cost * k)


def token_cost(per_token: float, rows: int) -> float:
    """What a guess costs, as a fraction of a decode step of `rows` rows where each row guesses alike, when a step takes
    a + b * tokens and per_token = b / a: k guesses a row stretch the step from a + b * rows by b * rows * k, so the
    throughput is E(k) / (1 + k * rows * per_token / (1 + rows * per_token)). The wider the step, the dearer a guess
    (at b / a = 0.33: 0.25 at one row, 0.73 at 8, 0.84 at 16)."""
    return rows * per_token / (1.0 + rows * per_token)


class StepCost:
    """A step's seconds against its tokens, over the recent steps without prompt tokens: each token count's own
    (the median of its last MEASURED_LAST steps, once it has MEASURED of them), else a + b * tokens fitted by least
    squares (older steps weighing less), else the prior b / a. A step's seconds are not linear in its tokens where the
    kernels take rows in groups: on AVX2 a row of 9 tokens costs a pass of 8 and another of 1 over the weights, and
    the few-row kernel's rows grow dearer past ~5 (Qwen2.5-Coder-1.5B Q4_K_M, 2 Zen 4 cores, avx2+fma forced: prompt
    lookup on a code edit, medians of 2: at most 5 guesses a step 1.94x plain decoding, at most 8 1.68x); measured
    counts find that."""

    DECAY = 0.99  # weight a step loses per later step: about the last hundred count
    SPREAD = 0.25  # the least variance of the steps' token counts a fit needs
    MEASURED, MEASURED_LAST = 3, 5  # a token count's own seconds: the median of its last 5 steps, once 3 were seen
    MOST_TOKENS = 1024  # token counts past this are fitted, never kept

    def __init__(self, prior: float = PRIOR_PER_TOKEN):
        self.prior = prior
        self._sums = [0.0] * 5  # weights, and their sums of tokens, tokens^2, seconds, tokens * seconds
        self._at: dict[int, deque[float]] = {}  # token count -> its last steps' seconds

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.DECAY
        for i, v in enumerate((1.0, tokens, tokens * tokens, seconds, tokens * seconds)):
            self._sums[i] = self._sums[i] * d + v
        if tokens <= self.MOST_TOKENS:
            self._at.setdefault(tokens, deque(maxlen=self.MEASURED_LAST)).append(seconds)

    def _fit(self) -> tuple[float, float] | None:
        w, t, t2, y, ty = self._sums
        if w < 8 or t2 / w - (t / w) ** 2 < self.SPREAD:
            return None
        b = (w * ty - t * y) / (w * t2 - t * t)
        a = (y - b * t) / w
        return (a, b) if a > 0 and b > 0 else None  # else a fit the noise made: no better than the prior

    def per_token(self) -> float:
        fit = self._fit()
        return min(4.0, fit[1] / fit[0]) if fit is not None else self.prior

    def measured(self, tokens: int) -> float | None:
        """The median seconds of the last steps of exactly `tokens` tokens, once there are MEASURED of them."""
        seen = self._at.get(tokens)
        return statistics.median(seen) if seen is not None and len(seen) >= self.MEASURED else None

    def seconds(self, tokens: int) -> float:
        """A step's seconds at `tokens`: its own (measured), else the fit's, else the steps' mean (0 before any)."""
        own = self.measured(tokens)
        if own is not None:
            return own
        fit = self._fit()
        if fit is not None:
            return fit[0] + fit[1] * tokens
        w, _, _, y, _ = self._sums
        return y / w if w else 0.0

    def guess_costs(self, rows: int, most: int) -> list[float]:
        """For k = 1 .. most: what each guess costs, as a fraction of a step of `rows` decode rows, where each row
        guesses k (the step grows from rows to rows * (k + 1) tokens). Where neither count is measured nor fitted, the
        prior's linear step (token_cost)."""
        rows = max(1, rows)
        fit, own = self._fit(), self.measured(rows)
        out = []
        for k in range(1, most + 1):
            wide = self.measured(rows * (k + 1))
            # both counts measured, or both fitted: one count's own seconds beside the other's fitted ones mix two
            # sources (a row's 8-token verifying step, measured, is dearer than the line says of 8 rows' plain one)
            if own is not None and wide is not None and own > 0:
                out.append(max(0.0, (wide - own) / (k * own)))
            elif fit is not None:
                a, b = fit
                out.append(b * rows / (a + b * rows))  # a + b * tokens: each guess adds b * rows
            else:
                out.append(token_cost(self.prior, rows))
        return out


class Adaptive:
    """One row's k: the one of 1..most whose expected gain is best at the row's running acceptance rate and a guess's
    cost, or 0 where none beats a plain step; after PROBE_EVERY steps without drafting, one guess to learn the rate
    again (the wait doubling, up to 8 times, while those guesses are refused), where guesses can pay at all
    (PROBE_GAIN). `forced` (a request's `speculative: true`): `most` guesses every step, whatever they pay."""

    def __init__(self, most: int, forced: bool = False):
        self.most = most
        self.forced = forced
        self.rate = PRIOR
        self._idle = 0  # steps since the row last drafted
        self._probe = PROBE_EVERY  # steps between probes: doubling while they fail
        self._run = 0  # the last draft's length where every guess of it was taken, else 0
        self.steps = 0  # steps the row has asked for its k
        self.probes = 0  # probes made
        self.probing = False  # the last k was a probe: its drafter's seconds are charged (charge)
        self.spent = 0.0  # seconds charged to probes after the first
        self.penalty = 1.0  # what the row's drafting steps really cost against the model's cost: grows while they lose

    def k(self, cost: float | Sequence[float], probe: bool = True, step_s: float = 0.0, model: Sequence[float] | None = None) -> int:
        """`cost`: what a guess costs as a fraction of a plain step, one for every k or each k's own (cost[k - 1]:
        the step's seconds need not grow by the same for each token). Guesses are taken in runs (a reply copying its
        input, a stretch the draft model knows): after a draft taken whole, up to twice as many where drafting pays at
        all, however many the running rate alone would say (the k of those that yields most at RUN_RATE at least).
        `probe` False: no probe this step (a draft model would read a row's whole prompt first, in a step of many
        rows). `step_s`: a step's seconds now; a probe after the first waits until what probes cost is within
        PROBE_SHARE of the row's steps. `model`: the cost the forward's and drafter's times alone give (cost less what
        drafting steps timed whole showed they miss: Speculator.cost), whether guesses can pay at all: a row probes
        where they might, and its probes measure the rest again."""
        self.steps += 1
        self.probing = False
        if self.most <= 0 or self.forced:
            return max(0, self.most)
        costs = self._per_k(cost)
        best, gain = 0, MIN_GAIN / 1.02
        for k in range(1, self.most + 1):
            g = expected_gain(self.rate, k, min(0.95, costs[k - 1] * self.penalty))
            if g > gain * 1.02:  # a longer draft must pay a little more than noise
                best, gain = k, g
        if self._run and best:
            top = max(best, min(self.most, 2 * self._run))
            rate = max(self.rate, RUN_RATE)
            return max(range(best, top + 1), key=lambda k: (expected_gain(rate, k, min(0.95, costs[k - 1] * self.penalty)), k))
        if best == 0:
            self.penalty = max(1.0, self.penalty * PENALTY_EASE)  # drafting is tried again, now and then, where it lost
        could = costs if model is None else self._per_k(model)
        if best == 0 and probe and max(expected_gain(1.0, k, could[k - 1]) for k in range(1, self.most + 1)) >= PROBE_GAIN:
            self._idle += 1
            if self._idle >= self._probe and (not self.probes or self.spent <= PROBE_SHARE * self.steps * step_s):
                self._idle = 0
                self.probes += 1
                self.probing = True
                return 1
        return best

    def _per_k(self, cost: float | Sequence[float]) -> list[float]:
        """A guess's cost for each k = 1 .. most: one for all, or each k's own (the last repeated where too few)."""
        costs = [cost] * self.most if isinstance(cost, (int, float)) else list(cost)[: self.most]
        return costs + [costs[-1] if costs else 0.95] * (self.most - len(costs))

    def realized(self, won: bool) -> None:
        """A drafting step of this row alone really took less time a token than a plain step (won), or not."""
        self.penalty = max(1.0, self.penalty * PENALTY_DOWN) if won else min(4.0, self.penalty * PENALTY_UP)

    def charge(self, seconds: float) -> None:
        """What the probe just made cost besides a plain step (its first free: it learns the rate at all)."""
        if self.probing and self.probes > 1:
            self.spent += seconds

    def record(self, drafted: int, accepted: int) -> None:
        """A verified draft: `accepted` of its first guesses taken, then (if fewer than `drafted`) one refused."""
        if drafted <= 0:
            return
        self._idle = 0
        self._run = drafted if accepted == drafted else 0
        self._probe = PROBE_EVERY if accepted else min(8 * PROBE_EVERY, 2 * self._probe)
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

    def history(self, prompt_ids: list[int], output_ids: list[int]) -> NgramIndex:
        """The request's prompt lookup index, brought up to date with its output."""
        if self.index is None:
            self.index = NgramIndex(list(prompt_ids) + output_ids)
        elif len(self.index.tokens) < len(prompt_ids) + len(output_ids):
            self.index.extend(output_ids[len(self.index.tokens) - len(prompt_ids) :])
        return self.index



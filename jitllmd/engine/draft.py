"""Drafting for speculative decoding (engine/speculative.py): the Speculator that puts each step's guesses after its
decode rows' tokens, and what guesses — prompt lookup (NgramDrafter) or a draft model (DraftModel).

A draft model is a small model of the target's vocabulary that guesses greedily, k tokens a step for each drafting
row, all rows in one forward of its own per guess. It keeps a KV per session of the target's (its own, beside the
target's), and the tokens that KV holds: before a step's guesses it catches up with the session's tokens (a new
prompt, the last step's taken guesses and the token the target picked; what it guessed and the target refused is cut
off first), then feeds each guess to get the next.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from .kv import RowSpan, SessionKV
from .loader import LoadedModel, load_model
from .memory.devices import is_remote
from .request import Request
from .scheduler import Row
from .sessions import Session, common_prefix
from .speculative import DRAFT_STEP, PRIOR_PER_TOKEN, Adaptive, RowSpec, SpecConfig, StepCost

__all__ = ["DraftModel", "Drafter", "NgramDrafter", "Speculator", "calibrate", "check_vocabulary", "draft_kv_bytes", "draft_model_for", "draft_of", "speculator_for"]

CATCH_UP = 512  # a row's catching-up tokens a draft forward takes at most (a long prompt goes in chunks)
_PROBES = 4096  # token ids whose strings must agree, spread over the vocabulary (its last one too)


class Drafter(Protocol):
    """Guesses for a step's rows: for each (request, k), up to k tokens to follow its history (prompt, output)."""

    def propose(self, asks: list[tuple[Request, int]]) -> list[list[int]]: ...


class NgramDrafter:
    """Prompt lookup: each row's guesses continue the latest earlier occurrence of its last few tokens."""

    def propose(self, asks: list[tuple[Request, int]]) -> list[list[int]]:
        return [req.spec.history(req.prompt_ids, req.output_ids).propose(k) if req.spec is not None else [] for req, k in asks]


MISS_WEIGHT = 0.2  # weight of a drafting step's own in the running mean of what the model misses (Speculator._miss), after 5
MISS_MOST = 4.0  # a step's own, at most (either way): one step held up by the machine's other work weighs no more


@dataclass
class _Open:
    """A step of decode rows alone, begun at `t0` (Speculator.draft), timed at the next: its guesses (0: a plain
    step), the fraction of a plain step the model says they add to it, and the rows drafting (not probing) in it."""

    t0: float
    rows: int
    guesses: int = 0
    model: float = 0.0
    drafting: list[Request] = field(default_factory=list)


class Speculator:
    """A model's speculative decoding: each step, the guesses of its decode rows that draft (Speculator.draft)."""

    def __init__(self, config: SpecConfig, drafter: Drafter, extra: float = 0.0, per_token: float | None = None):
        self.config = config
        self.drafter = drafter
        self.extra = extra  # what a guess costs besides the target's step, as a fraction of a step's fixed part, until measured
        # the target's step seconds against its tokens (the engine tells it each step); `per_token`: b / a until fitted
        self.steps = StepCost() if per_token is None else StepCost(per_token)
        self._passes: deque[float] = deque(maxlen=9)  # a drafter's recent passes (one guess of each drafting row): seconds
        self.drafted = 0  # over the engine's life: guesses fed, and those accepted (stats)
        self.accepted = 0
        self._plain: dict[int, float] = {}  # decode rows -> seconds a plain step of that many takes a token, draft() to draft() (running mean)
        self._open: _Open | None = None  # the step of decode rows alone begun, timed at the next draft()
        self._taken = 0  # guesses its verification took
        # decode rows -> what a guess costs beyond the model's cost (cost), as a fraction of a plain step of that many
        # rows: drafting steps timed whole (_close), a running mean. The model times the target's forward alone; the
        # rest of a step (sampling and verifying each guessed row, the drafter, the host's Python) grows with guesses
        # too, and where the forward is a small part of a step (a CUDA device's) it is most of a guess's cost.
        self._miss: dict[int, tuple[float, int]] = {}  # ... and the steps it is the mean of

    def row(self, draft_max: int | None, forced: bool = False) -> RowSpec:
        """A new request's state; `draft_max` its own limit (None: the server's); `forced`: it guesses that many every
        step (its `speculative: true`), whether or not they pay."""
        most = self.config.draft_max if draft_max is None else min(draft_max, self.config.draft_max)
        return RowSpec(Adaptive(most, forced))

    def cost(self, rows: int, model: list[float]) -> list[float]:
        """What a guess costs in a step of `rows` decode rows where each guesses k, for k = 1 .. -draft-max: the
        model's (`model`: _model_cost) and what drafting steps of as many rows, timed whole, showed it misses."""
        miss = self._missed(rows)
        return [min(0.95, c + miss) for c in model]

    def _missed(self, rows: int) -> float:
        """What a guess costs beyond the model's at `rows` decode rows, as a fraction of a plain step (_close); 0 where
        none was measured or the model overshoots."""
        return max(0.0, self._miss.get(rows, (0.0, 0))[0])

    def _model_cost(self, rows: int) -> list[float]:
        """The target's forward (StepCost.guess_costs) with the drafter's own: a draft model's forward, whose share of
        a one-row step shrinks as the target's step widens."""
        step = self.steps.seconds(rows)
        # the passes' median, once there are a few (a draft model's first passes run cold)
        extra = statistics.median(self._passes) / step if len(self._passes) >= 3 and step else self.extra / (1.0 + rows * self.steps.per_token())
        return [c + extra for c in self.steps.guess_costs(rows, max(1, self.config.draft_max))]

    def draft(self, rows: list[Row], budget: int) -> list[Row]:
        """The step's rows with each drafting decode row's guesses after its token (fed as a short feed: decode's
        products and attention per token), taking at most `budget` tokens in all."""
        now = time.perf_counter()
        self._close(now)
        asks: list[tuple[int, Request, int]] = []
        decoding = sum(1 for r in rows if not r.prompt and r.ids)
        model = self._model_cost(decoding)
        cost = self.cost(decoding, model)
        step_s = self.steps.seconds(decoding)
        probe = decoding == 1 or not self.extra  # a draft model's probe reads the row's prompt first: alone, not in a wide step
        # a step of decode rows alone is timed (_close); until one of this many rows ran plain, none guesses (but a
        # forced row): drafting steps need a plain one to be judged against, or guesses whose cost the model misses
        # (sampling and verifying k + 1 rows: a CUDA device's steps) would go on unjudged
        timed = decoding > 0 and decoding == len(rows)
        unjudged = timed and decoding not in self._plain
        for i, row in enumerate(rows):
            req = row.req
            spec = req.spec
            if spec is None or row.prompt or not row.ids or req.cancel_requested or (unjudged and not spec.adaptive.forced):
                continue
            # never past max_tokens (k + 1 tokens may come of it) nor the session's room
            room = min(req.max_tokens - len(req.output_ids) - 1, req.session.kv.capacity - row.pos - 1, budget)
            k = min(spec.adaptive.k(cost, probe, step_s, model), room)
            if k > 0:
                asks.append((i, row.req, k))
                budget -= k
        # a step of decode rows only is timed (a prompt's tokens would say nothing of guesses); its probing rows are
        # not judged on it (their cost is charged to them: Adaptive.charge), but what it shows of guesses counts
        judged = [req for _, req, _ in asks if req.spec is not None and not req.spec.adaptive.probing]
        if timed:
            self._open = _Open(now, decoding)
        if not asks:
            return rows
        t0 = time.perf_counter()
        guesses = self.drafter.propose([(req, k) for _, req, k in asks])
        took = time.perf_counter() - t0
        if getattr(self.drafter, "caught_up", False):  # a draft model read a new prompt first: a step unlike the others
            self._open = None
        elif self.extra:  # a model's forwards: what a pass took
            self._passes.append(took / max(k for _, _, k in asks))
        verify = self.steps.seconds(decoding + 1) - step_s  # a guessed token's share of the step
        for _, req, _ in asks:  # a probe's drafting, and its guess in the step, are its row's to pay
            assert req.spec is not None
            req.spec.adaptive.charge(took / len(asks) + max(0.0, verify) + self._missed(decoding) * step_s)
        out = list(rows)
        for (i, req, _), guess in zip(asks, guesses):
            if not guess:
                continue
            if self._open is not None:  # what the model says the step's guesses add to it, and who is judged on it
                self._open.guesses += len(guess)
                self._open.model += model[len(guess) - 1] * len(guess) / decoding
                if req in judged:
                    self._open.drafting.append(req)
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

    def _close(self, now: float) -> None:
        """The last step of decode rows, timed to this call, a token at a time (each row's own and its taken guesses):
        a plain one kept in the running mean of steps of as many rows, a drafting one checked against it, its drafting
        rows told whether it won (Adaptive.realized): in a wide step guesses cost more than the model's line says (on
        AVX2 16 tokens are two passes of the few-row kernel over the weights where 8 are one). What a drafting step
        took beyond what the model said its guesses add goes into the running mean of the model's miss (a probe's too:
        probes measure it again where it stopped every row). A gap past 4 plain steps a token (the engine idle
        between requests) says nothing."""
        taken, self._taken = self._taken, 0
        if self._open is None:
            return
        step, self._open = self._open, None
        num, seconds = step.rows, now - step.t0
        per = seconds / (num + (taken if step.guesses else 0))
        plain = self._plain.get(num)
        if plain is not None and per > 4 * plain:
            return
        if not step.guesses:
            self._plain[num] = per if plain is None else plain + 0.1 * (per - plain)
        elif plain is not None:
            for req in step.drafting:
                if req.spec is not None:
                    req.spec.adaptive.realized(per < plain)
            # what each guess cost beyond the model's, as a fraction of the plain step: (step / plain step - 1 - what
            # the model says the guesses add) over the guesses a row
            miss = (seconds / (num * plain) - 1.0 - step.model) * num / step.guesses
            was, seen = self._miss.get(num, (0.0, 0))
            self._miss[num] = (was + max(MISS_WEIGHT, 1.0 / (seen + 1)) * (min(MISS_MOST, max(-MISS_MOST, miss)) - was), seen + 1)

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        assert req.spec is not None
        self._taken += accepted
        req.spec.adaptive.record(drafted, accepted)
        req.spec.drafted += drafted
        req.spec.accepted += accepted
        self.drafted += drafted
        self.accepted += accepted


def check_vocabulary(draft: LoadedModel, target: LoadedModel) -> None:
    """Refuse a draft model whose token ids do not mean the target's: the same vocabulary size (the tokenizer's) and
    the same strings for ids across it, and the same end-of-sequence ids. ValueError names the first difference."""
    a, b = draft.tokenizer, target.tokenizer
    if a.vocab_size != b.vocab_size:
        raise ValueError(f"the draft model {draft.name} has a vocabulary of {a.vocab_size} tokens and {target.name} of {b.vocab_size}: "
                         "a draft model must share the target's tokenizer")
    step = max(1, a.vocab_size // _PROBES)
    for i in [*range(0, a.vocab_size, step), a.vocab_size - 1]:
        if a.id_to_token(i) != b.id_to_token(i):
            raise ValueError(f"the draft model {draft.name}'s token {i} is {a.id_to_token(i)!r}, {target.name}'s is {b.id_to_token(i)!r}: "
                             "a draft model must share the target's tokenizer")
    if set(draft.eos_token_ids) != set(target.eos_token_ids):
        raise ValueError(f"the draft model {draft.name} ends sequences with tokens {sorted(draft.eos_token_ids)}, {target.name} with "
                         f"{sorted(target.eos_token_ids)}: a draft model must share the target's tokenizer")


@dataclass
class _Held:
    kv: SessionKV
    ids: list[int] = field(default_factory=list)  # the tokens whose K/V `kv` holds


def draft_of(speculator: Speculator | None) -> DraftModel | None:
    """The draft model a speculator drafts with, if it is one (not prompt lookup)."""
    drafter = speculator.drafter if speculator is not None else None
    return drafter if isinstance(drafter, DraftModel) else None


def draft_kv_bytes(speculator: Speculator | None) -> int:
    """Bytes of K/V pages a draft model's sessions hold beside the target's (0 for prompt lookup or none)."""
    draft = draft_of(speculator)
    return draft.loaded.kv_bytes() if draft is not None else 0


class DraftModel:
    """Greedy guesses from a loaded draft model, for the rows of the target's steps. Only the target's engine thread
    calls it (the draft runs on that thread's torch pool)."""

    def __init__(self, loaded: LoadedModel, target: LoadedModel):
        if loaded.embeds or loaded.runner is None:
            raise ValueError(f"the draft model {loaded.name} does not generate text")
        check_vocabulary(loaded, target)
        self.loaded = loaded
        self.caught_up = False  # the last call fed a row more than a few tokens before its guesses (a new prompt)
        self._held: weakref.WeakKeyDictionary[Session, _Held] = weakref.WeakKeyDictionary()  # its KV goes with the session

    def close(self) -> None:
        self._held.clear()
        self.loaded.close()

    def _held_for(self, session: Session) -> _Held:
        held = self._held.get(session)
        if held is None:
            held = self._held[session] = _Held(self.loaded.new_kv(min(session.max_seq, self.loaded.max_seq)))
        return held

    def propose(self, asks: list[tuple[Request, int]]) -> list[list[int]]:
        """k greedy guesses for each (request, k), its session's tokens (the last: the token this step feeds) as the
        context; none for a row past the draft's own room (its context may be shorter than the target's)."""
        fits = [i for i, (req, k) in enumerate(asks) if len(req.session.token_ids) + k <= self._held_for(req.session).kv.capacity]
        out: list[list[int]] = [[] for _ in asks]
        if fits:
            for i, guess in zip(fits, self._propose([asks[i] for i in fits])):
                out[i] = guess
        return out

    def _propose(self, asks: list[tuple[Request, int]]) -> list[list[int]]:
        rows: list[tuple[_Held, list[int]]] = []
        for req, _ in asks:
            held, tokens = self._held_for(req.session), req.session.token_ids
            n = held.kv.reusable(min(common_prefix(held.ids, tokens), len(tokens) - 1))  # at least one token to feed
            held.kv.truncate(n)
            del held.ids[n:]
            rows.append((held, tokens[n:]))
        guesses: list[list[int]] = [[] for _ in asks]
        feeds = [list(t) for _, t in rows]
        self.caught_up = any(len(f) > 4 for f in feeds)  # a new prompt to read first: this call is no guess's cost
        for j in range(max(k for _, k in asks)):
            live = [i for i, (_, k) in enumerate(asks) if k > j]
            pending = list(live)
            while pending:  # catch up in chunks; a row's last chunk gives its next guess
                chunk = [(i, feeds[i][:CATCH_UP]) for i in pending]
                picks = self._forward([(rows[i][0], ids) for i, ids in chunk], [len(feeds[i]) <= CATCH_UP for i, _ in chunk])
                for (i, ids), pick in zip(chunk, picks):
                    rows[i][0].ids.extend(ids)
                    feeds[i] = feeds[i][len(ids) :]
                    if pick is not None:
                        guesses[i].append(pick)
                pending = [i for i in pending if feeds[i]]
            for i in live:  # the guess is fed for the next; the last one never is (the next step starts from the target's)
                feeds[i] = [guesses[i][-1]]
        return guesses

    @torch.inference_mode()
    def _forward(self, rows: list[tuple[_Held, list[int]]], last: list[bool]) -> list[int | None]:
        """One packed forward of the draft over each row's `ids` (appended to its KV); the greedy next token of each
        row whose ids are its `last` chunk, else None."""
        runner = self.loaded.runner
        assert runner is not None
        tokens: list[int] = []
        positions: list[int] = []
        spans: list[RowSpan] = []
        at: list[int] = []
        for (held, ids), is_last in zip(rows, last):
            start = len(tokens)
            tokens.extend(ids)
            positions.extend(range(held.kv.length, held.kv.length + len(ids)))
            # a few tokens (the last step's taken guesses and the target's token) run as decode rows do: a short feed,
            # not a prompt chunk of 2-4 rows (its products a GEMM's, 1.5-3x the few-row kernel's time at so few rows)
            short = 1 < len(ids) <= runner.short_feed
            spans.append(RowSpan(start, len(ids), held.kv, prompt=len(ids) > 1, short=short, many=short and len(ids) > runner.rows_feed))
            if is_last:
                at.append(len(tokens) - 1)
        dev = runner.device
        logits = runner.forward(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev), spans,
                                torch.tensor(at or [len(tokens) - 1], dtype=torch.long, device=dev))
        picks = iter(torch.argmax(logits, dim=-1).tolist())
        return [next(picks) if is_last else None for is_last in last]


def speculator_for(spec: SpecConfig | None, drafter: Drafter | None, loaded: LoadedModel) -> Speculator | None:
    """Speculative decoding where `spec` asks for it and the model can: a decoder whose blocks are all on this
    host (another rank's KV is not rolled back with this one's)."""
    if spec is None or spec.kind == "off" or spec.draft_max == 0 or loaded.embeds or loaded.runner is None:
        return None
    placement = loaded.placement
    if placement is not None and any(is_remote(p) for p in placement.places):
        return None
    if spec.kind == "draft":
        if not isinstance(drafter, DraftModel):
            raise ValueError("-spec draft needs a draft model (-draft FILE)")
        extra, per_token = calibrate(drafter, loaded, spec.draft_max)
        return Speculator(spec, drafter, extra, per_token)
    return Speculator(spec, drafter or NgramDrafter())


CALIBRATION_STEPS = 5  # timed rounds of each forward calibrate() takes the median of (after one not timed)


def calibrate(draft: DraftModel, target: LoadedModel, guesses: int = 8) -> tuple[float, float]:
    """What a draft model's guess costs, measured at load on scratch KVs (medians of CALIBRATION_STEPS interleaved
    rounds): the target's step of one token and of a row verifying `guesses` (at most 32; a short feed, logits for
    each token) give its step as a + b * tokens; the draft's pass (one token and its greedy pick, as DraftModel
    guesses) is `extra`, its seconds / a. -> (extra, b / a). So a row's first probes know whether a draft model can
    pay (Adaptive: PROBE_GAIN) before any request reads its prompt through it. Where the fit fails (noise), the prior
    b / a and the draft's share of the bytes a step reads, as before any measurement."""
    runner = target.runner
    assert runner is not None  # a decoder's (speculator_for)
    dev, settle = runner.device, runner.placement.synchronize
    wide = min(max(guesses, 1), 32) + 1
    kv, held = runner.new_kv(4 + wide), _Held(draft.loaded.new_kv(8))
    prefix = torch.zeros(4, dtype=torch.long, device=dev)
    runner.forward(prefix, torch.arange(4, device=dev), [RowSpan(0, 4, kv, prompt=True)], torch.tensor([3], device=dev))
    draft._forward([(held, [0, 0, 0, 0])], [True])
    times: dict[str, list[float]] = {"one": [], "wide": [], "pass": []}
    for i in range(CALIBRATION_STEPS + 1):
        for name, t in (("one", 1), ("wide", wide)):
            settle()
            t0 = time.perf_counter()
            runner.forward(torch.zeros(t, dtype=torch.long, device=dev), torch.arange(4, 4 + t, device=dev), [RowSpan(0, t, kv, short=t > 1)],
                           torch.arange(t, device=dev))
            settle()
            if i:
                times[name].append(time.perf_counter() - t0)
            kv.truncate(4)
        t0 = time.perf_counter()
        draft._forward([(held, [0])], [True])
        if i:
            times["pass"].append(time.perf_counter() - t0)
        held.kv.truncate(4)
        del held.ids[4:]
    one, most, pass_s = (statistics.median(times[k]) for k in ("one", "wide", "pass"))
    b = (most - one) / (wide - 1)
    a = one - b
    if a <= 0 or b <= 0:
        share = draft.loaded.decode_bytes() / max(1, target.decode_bytes())
        return DRAFT_STEP + share, PRIOR_PER_TOKEN
    return pass_s / a, min(4.0, b / a)


def draft_model_for(spec: SpecConfig | None, target: LoadedModel, load_kw: dict) -> DraftModel | None:
    """The draft model `spec` names, loaded on the target's devices with its sessions' room, within the same room on
    them (-device-mem: relocation counts its blocks as the target's, Engine.draft_placement); None where it names none.
    ValueError for one whose tokenizer is not the target's."""
    if spec is None or spec.kind != "draft" or not spec.draft:
        return None
    draft = load_model(spec.draft, devices=load_kw.get("devices"), sessions=load_kw.get("sessions", 1),
                       max_seq=target.max_seq, room=load_kw.get("room"))
    try:
        return DraftModel(draft, target)
    except BaseException:
        draft.close()
        raise

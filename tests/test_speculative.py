"""Speculative decoding (engine/speculative.py, Outputs.verify): a decode row feeds its guesses after its token and keeps
those the sampler takes. Greedy, the tokens are decoding's without guesses, token for token, on every kernel variant
(the guesses multiply and attend as decode rows do: their logits are decode's, bit for bit, and so is the KV left
behind); sampled, each token's law is the row's own distribution (checked against it with a chi-square bound that a
wrong acceptance rule fails)."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import pytest
import torch

from jitllmd.engine import kernels
from jitllmd.engine.engine import Engine
from jitllmd.engine.request import Generation
from jitllmd.engine.sampler import Sampler, SamplingParams
from jitllmd.engine.speculative import (
    MIN_GAIN,
    PRIOR,
    PROBE_EVERY,
    PROBE_GAIN,
    PROBE_SHARE,
    Adaptive,
    NgramIndex,
    SpecConfig,
    StepCost,
    expected_gain,
    token_cost,
)
from tests.test_engine import collect

GREEDY = SamplingParams(temperature=0.0)
# a prompt that repeats itself: prompt lookup finds what follows its last tokens, and a tiny random model's greedy
# output falls into loops, which it finds too
PROMPT = [11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12]


@pytest.fixture(params=kernels.variants() or [None])
def variant(request):
    kernels.use_variant(request.param)
    yield request.param
    kernels.use_variant(None)


def _engine(path, mode: str = "ngram", draft_max: int = 8, max_batch: int = 4) -> Engine:
    """The model with `mode`'s drafter: draft is the model itself as its own draft model (nearly every guess taken)."""
    spec = SpecConfig(mode=mode, draft=str(path) if mode == "draft" else None, draft_max=draft_max)
    return Engine.load(path, max_batch=max_batch, spec=spec, max_seq=512)


def _run(engine: Engine, prompt=PROMPT, n: int = 120, **kw):
    kw.setdefault("ignore_eos", True)  # long enough to fall into loops
    return collect(engine.generate(Generation(prompt, kw.pop("params", GREEDY), max_tokens=n, **kw)))


# -- the drafter and k ---------------------------------------------------------------------------------------------


def test_prompt_lookup_continues_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    idx = NgramIndex([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    assert idx.propose(3) == [4, 5, 9]  # "1 2 3" at 0, though "2 3" is later, at 6: the longest suffix wins
    idx = NgramIndex([1, 2, 3, 4, 5, 9, 2, 3, 7])
    assert idx.propose(2) == []  # "3 7", "2 3 7": never before
    idx.extend([4, 2, 3])
    assert idx.propose(4) == [7, 4, 2, 3]  # "2 3": latest earlier at 6, then what followed
    assert NgramIndex([6, 6]).propose(2) == []  # the suffix itself is no earlier occurrence


def test_adaptive_k_drafts_what_pays_stops_where_nothing_does_and_probes_again() -> None:
    assert expected_gain(0.0, 3, 0.1) < 1.0 < expected_gain(0.9, 3, 0.1)
    a = Adaptive(8)
    for _ in range(30):
        a.record(4, 4)
    assert a.k(0.12) >= 4
    for _ in range(40):
        a.record(4, 0)
    ks = [a.k(0.3) for _ in range(8 * PROBE_EVERY)]
    assert ks.count(1) == 1 and ks[-1] == 1  # off, then (the refusals having stretched the wait) one guess to learn again
    a.record(1, 1)  # taken: the next probe comes at the shortest wait
    ks = [a.k(0.3) for _ in range(PROBE_EVERY)]
    assert ks.count(1) == 1 and ks[-1] == 1
    a.record(1, 0)  # refused: the next one waits twice as long
    ks = [a.k(0.3) for _ in range(2 * PROBE_EVERY)]
    assert ks.count(1) == 1 and ks[-1] == 1
    assert Adaptive(0).k(0.0) == 0
    # a wider step makes a guess dearer: the same rate drafts fewer tokens, or none
    assert token_cost(0.33, 1) == pytest.approx(0.25, abs=0.01) and token_cost(0.33, 8) > 0.7
    b = Adaptive(8)
    for _ in range(30):
        b.record(4, 3)
    assert b.k(token_cost(0.1, 1)) > b.k(token_cost(0.1, 8)) > 0 and b.k(token_cost(0.1, 32)) <= 1


def test_no_probes_where_no_acceptance_rate_could_pay_and_a_forced_row_guesses_every_step() -> None:
    """A guess as dear as a step (a draft model no cheaper than its target) pays at no rate: a row that does not draft
    never probes, so it never reads its tokens through the drafter; a cheap guess (prompt lookup's) keeps probing. A
    forced row (speculative: true) guesses its most every step, even where every guess is refused."""
    dear, cheap = 0.95, 0.3
    assert expected_gain(1.0, 8, dear) < PROBE_GAIN <= expected_gain(1.0, 8, cheap)
    a = Adaptive(8)
    assert [a.k(dear) for _ in range(8 * PROBE_EVERY)].count(0) == 8 * PROBE_EVERY
    for _ in range(40):
        a.record(4, 0)
    assert [a.k(dear) for _ in range(8 * PROBE_EVERY)].count(0) == 8 * PROBE_EVERY
    ks = [a.k(cheap) for _ in range(8 * PROBE_EVERY)]  # the same row where guesses are cheap: a probe after the wait
    assert ks.count(1) == 1 and ks[-1] == 1
    # a gain the model puts just past a plain step is not taken: below MIN_GAIN what it leaves out eats it
    assert 1.02 < expected_gain(PRIOR, 1, 0.53) < MIN_GAIN and Adaptive(8).k(0.53) == 0 and Adaptive(8).k(0.3) == 1
    forced = Adaptive(3, forced=True)
    for _ in range(10):
        forced.record(3, 0)
    assert [forced.k(dear) for _ in range(20)] == [3] * 20 and Adaptive(0, forced=True).k(0.0) == 0


def test_probes_after_the_first_cost_a_row_at_most_its_share_of_its_steps() -> None:
    """A probe's drafting is charged to its row (a draft model reads the row's tokens since its last guess first): the
    first is free, the next waits until what probes cost is within PROBE_SHARE of the row's steps' seconds."""
    a = Adaptive(8)
    for _ in range(40):
        a.record(4, 0)  # a rate that does not pay: probes only, the wait at its longest (8 x PROBE_EVERY)
    step, cost = 0.05, 0.3

    def probes(n: int, charge: float) -> list[int]:
        at = []
        for i in range(n):
            if a.k(cost, step_s=step):
                a.charge(charge)
                a.record(1, 0)
                at.append(i)
        return at

    assert len(probes(8 * PROBE_EVERY, 1.0)) == 1 and a.spent == 0.0  # the first probe: free
    assert len(probes(8 * PROBE_EVERY, 1.0)) == 1 and a.spent == 1.0  # the second's second of drafting is charged
    before = a.steps
    later = probes(1000, 1.0)  # a third waits until PROBE_SHARE of the row's steps repays it
    assert later and before + later[0] + 1 >= 1.0 / (PROBE_SHARE * step) > before + 8 * PROBE_EVERY
    cheap = Adaptive(8)  # prompt lookup: its probes cost nothing to draft, so the budget never holds one back
    for _ in range(40):
        cheap.record(4, 0)
    ks = []
    for _ in range(4 * 8 * PROBE_EVERY):
        ks.append(cheap.k(cost, step_s=step))
        if ks[-1]:
            cheap.charge(0.0)
            cheap.record(1, 0)
    assert ks.count(1) == 4


def test_drafting_steps_that_lose_make_a_rows_guesses_dearer_until_it_stops() -> None:
    """Adaptive.realized: a row whose drafting steps took longer a token than plain ones (the model's cost too low)
    drafts fewer and then none; steps that won, and plain steps, ease it back to the model's own cost."""
    a = Adaptive(8)
    for _ in range(30):
        a.record(4, 3)  # ~70% taken
    cost = 0.4
    drafting = a.k(cost)
    assert drafting > 0
    for _ in range(6):
        a.realized(False)
    assert a.k(cost) == 0 and a.penalty > 2.0
    for _ in range(200):  # plain steps ease it until it tries again
        a.k(cost, probe=False)
    assert 0 < a.k(cost) <= drafting and a.penalty > 1.0
    for _ in range(40):  # and steps that win bring it back to the model's cost
        a.realized(True)
    assert a.penalty == 1.0 and a.k(cost) == drafting


def test_a_draft_model_is_calibrated_at_load_on_scratch_kv_that_goes_back(tiny_serve_q8_jlm) -> None:
    """calibrate: a draft pass against the target's step, both timed on scratch KVs: positive figures, within the
    bounds the cost model takes, and no page left held in either model's pool."""
    import gc

    from jitllmd.engine.draft import DraftModel, calibrate
    from jitllmd.engine.loader import load_model

    target, other = load_model(tiny_serve_q8_jlm, max_seq=64), load_model(tiny_serve_q8_jlm, max_seq=64)
    try:
        draft = DraftModel(other, target)
        extra, per_token = calibrate(draft, target)
        gc.collect()
        assert extra > 0 and 0 < per_token <= 4.0
        assert target.runner.kv_pool.held_bytes() == 0 and other.runner.kv_pool.held_bytes() == 0
    finally:
        target.close()
        other.close()


def test_a_draft_model_reads_a_few_tokens_as_a_short_feed(tiny_serve_q8_jlm) -> None:
    """What a draft model catches up on between guesses (the last step's taken guesses and the target's token) runs as
    decode rows do, a short feed, not as a prompt chunk of a few rows (a GEMM at 2-4 rows: its dearest shape); a
    prompt longer than a short feed as a prompt."""
    from jitllmd.engine.draft import draft_of

    spec = _engine(tiny_serve_q8_jlm, "draft", draft_max=3)
    try:
        draft = draft_of(spec.speculator)
        assert draft is not None
        runner = draft.loaded.runner
        seen: list[tuple[int, bool, bool]] = []
        forward = runner.forward

        def spy(tokens, positions, spans, *args, **kw):
            seen.extend((s.num_tokens, s.prompt, s.short) for s in spans)
            return forward(tokens, positions, spans, *args, **kw)

        runner.forward = spy  # type: ignore[method-assign]
        long_prompt = PROMPT * 7  # past FUSED_FEED's 64 tokens
        _run(spec, long_prompt, n=40, speculative=True)
        if runner.short_feed:  # the kernels' path (none without a compiler: no short feeds at all)
            few = [x for x in seen if 1 < x[0] <= runner.short_feed]
            assert few and all(short for _, _, short in few), seen
        assert any(n > max(runner.short_feed, 4) and prompt and not short for n, prompt, short in seen), seen  # read at the first guess
    finally:
        spec.stop()


def test_a_steps_cost_per_token_is_fitted_from_the_steps_it_sees() -> None:
    """Seconds a + b * tokens (with noise): the fit finds b / a once the token counts differ; before, the prior."""
    cost = StepCost(prior=0.5)
    for _ in range(20):
        cost.observe(4, 0.1 + 0.02 * 4)
    assert cost.per_token() == 0.5  # every step alike: nothing to tell b from a
    g = torch.Generator().manual_seed(0)
    for i in range(200):
        t = 1 + i % 9
        cost.observe(t, (0.1 + 0.02 * t) * (1 + 0.05 * float(torch.randn(1, generator=g))))
    assert cost.per_token() == pytest.approx(0.2, rel=0.25)


def test_each_token_counts_measured_seconds_override_the_fit_and_a_dearer_run_length_is_skipped() -> None:
    """Steps of 9 tokens that cost a second pass over the weights (the few-row kernel's groups of 8): once measured,
    a guess at k = 8 is dearer than at k = 7 though the fit is linear, and a row in a run taken whole drafts 7, not 8;
    where every count costs alike per token, the longest run as before."""
    cost = StepCost(prior=0.3)
    assert cost.guess_costs(1, 3) == [token_cost(0.3, 1)] * 3  # nothing seen: the prior's
    for _ in range(StepCost.MEASURED_LAST):
        for t in range(1, 10):
            cost.observe(t, 0.1 + 0.03 * t + (0.1 if t > 8 else 0.0))
    assert cost.measured(9) == pytest.approx(0.1 + 0.27 + 0.1) and cost.measured(10) is None
    costs = cost.guess_costs(1, 8)
    assert costs[6] == pytest.approx(0.21 / (7 * 0.13)) and costs[7] > costs[6] * 1.2
    run = Adaptive(8)
    for _ in range(30):
        run.record(4, 4)  # every guess taken: a run, k doubles up to the most
    assert run.k(costs) == 7
    flat = StepCost(prior=0.3)
    for _ in range(StepCost.MEASURED_LAST):
        for t in range(1, 10):
            flat.observe(t, 0.1 + 0.03 * t)
    assert run.k(flat.guess_costs(1, 8)) == 8



def test_a_wide_steps_guess_cost_takes_both_counts_from_one_source() -> None:
    """A row's verifying step of 8 tokens, measured, costs what the fitted line says of 20 tokens; 8 rows' step with
    guesses (16 tokens) is not measured: a guess there costs the line's b * 8 / (a + b * 8), not the fit's 16 tokens
    against the measured 8 (which once made guesses in a wide step look free, and 8 drafting clients 0.7x plain)."""
    cost = StepCost(prior=0.3)
    for _ in range(StepCost.MEASURED_LAST):
        for t in range(1, 10):
            cost.observe(t, 0.1 + 0.01 * t + (0.12 if t == 8 else 0.0))  # 8 tokens: a dear verifying step
    a, b = cost._fit()
    assert cost.measured(8) is not None and cost.measured(16) is None
    assert cost.guess_costs(8, 2) == pytest.approx([b * 8 / (a + b * 8)] * 2)
    assert min(cost.guess_costs(8, 2)) > 0.2


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Req:
    """What Speculator.draft reads of a request: its speculation, tokens, limits and session."""

    def __init__(self, spec) -> None:
        self.spec, self.prompt_ids, self.output_ids = spec, list(PROMPT), []
        self.max_tokens, self.cancel_requested = 100, False
        self.session = type("S", (), {"token_ids": list(PROMPT), "kv": type("K", (), {"capacity": 512})()})()


def test_drafting_steps_of_many_rows_are_judged_against_plain_steps_of_as_many(monkeypatch) -> None:
    """Steps of two decode rows, timed draft() to draft() on a clock the test moves: the first is plain whatever its rows
    would guess (nothing to judge guesses against yet); plain ones set what a token costs at two rows; drafting ones
    that give tokens cheaper than that leave the rows as they are, a step with a prompt's tokens is not timed, and
    drafting ones that give tokens dearer make guesses at two rows dearer (Adaptive.realized, Speculator._miss) until
    they stop."""
    from jitllmd.engine import draft as draft_mod
    from jitllmd.engine.draft import NgramDrafter, Speculator
    from jitllmd.engine.scheduler import Row

    clock = _Clock()
    monkeypatch.setattr(draft_mod.time, "perf_counter", clock)
    spec = Speculator(SpecConfig(mode="ngram", draft_max=2), NgramDrafter())

    def step(reqs, seconds: float, taken: int = 0, joining: bool = False) -> list:
        """A step of `reqs`' rows taking `seconds` where they draft, 1 s (plain) where none does and no prompt joins."""
        rows = [Row(req=r, ids=[PROMPT[-1]], pos=len(PROMPT), prompt=False, short=False, many=False, logits=1) for r in reqs]
        if joining:  # a prompt's tokens beside them
            rows.append(Row(req=_Req(None), ids=list(PROMPT), pos=0, prompt=True, short=False, many=False, logits=1))
        out = spec.draft(rows, budget=64)
        for r, row in zip(reqs, out):
            if row.draft:
                spec.verified(r, len(row.draft), min(taken, len(row.draft)))
                r.session.token_ids[len(PROMPT) :] = []  # what Outputs.verify trims
        clock.now += seconds if joining or any(row.draft for row in out) else 1.0
        return out

    def drafting() -> list:
        reqs = [_Req(spec.row(None)), _Req(spec.row(None))]
        for r in reqs:
            for _ in range(30):
                r.spec.adaptive.record(2, 2)  # every guess taken so far: they draft
        return reqs

    assert not any(row.draft for row in step(drafting(), 1.0))  # no plain step of two rows timed yet: this one is
    for _ in range(5):  # plain steps of two rows: 0.5 s a token
        step([_Req(None), _Req(None)], 1.0)
    winning = drafting()
    for _ in range(10):
        assert all(row.draft for row in step(winning, 1.2, taken=2))  # 6 tokens in 1.2 s: cheaper than plain
    assert all(r.spec.adaptive.penalty == 1.0 for r in winning) and spec._miss[2][0] <= 0
    slow = drafting()
    for _ in range(10):
        assert any(row.draft for row in step(slow, 30.0, taken=2, joining=True))  # beside a prompt: not timed
    assert all(r.spec.adaptive.penalty == 1.0 for r in slow) and spec._miss[2][0] <= 0
    losing = drafting()
    assert all(row.draft for row in step(losing, 4.0, taken=2))  # 6 tokens in 4 s: dearer than plain
    for _ in range(12):
        step(losing, 4.0, taken=2)
    assert all(r.spec.adaptive.penalty > 1.0 and r.spec.adaptive.rate > 0.9 for r in losing) and spec._miss[2][0] > 0.3
    assert not any(row.draft for row in step(losing, 1.0))  # they stopped, every guess still taken


def test_rows_whose_drafting_steps_lose_outside_the_timed_forward_stop_drafting(monkeypatch) -> None:
    """A CUDA device's case: the forward StepCost times finds a guess nearly free (2% of a step), but each drafting
    step, timed draft() to draft(), takes 2 plain steps a guess (sampling and verifying it, the host's work), every
    guess taken. What drafting steps showed the model misses (Speculator._miss) makes guesses dear enough that the
    first request stops within a few steps and the next one drafts only its probes; over 300 steps each they yield at
    least 0.95 of plain decoding's tokens a second (a row's own penalty alone, at most 4x the model's cost, kept it
    drafting at ~0.55)."""
    from jitllmd.engine import draft as draft_mod
    from jitllmd.engine.draft import NgramDrafter, Speculator
    from jitllmd.engine.scheduler import Row

    clock = _Clock()
    monkeypatch.setattr(draft_mod.time, "perf_counter", clock)
    spec = Speculator(SpecConfig(mode="ngram", draft_max=4), NgramDrafter())
    tokens, drafting = 0, []
    for n in range(2):
        req = _Req(spec.row(None))
        drafting.append([])
        for i in range(300):
            rows = [Row(req=req, ids=[PROMPT[-1]], pos=len(PROMPT), prompt=False, short=False, many=False, logits=1)]
            k = len(spec.draft(rows, budget=64)[0].draft)
            if k:
                spec.verified(req, k, k)
                req.session.token_ids[len(PROMPT) :] = []
                drafting[n].append((i, req.spec.adaptive.probing))
            spec.steps.observe(1 + k, 0.5 + 0.01 * k)  # the forward: a guess ~2% of it
            clock.now += 1.0 + 2.0 * k  # the whole step
            tokens += 1 + k
    first, second = ([i for i, probing in d if not probing] for d in drafting)
    assert first and len(first) <= 4, "it drafted at first (the model's cost says guesses pay), then stopped"
    assert not second and all(probing for _, probing in drafting[1])
    assert tokens / clock.now >= 0.95


# -- greedy: the same tokens -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
@pytest.mark.parametrize("model", ["tiny_serve_q8_jlm", "tiny_gemma_q8_jlm", "tiny_serve_jlm"])
def test_greedy_tokens_are_decodings_with_guesses_and_without(request, variant, model: str, drafter: str) -> None:
    """Every kernel variant and drafter, llama and Gemma (a window of 8, crossed) quantized, and the f32 llama
    (torch's products, the same up to f32 rounding: its greedy picks here are the same); the KV left behind is the
    same bits."""
    path = request.getfixturevalue(model)
    plain, spec = _engine(path, "off"), _engine(path, drafter, draft_max=3 if drafter == "draft" else 8)
    # a draft model as dear as its target never pays, so its rows guess only when asked to (speculative: true)
    forced = {"speculative": True} if drafter == "draft" else {}
    try:
        a_session, b_session = plain.new_session(), spec.new_session()
        a = _run(plain, session=a_session)
        b = _run(spec, session=b_session, **forced)
        assert b.ids == a.ids and b.done.finish_reason == a.done.finish_reason
        assert spec.speculator is not None and spec.speculator.accepted > 0, "no guess was taken: the test tests nothing"
        assert b_session.token_ids == a_session.token_ids and b_session.kv.length == a_session.kv.length
        if model != "tiny_serve_jlm":
            for layer in range(plain.loaded.model.cfg.num_layers):
                for x, y in zip(a_session.kv.filled(layer), b_session.kv.filled(layer)):
                    assert torch.equal(x, y), layer
        # the session goes on: a second turn on each, the same again
        more = [7, 5, 9, 14]
        assert _run(spec, a_session.token_ids + more, 40, session=b_session, **forced).ids == _run(plain, a_session.token_ids + more, 40, session=a_session).ids
    finally:
        plain.stop()
        spec.stop()


def test_batched_rows_stop_strings_and_max_tokens_inside_a_guessed_run(tiny_serve_q8_jlm) -> None:
    """Several rows at once (some drafting, one not), a stop string, and max_tokens landing inside a run of taken
    guesses: each row's tokens and text are its own plain decoding's."""
    plain, spec = _engine(tiny_serve_q8_jlm, "off"), _engine(tiny_serve_q8_jlm)
    try:
        prompts = [PROMPT, PROMPT[3:] + [8], [5, 9, 14, 3, 22, 7, 5, 9, 14, 3, 40, 5, 9], PROMPT[:7]]
        want = [_run(plain, p, 60) for p in prompts]
        text = want[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3]  # somewhere in the middle of the first's reply
        boxes: list = [None] * 6

        def go(i: int, engine: Engine, prompt, n: int, **kw) -> None:
            boxes[i] = _run(engine, prompt, n, **kw)

        jobs = [(i, spec, p, 60, {}) for i, p in enumerate(prompts)]
        jobs[3] = (3, spec, prompts[3], 60, {"speculative": False})
        jobs.append((4, spec, PROMPT, 60, {"stop": [stop]}))
        jobs.append((5, spec, PROMPT, 37, {}))
        threads = [threading.Thread(target=go, args=(i, e, p, n), kwargs=kw) for i, e, p, n, kw in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(4):
            assert boxes[i].ids == want[i].ids, i
        stopped = _run(plain, PROMPT, 60, stop=[stop])
        assert boxes[4].text == stopped.text and boxes[4].done.stop == stop
        assert boxes[5].ids == want[0].ids[:37] and boxes[5].done.completion_tokens == 37
        assert spec.speculator is not None and spec.speculator.accepted > 0
    finally:
        plain.stop()
        spec.stop()


def test_a_request_may_turn_it_off_or_cap_its_guesses(tiny_serve_q8_jlm) -> None:
    spec = _engine(tiny_serve_q8_jlm)
    try:
        _run(spec, speculative=False)
        assert spec.speculator is not None and spec.speculator.drafted == 0
        seen: list[int] = []
        draft = spec.speculator.draft
        spec.speculator.draft = lambda rows, budget: [seen.append(len(r.draft)) or r for r in draft(rows, budget)]  # type: ignore[method-assign]
        _run(spec, draft_max=2, speculative=True)  # forced: every step guesses, whatever the step times say
        assert max(seen) == 2 and spec.speculator.drafted > 0
    finally:
        spec.stop()
    assert _engine(tiny_serve_q8_jlm, "off").speculator is None
    with pytest.raises(ValueError, match="draft_max"):
        Generation([1], GREEDY, draft_max=-1)
    with pytest.raises(ValueError, match="spec must be"):
        SpecConfig(mode="sometimes")


# -- sampled: the row's own distribution ---------------------------------------------------------------------------------


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = float(counts.sum())
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "a token the distribution excludes was drawn"
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum())


# chi-square's 99.9% point for up to 7 degrees of freedom is 24.3: a sound rule stays below it but once in a thousand runs
BOUND = 26.0


def _target(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor:
    """The row's distribution as the API defines it: temperature, then top-k, top-p (the smallest likeliest set whose
    mass reaches it) and min-p (against the likeliest), renormalized."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros(probs.shape[0], dtype=torch.bool)
    mass, top = 0.0, probs.max()
    for rank, i in enumerate(order.tolist()):
        if params.top_k and rank >= params.top_k:
            break
        if mass >= params.top_p:
            break
        if probs[i] < params.min_p * top:
            continue
        keep[i] = True
        mass += float(probs[i]) / (float(probs[order[: params.top_k]].sum()) if params.top_k else 1.0)
    want = torch.where(keep, probs, torch.zeros_like(probs))
    return want / want.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_k=4, seed=2),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, seed=3),
        SamplingParams(temperature=1.0, presence_penalty=1.0, logit_bias=((2, 1.5),), seed=4),
    ],
    ids=["plain", "top_k", "top_p_min_p", "penalties_bias"],
)
def test_a_guess_is_taken_as_often_as_its_probability_and_each_token_follows_the_rows_distribution(params: SamplingParams) -> None:
    """On a vocabulary of 8, with a likely guess, an unlikely one and (under the filters) an excluded one: drawn 6000
    times each (seeded: the same draws every run), the tokens' counts against the row's own probabilities, and the
    guess taken (the pick is the guess: Outputs.verify) as often as its probability says (speculative sampling's rate
    for a deterministic guess), within 4.5 standard deviations."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0])
    n = 6000
    s = Sampler(params, prompt_ids=[])
    s.counts = {0: 1}  # a penalty applies to token 0 where one is asked
    want = _target(params, s.penalize(logits))
    for guess in (0, 5, 7):
        counts, taken = torch.zeros(8), 0
        for _ in range(n):
            token = s.sample(logits)
            counts[token] += 1
            taken += token == guess
        assert _chi_square(counts, want) < BOUND, (guess, counts, want * n)
        p = float(want[guess])
        assert abs(taken - n * p) <= 4.5 * math.sqrt(n * p * (1 - p)) + 1e-9, (guess, taken, n * p)


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_a_seed_gives_the_same_sampled_tokens_with_guesses_and_without(tiny_serve_q8_jlm, drafter: str) -> None:
    """Sampled with a seed (temperature, top-p, a penalty): the same tokens with guesses as without, a second turn too,
    guesses taken on the way; each sampled token is one draw of the row's generator whether a guess stood there or not
    (so how many were made, which timing decides, never moves the stream)."""
    params = SamplingParams(temperature=0.4, top_p=0.95, presence_penalty=0.2, seed=11)
    plain, spec = _engine(tiny_serve_q8_jlm, "off"), _engine(tiny_serve_q8_jlm, drafter, draft_max=4)
    try:
        a_session, b_session = plain.new_session(), spec.new_session()
        a = _run(plain, session=a_session, params=params)
        b = _run(spec, session=b_session, params=params, speculative=True)
        assert b.ids == a.ids
        assert spec.speculator is not None and spec.speculator.accepted > 0, "no guess was taken: the test tests nothing"
        more = a_session.token_ids + [7, 5, 9, 14]
        again = replace(params, seed=12)
        assert _run(spec, more, 40, session=b_session, params=again, speculative=True).ids == _run(plain, more, 40, session=a_session, params=again).ids
    finally:
        plain.stop()
        spec.stop()


def test_the_wrong_acceptance_rule_fails_the_bound() -> None:
    """What the bound catches: accept with p(guess), else draw from the whole distribution (guess not left out)."""
    probs = torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0]), dim=-1)
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(4)
    for _ in range(20000):
        if float(torch.rand(1, generator=g)) < float(probs[0]):
            counts[0] += 1
        else:
            counts[int(torch.multinomial(probs, 1, generator=g))] += 1
    assert _chi_square(counts, probs) > BOUND
    assert math.isfinite(_chi_square(counts, probs))


# -- served: the flags, the request's say, the figures ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_models(tmp_path_factory, tiny_serve_q8_jlm, tiny_thinker_jlm):
    """A -models directory: the tiny quantized llama, itself again as its draft, and a model of another tokenizer."""
    import shutil

    d = tmp_path_factory.mktemp("spec") / "models"
    d.mkdir()
    shutil.copyfile(tiny_serve_q8_jlm, d / "tiny.jlm")
    shutil.copyfile(tiny_serve_q8_jlm, d / "small.jlm")
    shutil.copyfile(tiny_thinker_jlm, d / "other.jlm")
    return d


def _completion(url: str, model: str, **jitllm) -> dict:
    import httpx

    # a prompt past every variant's short feed (64 tokens): the target reads it as a prompt chunk, and so does a draft
    # of its own weights (with the target's first token); a short one is a short feed for the target, but a chunk for
    # the draft where short feeds stop at 8 tokens (AMX), whose other rounding costs a few of its guesses
    body = {"model": model, "prompt": "a b c " * 30, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    if jitllm:
        body["jitllm"] = jitllm
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_served_with_a_draft_model_and_with_prompt_lookup_the_same_text(serve, spec_models) -> None:
    """serve -draft: the draft model guesses (itself here: nearly every guess taken; as dear as the target, so only
    where a request's jitllm.speculative is true, which makes it guess every step); false turns it off and
    jitllm.draft_max caps it; the text is the same each way, the figures and stats say what was guessed and taken; -spec
    off serves with none."""
    import httpx

    from tests.serving import jitllmd

    server = serve("-models", str(spec_models), "-load", "tiny.jlm", "-id", "tiny", "-draft", "small.jlm", "-sessions", "2")
    off = serve("-models", str(spec_models), "-load", "tiny.jlm", "-id", "tiny", "-spec", "off")
    plain = _completion(off.url, "tiny")
    assert plain["jitllm"]["drafted_tokens"] == 0
    assert _completion(server.url, "tiny")["choices"][0]["text"] == plain["choices"][0]["text"]  # adaptive: whatever it guessed
    guessed = _completion(server.url, "tiny", speculative=True)
    assert guessed["choices"][0]["text"] == plain["choices"][0]["text"]
    figures = guessed["jitllm"]
    assert figures["drafted_tokens"] > 0 and figures["accepted_tokens"] >= figures["drafted_tokens"] * 0.9
    none = _completion(server.url, "tiny", speculative=False)
    assert none["choices"][0]["text"] == plain["choices"][0]["text"] and none["jitllm"]["drafted_tokens"] == 0
    capped = _completion(server.url, "tiny", speculative=True, draft_max=1)
    assert capped["choices"][0]["text"] == plain["choices"][0]["text"] and 20 <= capped["jitllm"]["drafted_tokens"] <= 60  # one a step
    bad = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "jitllm": {"draft_max": -1}}, timeout=60)
    assert bad.status_code == 400 and "draft_max" in bad.json()["error"]["message"]
    stats = httpx.post(server.url + "/jitllm.v1.TelemetryService/GetStats", json={}, timeout=60).json()["models"][0]
    assert stats["speculative"] == "draft small.jlm" and int(stats["acceptedTokens"]) > 0
    metrics = httpx.get(server.url + "/metrics", timeout=60).text
    assert "jitllmd:spec_decode_num_accepted_tokens_total" in metrics or "spec_decode_num_accepted_tokens" in metrics
    shown = jitllmd("stats", "-addr", server.url.removeprefix("http://"))
    assert "speculative decoding draft small.jlm" in shown.stdout, shown.stdout + shown.stderr


def test_a_draft_of_another_tokenizer_is_refused_at_load_and_nothing_is_loaded(serve, spec_models) -> None:
    import httpx

    server = serve("-models", str(spec_models), "-load", "tiny.jlm", "-id", "tiny", "-spec", "off")
    r = httpx.post(server.url + "/jitllm.v1.ModelService/LoadModel", json={"file": "tiny.jlm", "id": "t2", "draft": "other.jlm"}, timeout=120)
    assert r.status_code == 400 and "must share the target's tokenizer" in r.text, r.text
    assert [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=60).json()["data"] if m["jitllm"]["loaded"]] == ["tiny"]
    r = httpx.post(server.url + "/jitllm.v1.ModelService/LoadModel", json={"file": "tiny.jlm", "id": "t3", "draft": "../outside.jlm"}, timeout=60)
    assert r.status_code in (400, 403, 404), r.text  # a draft is found as a model file is: never outside -models
    r = httpx.post(server.url + "/jitllm.v1.ModelService/LoadModel", json={"file": "tiny.jlm", "id": "t4", "spec": "draft"}, timeout=60)
    assert r.status_code == 400 and "-draft" in r.json()["message"], r.text


def test_the_flags_are_checked_before_anything_loads(spec_models) -> None:
    from tests.serving import jitllmd

    for args, says in [
        (("serve", "-models", str(spec_models), "-load", "tiny.jlm", "-spec", "draft"), "-spec draft needs a draft model"),
        (("serve", "-models", str(spec_models), "-load", "tiny.jlm", "-draft", "nope.jlm"), "nope.jlm: no such model file"),
        (("serve", "-models", str(spec_models), "-load", "tiny.jlm", "-spec", "maybe"), "-spec must be one of"),
        (("run", "-model", str(spec_models / "tiny.jlm"), "-draft", str(spec_models / "other.jlm"), "hi"), "must share the target's tokenizer"),
    ]:
        r = jitllmd(*args)
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    import json

    runs = [jitllmd("run", "-model", str(spec_models / "tiny.jlm"), *spec, "-temp", "0", "-n", "40", "-json", "a b c a b c a b")
            for spec in (("-draft", str(spec_models / "small.jlm")), ("-spec", "off"))]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    drafted, plain = (json.loads(r.stdout) for r in runs)
    # the draft (the model itself) guesses only where its calibrated cost lets guesses pay: the text is the same either way
    assert drafted["text"] == plain["text"] and drafted["jitllm"]["drafted_tokens"] >= 0 == plain["jitllm"]["drafted_tokens"]


def test_responses_and_anthropic_take_the_requests_say_too(serve, spec_models) -> None:
    import httpx

    server = serve("-models", str(spec_models), "-load", "tiny.jlm", "-id", "tiny", "-draft", "small.jlm", "-sessions", "2")
    for path, body in [
        ("/v1/responses", {"model": "tiny", "input": "a b c a b c a b", "max_output_tokens": 40, "temperature": 0, "ignore_eos": True}),
        ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "a b c a b c a b"}], "max_tokens": 40, "temperature": 0, "ignore_eos": True}),
    ]:
        on = httpx.post(server.url + path, json={**body, "jitllm": {"speculative": True}}, timeout=120).json()
        off = httpx.post(server.url + path, json={**body, "jitllm": {"speculative": False}}, timeout=120).json()
        assert on["jitllm"]["drafted_tokens"] > 0 and off["jitllm"]["drafted_tokens"] == 0, path
        assert (on.get("output") or on.get("content")) is not None


def test_a_draft_model_on_the_device_counts_in_its_memory_and_its_stats(tiny_serve_jlm) -> None:
    """A draft model loaded beside a target on `cpu` as a device: relocation's device arithmetic (-device-mem) counts
    its blocks and their KV with the target's, and the K/V its sessions hold count in the target's figures."""
    from jitllmd.engine.draft import draft_kv_bytes
    from jitllmd.engine.memory.relocation import Relocation, held_on

    plain = Engine.load(tiny_serve_jlm, devices=["cpu"], max_seq=512)
    drafted = Engine.load(tiny_serve_jlm, devices=["cpu"], max_seq=512, spec=SpecConfig(mode="draft", draft=str(tiny_serve_jlm)))
    try:
        assert plain.draft_placement is None and drafted.draft_placement is not None
        own = held_on(drafted.placement, "cpu")
        assert own > 0 and held_on(drafted.draft_placement, "cpu") == own  # the same file as its own draft
        relocation = Relocation(device_mem=1 << 40)
        relocation.register("plain", plain)
        relocation.register("drafted", drafted)
        assert relocation.used("cpu") == held_on(plain.placement, "cpu") + 2 * own
        assert draft_kv_bytes(drafted.speculator) == 0  # calibration's scratch K/V went back
        _run(drafted, n=40, speculative=True)
        assert draft_kv_bytes(drafted.speculator) > 0 and draft_kv_bytes(plain.speculator) == 0
    finally:
        plain.stop()
        drafted.stop()

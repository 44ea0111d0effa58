"""Sampler: parameter validation, seeding, greedy equivalences, truncation (top-k/top-p/min-p), penalties, distribution, device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from jitllmd.engine.memory.devices import synchronize
from jitllmd.engine.sampler import Sampler, SamplingParams

V = 50


def _logits(seed: int = 0, n: int = V, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


# -- validation -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": 7}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    msg = str(info.value)
    assert msg.startswith(field), msg
    assert str(next(iter(kwargs.values()))) in msg, msg


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 2.0},
        {"top_p": 1.0, "top_k": 0, "min_p": 0.0},
        {"top_p": 1e-9, "min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
    ],
)
def test_valid_edges(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy
    assert not SamplingParams(top_k=2, temperature=0.5).greedy


def test_params_are_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


# -- seeding ----------------------------------------------------------------------------------------------------------


def _draws(params: SamplingParams, logits: torch.Tensor, n: int = 50) -> list[int]:
    s = Sampler(params, [])
    return [s.sample(logits) for _ in range(n)]


def test_same_seed_same_samples() -> None:
    logits = _logits(1, scale=1.0)
    p = SamplingParams(temperature=1.0, seed=1234)
    a, b = _draws(p, logits), _draws(p, logits)
    assert a == b
    assert len(set(a)) > 5  # actually random, not constant


def test_different_seed_different_samples() -> None:
    logits = _logits(1, scale=1.0)
    a = _draws(SamplingParams(temperature=1.0, seed=1), logits)
    b = _draws(SamplingParams(temperature=1.0, seed=2), logits)
    assert a != b


def test_same_seed_with_truncation() -> None:
    logits = _logits(2, scale=1.0)
    p = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, seed=7)
    assert _draws(p, logits) == _draws(p, logits)


def test_no_seed_is_random() -> None:
    logits = _logits(1, scale=0.5)
    runs = {tuple(_draws(SamplingParams(), logits, 20)) for _ in range(3)}
    assert len(runs) > 1


# -- greedy -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_top_k_1_and_temperature_0_are_argmax(seed: int) -> None:
    logits = _logits(seed)
    best = int(torch.argmax(logits))
    assert Sampler(SamplingParams(top_k=1, temperature=1.5, seed=seed), []).sample(logits) == best
    assert Sampler(SamplingParams(temperature=0.0, top_p=0.5, seed=seed), []).sample(logits) == best
    assert Sampler(SamplingParams(temperature=0.0), []).sample(logits) == best


def test_top_p_tiny_keeps_only_the_top_token() -> None:
    logits = _logits(3, scale=0.3)  # flat-ish: without truncation many tokens would show up
    best = int(torch.argmax(logits))
    assert set(_draws(SamplingParams(temperature=1.0, top_p=1e-6, seed=0), logits, 200)) == {best}
    assert len(set(_draws(SamplingParams(temperature=1.0, seed=0), logits, 200))) > 10


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two (0.5 < 0.7, 0.5+0.3 >= 0.7)
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs.log()
    seen = set(_draws(SamplingParams(temperature=1.0, top_p=0.7, seed=0), logits, 300))
    assert seen == {1, 3}
    seen = set(_draws(SamplingParams(temperature=1.0, top_p=0.81, seed=0), logits, 300))
    assert seen == {0, 1, 3}


def test_top_k_keeps_the_k_best() -> None:
    logits = _logits(4, scale=0.2)
    top = set(torch.topk(logits, 5).indices.tolist())
    seen = set(_draws(SamplingParams(temperature=1.0, top_k=5, seed=0), logits, 400))
    assert seen == top


def test_min_p_prunes_below_a_fraction_of_the_best() -> None:
    probs = torch.tensor([0.40, 0.25, 0.15, 0.11, 0.05, 0.04])
    logits = probs.log()
    # min_p 0.3: keep p >= 0.3 * 0.40 = 0.12 -> tokens 0, 1, 2
    seen = set(_draws(SamplingParams(temperature=1.0, min_p=0.3, seed=0), logits, 400))
    assert seen == {0, 1, 2}
    # min_p 0.26: 0.104 -> 0.11 stays too
    seen = set(_draws(SamplingParams(temperature=1.0, min_p=0.26, seed=0), logits, 400))
    assert seen == {0, 1, 2, 3}
    # min_p 1: only the best
    assert set(_draws(SamplingParams(temperature=1.0, min_p=1.0, seed=0), logits, 100)) == {0}


def test_min_p_uses_probabilities_after_temperature() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log()
    # at temperature 0.5 the probabilities are proportional to p^2: 0.25, 0.09, 0.04 -> 0.658, 0.237, 0.105
    # min_p 0.3 keeps p >= 0.197: tokens 0 and 1 (at temperature 1 all three would be kept)
    seen = set(_draws(SamplingParams(temperature=0.5, min_p=0.3, seed=0), logits, 400))
    assert seen == {0, 1}
    assert set(_draws(SamplingParams(temperature=1.0, min_p=0.3, seed=0), logits, 400)) == {0, 1, 2}


# -- penalties --------------------------------------------------------------------------------------------------------


def test_presence_and_frequency_penalties_exact() -> None:
    logits = _logits(5)
    s = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt_ids=[1, 2, 3])
    for t in [7, 7, 7, 9, 11, 11]:
        s.accept(t)
    out = s.penalize(logits)
    want = logits.clone()
    want[7] -= 0.25 * 3 + 0.5
    want[9] -= 0.25 * 1 + 0.5
    want[11] -= 0.25 * 2 + 0.5
    assert torch.equal(out, want)  # exactly frequency * count + presence (all exact in f32 here)
    assert torch.equal(out[[i for i in range(V) if i not in (7, 9, 11)]], logits[[i for i in range(V) if i not in (7, 9, 11)]])
    assert torch.equal(logits, _logits(5))  # the input is not modified


def test_negative_penalties_raise_logits() -> None:
    logits = _logits(6)
    s = Sampler(SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5), [])
    s.accept(3)
    s.accept(3)
    out = s.penalize(logits)
    assert out[3].item() == pytest.approx(logits[3].item() + 0.5 * 2 + 1.0, abs=1e-6)


def test_prompt_tokens_are_not_counted_by_presence_penalty() -> None:
    logits = _logits(7)
    s = Sampler(SamplingParams(presence_penalty=1.0, frequency_penalty=1.0), prompt_ids=[4, 5, 6])
    assert torch.equal(s.penalize(logits), logits)


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([2.0, -2.0, 3.0, -1.0, 0.0, 5.0])
    s = Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1, 4])
    out = s.penalize(logits)
    assert out.tolist() == [1.0, -4.0, 3.0, -1.0, 0.0, 5.0]
    s.accept(2)  # generated tokens are covered too
    s.accept(3)
    assert s.penalize(logits).tolist() == [1.0, -4.0, 1.5, -2.0, 0.0, 5.0]
    assert logits.tolist() == [2.0, -2.0, 3.0, -1.0, 0.0, 5.0]


def test_repetition_penalty_below_one_boosts() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = Sampler(SamplingParams(repetition_penalty=0.5), prompt_ids=[0, 1]).penalize(logits)
    assert out.tolist() == [4.0, -1.0, 1.0]


def test_repetition_penalty_counts_each_token_once() -> None:
    logits = torch.tensor([8.0, 1.0])
    s = Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 0, 0])
    s.accept(0)
    s.accept(0)
    assert s.penalize(logits).tolist() == [4.0, 1.0]


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([1.0, 0.9, 0.1])
    s = Sampler(SamplingParams(temperature=0, frequency_penalty=0.2), [])
    assert s.sample(logits) == 0
    s.accept(0)
    assert s.sample(logits) == 1  # 1.0 - 0.2 < 0.9


def test_no_penalties_returns_logits_unchanged() -> None:
    logits = _logits(8)
    s = Sampler(SamplingParams(), prompt_ids=[1, 2])
    s.accept(1)
    assert torch.equal(s.penalize(logits), logits)


# -- distribution -----------------------------------------------------------------------------------------------------


def test_samples_follow_softmax() -> None:
    """Temperature 1 and no truncation: frequencies over many draws match softmax (a loose chi-square bound)."""
    n_tokens, draws = 12, 6000
    logits = _logits(9, n=n_tokens, scale=1.0)
    probs = torch.softmax(logits, -1)
    s = Sampler(SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=42), [])
    counts = torch.zeros(n_tokens)
    for _ in range(draws):
        counts[s.sample(logits)] += 1
    expected = probs * draws
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    # 11 degrees of freedom: the 99.9% point is ~31.3
    assert chi2 < 40, (chi2, counts.tolist(), expected.tolist())
    assert (counts / draws - probs).abs().max().item() < 0.03


def test_temperature_sharpens() -> None:
    logits = _logits(10, n=8, scale=1.0)
    best = int(torch.argmax(logits))
    cold = _draws(SamplingParams(temperature=0.2, seed=3), logits, 500).count(best)
    warm = _draws(SamplingParams(temperature=1.5, seed=3), logits, 500).count(best)
    assert cold > warm
    p_cold = torch.softmax(logits / 0.2, -1)[best].item()
    assert abs(cold / 500 - p_cold) < 0.08


# -- device -----------------------------------------------------------------------------------------------------------

# Recorded from the sampler as it samples now (on the CPU generator with CPU tensors; re-recorded when top-p stopped
# sorting the whole vocabulary and the draw became one uniform number through the candidates' cumulative mass): on
# the CPU the same seed and logits must keep giving exactly these tokens. (settings, prompt ids, vocabulary) -> 16 tokens, each accepted.
RECORDED: list[tuple[dict[str, Any], list[int], int, list[int]]] = [
    ({"temperature": 1.0, "seed": 1234}, [], 50, [1, 24, 14, 20, 1, 31, 1, 28, 31, 17, 35, 31, 35, 38, 17, 31]),
    ({"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.02, "seed": 7}, [], 50, [18, 3, 11, 11, 28, 28, 3, 11, 28, 7, 7, 18, 28, 3, 20, 28]),
    ({"temperature": 1.3, "top_p": 0.8, "seed": 99}, [], 1000, [370, 83, 17, 161, 29, 831, 30, 400, 666, 458, 266, 715, 66, 736, 649, 21]),
    ({"temperature": 0.9, "min_p": 0.1, "seed": (1 << 63) + 5}, [], 50, [46, 9, 46, 46, 46, 9, 14, 46, 5, 46, 37, 33, 8, 44, 46, 33]),
    ({"temperature": 1.0, "top_k": 5, "seed": -3}, [], 1000, [244, 710, 687, 889, 710, 710, 687, 244, 244, 244, 889, 687, 687, 889, 889, 244]),
    (
        {"temperature": 1.0, "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.3, "seed": 2024},
        [3, 5, 8],
        50,
        [18, 40, 48, 4, 5, 14, 8, 31, 24, 38, 4, 29, 6, 37, 46, 18],
    ),
    ({"temperature": 0.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2}, [0, 1], 50, [11, 47, 38, 37, 7, 9, 13, 31, 23, 11, 47, 41, 27, 38, 40, 21]),
]


@pytest.mark.parametrize("case", range(len(RECORDED)))
def test_cpu_tokens_are_the_recorded_ones(case: int) -> None:
    kwargs, prompt_ids, vocab, want = RECORDED[case]
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(100 + case), device=torch.device("cpu"))
    s = Sampler(SamplingParams(**kwargs), prompt_ids)
    got = []
    for _ in range(len(want)):
        token = s.sample(logits)
        s.accept(token)
        got.append(token)
    assert got == want


class _DeviceLog(TorchFunctionMode):
    """Records the device each tensor made from Python values asks for, and the device of each generator handed in."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list[tuple[str, object]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor:
            self.devices.append(("tensor", kwargs.get("device")))
        if kwargs.get("generator") is not None:
            self.devices.append((func.__name__, kwargs["generator"].device))
        return func(*args, **kwargs)


def test_sampling_names_the_logits_device() -> None:
    """Penalty tensors and the generator are made on the logits' device, never on the default one (no GPU needed)."""
    device = torch.device("cpu")
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.01, presence_penalty=0.5, repetition_penalty=1.2, seed=3)
    s = Sampler(params, prompt_ids=[1, 2])
    s.accept(4)
    logits = _logits(11).to(device)
    with _DeviceLog() as log:
        s.sample(logits)
    assert [name for name, _ in log.devices] == ["tensor", "tensor", "tensor", "rand"]
    assert all(d == device for _, d in log.devices), log.devices


def test_generator_per_device_seeded_with_the_row_seed() -> None:
    s = Sampler(SamplingParams(seed=5), [])
    cpu = torch.device("cpu")
    gen = s.generator(cpu)
    assert gen.device == cpu and gen.initial_seed() == 5
    assert s.generator(cpu) is gen  # one stream per device, kept across steps
    assert Sampler(SamplingParams(), []).generator(cpu).initial_seed() != Sampler(SamplingParams(), []).generator(cpu).initial_seed()


@pytest.mark.parametrize("device", [torch.device("cpu"), "cpu"])
def test_synchronize_accepts_the_cpu(device: torch.device | str) -> None:
    synchronize(device)  # the CPU has nothing queued: a no-op


@pytest.mark.parametrize("scale", [8.0, 0.01])  # peaked: the nucleus inside the first candidates; flat: beyond them
def test_top_p_over_a_large_vocabulary_keeps_the_exact_nucleus(scale: float) -> None:
    """A 262k vocabulary: top-p sorts only the likeliest NUCLEUS_CANDIDATES where they hold the mass, the whole
    vocabulary where they do not; either way every draw is in the nucleus a full sort gives, and a peaked one's
    draws cover more than one token."""
    from jitllmd.engine.sampler import NUCLEUS_CANDIDATES

    logits = torch.randn(262_144, generator=torch.Generator().manual_seed(5)) * scale
    values, ids = torch.sort(logits, descending=True)
    probs = torch.softmax(values, -1)
    nucleus = set(ids[(torch.cumsum(probs, -1) - probs) < 0.9].tolist())
    assert (len(nucleus) < NUCLEUS_CANDIDATES) == (scale > 1)
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=11), [])
    drawn = {s.sample(logits) for _ in range(200)}
    assert drawn <= nucleus and len(drawn) > 1

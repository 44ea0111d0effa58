"""Joint steps: the policy as pure logic, and a batched engine giving every row the tokens it gets alone, in each mode."""

from __future__ import annotations

import threading

import pytest

from jitllmd.engine.engine import Engine
from jitllmd.engine.request import Generation
from jitllmd.engine.runner import SAMPLES, SEQUENTIAL_WINS, JointSteps
from tests.test_engine import GREEDY, PROMPTS, TIMEOUT, Result, collect, hf_greedy


def test_forced_modes():
    assert JointSteps("always").joint(4, True) and not JointSteps("never").joint(4, True)
    assert JointSteps("never").joint(1, True)  # one row is one forward either way
    with pytest.raises(ValueError, match="joint_steps"):
        JointSteps("sometimes")


def test_auto_alternates_then_keeps_the_faster():
    policy = JointSteps("auto")
    seen = []
    for _ in range(2 * SAMPLES):
        joint = policy.joint(3, decode_only=True)
        seen.append(joint)
        policy.record(3, joint, 0.010 if joint else 0.004, decode_only=True)  # sequential is faster here
    assert seen.count(True) == seen.count(False) == SAMPLES
    assert policy.joint(3, decode_only=True) is False
    assert policy.choices() == {3: ("sequential", 10.0, 4.0)}
    assert policy.joint(3, decode_only=False) is False  # decided: prompt steps follow the choice too
    assert policy.joint(5, decode_only=False) is True  # undecided: a prompt step runs jointly and teaches nothing
    policy.record(5, True, 1.0, decode_only=False)
    assert 5 not in policy.timings or not policy.timings[5].joint_ms


def test_auto_learns_a_rows_time_once_and_decides_later_counts_from_joint_steps_alone():
    """The rows one after another cost a row's forward times the rows: after one row count's sequential steps (or
    one-row steps) teach that, a new row count runs jointly only, and is decided on its joint steps' median."""
    policy = JointSteps("auto")
    for _ in range(2 * SAMPLES):  # 2 rows: 12 ms jointly, 14 one after another (7 a row)
        joint = policy.joint(2, decode_only=True)
        policy.record(2, joint, 0.012 if joint else 0.014, decode_only=True)
    assert policy.choices()[2][0] == "joint" and policy.row_ms == [7.0] * SAMPLES
    asked = [policy.joint(16, decode_only=True) for _ in range(SAMPLES)]
    for joint in asked:
        policy.record(16, joint, 0.032, decode_only=True)
    assert all(asked) and policy.choices()[16] == ("joint", 32.0, 112.0)  # never 16 rows one after another (112 ms)
    fresh = JointSteps("auto")
    for _ in range(SAMPLES):
        fresh.record(1, True, 0.0015, decode_only=True)  # one-row steps: a row's forward alone
    assert all(fresh.joint(8, decode_only=True) for _ in range(3))
    for _ in range(SAMPLES):
        fresh.record(8, True, 0.020, decode_only=True)
    assert fresh.choices()[8] == ("sequential", 20.0, 12.0)  # 8 x 1.5 ms <= 3/4 of 20: one after another


def _decide(joint_ms: list[float], sequential_ms: list[float]) -> str:
    """Feed auto these step times (ms) in the order it asks for them; its choice for 4 rows."""
    policy, joint_left, sequential_left = JointSteps("auto"), list(joint_ms), list(sequential_ms)
    while not policy.timings.get(4) or not policy.timings[4].choice:
        together = policy.joint(4, decode_only=True)
        policy.record(4, together, (joint_left if together else sequential_left).pop(0) / 1000, decode_only=True)
    return policy.choices()[4][0]


def test_auto_keeps_joint_steps_through_noise():
    """A shared machine's noise (a descheduled step, steps a little apart) never turns batching off: sequential is
    chosen only when its median is clearly below the joint step's."""
    assert _decide([10, 10, 80, 10, 10], [9, 9, 9, 9, 9]) == "joint"  # a little slower jointly, and one step descheduled
    assert _decide([10] * SAMPLES, [10 * SEQUENTIAL_WINS + 0.1] * SAMPLES) == "joint"
    assert _decide([10] * SAMPLES, [1, 1, 90, 90, 90]) == "joint"  # two fast outliers move no median
    assert _decide([10, 10, 10, 90, 90], [7, 7, 7, 7, 7]) == "sequential"
    assert _decide([10] * SAMPLES, [10 * SEQUENTIAL_WINS] * SAMPLES) == "sequential"


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from jitllmd.engine.loader import load_model

    hf_dir, hf_model, jlm = tiny_llama
    return load_model(jlm, max_seq=256), hf_model


@pytest.mark.parametrize("mode", ["always", "never", "auto"])
def test_four_rows_match_alone_in_every_mode(tiny, mode: str) -> None:
    loaded, hf_model = tiny
    e = Engine(loaded, max_batch=4, prompt_chunk=5, joint_steps=mode).start()
    wants = [(PROMPTS[k], 16 + k) for k in range(4)]
    try:
        gens = [e.generate(Generation(p, GREEDY, max_tokens=n, ignore_eos=True)) for p, n in wants]  # all submitted before any is read
        results: dict[int, Result] = {}
        threads = [threading.Thread(target=lambda k=k, g=g: results.__setitem__(k, collect(g))) for k, g in enumerate(gens)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        for k, (p, n) in enumerate(wants):
            assert results[k].ids == hf_greedy(hf_model, p, n, eos=()), (mode, k)
        if mode == "auto":  # joint steps timed, and a row's forward alone (one-row steps, or a sequential step's rows)
            assert e.joint.row_ms and any(t.joint_ms for t in e.joint.timings.values())
    finally:
        e.stop()


def test_ephemeral_requests_reuse_a_pooled_slots_prefix(tiny) -> None:
    """No named session: the engine keeps one KV slot per row, and a prompt that extends the last one feeds only
    what is new, with the same tokens as a cold run."""
    loaded, hf_model = tiny
    e = Engine(loaded, max_batch=1).start()
    try:
        first = collect(e.generate(Generation(PROMPTS[2], GREEDY, max_tokens=6, ignore_eos=True)))
        assert first.done.fed_tokens == len(PROMPTS[2])
        longer = PROMPTS[2] + first.ids + PROMPTS[0][:3]
        second = collect(e.generate(Generation(longer, GREEDY, max_tokens=6, ignore_eos=True)))
        assert second.done.fed_tokens <= len(longer) - len(PROMPTS[2])  # the earlier prompt came from the cache
        assert second.ids == hf_greedy(hf_model, longer, 6, eos=())
        assert len(e.slots) == 1 and first.done.figures.session_id == second.done.figures.session_id
    finally:
        e.stop()

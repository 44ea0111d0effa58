"""Placement and the host pager: the plan as pure arithmetic, blocks moved between turns (and mid-generation) with
their KV, a page budget, and the error cases; the CLI's `place` against a real server is in test_place_cli.py."""

from __future__ import annotations

import queue

import pytest

from jitllmd.engine.engine import Engine
from jitllmd.engine.memory.placement import HOST, plan_places
from jitllmd.engine.request import Delta, Done, Generation
from jitllmd.engine.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0.0)

# -- the plan, as pure logic ------------------------------------------------------------------------------------------

SIZES = [10, 5, 5, 5, 8]  # embed, blocks.0..2, head
KV = [0, 2, 2, 2, 0]  # KV reserved for each layer block on its place


def test_plan_fills_devices_from_the_head_backwards() -> None:
    assert plan_places(SIZES, KV, [("d", 100)], -1) == ["d"] * 5
    assert plan_places(SIZES, KV, [("d", 15)], -1) == [HOST, HOST, HOST, "d", "d"]  # head 8 + blocks.2 5 + its KV 2
    assert plan_places(SIZES, KV, [("d", 14)], -1) == [HOST, HOST, HOST, HOST, "d"]  # blocks.2 fits only without its KV
    assert plan_places(SIZES, KV, [("d", 7)], -1) == [HOST] * 5  # not even the head: nothing moves
    assert plan_places(SIZES, KV, [("d", 32)], -1) == [HOST, "d", "d", "d", "d"]  # 8 + 3*7 = 29; embed's 10 does not fit


def test_plan_caps_device_blocks_and_keeps_the_host_a_prefix() -> None:
    assert plan_places(SIZES, KV, [("d", 100)], 2) == [HOST, HOST, HOST, "d", "d"]
    assert plan_places(SIZES, KV, [("d", 100)], 0) == [HOST] * 5
    assert plan_places(SIZES, KV, [], -1) == [HOST] * 5
    assert plan_places(SIZES, KV, [("d", 100)], 99) == ["d"] * 5
    # a block that does not fit ends the device part even if a smaller one before it would
    assert plan_places([1, 1, 50, 1], [0, 0, 0, 0], [("d", 10)], -1) == [HOST, HOST, HOST, "d"]


def test_plan_spills_onto_the_next_device() -> None:
    assert plan_places(SIZES, KV, [("a", 15), ("b", 100)], -1) == ["b", "b", "b", "a", "a"]
    assert plan_places(SIZES, KV, [("a", 15), ("b", 8)], -1) == [HOST, HOST, "b", "a", "a"]
    assert plan_places(SIZES, KV, [("a", 3), ("b", 100)], 3) == [HOST, HOST, "b", "b", "b"]  # a fits nothing, b takes them


def test_plan_needs_one_kv_entry_per_block() -> None:
    with pytest.raises(ValueError, match="one entry per block"):
        plan_places(SIZES, KV[:-1], [("d", 100)], -1)


# -- the engine: moves keep the conversation ---------------------------------------------------------------------------


def _turn(engine: Engine, session, new_ids: list[int], n: int = 24) -> list[int]:
    """One greedy turn: the session's tokens so far plus `new_ids` as the prompt (only the new ones are fed)."""
    prompt = list(session.token_ids) + new_ids
    out: list[int] = []
    for ev in engine.generate(Generation(prompt, GREEDY, max_tokens=n, session=session, ignore_eos=True)):
        if isinstance(ev, Delta):
            out += ev.token_ids
        assert not isinstance(ev, Done) or ev.finish_reason.value == "length"
    return out


TURNS = [[5, 17, 23, 42, 7], [9, 9, 31], [60, 2, 14, 27], [11, 70]]


@pytest.fixture(scope="module", params=["f32", "q8_0", "gemma3", "gemma3-q8_0"])
def model(request):
    """The tiny serving llama and a tiny Gemma 3 (its sliding layer's KV dropping what no query sees), as floats and
    kept quantized: moves and paging carry either kind of block and of KV."""
    fixture = {"f32": "tiny_serve_jlm", "q8_0": "tiny_serve_q8_jlm", "gemma3": "tiny_gemma_jlm", "gemma3-q8_0": "tiny_gemma_q8_jlm"}[request.param]
    return request.getfixturevalue(fixture)


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    """The conversation never moved: every block resident on the host."""
    engine = Engine.load(model, max_seq=512)
    try:
        session = engine.new_session()
        return [_turn(engine, session, t) for t in TURNS]
    finally:
        engine.stop()


def test_moves_between_turns_keep_the_conversation(model, reference) -> None:
    """host -> device -> split -> host between turns gives exactly the tokens of the conversation never moved (f32)."""
    engine = Engine.load(model, max_seq=512, devices=["cpu"], gpu_layers=0)
    try:
        placement = engine.loaded.placement
        assert placement.places == [HOST] * 4
        session = engine.new_session()
        got = [_turn(engine, session, TURNS[0])]
        engine.relocate(0, 3, "cpu", session).result(timeout=30)
        assert placement.places == ["cpu"] * 4 and engine.loaded.device_ids == ["cpu"]
        got.append(_turn(engine, session, TURNS[1]))
        engine.relocate(1, 2, HOST, session).result(timeout=30)
        assert placement.places == ["cpu", HOST, HOST, "cpu"] and placement.num_seams == 2
        got.append(_turn(engine, session, TURNS[2]))
        engine.replace([], session=session).result(timeout=30)  # no devices: every block home
        assert placement.places == [HOST] * 4 and engine.loaded.device_ids == []
        got.append(_turn(engine, session, TURNS[3]))
        assert got == reference
    finally:
        engine.stop()


@pytest.mark.parametrize("read_ahead", [True, False])
def test_a_paged_model_gives_the_same_tokens_within_its_budget(model, reference, read_ahead: bool) -> None:
    """About a third of the model's bytes resident: the same conversation, resident bytes within the budget, and
    the paged blocks read from the file at every step (read ahead of their turn, or at it)."""
    probe = Engine.load(model, max_seq=512)
    total = sum(probe.loaded.placement.block_bytes)
    largest = probe.loaded.placement.pager.largest_layer()[1]
    probe.stop()
    budget = max(total // 3, largest)
    engine = Engine.load(model, max_seq=512, page_budget=budget, read_ahead=read_ahead)
    try:
        pager = engine.loaded.placement.pager
        session = engine.new_session()
        assert [_turn(engine, session, t) for t in TURNS] == reference
        assert 0 < pager.resident_bytes() <= budget
        paged = [n for n in pager.host if n not in pager.resident]
        assert paged, "a third of the model cannot hold every block"
        steps = len(TURNS) * 24  # one step per generated token at least
        assert all(pager.reader.stats[n].reads >= steps for n in paged if n != "embed")
        assert all(engine.loaded.placement.residency(i) in ("resident", "paged") for i in range(4))
        # re-budgeting live: everything resident, then the least that holds one block
        engine.set_page_budget(total).result(timeout=30)
        assert set(pager.resident) == set(pager.host) and pager.resident_bytes() <= total
        engine.set_page_budget(largest).result(timeout=30)
        assert pager.resident_bytes() <= largest
        assert _turn(engine, engine.new_session(), TURNS[0]) == reference[0]
    finally:
        engine.stop()


def test_a_move_mid_generation_happens_between_steps(model) -> None:
    """A move of the model (no session named) lands between two steps of a running generation, which goes on
    with the same tokens; a move naming the session waits for its generation to end."""
    prompt = [5, 17, 23, 42, 7, 9]
    alone = Engine.load(model, max_seq=1024)
    try:
        expected = _turn(alone, alone.new_session(), prompt, n=600)
    finally:
        alone.stop()
    engine = Engine.load(model, max_seq=1024, devices=["cpu"], gpu_layers=0)
    try:
        session = engine.new_session()
        events: queue.SimpleQueue = queue.SimpleQueue()
        req = engine.submit(Generation(prompt, GREEDY, max_tokens=600, session=session, ignore_eos=True), events.put)
        got = [events.get(timeout=30)]  # the first token is out: the generation runs
        engine.relocate(1, 3, "cpu").result(timeout=30)  # the model's blocks, between two steps
        assert not req.finished, "the first move should land while the generation runs"
        waited = engine.relocate(0, 0, "cpu", session)  # waits for the session's generation
        seen = engine.run_job(lambda: req.finished, session)  # what a job naming the session sees when it runs
        waited.result(timeout=60)
        assert seen.result(timeout=60) is True
        while not isinstance(got[-1], Done):
            got.append(events.get(timeout=30))
        assert [t for ev in got if isinstance(ev, Delta) for t in ev.token_ids] == expected
        assert engine.loaded.placement.places == ["cpu"] * 4
    finally:
        engine.stop()


def test_placement_errors(tiny_serve_jlm) -> None:
    engine = Engine.load(tiny_serve_jlm, max_seq=256, devices=["cpu"], gpu_layers=0)
    host_only = Engine.load(tiny_serve_jlm, max_seq=256)
    try:
        with pytest.raises(ValueError, match="not one of the model's devices"):
            engine.relocate(0, 1, "cuda:0").result(timeout=30)
        with pytest.raises(ValueError, match="not one of the model's devices"):
            host_only.relocate(0, 1, "cpu").result(timeout=30)
        with pytest.raises(ValueError, match="out of range"):
            engine.relocate(2, 9, "cpu").result(timeout=30)
        with pytest.raises(ValueError, match="out of range"):
            engine.relocate(3, 1, "cpu").result(timeout=30)
        pager = engine.loaded.placement.pager
        name, size = pager.largest_layer()
        with pytest.raises(ValueError, match=f"below one block: {name} takes {size} bytes"):
            engine.set_page_budget(size - 1).result(timeout=30)
        with pytest.raises(ValueError, match="below one block"):
            Engine.load(tiny_serve_jlm, max_seq=256, page_budget=1)
        assert engine.loaded.placement.places == [HOST] * 4  # nothing moved
        # overlapping moves apply in the order they were asked
        a = engine.relocate(0, 2, "cpu")
        b = engine.relocate(1, 3, HOST)
        a.result(timeout=30)
        b.result(timeout=30)
        assert engine.loaded.placement.places == ["cpu", HOST, HOST, HOST]
    finally:
        engine.stop()
        host_only.stop()


def test_load_places_the_head_end_on_the_device(tiny_serve_jlm) -> None:
    engine = Engine.load(tiny_serve_jlm, max_seq=256, devices=["cpu"], gpu_layers=2)
    try:
        placement = engine.loaded.placement
        assert placement.places == [HOST, HOST, "cpu", "cpu"]
        assert [placement.residency(i) for i in range(4)] == ["resident", "resident", "device", "device"]
        out = list(engine.generate(Generation([5, 17, 23], GREEDY, max_tokens=4, ignore_eos=True)))
        figures = out[-1].figures.to_json()
        assert (figures["device_blocks"], figures["host_blocks"], figures["device_ids"]) == (2, 2, ["cpu"])
    finally:
        engine.stop()


def test_tune_seam_measures_each_count_and_keeps_the_fastest(model) -> None:
    engine = Engine.load(model, max_seq=256, devices=["cpu"], gpu_layers=0)
    try:
        measured = engine.tune_seam().result(timeout=120)
        counts = [c.device_blocks for c in measured]
        assert counts == sorted(set(counts)) and counts[0] == 0 and counts[-1] == 4
        assert all(c.decode_tokens_per_second > 0 for c in measured)
        best = max(measured, key=lambda c: c.decode_tokens_per_second)
        assert engine.loaded.placement.num_device_blocks == best.device_blocks
    finally:
        engine.stop()


def test_rows_follow_the_placement() -> None:
    """One device: the step's rows; any host block: -host-concurrency; several devices, no host block: -device-concurrency."""
    from types import SimpleNamespace

    from jitllmd.engine.memory.placement import Placement

    engine = Engine.__new__(Engine)
    engine.device_rows, engine.host_rows, engine.split_rows = 8, 1, 3
    for places, rows in ((["a"] * 3, 8), (["host", "a", "a"], 1), (["a", "b", "b"], 3), (["host", "a", "b"], 1)):
        placement = Placement.__new__(Placement)
        placement.places = places
        engine.loaded = SimpleNamespace(placement=placement)
        assert engine._rows_now() == rows, places

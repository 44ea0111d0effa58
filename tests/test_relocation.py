"""Relocation (engine/memory/relocation.py): two tiny models on `-devices cpu` with a device budget that holds one. Idle
models give up their device blocks to the one that needs them, busy ones get theirs back, and every conversation's
greedy tokens are those of a model that never moved."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from jitllmd.engine.catalog import Catalog
from jitllmd.engine.config import EngineConfig
from jitllmd.engine.engine import Engine
from jitllmd.engine.memory.placement import HOST
from jitllmd.engine.memory.relocation import held_on, repays
from jitllmd.engine.request import Delta, Generation
from jitllmd.engine.sampler import SamplingParams

from .conftest import write_tiny_llama

GREEDY = SamplingParams(temperature=0)
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [12, 11, 10]}
TOKENS = 120  # a burst: ten times the steps a model of six blocks needs to bring every block back


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """a.jlm and b.jlm: the same tiny 4-layer llama twice (six blocks each with embed and head)."""
    from jitllmd.engine.convert import convert

    root = tmp_path_factory.mktemp("relocation")
    hf, _ = write_tiny_llama(root / "hf", max_position_embeddings=512, num_hidden_layers=4)
    d = root / "models"
    d.mkdir()
    convert(hf, d / "a.jlm", "f32")
    shutil.copyfile(d / "a.jlm", d / "b.jlm")
    return d


def generate(engine: Engine, prompt: list[int], n: int = TOKENS, **kw) -> list[int]:
    out: list[int] = []
    for ev in engine.generate(Generation(prompt, GREEDY, max_tokens=n, ignore_eos=True, **kw)):
        if isinstance(ev, Delta):
            out += ev.token_ids
    return out


@pytest.fixture(scope="module")
def reference(models_dir: Path) -> dict:
    """What a model that never moves answers (all on the device, no budget), and what one model holds on it."""
    engine = Engine.load(models_dir / "a.jlm", devices=["cpu"], max_seq=256)
    try:
        session = engine.new_session()
        ref = {
            "a": generate(engine, PROMPTS["a"]),
            "b": generate(engine, PROMPTS["b"]),
            "turn1": generate(engine, [20, 21, 22], 16, session=session),
            "turn2": generate(engine, [23, 24], 16, session=session),
            "held": held_on(engine.loaded.placement, "cpu"),
        }
    finally:
        engine.stop()
    return ref


def catalog(models_dir: Path, held: int, **kw) -> Catalog:
    """Room on the device for one model and a half; host blocks past one block's page budget are read for their turn."""
    opts = dict(devices="cpu", max_seq=256, device_mem=held * 3 // 2, relocate=True, relocate_idle=0.0, maxmem=130_000)
    return Catalog(models_dir, EngineConfig(**{**opts, **kw}), models_dir / ".cache")


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def places(c: Catalog, name: str) -> list[str]:
    return list(c.get(name).engine.loaded.placement.places)


def test_repays_weighs_the_saving_against_the_copy():
    assert repays(saving_s=0.001, copy_s=0.1, horizon=256, rows=1)  # 0.256 s saved over the horizon > 0.1 s
    assert not repays(saving_s=0.001, copy_s=0.1, horizon=64, rows=1)
    assert not repays(saving_s=0.001, copy_s=0.1, horizon=256, rows=4)  # four tokens a step: a quarter of the steps
    assert not repays(saving_s=0.0, copy_s=0.0, horizon=256, rows=1)  # nothing saved never moves a block


def test_blocks_follow_the_traffic_and_the_tokens_stay(models_dir: Path, reference: dict):
    c = catalog(models_dir, reference["held"])
    try:
        a = c.load("a.jlm", id="a")
        session = a.engine.new_session()
        assert generate(a.engine, [20, 21, 22], 16, session=session) == reference["turn1"]
        assert places(c, "a") == ["cpu"] * 6
        c.load("b.jlm", id="b")  # no room for b: idle a gives up blocks from its front, its head stays
        assert places(c, "b") == ["cpu"] * 6 and places(c, "a")[0] == HOST
        [first] = c.relocation.moves("a")
        assert (first.direction, first.first, first.to, first.reason) == ("demote", 0, HOST, "room to load b")
        assert c.relocation.used("cpu") <= c.relocation.device_mem
        kv_bytes: dict[str, int] = {}
        for turn in range(20):  # traffic alternates: each burst brings its model's blocks back and sends the other's home
            for name in ("a", "b"):
                engine = c.get(name).engine
                assert generate(engine, PROMPTS[name]) == reference[name], f"turn {turn}, model {name}"
                assert places(c, name) == ["cpu"] * 6, f"turn {turn}: {name} is busy and should be whole on the device"
                assert HOST in places(c, "b" if name == "a" else "a")
                assert c.relocation.used("cpu") <= c.relocation.device_mem
                if turn == 1:
                    kv_bytes[name] = engine.loaded.kv_bytes()
                    rss = _rss()
                elif turn > 1:
                    assert engine.loaded.kv_bytes() == kv_bytes[name] and len(engine.slots) == 1  # nothing piles up
        # 200-odd moves of 120-400 KB blocks since turn 1: a block kept by each would be tens of MB
        assert _rss() - rss < 12 << 20
        # the named session's KV went to the host and back with its blocks, many times: the conversation goes on
        assert generate(a.engine, [23, 24], 16, session=session) == reference["turn2"]
        for name in ("a", "b"):
            moves = c.relocation.moves(name)
            directions = [m.direction for m in moves]
            assert directions.count("promote") >= 20 and directions.count("demote") >= 20
            # a model's blocks come back nearest the seam first (the head's side), a run of them at a step boundary
            for before, after in zip(moves, moves[1:]):
                if before.direction == after.direction == "promote":
                    assert after.last == before.first - 1
            assert all("busy" in m.reason for m in moves if m.direction == "promote")
            assert all(m.reason.startswith("room for") for m in moves[1 if name == "a" else 0 :] if m.direction == "demote")
            assert c.relocation.counts(name)["promote"] == directions.count("promote")  # moves kept: all of them here
    finally:
        c.stop()


def test_with_relocation_off_nothing_moves(models_dir: Path, reference: dict):
    c = catalog(models_dir, reference["held"], relocate=False)
    try:
        c.load("a.jlm", id="a")
        b = c.load("b.jlm", id="b")  # as before relocation: b gets what room is left, the rest of it on the host
        assert places(c, "a") == ["cpu"] * 6
        assert places(c, "b")[0] == HOST and places(c, "b")[-1] == "cpu"
        assert generate(b.engine, PROMPTS["b"]) == reference["b"]
        assert places(c, "b")[0] == HOST  # busy, but its relocation is off
        assert c.relocation.moves("a") == c.relocation.moves("b") == []
        c.relocation.set_enabled("a", True)  # a's on, b's off: b still takes nothing from a, which is not asked
        assert generate(b.engine, PROMPTS["b"]) == reference["b"]
        assert places(c, "a") == ["cpu"] * 6 and c.relocation.moves("a") == []
    finally:
        c.stop()


def test_a_model_mid_generation_is_never_moved(models_dir: Path, reference: dict):
    c = catalog(models_dir, reference["held"])
    try:
        a = c.load("a.jlm", id="a")
        c.load("b.jlm", id="b")
        assert generate(a.engine, PROMPTS["a"]) == reference["a"]  # a whole again, b demoted
        assert HOST in places(c, "b")
        started, release = threading.Event(), threading.Event()
        got: list[int] = []

        long = a.engine.new_session(max_seq=512)  # room for ~500 tokens: it runs on while the test asks for room

        def long_stream() -> None:
            for ev in a.engine.generate(Generation(PROMPTS["a"], GREEDY, max_tokens=500, ignore_eos=True, session=long)):
                if isinstance(ev, Delta):
                    got.extend(ev.token_ids)
                    started.set()
                    if len(got) == 5:
                        release.wait(120)  # hold the stream (its request stays running) while b asks for room

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(120)
        before = places(c, "a")
        assert c.relocation.make_room("cpu", 10**9, "b", "room for a test") == 0  # a is busy: nothing of it moves
        assert c.relocation.reclaimable("cpu", "b") == 0
        assert a.engine.snapshot()[0], "the generation ended before the test asked for room"
        assert places(c, "a") == before
        release.set()
        t.join(120)
        assert got[:TOKENS] == reference["a"]
    finally:
        c.stop()


def test_the_server_shows_and_switches_relocation(models_dir: Path, reference: dict):
    """serve with two models and relocation on: place, GetResidency, stats and devices show the moves; place
    -relocate switches a model's; under -device-mem a move that cannot get room is refused."""
    import httpx

    from jitllmd.client import Client
    from jitllmd.gen.jitllm.v1 import placement_pb2 as pb
    from jitllmd.gen.jitllm.v1 import telemetry_pb2 as tel
    from tests.serving import Server
    from tests.test_client_verbs import as_json, jitllmd, ok

    budget = str(reference["held"] * 3 // 2)
    server = Server("-models", str(models_dir), "-devices", "cpu", "-max-seq", "256", "-maxmem", "130000", "-load", "a.jlm", "-id", "a",
                    "-load", "b.jlm", "-id", "b", "-device-mem", budget, "-relocate", "on", "-relocate-idle", "0")
    try:
        addr = server.url.removeprefix("http://")
        assert "relocation on" in server.log
        shown = ok("place", "-model", "a", "-addr", addr).stdout
        assert "relocation: on" in shown and "demote blocks 0:" in shown and "room to load b" in shown
        body = {"model": "a", "prompt": [5, 6, 7, 8, 9], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        assert r["usage"]["completion_tokens"] == TOKENS and r["jitllm"]["host_blocks"] == 0  # whole on the device by its end

        client = Client(addr)
        residency = client.placement.get_residency(pb.GetResidencyRequest(model="a"))
        assert residency.relocation and [m.direction for m in residency.moves][0] == "demote"
        assert "promote" in [m.direction for m in residency.moves]
        stats = {m.model: m for m in client.telemetry.get_stats(tel.GetStatsRequest()).models}
        assert stats["a"].relocation and stats["a"].promotions >= 1 and stats["a"].demotions == 1
        assert stats["b"].demotions >= 1 and stats["b"].promotions == 0
        assert "relocation: a 1 moves to the host, " in ok("stats", "-addr", addr).stdout
        [cpu] = [d for d in as_json("devices", "-addr", addr)["devices"] if d["id"] == "cpu"]
        assert int(cpu["budget_bytes"]) == int(budget) and 0 < int(cpu["held_bytes"]) <= int(budget)
        assert f"-device-mem {int(budget) / 2**20:.0f} MiB" in ok("devices", "-addr", addr).stdout

        off = as_json("place", "-model", "a", "-relocate", "off", "-addr", addr)  # a keeps what it holds and gives none up
        assert off.get("relocation", False) is False
        p = jitllmd("place", "-model", "b", "-move", "0:5", "-to", "cpu", "-addr", addr)  # b needs a's room; a is not asked
        assert p.returncode == 1 and "-device-mem" in p.stderr and "Traceback" not in p.stderr
        assert jitllmd("place", "-model", "a", "-relocate", "maybe", "-addr", addr).returncode == 2
        ok("place", "-model", "a", "-relocate", "on", "-addr", addr)
        moved = as_json("place", "-model", "b", "-move", "0:5", "-to", "cpu", "-addr", addr)  # now idle a makes the room
        assert int(moved.get("host_blocks", 0)) == 0
        assert "room to move b's blocks 0:5" in ok("place", "-model", "a", "-addr", addr).stdout
    finally:
        server.stop()

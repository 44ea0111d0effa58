"""`jitllmd place` and `devices` against a real server whose model is split between the host pager and `cpu` as a
device: the conversation goes on across moves, the pager is re-budgeted live, and bad moves are clean errors."""

from __future__ import annotations

import json
import time

import pytest

from jitllmd.client import Client
from jitllmd.engine.jlm import JLMFile
from jitllmd.gen.jitllm.v1 import placement_pb2 as pb
from tests.serving import Server, tiny_models_dir
from tests.test_client_verbs import as_json, jitllmd, ok


@pytest.fixture(scope="module")
def budget(tiny_serve_jlm) -> int:
    """Room for one transformer block and a little: the rest of the host part is paged."""
    return JLMFile(tiny_serve_jlm).block_nbytes("blocks.0") + 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_serve_jlm, budget):
    models = tiny_models_dir(tmp_path_factory.mktemp("split"), tiny_serve_jlm)
    server = Server("-models", str(models), "-load", "tiny.jlm", "-id", "tiny", "-devices", "cpu", "-gpu-layers", "2", "-maxmem", str(budget), "-max-seq", "512")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def addr(server) -> str:
    return server.url.removeprefix("http://")


def _say(addr: str, sid: str, text: str) -> str:
    return as_json("run", "-session", sid, "-continue", text, "-n", "12", "-temp", "0", "-addr", addr)["text"]


def _new_session(addr: str) -> str:
    return ok("sessions", "-new", "-model", "tiny", "-addr", addr).stdout.strip().splitlines()[-1]


def test_served_split_as_asked(server, addr: str, budget: int) -> None:
    deadline = time.monotonic() + 120
    while "host pager: budget" not in server.log:  # the line after the start line, which the fixture waited for
        assert time.monotonic() < deadline, server.log
        time.sleep(0.05)
    assert "2 blocks on cpu, 2 on the host" in server.log
    p = as_json("place", "-model", "tiny", "-addr", addr)
    assert [b["place"] for b in p["blocks"]] == ["host", "host", "cpu", "cpu"]
    assert (p["device_blocks"], p["host_blocks"], p["num_seams"]) == (2, 2, 1)
    residency = [b["residency"] for b in p["blocks"]]
    assert residency[2:] == ["RESIDENCY_DEVICE"] * 2 and set(residency[:2]) <= {"RESIDENCY_RESIDENT", "RESIDENCY_PAGED"}
    out = as_json("run", "-model", "tiny", "Hello there", "-n", "4", "-temp", "0", "-addr", addr)
    assert (out["jitllm"]["device_blocks"], out["jitllm"]["host_blocks"], out["jitllm"]["device_ids"]) == (2, 2, ["cpu"])
    assert out["jitllm"]["bytes_per_token"] > 0
    host = as_json("devices", "-addr", addr)["host"]
    assert int(host["page_budget_bytes"]) == budget
    table = ok("place", "-model", "tiny", "-addr", addr).stdout
    assert "2 blocks on devices, 2 on the host, 1 seams" in table and "blocks.1" in table


def test_conversation_goes_on_across_moves(addr: str) -> None:
    turns = ["Once upon a time", " and then", " the end"]
    reference = _new_session(addr)
    moved = _new_session(addr)
    try:
        expected = [_say(addr, reference, t) for t in turns]  # before any move: never moved
        got = [_say(addr, moved, turns[0])]
        p = as_json("place", "-session", moved, "-devices", "cpu", "-gpu-layers", "4", "-addr", addr)
        assert p["session_id"] == moved and p["device_blocks"] == 4 and p["num_seams"] == 0
        got.append(_say(addr, moved, turns[1]))
        # its K/V on the device with the blocks (between turns on the host, -maxmem's one block sent them to the spill file)
        p = as_json("place", "-session", moved, "-addr", addr)
        assert all(int(b["kv_bytes"]) > 0 for b in p["blocks"] if b["name"].startswith("blocks."))
        p = as_json("place", "-session", moved, "-move", "0:2", "-to", "host", "-addr", addr)
        assert [b["place"] for b in p["blocks"]] == ["host", "host", "host", "cpu"]
        got.append(_say(addr, moved, turns[2]))
        assert got == expected
        p = as_json("place", "-session", moved, "-devices", "host", "-addr", addr)
        assert p["device_blocks"] == 0 and p["host_blocks"] == 4
    finally:
        for sid in (reference, moved):
            ok("sessions", "-close", sid, "-addr", addr)
        ok("place", "-model", "tiny", "-devices", "cpu", "-gpu-layers", "2", "-addr", addr)  # as the server started


def test_rebudget_the_pager(addr: str, budget: int) -> None:
    roomy = 4 * budget + (1 << 20)
    r = as_json("place", "-model", "tiny", "-maxmem", str(roomy), "-addr", addr)
    assert int(r["page_budget_bytes"]) == roomy and int(r["resident_bytes"]) <= roomy
    host = [b for b in r["blocks"] if b["residency"] != "RESIDENCY_DEVICE"]
    assert host and all(b["residency"] == "RESIDENCY_RESIDENT" for b in host)
    r = as_json("place", "-model", "tiny", "-maxmem", str(budget), "-addr", addr)
    assert int(r["resident_bytes"]) <= budget
    table = ok("place", "-model", "tiny", "-maxmem", str(budget), "-addr", addr).stdout
    assert "page budget" in table and "reads" in table


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-move", "0:9", "-to", "host"], "out of range"),
        (["-move", "1:2", "-to", "cuda:7"], "not one of the model's devices"),
        (["-devices", "cuda:3"], "no device 'cuda:3'"),
        (["-maxmem", "1K"], "below one block"),
    ],
)
def test_bad_placement_requests_exit_1(addr: str, args: list[str], message: str) -> None:
    p = jitllmd("place", "-model", "tiny", *args, "-addr", addr)
    assert p.returncode == 1 and message in p.stderr and "Traceback" not in p.stderr


def test_tune_seam_and_relocation_policy(addr: str) -> None:
    tuned = json.loads(ok("place", "-model", "tiny", "-tune", "-json", "-addr", addr).stdout)
    counts = [c.get("device_blocks", 0) for c in tuned["candidates"]]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 4
    best = max(tuned["candidates"], key=lambda c: c["decode_tokens_per_second"])
    assert tuned["placement"]["device_blocks"] == best.get("device_blocks", 0)
    client = Client(addr)
    on = client.placement.set_relocation(pb.SetRelocationRequest(model="tiny", enabled=True))
    assert on.enabled is True and on.placement.relocation is True
    assert "relocation: on" in ok("place", "-model", "tiny", "-addr", addr).stdout
    assert json.loads(ok("place", "-model", "tiny", "-relocate", "off", "-json", "-addr", addr).stdout).get("relocation", False) is False
    assert client.placement.get_placement(pb.GetPlacementRequest(model="tiny")).placement.relocation is False
    ok("place", "-model", "tiny", "-devices", "cpu", "-gpu-layers", "2", "-addr", addr)

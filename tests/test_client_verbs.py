"""The client verbs (models, devices, stats, sessions, place) as `python -m jitllmd` processes against a real server;
flag checks that never reach a server run in-process through CliRunner."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from jitllmd.client import base_url
from jitllmd.commands import devices, models, place, sessions, stats
from jitllmd.commands.place import parse_range
from jitllmd.engine.config import parse_size
from tests.serving import jitllmd

VERBS = {"models": models.models, "devices": devices.devices, "stats": stats.stats, "sessions": sessions.sessions, "place": place.place}


@pytest.fixture(scope="module")
def addr(tiny_server) -> str:
    return tiny_server.url.removeprefix("http://")


def ok(*args: str) -> subprocess.CompletedProcess[str]:
    p = jitllmd(*args)
    assert p.returncode == 0, p.stderr
    return p


def as_json(*args: str) -> dict:
    return json.loads(ok(*args, "-json").stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- parsing, no server -----------------------------------------------------------------------------------------------


def test_base_url() -> None:
    assert base_url("127.0.0.1:9000") == "http://127.0.0.1:9000"
    assert base_url(":9000") == "http://127.0.0.1:9000"
    assert base_url("example.org") == "http://example.org:8080"
    assert base_url("http://h:1/") == "http://h:1"
    assert base_url("[::1]:9000") == "http://[::1]:9000"
    with pytest.raises(ValueError):
        base_url("host:port")


def test_parse_size_and_range() -> None:
    assert parse_size("8G") == 8 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size("4096") == 4096
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_range("20:35") == (20, 35)
    for bad in ("3-4", "4:3", "a:b", "3"):
        with pytest.raises(ValueError):
            parse_range(bad)
    with pytest.raises(ValueError):
        parse_size("12X")


def test_no_server() -> None:
    port = free_port()
    for verb in ("models", "stats"):
        p = jitllmd(verb, "-addr", f"127.0.0.1:{port}")
        assert p.returncode == 1, (verb, p.stderr)
        assert f"no server at 127.0.0.1:{port}" in p.stderr
        assert "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["place", "-session", "s", "-move", "3-4", "-to", "host"],
        ["place", "-session", "s", "-move", "0:1"],
        ["place", "-session", "s", "-model", "m"],
        ["place", "-session", "s", "-maxmem", "1G"],
        ["place", "-model", "m", "-maxmem", "lots"],
        ["place", "-model", "m", "-gpu-layers", "2"],
        ["sessions", "-new"],
        ["sessions", "-reset", "a", "-close", "b"],
        ["models", "-load", "a.jlm", "-unload", "b"],
        ["models", "-id", "x"],
        ["stats", "-interval", "500"],
        ["devices", "-addr", "nohost:port"],
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    app = typer.Typer()
    for name, fn in VERBS.items():
        app.command(name)(fn)
    r = CliRunner().invoke(app, [*args, "-addr", "127.0.0.1:1"] if "-addr" not in args else args)
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ")


def test_bad_move_exits_2() -> None:
    p = jitllmd("place", "-session", "s", "-move", "3-4", "-to", "host")
    assert p.returncode == 2
    assert p.stderr.startswith("error: -move '3-4'")


# -- against the tiny server ------------------------------------------------------------------------------------------


def test_models(addr: str) -> None:
    listed = {m["id"]: m for m in as_json("models", "-addr", addr)["models"]}
    tiny = listed["tiny"]
    assert tiny["loaded"] is True and tiny["arch"] == "llama" and tiny["num_blocks"] == 4
    assert tiny["weight_types"] == ["F32"]
    assert any(m["file"].endswith("spare.jlm") and not m["loaded"] for m in listed.values())
    out = ok("models", "-addr", addr).stdout
    assert "tiny" in out and "spare.jlm" in out and "weights" in out and " f32 " in out


def test_models_load_unload(addr: str) -> None:
    model = as_json("models", "-load", "spare.jlm", "-id", "spare2", "-max-seq", "64", "-addr", addr)
    assert model["id"] == "spare2" and model["loaded"] is True and model["max_seq"] == 64
    assert "spare2" in ok("models", "-addr", addr).stdout
    p = ok("models", "-unload", "spare2", "-addr", addr)
    assert "unloaded spare2" in p.stdout
    assert "spare2" not in {m["id"] for m in as_json("models", "-addr", addr)["models"]}


def test_models_unload_unknown(addr: str) -> None:
    p = jitllmd("models", "-unload", "nope", "-addr", addr)
    assert p.returncode == 1
    assert p.stderr.startswith("error: ") and "nope" in p.stderr
    assert "Traceback" not in p.stderr


def test_devices(addr: str) -> None:
    resp = as_json("devices", "-addr", addr)
    assert "cpu" in {d["id"] for d in resp["devices"]}
    assert int(resp["host"]["total_bytes"]) > 0 and resp["host"]["num_cpus"] >= 1 and resp["host"]["kernels"]
    out = ok("devices", "-addr", addr).stdout
    assert "host:" in out and f"kernels: {resp['host']['kernels']}" in out


def test_stats(addr: str) -> None:
    resp = as_json("stats", "-addr", addr)
    assert "tiny" in {m["model"] for m in resp["models"]}
    assert {"requests", "generated_tokens", "tokens_per_second", "active_rows", "queue_depth", "sessions"} <= resp.keys()
    assert "tiny" in ok("stats", "-addr", addr).stdout


def test_stats_watch_json(addr: str) -> None:
    """-watch -json prints one object per line until stopped; three updates at 100 ms come well within the timeout."""
    cmd = [sys.executable, "-m", "jitllmd", "stats", "-watch", "-interval", "100", "-json", "-addr", addr]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        proc.terminate()
        proc.wait(10)
    assert all("tiny" in {m["model"] for m in json.loads(line)["models"]} for line in lines)


def test_sessions_lifecycle(addr: str) -> None:
    p = ok("sessions", "-new", "-model", "tiny", "-max-seq", "128", "-addr", addr)
    sid = p.stdout.strip().splitlines()[-1]
    assert sid.startswith("s-")
    try:
        listed = {s["id"]: s for s in as_json("sessions", "-addr", addr)["sessions"]}
        assert listed[sid]["model"] == "tiny" and listed[sid]["max_seq"] == 128 and listed[sid]["position"] == 0
        assert sid in ok("sessions", "-addr", addr).stdout
        assert sid in {s["id"] for s in as_json("sessions", "-model", "tiny", "-addr", addr)["sessions"]}
        assert as_json("sessions", "-reset", sid, "-addr", addr)["position"] == 0
        queues = as_json("sessions", "-queue", "-addr", addr)["queues"]
        assert "tiny" in {q["model"] for q in queues}
        assert "tiny" in ok("sessions", "-queue", "-addr", addr).stdout

        placement = as_json("place", "-session", sid, "-addr", addr)
        assert placement["session_id"] == sid and placement["model"] == "tiny"
        assert [b["name"] for b in placement["blocks"]] == ["embed", "blocks.0", "blocks.1", "head"]
        assert [b["index"] for b in placement["blocks"]] == [0, 1, 2, 3]
        assert {b["place"] for b in placement["blocks"]} == {"host"}
        assert placement["host_blocks"] == 4 and placement["device_blocks"] == 0
        out = ok("place", "-session", sid, "-addr", addr).stdout
        assert "blocks.1" in out and "head" in out
    finally:
        ok("sessions", "-close", sid, "-addr", addr)
    assert sid not in {s["id"] for s in as_json("sessions", "-addr", addr)["sessions"]}
    p = jitllmd("sessions", "-reset", sid, "-addr", addr)
    assert p.returncode == 1 and sid in p.stderr


def test_sessions_new_unknown_model(addr: str) -> None:
    p = jitllmd("sessions", "-new", "-model", "nope", "-addr", addr)
    assert p.returncode == 1 and "nope" in p.stderr


def test_place_model(addr: str) -> None:
    placement = as_json("place", "-model", "tiny", "-addr", addr)
    assert placement["model"] == "tiny" and len(placement["blocks"]) == 4


def test_place_mutations_fail_cleanly(addr: str) -> None:
    """A move the server cannot make (or does not implement yet) is an error line and exit 1, not a traceback."""
    sid = ok("sessions", "-new", "-model", "tiny", "-addr", addr).stdout.strip().splitlines()[-1]
    try:
        p = jitllmd("place", "-session", sid, "-move", "1:2", "-to", "cuda:7", "-addr", addr)
        assert p.returncode == 1 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr
    finally:
        ok("sessions", "-close", sid, "-addr", addr)

"""`jitllmd serve -cluster` with `jitllmd worker` processes on loopback, as a user runs them: the other rank's devices
in `devices`, blocks placed and moved there (`-device-mem`, `place -move`), the conversation unchanged; a worker
killed or stopped mid-stream fails its model's requests within -cluster-timeout while the server and its other models
go on, `models -unload` works, and a restarted worker serves the model loaded again. And under torchrun."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from jitllmd.engine.jlm import JLMFile
from tests.serving import Server, wait_for
from tests.test_client_verbs import as_json, free_port, jitllmd, ok

from .conftest import write_tiny_llama
from .test_cluster import start_worker

TIMEOUT = 5  # -cluster-timeout of these servers: how long a rank that stops answering is waited for


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """tiny.jlm (a 4-layer llama, 4096 positions) and spare.jlm, the same weights under another name."""
    from jitllmd.engine.convert import convert

    root = tmp_path_factory.mktemp("cluster_serve")
    hf, _ = write_tiny_llama(root / "hf", max_position_embeddings=4096, num_hidden_layers=4)
    d = root / "models"
    d.mkdir()
    convert(hf, d / "tiny.jlm", "f32")
    shutil.copyfile(d / "tiny.jlm", d / "spare.jlm")
    return d


def serve(models: Path, url: str, *args: str) -> Server:
    return Server("-models", str(models), "-load", "tiny.jlm", "-id", "tiny", "-load", "spare.jlm", "-id", "local", "-devices", "cpu,1:cpu",
                  "-cluster", url, "-world", "2", "-cluster-timeout", str(TIMEOUT), "-max-seq", "1024", *args)


def chat(url: str, model: str, text: str, tokens: int = 16, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens, "temperature": 0, "ignore_eos": True, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def reply(url: str, model: str, text: str, **kw) -> str:
    r = chat(url, model, text, **kw)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def places(addr: str, model: str) -> list[str]:
    return [b["place"] for b in as_json("place", "-model", model, "-addr", addr)["blocks"]]


@pytest.fixture(scope="module")
def cluster(models: Path):
    url = f"tcp://127.0.0.1:{free_port()}"
    worker = start_worker(models, url, 1)
    server = serve(models, url)
    yield server, server.url.removeprefix("http://"), worker
    server.stop()
    worker.wait(30)  # it stops once rank 0 is gone


def test_devices_lists_the_other_ranks(cluster) -> None:
    server, addr, _ = cluster
    assert "rank 1:" in server.log and "1:cpu" in server.log
    devices = {d["id"]: d for d in as_json("devices", "-addr", addr)["devices"]}
    assert set(devices) == {"cpu", "1:cpu"}
    remote = devices["1:cpu"]
    assert remote["rank"] == 1 and remote["reachable"] and remote["opened"] and remote["host"]
    assert int(remote["total_bytes"]) > 0 and int(remote["free_bytes"]) > 0
    table = ok("devices", "-addr", addr).stdout
    assert "1:cpu" in table and "this host" in table
    topology = httpx.post(server.url + "/jitllm.v1.DeviceService/GetMemoryTopology", json={}, timeout=60).json()["domains"]
    assert {"name": "1:host", "deviceIds": ["1:cpu"]}.items() <= next(d for d in topology if d["name"] == "1:host").items()


def test_blocks_cross_to_rank_1_and_the_conversation_goes_on(cluster) -> None:
    server, addr, _ = cluster
    first = reply(server.url, "local", "Hello there")  # the same weights, never on rank 1
    assert reply(server.url, "tiny", "Hello there") == first
    out = ok("place", "-model", "tiny", "-move", "2:4", "-to", "1:cpu", "-addr", addr).stdout
    assert "1:cpu" in out
    assert places(addr, "tiny") == ["cpu", "cpu", "1:cpu", "1:cpu", "1:cpu", "cpu"]
    r = chat(server.url, "tiny", "Hello there")
    assert r.json()["choices"][0]["message"]["content"] == first
    assert r.json()["jitllm"]["device_ids"] == ["cpu", "1:cpu"]
    # n replies of one prompt: run once, the KV copied for each (on rank 1 too)
    r = chat(server.url, "tiny", "Hello there", n=3)
    assert [c["message"]["content"] for c in r.json()["choices"]] == [first] * 3

    sid = ok("sessions", "-new", "-model", "tiny", "-addr", addr).stdout.strip().splitlines()[-1]
    ref = ok("sessions", "-new", "-model", "local", "-addr", addr).stdout.strip().splitlines()[-1]

    def say(session: str, text: str) -> str:
        return as_json("run", "-session", session, "-continue", text, "-n", "12", "-temp", "0", "-addr", addr)["text"]

    for turn, move in enumerate([("1:4", "cpu"), ("1:3", "1:cpu"), ("3:4", "cpu"), ("1:2", "1:cpu")]):
        assert say(sid, f"turn {turn}") == say(ref, f"turn {turn}")
        ok("place", "-session", sid, "-move", move[0], "-to", move[1], "-addr", addr)
    assert say(sid, "last") == say(ref, "last")
    # SetPlacement over the other rank alone: its layers go there, embed and head stay on rank 0 (on the host)
    ok("place", "-session", sid, "-devices", "1:cpu", "-addr", addr)
    assert places(addr, "tiny") == ["host", "1:cpu", "1:cpu", "1:cpu", "1:cpu", "host"]
    assert say(sid, "again") == say(ref, "again")
    ok("place", "-session", sid, "-devices", "cpu", "-addr", addr)
    assert places(addr, "tiny") == ["cpu"] * 6


def test_layers_only_go_to_another_rank(cluster) -> None:
    _, addr, _ = cluster
    p = jitllmd("place", "-model", "tiny", "-move", "4:5", "-to", "1:cpu", "-addr", addr)
    assert p.returncode != 0 and "head (5), which stays on this host" in p.stderr
    p = jitllmd("place", "-model", "tiny", "-move", "2:3", "-to", "2:cpu", "-addr", addr)
    assert p.returncode != 0 and "2:cpu" in p.stderr and "Traceback" not in p.stderr


def test_device_mem_spills_layers_to_rank_1(models: Path) -> None:
    """-device-mem room on cpu for the head and two layers (with their KV): the next layers go to 1:cpu, the embedding
    to the host (it never leaves rank 0)."""
    jlm = JLMFile(models / "tiny.jlm")
    cfg = jlm.config
    kv = 2 * cfg["num_kv_heads"] * cfg["head_dim"] * 4 * 1024  # one layer's K/V reserved for -max-seq 1024, f32
    layer = jlm.block_nbytes("blocks.0") + kv
    room = jlm.block_nbytes("head") + 2 * layer + layer // 2
    url = f"tcp://127.0.0.1:{free_port()}"
    worker = start_worker(models, url, 1)
    server = serve(models, url, "-device-mem", str(room))
    try:
        addr = server.url.removeprefix("http://")
        assert places(addr, "tiny") == ["host", "1:cpu", "1:cpu", "cpu", "cpu", "cpu"]
        assert reply(server.url, "tiny", "Hello there") == reply(server.url, "local", "Hello there")
    finally:
        server.stop()
        worker.wait(30)


def _stream_until_broken(url: str, model: str, act) -> tuple[list[dict], float]:  # noqa: ANN001
    """Stream a long reply; after its first chunk call `act()`. -> every data event, and seconds from act to the end."""
    body = {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[dict] = []
    acted = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if acted is None:
                act()
                acted = time.monotonic()
    assert acted is not None
    return events, time.monotonic() - acted


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_worker_that_dies_fails_its_model_only(models: Path, fault: str) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    worker = start_worker(models, url, 1)
    server = serve(models, url)
    try:
        addr = server.url.removeprefix("http://")
        first = reply(server.url, "local", "Hello there")
        ok("place", "-model", "tiny", "-move", "1:4", "-to", "1:cpu", "-addr", addr)

        during: dict[str, object] = {}

        def hit() -> None:
            worker.send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
            # while tiny's engine waits on rank 1 (up to -cluster-timeout when it is stopped), the server answers
            during["healthz"] = httpx.get(server.url + "/healthz", timeout=30).status_code
            during["local"] = reply(server.url, "local", "Hello there")

        events, seconds = _stream_until_broken(server.url, "tiny", hit)
        assert during == {"healthz": 200, "local": first}
        assert "error" in events[-1] and "rank 1" in events[-1]["error"]["message"], events[-1]
        assert seconds < 4 * TIMEOUT + 30  # bounded by -cluster-timeout, not a hang (a generous bound: a busy machine)
        assert httpx.get(server.url + "/healthz", timeout=30).status_code == 200
        assert reply(server.url, "local", "Hello there") == first  # the server's other model goes on
        r = chat(server.url, "tiny", "Hello there")
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error" and "unavailable" in r.json()["error"]["message"]
        r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert r.status_code == 503 and r.json()["type"] == "error"
        remote = next(d for d in as_json("devices", "-addr", addr)["devices"] if d["id"] == "1:cpu")
        assert not remote.get("reachable", False)
        ok("models", "-unload", "tiny", "-addr", addr)

        if fault == "stopped":
            worker.send_signal(signal.SIGCONT)  # it finds its link gone and stops
        worker.kill()
        worker.wait(30)
        worker = start_worker(models, url, 1)  # the same rank again: it rejoins, and a model loaded again uses it
        wait_for(lambda: next(d for d in as_json("devices", "-addr", addr)["devices"] if d["id"] == "1:cpu").get("reachable"), "rank 1 back")
        ok("models", "-load", "tiny.jlm", "-id", "tiny", "-addr", addr)
        ok("place", "-model", "tiny", "-move", "1:4", "-to", "1:cpu", "-addr", addr)
        assert reply(server.url, "tiny", "Hello there") == first
    finally:
        server.stop()
        if worker.poll() is None:
            worker.kill()
        worker.wait(30)


def test_serve_names_the_rank_that_never_joined(models: Path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    p = jitllmd("serve", "-addr", "127.0.0.1:0", "-models", str(models), "-load", "tiny.jlm", "-cluster", url, "-world", "2", "-join-timeout", "2")
    assert p.returncode == 1
    assert "rank 1 did not join within 2 s" in p.stderr and "jitllmd worker -cluster" in p.stderr and "Traceback" not in p.stderr
    p = jitllmd("worker", "-cluster", url, "-rank", "0")
    assert p.returncode == 1 and "rank 0 is the server" in p.stderr
    p = jitllmd("serve", "-world", "2")
    assert p.returncode == 1 and "-world needs -cluster" in p.stderr


def test_a_worker_outside_the_world_is_told(models: Path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    worker = start_worker(models, url, 1)
    server = serve(models, url)
    try:
        p = jitllmd("worker", "-models", str(models), "-cluster", url, "-rank", "3", "-cluster-timeout", "10")
        assert p.returncode == 1 and "-rank 3: the cluster at" in p.stderr and "ranks 1..1" in p.stderr
    finally:
        server.stop()
        worker.wait(30)


def test_torchrun_starts_both_ranks(models: Path) -> None:
    """`torchrun --nproc-per-node 2 -m jitllmd serve ...`: rank 0 serves, rank 1 becomes its worker (torch's env)."""
    port = free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(port), "-m", "jitllmd"]
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    server = Server("-models", str(models), "-load", "tiny.jlm", "-id", "tiny", "-load", "spare.jlm", "-id", "local", "-devices", "cpu,1:cpu",
                    "-max-seq", "1024", launcher=launcher, env=env)
    try:
        addr = server.url.removeprefix("http://")
        assert "1:cpu" in {d["id"] for d in as_json("devices", "-addr", addr)["devices"]}
        ok("place", "-model", "tiny", "-move", "2:3", "-to", "1:cpu", "-addr", addr)
        assert reply(server.url, "tiny", "Hello there") == reply(server.url, "local", "Hello there")
    finally:
        server.stop()  # SIGINT to torchrun, which stops both ranks

"""Crafted model files (deeply nested headers, absurd counts, offsets past the end) are a 400 that names the file,
never a 5xx or a big allocation, and the listing shows the good files beside them; a convert killed mid-write leaves
a part the next convert removes, never a live writer's."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from jitllmd.engine import jlm as jlm_module
from jitllmd.engine.convert import ConvertError, convert
from jitllmd.engine.convert.gguf_reader import GGUFError, open_gguf
from jitllmd.engine.jlm import JLMFile
from tests.serving import Server, jitllmd

# -- crafted files ------------------------------------------------------------------------------------------------

DEEP = 100_000  # far past any recursion limit


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header: bytes | dict, data: bytes) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def crafted_jlms(good: Path, out: Path) -> dict[str, str]:
    """Copies of `good` with crafted headers in `out`: file name -> what its error says."""
    header, data = _split(good)
    meta = json.loads(header["__metadata__"]["jlm"])
    _write(out / "nested-meta.jlm", {**header, "__metadata__": {"jlm": "[" * DEEP + "]" * DEEP}}, data)
    _write(out / "nested-header.jlm", b'{"a":' + b"[" * DEEP + b"]" * DEEP + b"}", data)
    layers = {**meta, "config": {**meta["config"], "num_layers": 1_000_000}}
    _write(out / "layers.jlm", {**header, "__metadata__": {"jlm": json.dumps(layers)}}, data)
    past = json.loads(json.dumps(header))
    start, end = past["embed.weight"]["data_offsets"]
    past["embed.weight"]["data_offsets"] = [start + 2**40, end + 2**40]
    _write(out / "offsets.jlm", past, data)
    return {"nested-meta.jlm": "nests JSON deeper", "nested-header.jlm": "nests JSON deeper", "layers.jlm": "num_layers is 1000000",
            "offsets.jlm": "ends past the end of the file"}


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


_ARCH = _s(b"general.architecture") + struct.pack("<I", 8) + _s(b"llama")


def _gguf(num_tensors: int, fields: list[bytes], rest: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, num_tensors, len(fields)) + b"".join(fields) + rest


def crafted_ggufs() -> dict[str, bytes]:
    """GGUF headers whose counts their bytes cannot hold (gguf.GGUFReader loops on an array's, allocating as it goes),
    a shape whose element count wraps a uint64, a block count no tensor table backs."""
    dims = struct.pack("<I", 2) + struct.pack("<QQ", 2**40, 2**40)
    be_arch = struct.pack(">Q", 20) + b"general.architecture" + struct.pack(">IQ", 8, 5) + b"llama"
    return {
        "array": _gguf(0, [_ARCH, _s(b"x") + struct.pack("<IIQ", 9, 0, 2**40)]),
        "big-endian": b"GGUF" + struct.pack(">IQQ", 3, 0, 2) + be_arch + struct.pack(">Q", 1) + b"x" + struct.pack(">IIQ", 9, 0, 2**40),
        "shape": _gguf(1, [_ARCH], _s(b"token_embd.weight") + dims + struct.pack("<IQ", 0, 0) + bytes(64)),
        "blocks": _gguf(1, [_ARCH, _s(b"llama.block_count") + struct.pack("<IQ", 10, 10**6)],
                        _s(b"token_embd.weight") + struct.pack("<IQ", 1, 8) + struct.pack("<IQ", 0, 0) + bytes(64)),
    }


@pytest.mark.parametrize("kind", ["array", "big-endian"])
def test_a_crafted_gguf_is_a_convert_error_naming_it(tmp_path: Path, kind: str) -> None:
    """A count its bytes cannot hold is refused as it is read, not left to gguf.GGUFReader (which loops on it,
    allocating as it goes), also in a big-endian file (which GGUFReader reads)."""
    src = tmp_path / f"{kind}.gguf"
    src.write_bytes(crafted_ggufs()[kind])
    with pytest.raises(ConvertError, match=f"{kind}.gguf"):
        convert(src, tmp_path / "out.jlm")
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


@pytest.mark.parametrize(("kind", "why"), [("shape", "holds more weights than the file has bits"), ("blocks", "block_count is 1000000")])
def test_a_gguf_header_whose_numbers_its_bytes_cannot_back_is_refused(tmp_path: Path, kind: str, why: str) -> None:
    """Shapes whose element count wraps numpy's uint64, and a block count (per-layer lists are sized by it) past the
    tensor table, are refused by the header reader."""
    src = tmp_path / f"{kind}.gguf"
    src.write_bytes(crafted_ggufs()[kind])
    with pytest.raises(GGUFError, match=why):
        open_gguf(src)


def test_convert_of_a_crafted_gguf_exits_with_one_line(tmp_path: Path) -> None:
    src = tmp_path / "absurd.gguf"
    src.write_bytes(crafted_ggufs()["array"])
    done = jitllmd("convert", str(src), "-o", str(tmp_path / "out.jlm"))
    assert done.returncode == 1, done.stderr
    assert "absurd.gguf" in done.stderr and "Traceback" not in done.stderr


def test_a_crafted_jlm_is_refused_on_open(tmp_path: Path, tiny_serve_jlm: Path) -> None:
    for name, why in crafted_jlms(tiny_serve_jlm, tmp_path).items():
        with pytest.raises(jlm_module.JLMError, match=why):
            JLMFile(tmp_path / name)


# -- served: the listing and LoadModel --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crafted(tmp_path_factory, tiny_serve_jlm):
    """A server whose -models holds good.jlm (loaded, id "good"), spare.jlm, the crafted .jlm files and a crafted
    .gguf: (server, models dir, crafted file -> what its error says)."""
    models = tmp_path_factory.mktemp("crafted") / "models"
    models.mkdir()
    for name in ("good.jlm", "spare.jlm"):
        shutil.copyfile(tiny_serve_jlm, models / name)
    bad = crafted_jlms(tiny_serve_jlm, models)
    (models / "absurd.gguf").write_bytes(crafted_ggufs()["array"])
    bad["absurd.gguf"] = "not a readable GGUF file"
    server = Server("-models", str(models), "-load", "good.jlm", "-id", "good")
    yield server, models, bad
    server.stop()


def _rpc(server: Server, method: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/jitllm.v1.ModelService/{method}", json=body, timeout=120)


def _rss(server: Server) -> int:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_the_listing_shows_the_good_files_and_marks_the_crafted(crafted) -> None:
    server, models, bad = crafted
    r = _rpc(server, "ListModels", {})
    assert r.status_code == 200, r.text
    listed = {m["file"]: m for m in r.json()["models"]}
    assert listed["good.jlm"]["loaded"] and listed["good.jlm"]["arch"] == "llama"
    assert listed["spare.jlm"]["arch"] == "llama" and not listed["spare.jlm"].get("loaded")
    for name in (n for n in bad if n.endswith(".jlm")):
        assert not listed[name].get("loaded") and not listed[name].get("arch"), name  # listed, without an arch: unreadable
        assert listed[name]["error"].startswith(f"{name}: ") and bad[name] in listed[name]["error"]  # and why
        got = _rpc(server, "GetModel", {"model": listed[name]["id"]})
        assert got.status_code == 400 and got.json()["code"] == "invalid_argument", got.text
        assert got.json()["message"].startswith(f"{name}: ") and bad[name] in got.json()["message"]
    shown = jitllmd("models", "-addr", server.url.removeprefix("http://"))
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line for line in shown.stdout.splitlines() if line.strip()}
    assert "unreadable" in rows["layers"] and "unreadable" not in rows["spare"]
    assert "layers.jlm: config.num_layers is 1000000" in shown.stdout  # and why
    assert str(models) not in shown.stdout + r.text


@pytest.mark.parametrize("name", ["nested-meta.jlm", "nested-header.jlm", "layers.jlm", "absurd.gguf"])
def test_loading_a_crafted_file_is_invalid_argument_naming_it(crafted, name: str) -> None:
    server, models, bad = crafted
    before = _rss(server)
    r = _rpc(server, "LoadModel", {"file": name})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
    message = r.json()["message"]
    assert message.startswith(f"{name}: ") and bad[name] in message and str(models) not in message
    assert _rss(server) - before < 50 * 2**20  # refused before anything was sized by its numbers


def test_the_good_model_still_loads_and_answers(crafted) -> None:
    """After every crafted file was refused (as a 400, taking no memory to speak of), models load and answer."""
    server, _, bad = crafted
    before = _rss(server)
    for name in bad:
        assert _rpc(server, "LoadModel", {"file": name}).status_code == 400, name
    assert _rss(server) - before < 50 * 2**20
    r = _rpc(server, "LoadModel", {"file": "spare.jlm", "id": "spare"})
    assert r.status_code == 200 and r.json()["model"]["arch"] == "llama", r.text
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        for model in ("good", "spare"):
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            assert reply.choices[0].message.content is not None
    assert _rpc(server, "UnloadModel", {"model": "spare"}).status_code == 200


# -- parts a killed convert leaves ----------------------------------------------------------------------------

# `jitllmd convert` whose writer stalls once the part holds its header: killed there as `kill -9` mid-write would
_STALLING = """
import sys, time
import jitllmd.engine.jlm as jlm
from jitllmd.cli import app

write = jlm._write_all

def stall(fd, data):
    write(fd, data)
    print("writing", flush=True)
    time.sleep(600)

jlm._write_all = stall
app(sys.argv[1:], prog_name="jitllmd")
"""


def _killed_convert(src: Path, out: Path) -> Path:
    """Run `jitllmd convert src -o out`, kill -9 it mid-write, and return the part it left."""
    before = set(out.parent.glob(f".{out.name}.*.part"))
    proc = subprocess.Popen([sys.executable, "-c", _STALLING, "convert", str(src), "-o", str(out), "-dtype", "f32"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == "writing\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    (part,) = set(out.parent.glob(f".{out.name}.*.part")) - before
    return part


def _live_writer(src: Path, out: Path) -> tuple[subprocess.Popen[str], Path]:
    """A convert of `out` that stalls mid-write and stays alive (it holds its part's lock)."""
    before = set(out.parent.glob(f".{out.name}.*.part"))
    proc = subprocess.Popen([sys.executable, "-c", _STALLING, "convert", str(src), "-o", str(out), "-dtype", "f32"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
    (part,) = set(out.parent.glob(f".{out.name}.*.part")) - before
    return proc, part


def test_a_killed_converts_part_goes_at_the_next_convert_even_one_that_fails(tmp_path: Path, tiny_serve_hf: Path) -> None:
    out = tmp_path / "out.jlm"
    live, held = _live_writer(tiny_serve_hf, out)
    try:
        dead = _killed_convert(tiny_serve_hf, out)
        assert dead.stat().st_size > 0 and held.exists() and not out.exists()
        broken = tmp_path / "broken.gguf"
        broken.write_bytes(crafted_ggufs()["shape"])
        with pytest.raises(ConvertError, match="broken.gguf"):
            convert(broken, out)  # fails before it writes: it still clears what the killed writer left
        assert not dead.exists() and held.exists()
        convert(tiny_serve_hf, out, "f32")
        assert JLMFile(out).arch == "llama" and held.exists()  # the live writer's part is its own
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
        assert live.stdout is not None
        live.stdout.close()
    convert(tiny_serve_hf, out, "f32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf", "out.jlm"]


def test_another_outputs_dead_part_goes_once_it_is_old(tmp_path: Path, tiny_serve_hf: Path) -> None:
    """A convert clears its directory of other outputs' parts that no writer holds and none has written lately (the
    GGUF-on-load cache: a conversion killed, then its source changed, names a new output); a fresh one stays."""
    old = _killed_convert(tiny_serve_hf, tmp_path / "a.jlm")
    fresh = tmp_path / ".b.jlm.x1y2z3.part"
    fresh.write_bytes(b"written by a writer that may still be alive")
    held = tmp_path / ".c.jlm.held.part"
    fd = os.open(held, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        long_ago = time.time() - 3600  # past STALE_SECONDS
        for part in (old, held):
            os.utime(part, (long_ago, long_ago))
        convert(tiny_serve_hf, tmp_path / "d.jlm", "f32")
        assert not old.exists() and fresh.exists() and held.exists()
        assert JLMFile(tmp_path / "d.jlm").arch == "llama"
    finally:
        os.close(fd)
    assert jlm_module.STALE_SECONDS < 3600


def test_a_config_missing_a_field_is_invalid_argument_naming_both(crafted, tiny_serve_jlm) -> None:
    """A .jlm whose config lacks hidden_size (its header reads fine, so the listing shows it): LoadModel is a 400 that
    names the file and the field, never a 500."""
    server, models, _ = crafted
    header, data = _split(tiny_serve_jlm)
    meta = json.loads(header["__metadata__"]["jlm"])
    meta["config"].pop("hidden_size")
    _write(models / "no-width.jlm", {**header, "__metadata__": {"jlm": json.dumps(meta)}}, data)
    r = _rpc(server, "LoadModel", {"file": "no-width.jlm"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
    assert r.json()["message"] == "no-width.jlm: config.hidden_size: this field is required"


def test_a_damaged_tokenizer_is_invalid_argument_naming_the_file(crafted, tiny_serve_jlm) -> None:
    server, models, _ = crafted
    header, data = _split(tiny_serve_jlm)
    meta = json.loads(header["__metadata__"]["jlm"])
    meta["tokenizer"] = '{"model": 5}'
    _write(models / "bad-tokenizer.jlm", {**header, "__metadata__": {"jlm": json.dumps(meta)}}, data)
    r = _rpc(server, "LoadModel", {"file": "bad-tokenizer.jlm"})
    assert r.status_code == 400 and r.json()["message"].startswith("bad-tokenizer.jlm: "), r.text

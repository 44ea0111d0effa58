"""The .jlm format: write/read round trips, safetensors compatibility, block reads, damaged files, atomic writes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from jitllmd.engine.jlm import FORMAT_VERSION, JLMError, JLMFile, TensorSpec, write_jlm


def _spec(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, t.dtype, tuple(t.shape), lambda t=t: t)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=g),
        "blocks.0.attn.weight": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "blocks.0.norm.weight": torch.randn(5, generator=g).to(torch.float16),
        "blocks.1.attn.weight": torch.randint(-128, 128, (2, 3, 4), generator=g, dtype=torch.int8),
        "blocks.1.norm.weight": torch.randn(5, generator=g),
        "blocks.10.norm.weight": torch.randn(1, generator=g),
        "blocks.1.empty": torch.empty(0, 4),
        "head.scalar": torch.tensor(3.5),
    }


META = {"arch": "llama", "config": {"hidden_size": 5, "nested": [1, 2, {"x": None}]}, "tokenizer": "{}", "unicode": "é你😀"}


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], int]:
    tensors = _tensors()
    path = tmp_path / "m.jlm"
    seen: list[str] = []
    size = write_jlm(path, [_spec(n, t) for n, t in tensors.items()], META, on_tensor=lambda s: seen.append(s.name))
    assert seen == list(tensors)  # on_tensor is called once per tensor, in order
    return path, tensors, size


def test_round_trip(written) -> None:
    path, tensors, size = written
    assert size == path.stat().st_size
    f = JLMFile(path)
    assert f.names == list(tensors)
    assert f.meta == {"format_version": FORMAT_VERSION, **META}
    assert f.arch == "llama" and f.config == META["config"]
    for name, want in tensors.items():
        got = f.tensor(name)
        assert got.dtype == want.dtype, name
        assert tuple(got.shape) == tuple(want.shape), name
        assert torch.equal(got, want), name
    f.close()


def test_data_is_8_byte_aligned_and_offsets_contiguous(written) -> None:
    path, tensors, _ = written
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    end = 0
    for name in tensors:
        start, stop = header[name]["data_offsets"]
        assert start == end
        end = stop
    assert 8 + n + end == len(raw)


def test_readable_by_safetensors(written) -> None:
    from safetensors import safe_open

    path, tensors, _ = written
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        meta = json.loads(f.metadata()["jlm"])
        assert meta["arch"] == "llama" and meta["format_version"] == FORMAT_VERSION and meta["unicode"] == META["unicode"]
        for name, want in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == want.dtype and torch.equal(got, want), name


def test_block_returns_only_that_block(written) -> None:
    path, tensors, _ = written
    f = JLMFile(path)
    b1 = f.block("blocks.1")
    assert sorted(b1) == ["attn.weight", "empty", "norm.weight"]  # not blocks.10.*
    assert torch.equal(b1["attn.weight"], tensors["blocks.1.attn.weight"])
    assert sorted(f.block("blocks.10")) == ["norm.weight"]
    assert sorted(f.block("blocks.0")) == ["attn.weight", "norm.weight"]
    assert f.block("blocks.2") == {}
    assert f.block_nbytes("blocks.1") == 2 * 3 * 4 + 5 * 4
    assert f.block_nbytes("blocks.0") == 3 * 4 * 2 + 5 * 2


def test_mapped_tensors_do_not_write_back(written) -> None:
    path, _, _ = written
    before = path.read_bytes()
    f = JLMFile(path)
    f.tensor("embed.weight").add_(1.0)  # ACCESS_COPY: a private mapping
    assert path.read_bytes() == before


@pytest.mark.parametrize("cut", [0, 4, 8, 20, -1, -30])
def test_truncated_file(written, tmp_path: Path, cut: int) -> None:
    path, _, _ = written
    raw = path.read_bytes()
    bad = tmp_path / "cut.jlm"
    bad.write_bytes(raw[:cut] if cut >= 0 else raw[: len(raw) + cut])
    with pytest.raises(JLMError, match="cut.jlm"):
        JLMFile(bad)


@pytest.mark.parametrize(
    "content",
    [
        b"hello, this is not a model file at all" * 10,
        struct.pack("<Q", 2) + b"{}",  # valid JSON, no jlm metadata
        struct.pack("<Q", 11) + b"not json!!!",
        struct.pack("<Q", 10**12) + b"{}",  # header length past the end
        bytes(range(256)) * 4,
    ],
)
def test_garbage_file(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "garbage.jlm"
    bad.write_bytes(content)
    with pytest.raises(JLMError, match="garbage.jlm"):
        JLMFile(bad)


def test_plain_safetensors_without_jlm_metadata(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    p = tmp_path / "plain.safetensors"
    save_file({"a": torch.zeros(2)}, str(p))
    with pytest.raises(JLMError, match="no jlm metadata"):
        JLMFile(p)


def test_missing_and_directory(tmp_path: Path) -> None:
    with pytest.raises(JLMError, match="nope.jlm"):
        JLMFile(tmp_path / "nope.jlm")
    with pytest.raises(JLMError, match="directory"):
        JLMFile(tmp_path)


def test_wrong_format_version(tmp_path: Path) -> None:
    p = tmp_path / "v.jlm"
    write_jlm(p, [], {"arch": "llama", "format_version": FORMAT_VERSION + 1})
    with pytest.raises(JLMError, match="format version"):
        JLMFile(p)


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_producer_raising_leaves_nothing(tmp_path: Path) -> None:
    def boom() -> torch.Tensor:
        raise RuntimeError("disk on fire")

    specs = [_spec("a", torch.zeros(1000)), TensorSpec("b", torch.float32, (4,), boom), _spec("c", torch.ones(3))]
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_jlm(out / "m.jlm", specs, META)
    assert _leftovers(out) == []


def test_producer_wrong_shape_leaves_nothing_and_keeps_old_file(tmp_path: Path) -> None:
    out = tmp_path / "m.jlm"
    write_jlm(out, [_spec("a", torch.zeros(2))], META)
    old = out.read_bytes()
    specs = [TensorSpec("a", torch.float32, (3,), lambda: torch.zeros(4))]
    with pytest.raises(JLMError, match="declared"):
        write_jlm(out, specs, META)
    assert out.read_bytes() == old
    assert _leftovers(tmp_path) == ["m.jlm"]
    specs = [TensorSpec("a", torch.float32, (3,), lambda: torch.zeros(3, dtype=torch.float16))]
    with pytest.raises(JLMError):
        write_jlm(out, specs, META)
    assert _leftovers(tmp_path) == ["m.jlm"]


def test_interrupt_mid_write_leaves_nothing(tmp_path: Path) -> None:
    def interrupted() -> torch.Tensor:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_jlm(tmp_path / "m.jlm", [TensorSpec("a", torch.float32, (2,), interrupted)], META)
    assert _leftovers(tmp_path) == []


def test_unstorable_dtype(tmp_path: Path) -> None:
    with pytest.raises(JLMError, match="complex"):
        write_jlm(tmp_path / "m.jlm", [_spec("a", torch.zeros(2, dtype=torch.complex64))], META)
    assert _leftovers(tmp_path) == []


def test_creates_parent_directories(tmp_path: Path) -> None:
    p = tmp_path / "a" / "b" / "m.jlm"
    write_jlm(p, [_spec("x", torch.arange(4, dtype=torch.int32))], META)
    assert torch.equal(JLMFile(p).tensor("x"), torch.arange(4, dtype=torch.int32))


def _header_file(path: Path, header: object, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


_JLM_META = {"__metadata__": {"jlm": json.dumps({"format_version": FORMAT_VERSION, "arch": "llama"})}}
MALFORMED_HEADERS = {
    "header-is-a-number": (123, b""),
    "header-is-a-string": ("abc", b""),
    "jlm-metadata-is-a-list": ({"__metadata__": {"jlm": "[1, 2]"}}, b""),
    "unknown-dtype-F64": ({**_JLM_META, "a": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
    "no-data-offsets": ({**_JLM_META, "a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8),
    "tensor-entry-not-an-object": ({**_JLM_META, "a": 5}, b"\0" * 8),
    "offsets-disagree-with-shape": ({**_JLM_META, "a": {"dtype": "F32", "shape": [5], "data_offsets": [0, 8]}}, b"\0" * 8),
}


@pytest.mark.parametrize("case", list(MALFORMED_HEADERS))
def test_malformed_header_is_a_jlm_error(tmp_path: Path, case: str) -> None:
    header, data = MALFORMED_HEADERS[case]
    p = _header_file(tmp_path / f"{case}.jlm", header, data)
    with pytest.raises(JLMError, match=case):
        f = JLMFile(p)
        for name in f.names:
            f.tensor(name)


def test_duplicate_names_are_refused(tmp_path: Path) -> None:
    specs = [_spec("x", torch.ones(4)), _spec("x", torch.full((4,), 2.0))]
    with pytest.raises(JLMError, match="x"):
        write_jlm(tmp_path / "dup.jlm", specs, META)
    assert _leftovers(tmp_path) == []


_WRITER = """
import sys, time, torch
from jitllmd.engine.jlm import TensorSpec, write_jlm

def slow():
    print("writing", flush=True)
    time.sleep(600)
    return torch.zeros(4)

write_jlm(sys.argv[1], [TensorSpec("a", torch.float32, (4,), slow)], {"arch": "x"})
"""


def test_a_killed_writers_part_is_removed_by_the_next_write_and_a_live_ones_kept(tmp_path: Path) -> None:
    """`kill -9` mid-write leaves `.NAME.jlm.XXXX.part`: the next write of NAME.jlm removes it; a part whose writer
    still runs (it holds its lock) stays; neither is ever a .jlm to list."""
    import fcntl
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "model.jlm"
    dead = subprocess.Popen([sys.executable, "-c", _WRITER, str(out)], stdout=subprocess.PIPE, text=True)
    assert dead.stdout is not None and dead.stdout.readline() == "writing\n"
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    dead.stdout.close()
    stale = list(tmp_path.glob(".model.jlm.*.part"))
    assert len(stale) == 1 and not out.exists()
    live = tmp_path / ".model.jlm.live.part"  # as a running writer holds its own
    fd = os.open(live, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert list(tmp_path.glob("*.jlm")) == []
        write_jlm(out, [TensorSpec("a", torch.float32, (2,), lambda: torch.ones(2))], {"arch": "x"})
        assert not stale[0].exists() and live.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == [".model.jlm.live.part", "model.jlm"]
    finally:
        os.close(fd)

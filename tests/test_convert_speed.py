"""Converting a GGUF at the speed of a copy: the real models' .jlm byte for byte what the converter always wrote, in
memory bounded by a tensor and the tokenizer (not the file); the header reader reads what gguf.GGUFReader reads."""

from __future__ import annotations

import hashlib
import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from jitllmd.engine.convert.gguf_reader import GGUFFile, open_gguf
from jitllmd.engine.convert.gguf_tokenizer import _derive_merges
from jitllmd.engine.jlm import JLMError, JLMFile, TensorSpec, write_jlm
from jitllmd.engine.layers.formats import FORMATS, lanes_

from .conftest import write_tiny_gguf

# sha256 of each model's `convert x.gguf -o x.jlm` (dtype auto) as the converter wrote it before it copied file to file
# (format version 1, K-format codes in ggml's order: `_sha256_as_version_1` takes a version 2 file back there); the
# .jlm names its GGUF, so these are of the files as the fixtures name them
SHA256 = {
    "smollm2_gguf": "284de4ddd8d0b7ace8f23e7c2b8fb696febb621fb4acfe90d74f9ff63e3d20d0",  # SmolLM2-135M-Instruct Q4_1
    "gemma3_gguf": "7cb16461bf8be78355bccbff0ba502754d4477808b1456405673f98f26d83f3c",  # Gemma 3 270M Q4_K_M
    "qwen_gguf": "a7da30fa39cfd28b934ad820ab73c052c86659cb84eb1e748fc900f0b19d065d",  # Qwen2.5-Coder-0.5B-Instruct Q4_K_M
}

# The conversion in a process of its own, its peak RSS before and after: VmHWM is the process's own high-water mark
# (a child's ru_maxrss starts from its parent's, which pytest's own size would swamp).
_CONVERT = """
import json, sys
from jitllmd.engine.convert import convert

def hwm():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))

base = hwm()
convert(sys.argv[1], sys.argv[2])
print(json.dumps({"base": base, "peak": hwm()}))
"""


def _sha256_as_version_1(path: Path) -> str:
    """sha256 of the .jlm at `path` as format version 1 wrote it: its K-format tensors' codes back in ggml's order
    (formats.lanes_, its own inverse) and its version 1 (the same length in the header: no offset moves)."""
    jlm = JLMFile(path)
    data = bytearray(path.read_bytes())
    for name, entry in jlm.meta["quantization"].items():
        fmt = FORMATS[entry["type"]]
        _, _, offset, nbytes = jlm.locate(name)
        lanes_(torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset).view(-1, fmt.nbytes), fmt)
    jlm.close()
    n = struct.unpack("<Q", data[:8])[0]
    header = bytes(data[8 : 8 + n])
    assert header.count(b'\\"format_version\\": 2,') == 1
    data[8 : 8 + n] = header.replace(b'\\"format_version\\": 2,', b'\\"format_version\\": 1,')
    return hashlib.sha256(data).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("model", list(SHA256))
def test_real_gguf_converts_to_the_same_bytes_in_bounded_memory(model: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if not Path("/proc/self/status").exists():
        pytest.skip("peak RSS is read from /proc (Linux)")
    src = request.getfixturevalue(model)
    out = tmp_path / "model.jlm"
    run = subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rss = json.loads(run.stdout.splitlines()[-1])
    assert _sha256_as_version_1(out) == SHA256[model]
    jlm = JLMFile(out)
    largest = max(jlm.locate(name)[3] for name in jlm.names)
    vocab = int(jlm.config["vocab_size"])
    jlm.close()
    # A tensor at a time (none, where its blocks are copied file to file) and the tokenizer: ~1 KB a token measured,
    # 46-325 MB in all; the whole file read through memory took 308-1418 MB here, over each bound
    bound = largest + 1536 * vocab + (128 << 20)
    grown = rss["peak"] - rss["base"]
    assert grown <= bound, f"{model}: converting grew RSS by {grown >> 20} MB, over {bound >> 20} MB"


# -- the header reader ------------------------------------------------------------------------------------------------


def _same_as_gguf_reader(path: Path) -> None:
    mine, theirs = GGUFFile(path), gguf.GGUFReader(path)
    fields = {k: v.contents() for k, v in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(mine.fields) == list(fields)
    for key, value in fields.items():
        got = mine.fields[key].contents()
        assert got == value and type(got) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in got] == [type(v) for v in value], key
    assert [t.name for t in mine.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(mine.tensors, theirs.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert a.shape.dtype == b.shape.dtype and a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and a.data.tobytes() == b.data.tobytes()


def _write(path: Path, *, alignment: int | None = None, nested: bool = False, endianess=gguf.GGUFEndian.LITTLE) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-6)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁ 你好")
    writer.add_string("t.empty", "")
    writer.add_array("t.strs", ["a", "", "▁b", "😀"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False])
    if nested:
        writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b", np.arange(6, dtype=np.float16))
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("c", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_reader_reads_what_gguf_reader_reads(tmp_path: Path, alignment: int | None) -> None:
    path = _write(tmp_path / "t.gguf", alignment=alignment)
    _same_as_gguf_reader(path)
    assert isinstance(open_gguf(path), GGUFFile)


def test_reader_reads_the_real_smollm2_as_gguf_reader_does(smollm2_gguf: Path) -> None:
    _same_as_gguf_reader(smollm2_gguf)


@pytest.mark.parametrize("unusual", ["nested", "big-endian"])
def test_unusual_files_are_left_to_gguf_reader(tmp_path: Path, unusual: str) -> None:
    path = _write(tmp_path / "u.gguf", nested=unusual == "nested",
                  endianess=gguf.GGUFEndian.BIG if unusual == "big-endian" else gguf.GGUFEndian.LITTLE)
    reader = open_gguf(path)
    assert isinstance(reader, gguf.GGUFReader)
    assert reader.fields["t.str"].contents() == "héllo ▁ 你好"


@pytest.mark.parametrize("dtype", ["auto", "f32"])
def test_a_file_left_to_gguf_reader_converts_the_same(tiny_llama, tmp_path: Path, monkeypatch, dtype: str) -> None:
    from jitllmd.engine.convert import convert, gguf_reader

    hf_dir, hf_model, _ = tiny_llama
    src = write_tiny_gguf(tmp_path / "tiny.gguf", hf_dir, hf_model, q8_0=True)
    convert(src, tmp_path / "ours.jlm", dtype)

    def unusual(path: Path) -> None:
        raise gguf_reader._Unusual("as if")

    monkeypatch.setattr(gguf_reader, "GGUFFile", unusual)
    assert isinstance(open_gguf(src), gguf.GGUFReader)
    convert(src, tmp_path / "theirs.jlm", dtype)
    assert (tmp_path / "ours.jlm").read_bytes() == (tmp_path / "theirs.jlm").read_bytes()


# -- derived merges, kept blocks copied ---------------------------------------------------------------------------------


def _every_split_sorted(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """The definition: every split of a token into two tokens, best token first, then the longer left part, then the
    shorter right part, then file order."""
    ranked = [(-priority[t], -cut, cut - len(t), i, t[:cut], t[cut:]) for t, i in vocab.items() for cut in range(1, len(t))
              if t[:cut] in vocab and t[cut:] in vocab]
    return [(left, right) for *_, left, right in sorted(ranked)]


@pytest.mark.parametrize("ties", [False, True])
def test_derived_merges_are_every_split_in_rank_order(ties: bool) -> None:
    rng = random.Random(7)
    vocab: dict[str, int] = {}
    for _ in range(3000):
        vocab.setdefault("".join(rng.choice("ab▁c") for _ in range(rng.randint(1, 6))), len(vocab))
    priority = {t: float(rng.randint(-5, 0)) if ties else -float(i) for t, i in vocab.items()}
    assert _derive_merges(vocab, priority) == _every_split_sorted(vocab, priority)


@pytest.mark.parametrize("kernel", ["copy_file_range", "refused", "absent"])
def test_stored_tensors_are_copied_from_their_file(tmp_path: Path, monkeypatch, kernel: str) -> None:
    import errno
    import os

    if kernel == "refused":  # e.g. between file systems: read and written instead
        def refuse(*args):
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(os, "copy_file_range", refuse)
    elif kernel == "absent":
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    blob = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)
    blob.write_bytes(b"x" * 13 + data.tobytes())
    never = lambda: pytest.fail("a stored tensor is copied, not produced")  # noqa: E731
    specs = [TensorSpec("a", torch.uint8, (50, 100), never, stored_at=(blob, 13)),
             TensorSpec("b", torch.float32, (2,), lambda: torch.tensor([1.0, 2.0]))]
    write_jlm(tmp_path / "m.jlm", specs, {"arch": "x"})
    jlm = JLMFile(tmp_path / "m.jlm")
    assert jlm.tensor("a").numpy().tobytes() == data.tobytes()
    assert jlm.tensor("b").tolist() == [1.0, 2.0]
    jlm.close()


def test_a_stored_tensor_past_its_file_fails_and_leaves_nothing(tmp_path: Path) -> None:
    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(100))
    out = tmp_path / "out"
    with pytest.raises(JLMError, match="a: its source file ends 20 bytes short"):
        write_jlm(out / "m.jlm", [TensorSpec("a", torch.uint8, (30,), lambda: torch.zeros(30, dtype=torch.uint8), stored_at=(blob, 90))], {})
    assert list(out.iterdir()) == []

"""convert: GGUF files (as llama.cpp writes them) and Hugging Face directories -> .jlm; dtypes; one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from jitllmd.engine.convert import ConvertError, convert
from jitllmd.engine.jlm import JLMFile
from jitllmd.engine.kv import RowSpan
from jitllmd.engine.loader import load_model

from .conftest import write_tiny_gguf, write_tiny_hf, write_tiny_llama

PROMPT = [93, 36, 7, 92, 17, 79, 84, 66, 79, 88, 80, 22, 81, 2, 94, 5, 60, 41]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there, the winter!"},
    {"role": "assistant", "content": "In Oslo: 42 (ok)."},
    {"role": "user", "content": "What's on?"},
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, object]:
    """A tiny llama as a Hugging Face dir, an F32 GGUF and a Q8_0 GGUF, each converted to f32 .jlm."""
    d = tmp_path_factory.mktemp("convert")
    hf_dir, hf_model = write_tiny_llama(d / "hf")
    f32_gguf = write_tiny_gguf(d / "tiny-f32.gguf", hf_dir, hf_model)
    q8_gguf = write_tiny_gguf(d / "tiny-q8_0.gguf", hf_dir, hf_model, q8_0=True)
    return {
        "dir": d,
        "hf_dir": hf_dir,
        "hf_model": hf_model,
        "f32_gguf": f32_gguf,
        "q8_gguf": q8_gguf,
        "hf": convert(hf_dir, d / "hf.jlm", "f32"),
        "gguf_f32": convert(f32_gguf, d / "gguf-f32.jlm", "f32"),
        "gguf_q8": convert(q8_gguf, d / "gguf-q8.jlm", "f32"),
    }


def _logits(path: Path, ids: list[int] = PROMPT) -> torch.Tensor:
    loaded = load_model(path, max_seq=64)
    kv = loaded.new_kv()
    return loaded.runner.forward(torch.tensor(ids), torch.arange(len(ids)), [RowSpan(0, len(ids), kv)])


def _hf_logits(hf_model, ids: list[int] = PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


# -- GGUF as llama.cpp writes it ------------------------------------------------------------------------------------


def test_results_describe_the_conversion(sources) -> None:
    for key, kind in (("hf", "hf"), ("gguf_f32", "gguf"), ("gguf_q8", "gguf")):
        r = sources[key]
        assert r.arch == "llama" and r.source_kind == kind
        assert r.num_tensors == 2 + 2 * 9 + 1  # embed, lm_head, final norm + 9 per layer
        assert r.num_params == sum(p.numel() for p in sources["hf_model"].parameters())
        assert r.nbytes == r.path.stat().st_size
        assert r.nbytes > 4 * r.num_params


def test_f32_gguf_unpermutes_to_the_hf_weights(sources) -> None:
    """llama.cpp interleaves q/k rows; after convert every tensor equals the Hugging Face one bit for bit."""
    a, b = JLMFile(sources["hf"].path), JLMFile(sources["gguf_f32"].path)
    assert a.names == b.names
    for name in a.names:
        assert torch.equal(a.tensor(name), b.tensor(name)), name
    q = b.tensor("blocks.0.self_attn.q_proj.weight")
    hf_q = sources["hf_model"].model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q, hf_q)
    assert sources["hf_model"].config.num_attention_heads != sources["hf_model"].config.num_key_value_heads  # k used its own head count


def test_f32_gguf_config_matches_hf_dir(sources) -> None:
    a, b = JLMFile(sources["hf"].path).config, JLMFile(sources["gguf_f32"].path).config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "rope_theta", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "qk_norm"):
        assert a[key] == b[key], key
    assert b["rms_norm_eps"] == pytest.approx(a["rms_norm_eps"], rel=1e-6)
    assert not b["rope_scaling"]


def test_f32_gguf_logits_equal_hf_dir_logits(sources) -> None:
    ours = _logits(sources["gguf_f32"].path)
    assert (ours - _logits(sources["hf"].path)).abs().max().item() <= 1e-5
    assert (ours - _hf_logits(sources["hf_model"])).abs().max().item() <= 1e-4


def test_q8_0_gguf_logits_are_close(sources) -> None:
    ref = _logits(sources["hf"].path)
    q8 = _logits(sources["gguf_q8"].path)
    diff = (q8 - ref).abs().max().item()
    assert 0 < diff < 0.1 * ref.abs().max().item()
    # dequantized weights are near, not equal, to the originals (Q8_0: 8 bits per weight + a scale per 32)
    a, b = JLMFile(sources["hf"].path), JLMFile(sources["gguf_q8"].path)
    for name in a.names:
        w, wq = a.tensor(name), b.tensor(name)
        assert wq.dtype == torch.float32 and wq.shape == w.shape, name
        if w.dim() == 2:
            assert 0 < (wq - w).abs().max().item() <= w.abs().max().item() / 100, name
        else:
            assert torch.equal(wq, w), name  # 1-D norms stay F32


def test_q8_0_gguf_greedy_agrees_with_hf_mostly(sources) -> None:
    ids = PROMPT
    ref = _logits(sources["hf"].path, ids).argmax(-1)
    q8 = _logits(sources["gguf_q8"].path, ids).argmax(-1)
    assert (ref == q8).float().mean().item() >= 0.8


def test_gguf_tokenizer_and_chat_template_came_through(sources) -> None:
    hf = load_model(sources["hf"].path, max_seq=64)
    gg = load_model(sources["gguf_f32"].path, max_seq=64)
    assert gg.chat.available and gg.chat.source == hf.chat.source
    text = hf.chat.render(CHAT, add_generation_prompt=True)
    assert gg.chat.render(CHAT, add_generation_prompt=True) == text
    assert text.endswith("<|assistant|>")
    ids = hf.tokenizer.encode(text)
    assert gg.tokenizer.encode(text) == ids
    assert 0 not in ids  # every character is in the vocabulary (no <unk>)
    assert any(77 <= i < 93 for i in ids)  # merged tokens (ids 77..92) are used, so the GGUF merges came through
    assert gg.tokenizer.decode(ids) == hf.tokenizer.decode(ids)
    assert gg.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert (gg.tokenizer.bos_token_id, gg.eos_token_ids, gg.tokenizer.add_bos_token) == (1, [2], False)
    meta = JLMFile(sources["gguf_f32"].path).meta
    assert meta["source"]["kind"] == "gguf" and meta["source"]["file"] == "tiny-f32.gguf"
    for plain in ("Hello there, the winter in Oslo!", "  two  spaces\nnewline", "x"):
        assert gg.tokenizer.encode(plain) == hf.tokenizer.encode(plain), plain


def test_tied_embeddings_gguf(tmp_path: Path) -> None:
    """A tied model has no output.weight in the GGUF: the head reuses token_embd."""
    hf_dir, hf_model = write_tiny_llama(tmp_path / "hf", tie_word_embeddings=True)
    path = write_tiny_gguf(tmp_path / "tied.gguf", hf_dir, hf_model)
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    out = convert(path, tmp_path / "tied.jlm", "f32")
    f = JLMFile(out.path)
    assert f.config["tie_word_embeddings"] is True and "head.lm_head.weight" not in f.names
    assert (_logits(out.path) - _hf_logits(hf_model)).abs().max().item() <= 1e-4


def test_progress_reports_bytes(sources, tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    convert(sources["q8_gguf"], tmp_path / "p.jlm", "bf16", on_progress=lambda d, t: calls.append((d, t)))
    assert len(calls) == sources["gguf_q8"].num_tensors
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert calls[-1][0] == calls[-1][1] == sum(p.numel() for p in sources["hf_model"].parameters()) * 2


# -- dtypes -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, torch_dtype", [("f16", torch.float16), ("bf16", torch.bfloat16), ("f32", torch.float32)])
@pytest.mark.parametrize("source", ["hf_dir", "q8_gguf"])
def test_dtype_is_stored(sources, tmp_path: Path, dtype: str, torch_dtype: torch.dtype, source: str) -> None:
    out = convert(sources[source], tmp_path / f"m-{dtype}.jlm", dtype)
    f = JLMFile(out.path)
    for name in f.names:
        assert f.tensor(name).dtype == torch_dtype, name
    ref = JLMFile(sources["hf"].path if source == "hf_dir" else sources["gguf_q8"].path)
    for name in f.names:
        assert torch.equal(f.tensor(name), ref.tensor(name).to(torch_dtype)), name


def test_default_dtype_is_bf16(sources, tmp_path: Path) -> None:
    out = convert(sources["hf_dir"], tmp_path / "default.jlm")
    assert JLMFile(out.path).tensor("embed.weight").dtype == torch.bfloat16


def test_f16_computes_in_bf16_on_cpu(sources, tmp_path: Path) -> None:
    out = convert(sources["hf_dir"], tmp_path / "f16.jlm", "f16")
    loaded = load_model(out.path, max_seq=64)
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.placement.pager.resident["embed"].table.dtype == torch.bfloat16
    logits = _logits(out.path)
    assert logits.dtype == torch.float32
    assert (logits - _hf_logits(sources["hf_model"])).abs().max().item() < 0.15


def test_bad_dtype(sources, tmp_path: Path) -> None:
    with pytest.raises(ConvertError, match="f64"):
        convert(sources["hf_dir"], tmp_path / "x.jlm", "f64")
    assert list(tmp_path.iterdir()) == []


# -- errors -----------------------------------------------------------------------------------------------------------


def _assert_fails(src: Path, out_dir: Path, match: str) -> ConvertError:
    out_dir.mkdir(exist_ok=True)
    with pytest.raises(ConvertError) as info:
        convert(src, out_dir / "out.jlm", "f32")
    msg = str(info.value)
    assert src.name in msg, msg
    assert "\n" not in msg
    assert match.lower() in msg.lower(), msg
    assert list(out_dir.iterdir()) == [], "an output or temp file was left behind"
    return info.value


def _tensor_span(path: Path) -> tuple[int, int]:
    """(start of tensor data, end of the last tensor) in a GGUF file."""
    r = gguf.GGUFReader(path)
    return min(t.data_offset for t in r.tensors), max(t.data_offset + t.n_bytes for t in r.tensors)


@pytest.mark.parametrize("where", ["header", "kv", "tensor-infos", "data-middle", "last-byte"])
@pytest.mark.parametrize("which", ["f32_gguf", "q8_gguf"])
def test_truncated_gguf(sources, tmp_path: Path, where: str, which: str) -> None:
    raw = sources[which].read_bytes()
    start, end = _tensor_span(sources[which])
    assert end == len(raw)  # no trailing padding, so cutting the last byte truncates data
    cut = {"header": 10, "kv": 200, "tensor-infos": start - 40, "data-middle": (start + end) // 2, "last-byte": end - 1}[where]
    bad = tmp_path / f"cut-{where}.gguf"
    bad.write_bytes(raw[:cut])
    _assert_fails(bad, tmp_path / "out", "")


@pytest.mark.parametrize("content", [b"this is not a gguf file\n" * 50, b"", b"GGU", b"GGUF" + bytes(range(256)) * 8])
def test_garbage_file(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(content)
    _assert_fails(bad, tmp_path / "out", "gguf")


def test_garbage_with_gguf_magic_is_not_readable(tmp_path: Path) -> None:
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    _assert_fails(bad, tmp_path / "out", "not a readable GGUF")


def test_unsupported_gguf_architecture(sources, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "phi.gguf", sources["hf_dir"], sources["hf_model"], arch="phi3")
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "phi3"
    err = _assert_fails(path, tmp_path / "out", "phi3")
    assert "not supported" in str(err) and "llama" in str(err)


def test_gguf_with_unsupported_tensor_type(sources, tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_fails(tmp_path / "iq.gguf", tmp_path / "out", "I32")


def test_missing_source(tmp_path: Path) -> None:
    _assert_fails(tmp_path / "absent.gguf", tmp_path / "out", "no such file")


def test_dir_without_config_json(sources, tmp_path: Path) -> None:
    d = tmp_path / "noconfig"
    shutil.copytree(sources["hf_dir"], d)
    (d / "config.json").unlink()
    _assert_fails(d, tmp_path / "out", "config.json")


@pytest.mark.parametrize("model_type", ["phi3", "gpt2", None])
def test_hf_dir_with_unsupported_model_type(sources, tmp_path: Path, model_type: str | None) -> None:
    d = tmp_path / "other"
    shutil.copytree(sources["hf_dir"], d)
    cfg = json.loads((d / "config.json").read_text())
    if model_type is None:
        del cfg["model_type"]
    else:
        cfg["model_type"] = model_type
    (d / "config.json").write_text(json.dumps(cfg))
    _assert_fails(d, tmp_path / "out", f"model_type {model_type!r}")


def test_hf_dir_with_broken_config_json(sources, tmp_path: Path) -> None:
    d = tmp_path / "broken"
    shutil.copytree(sources["hf_dir"], d)
    (d / "config.json").write_text("{not json")
    _assert_fails(d, tmp_path / "out", "config.json")


def test_hf_dir_without_tokenizer(sources, tmp_path: Path) -> None:
    d = tmp_path / "notok"
    shutil.copytree(sources["hf_dir"], d)
    (d / "tokenizer.json").unlink()
    _assert_fails(d, tmp_path / "out", "tokenizer.json")


def test_hf_dir_with_corrupt_safetensors(sources, tmp_path: Path) -> None:
    d = tmp_path / "corrupt"
    shutil.copytree(sources["hf_dir"], d)
    (d / "model.safetensors").write_bytes(b"\x00" * 100)
    err = _assert_fails(d, tmp_path / "out", "safetensors")
    assert "model.safetensors" in str(err)


def test_failed_conversion_keeps_an_existing_output(sources, tmp_path: Path) -> None:
    out = tmp_path / "keep.jlm"
    out.write_bytes(b"old contents")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(sources["f32_gguf"].read_bytes()[:5000])
    with pytest.raises(ConvertError):
        convert(bad, out, "f32")
    assert out.read_bytes() == b"old contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "keep.jlm"]


def test_other_architectures_convert_from_hf(tmp_path: Path) -> None:
    """qwen2 has q/k/v biases; the HF path keeps them (the GGUF un-permute applies only to llama)."""
    hf_dir, hf_model = write_tiny_hf(tmp_path / "hf", "qwen2")
    out = convert(hf_dir, tmp_path / "q.jlm", "f32")
    f = JLMFile(out.path)
    assert f.arch == "qwen2" and f.config["attention_bias"] is True
    assert torch.equal(f.tensor("blocks.1.self_attn.k_proj.bias"), hf_model.model.layers[1].self_attn.k_proj.bias)


# -- the family registry: convert and the loader ask it -------------------------------------------------------------


def test_registry_names_each_source_once() -> None:
    from jitllmd.engine.models import FAMILIES, bert, family_for, family_for_gguf, family_for_hf, gemma3, llama

    for names in ([a for f in FAMILIES for a in f.archs], [t for f in FAMILIES if f.hf for t in f.hf.model_types],
                  [a for f in FAMILIES if f.gguf for a in f.gguf.archs]):
        assert len(names) == len(set(names)), names
    assert family_for("qwen3") is family_for_hf("mistral") is family_for_gguf("qwen2") is llama.FAMILY
    assert family_for("bert") is family_for_hf("bert") is bert.FAMILY and bert.FAMILY.embeds and bert.FAMILY.gguf is None
    assert family_for("gemma3") is family_for_hf("gemma3_text") is family_for_hf("gemma3") is family_for_gguf("gemma3") is gemma3.FAMILY
    with pytest.raises(ValueError, match=r"arch 'gpt2' is not supported \(supported: bert, gemma3, llama"):
        family_for("gpt2")


def test_a_family_is_a_registry_line(sources, tmp_path: Path, monkeypatch) -> None:
    """A family registered beside the others converts and loads with nothing changed in convert/ or the loader."""
    import dataclasses

    from jitllmd.engine import models
    from jitllmd.engine.models import llama
    from jitllmd.engine.models.family import HFSource

    family = dataclasses.replace(
        llama.FAMILY, archs=("tinyfam",), gguf=None,
        hf=HFSource(model_types={"tiny_fam": "tinyfam"}, config=llama.hf_config, tensor_name=llama.hf_tensor_name),
    )
    monkeypatch.setattr(models, "FAMILIES", (*models.FAMILIES, family))
    d = tmp_path / "hf"
    shutil.copytree(sources["hf_dir"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"model_type": "tiny_fam"}))
    out = convert(d, tmp_path / "fam.jlm", "f32")
    f = JLMFile(out.path)
    assert f.arch == "tinyfam" and f.meta["source"]["model_type"] == "tiny_fam"
    assert torch.equal(_logits(out.path), _logits(sources["hf"].path))


def test_hf_config_the_family_refuses(sources, tmp_path: Path) -> None:
    """The family's config class checks the converted config, so an unsupported one fails at convert, not at load."""
    d = tmp_path / "yarn"
    shutil.copytree(sources["hf_dir"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    _assert_fails(d, tmp_path / "out", "config.rope_scaling type 'yarn'")


def test_gguf_without_a_hyperparameter(sources, tmp_path: Path) -> None:
    bad = tmp_path / "nolayers.gguf"
    raw = sources["f32_gguf"].read_bytes()
    assert raw.count(b"llama.block_count") == 1
    bad.write_bytes(raw.replace(b"llama.block_count", b"llama.block_cXunt"))  # same length: the file stays readable
    _assert_fails(bad, tmp_path / "out", "missing or bad metadata 'llama.block_count'")

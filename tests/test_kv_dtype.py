"""-kv-dtype: the sessions' K/V kept as f32, f16, bf16 or q8_0 (blocks of 32 int8 and an f16 scale, rows of the pages
the kernels read): written as the reference rounds them, read back as their values, saved and restored in their dtype."""

from __future__ import annotations

import pytest
import torch

from jitllmd.engine import kernels
from jitllmd.engine.convert import convert
from jitllmd.engine.engine import Engine
from jitllmd.engine.kv import RowSpan
from jitllmd.engine.loader import load_model
from jitllmd.engine.pages import Q8_0, dequantize_q8, quantize_q8
from jitllmd.engine.request import Generation
from jitllmd.engine.sampler import SamplingParams
from tests.conftest import write_tiny_llama
from tests.test_engine import collect

PROMPT = [(5 * i + 7) % 80 + 3 for i in range(150)]


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A tiny llama with heads of 32 (q8_0 blocks): its f32 .jlm and its Q8_0 one."""
    d = tmp_path_factory.mktemp("kv_dtype")
    hf_dir, _ = write_tiny_llama(d / "hf", head_dim=32, max_position_embeddings=1024)
    return convert(hf_dir, d / "tiny32.jlm", "f32").path, convert(hf_dir, d / "tiny32-q8_0.jlm", "q8_0").path


@pytest.fixture(params=kernels.variants() or [None])
def variant(request):
    kernels.use_variant(request.param)
    yield request.param
    kernels.use_variant(None)


def _logits(path, kv_dtype: str, chunks: list[int]) -> tuple[torch.Tensor, object]:
    loaded = load_model(path, max_seq=512, kv_dtype=kv_dtype)
    kv, out, at = loaded.new_kv(), [], 0
    for n in chunks:
        part = PROMPT[at : at + n]
        out.append(loaded.runner.forward(torch.tensor(part), torch.arange(at, at + n), [RowSpan(0, n, kv, prompt=True)], torch.arange(n)))
        at += n
    return torch.cat(out), kv


@pytest.mark.parametrize("which", [0, 1])
def test_q8_0_keys_are_the_reference_rounding_and_the_logits_stay_close(variant, wide_heads, which: int) -> None:
    """A prompt in chunks, then token by token: layer 0's K/V in the pages are the f32 cache's rounded by the
    reference rule, bit for bit; the logits stay within a few hundredths of the f32 cache's."""
    path = wide_heads[which]
    chunks = [70, 30] + [1] * 50
    ref, exact = _logits(path, "f32", chunks)
    got, kv = _logits(path, "q8_0", chunks)
    assert kv.dtype == Q8_0 and kv.pool.k[0].dtype == torch.uint8
    k8, v8 = kv.read(0, 0, len(PROMPT), raw=True)
    k32, v32 = exact.read(0, 0, len(PROMPT))
    assert torch.equal(k8, quantize_q8(k32)) and torch.equal(v8, quantize_q8(v32))
    assert torch.equal(kv.read(0, 0, len(PROMPT))[0], dequantize_q8(k8, 32))
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()
    assert kv.bytes_per_position() * 32 == exact.bytes_per_position() * 34 // 4  # 34 bytes a block of 32, against 128


def test_each_dtype_generates_saves_and_restores(wide_heads) -> None:
    """f16, bf16 and q8_0 caches each run a conversation; a session saved from one restores into an engine of another
    dtype (converted) and into its own (the same rows, the same next tokens)."""
    from jitllmd.engine import session_file

    path = wide_heads[1]
    greedy = SamplingParams(temperature=0)
    engines = {name: Engine.load(path, max_seq=512, kv_dtype=name) for name in ("f16", "bf16", "q8_0")}
    try:
        ids = {}
        for name, engine in engines.items():
            session = engine.new_session()
            ids[name] = collect(engine.generate(Generation(PROMPT, greedy, max_tokens=12, ignore_eos=True, session=session))).ids
            assert len(ids[name]) == 12
            if name == "q8_0":
                saved = session_file.load(engine.save_session(session).result(timeout=60))
                assert saved.meta["dtype"] == "q8_0" and saved.tensors["k.0"].dtype == torch.uint8
                again = Engine.load(path, max_seq=512, kv_dtype="q8_0")
                try:
                    twin = again.restore_session(saved).result(timeout=60)
                    assert torch.equal(twin.kv.read(1, 0, twin.kv.length, raw=True)[1], session.kv.read(1, 0, session.kv.length, raw=True)[1])
                    more = session.token_ids + [9, 10, 11]
                    go = lambda e, s, more=more: collect(e.generate(Generation(more, greedy, max_tokens=8, ignore_eos=True, session=s))).ids
                    assert go(again, twin) == go(engine, session)
                finally:
                    again.stop()
                wider = engines["f16"].restore_session(saved).result(timeout=60)
                assert wider.kv.dtype == torch.float16 and torch.equal(wider.kv.read(0, 0, 20)[0], session.kv.read(0, 0, 20)[0].half())
        # the first pick's margin (0.08-0.12 on every variant) is past what the caches' rounding moves a logit (< 0.04);
        # a tiny random model's later ones are not (0.004 at the second where AMX runs: q8_0 takes the other token)
        assert ids["f16"][0] == ids["q8_0"][0] == ids["bf16"][0]
    finally:
        for engine in engines.values():
            engine.stop()


def test_a_head_size_q8_0_cannot_block_is_a_clear_error(tiny_serve_jlm) -> None:
    from tests.serving import jitllmd

    with pytest.raises(ValueError, match="head size is 16"):
        load_model(tiny_serve_jlm, max_seq=64, kv_dtype="q8_0")
    r = jitllmd("run", "-model", str(tiny_serve_jlm), "-kv-dtype", "q8_0", "-n", "4", "hi")
    assert r.returncode != 0 and "head size is 16" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = jitllmd("run", "-model", str(tiny_serve_jlm), "-kv-dtype", "q4", "-n", "4", "hi")
    assert r.returncode != 0 and "-kv-dtype must be one of" in r.stderr, r.stderr


def test_served_models_load_takes_a_kv_dtype(serve, wide_heads) -> None:
    import httpx

    models = wide_heads[0].parent
    server = serve("-models", str(models), "-load", wide_heads[0].name, "-id", "tiny32", "-kv-dtype", "f16")
    engine = server.catalog.get("tiny32").engine
    assert engine.loaded.runner.kv_pool.dtype == torch.float16
    r = httpx.post(server.url + "/jitllm.v1.ModelService/LoadModel", json={"file": wide_heads[1].name, "id": "tiny32q", "kvDtype": "q8_0"}, timeout=120)
    assert r.status_code == 200, r.text
    try:
        assert server.catalog.get("tiny32q").engine.loaded.runner.kv_pool.dtype == Q8_0
        body = {"model": "tiny32q", "prompt": "a b c", "max_tokens": 5, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        bad = httpx.post(server.url + "/jitllm.v1.ModelService/LoadModel", json={"file": wide_heads[1].name, "id": "t3", "kvDtype": "q4"}, timeout=60)
        assert bad.status_code == 400 and "kv_dtype" in bad.text, bad.text
    finally:
        httpx.post(server.url + "/jitllm.v1.ModelService/UnloadModel", json={"model": "tiny32q"}, timeout=60)

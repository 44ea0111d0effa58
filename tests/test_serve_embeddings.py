"""/v1/embeddings and InferenceService.Embed on the real all-MiniLM-L6-v2, against sentence-transformers."""

from __future__ import annotations

import base64
import shutil

import httpx
import numpy as np
import openai
import pytest

from tests.serving import InProcessServer

pytestmark = pytest.mark.slow

TEXTS = ["a sentence to embed", "and another", "Ein Satz auf Deutsch.", "emoji 🚀✨ too"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, minilm_jlm, tiny_serve_jlm):
    models = tmp_path_factory.mktemp("embed_models")
    shutil.copyfile(minilm_jlm, models / "minilm.jlm")
    shutil.copyfile(tiny_serve_jlm, models / "tiny.jlm")
    s = InProcessServer("-models", str(models), "-load", "minilm.jlm", "-id", "minilm")  # its own: the fixture loads tiny into it
    loaded = httpx.post(s.url + "/jitllm.v1.ModelService/LoadModel", json={"file": "tiny.jlm", "id": "tiny"}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


def test_sdk_float_and_base64_match_sentence_transformers(server, reference):
    want = reference.encode(TEXTS, convert_to_numpy=True)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        r = client.embeddings.create(model="minilm", input=TEXTS)
        got = np.array([d.embedding for d in r.data], dtype=np.float32)
        assert [d.index for d in r.data] == list(range(len(TEXTS))) and got.shape == (4, 384)
        assert np.abs(got - want).max() <= 1e-5
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        assert r.usage.prompt_tokens > 10 and r.model_extra["jitllm"]["host_blocks"] > 0
        raw = httpx.post(server.url + "/v1/embeddings", json={"model": "minilm", "input": TEXTS, "encoding_format": "base64"}, timeout=60).json()
        decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
        assert np.array_equal(decoded, got)
        one = client.embeddings.create(model="minilm", input="a sentence to embed", dimensions=384)
        assert np.abs(np.array(one.data[0].embedding) - want[0]).max() <= 1e-5


def test_token_id_inputs(server):
    from jitllmd.gen.jitllm.v1 import model_pb2 as mdl
    from jitllmd.gen.jitllm.v1.model_connect import ModelServiceClientSync

    with ModelServiceClientSync(server.url, send_compression=None) as models:
        ids = list(models.tokenize(mdl.TokenizeRequest(model="minilm", text="and another", add_special_tokens=True)).token_ids)
    by_text = httpx.post(server.url + "/v1/embeddings", json={"model": "minilm", "input": "and another"}, timeout=60).json()
    by_ids = httpx.post(server.url + "/v1/embeddings", json={"model": "minilm", "input": ids}, timeout=60).json()
    both = httpx.post(server.url + "/v1/embeddings", json={"model": "minilm", "input": [ids, ids]}, timeout=60).json()
    assert by_ids["data"][0]["embedding"] == by_text["data"][0]["embedding"] == both["data"][1]["embedding"]


def test_embed_rpc(server, reference):
    from jitllmd.gen.jitllm.v1 import inference_pb2 as inf
    from jitllmd.gen.jitllm.v1.inference_connect import InferenceServiceClientSync

    with InferenceServiceClientSync(server.url, send_compression=None) as client:
        r = client.embed(inf.EmbedRequest(model="minilm", inputs=TEXTS[:2]))
    got = np.array([list(e.values) for e in r.embeddings], dtype=np.float32)
    assert np.abs(got - reference.encode(TEXTS[:2], convert_to_numpy=True)).max() <= 1e-5


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": "minilm", "input": TEXTS, "dimensions": 128}, "384"),
        ({"model": "minilm", "input": ["fine", "word " * 400]}, "input 1 has"),
        ({"model": "minilm", "input": ["ok", ""]}, "empty"),
        ({"model": "minilm", "input": [[]]}, "input"),
        ({"model": "minilm", "input": [[1, 2], "mixed is fine", 5]}, "input"),
        ({"model": "minilm", "input": TEXTS, "encoding_format": "int8"}, "encoding_format"),
        ({"model": "minilm", "input": [[10**9]]}, "token ids"),
        ({"model": "tiny", "input": "a chat model"}, "embedding model"),
        ({"model": "minilm"}, "input"),
    ],
)
def test_embedding_errors(server, body, words):
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_chat_asked_of_an_embedding_model(server):
    for path, body in (
        ("/v1/chat/completions", {"model": "minilm", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"model": "minilm", "prompt": "hi"}),
    ):
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", json={"model": "minilm", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]

"""/v1/rerank (and /rerank, /v2/rerank) and /v1/score (and /score) on real servers, in the shapes vLLM serves: a tiny
random BERT cross-encoder converted from a Hugging Face directory against transformers' scores, the real
all-MiniLM-L6-v2 against sentence-transformers' cosines, and every bad field a 400 naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from jitllmd.engine.convert import ConvertError, convert
from jitllmd.engine.jlm import JLMFile
from jitllmd.engine.loader import load_model
from jitllmd.serve.rerank import MOST_TEXTS

from .serving import InProcessServer
from .test_bert import VOCAB, tiny_bert_tokenizer_json

TOL = 1e-4
QUERY = "w1 w2 w3 w4"
# different lengths; an empty one; words the vocabulary lacks ([UNK]); a literal [SEP] inside a document, which the
# tokenizer makes the separator token (segment 1 all the same)
DOCS = ["w1 w2 w9", "w50 w51 w52 w53 w54 w55 w56 w57 w58 w59 w60", "", "w3 w4 w1 w2", "zzz unknown w7", "w5 [SEP] w6", "w88"]
SENTENCES = [
    "What is the capital of France?",
    "Paris is the capital and largest city of France.",
    "The Eiffel Tower stands in Paris.",
    "Berlin is the capital of Germany.",
    "Photosynthesis turns light into chemical energy in plants.",
    "I love pizza 🍕 and rockets 🚀!",
    "",
    "Größenordnung, Straße, Ärger und Übermut",
]


def post(server, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def write_cross_encoder(path: Path, **config) -> Path:
    """A 2-layer, hidden-64 random BertForSequenceClassification with one label, and the tiny BERT tokenizer."""
    import transformers

    torch.manual_seed(0)
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, type_vocab_size=2, initializer_range=0.15, pad_token_id=0, num_labels=1)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**cfg)).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a missing one shows; the logits spread
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif name == "classifier.weight":
                p.mul_(10)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(tiny_bert_tokenizer_json())
    if config:
        doc = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(doc | config))
    return path


def logits(hf_dir: Path, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """transformers' logits of each pair, encoded by the tokenizer's own pair template (its type ids too). -> [N]"""
    import transformers
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str((hf_dir / "tokenizer.json").read_text())
    tok.no_padding()
    tok.no_truncation()
    model = transformers.BertForSequenceClassification.from_pretrained(hf_dir).eval()
    out = []
    with torch.no_grad():
        for a, b in pairs:
            enc = tok.encode(a, b)
            out.append(model(input_ids=torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids])).logits[0, 0])
    return torch.stack(out)


@pytest.fixture(scope="module")
def cross_dir(tmp_path_factory) -> Path:
    return write_cross_encoder(tmp_path_factory.mktemp("cross") / "hf")


@pytest.fixture(scope="module")
def server(tmp_path_factory, cross_dir, tiny_serve_jlm):
    """The tiny cross-encoder (`cross`) and the tiny generator (`tiny`) on one server."""
    models = tmp_path_factory.mktemp("rerank_models")
    convert(cross_dir, models / "cross.jlm", "f32")
    shutil.copyfile(tiny_serve_jlm, models / "tiny.jlm")
    s = InProcessServer("-models", str(models), "-load", "cross.jlm", "-id", "cross", "-load", "tiny.jlm", "-id", "tiny")
    yield s
    s.stop()


# -- the cross-encoder -------------------------------------------------------------------------------------------------


def test_convert_keeps_the_head(cross_dir: Path, tmp_path: Path) -> None:
    jlm = JLMFile(convert(cross_dir, tmp_path / "c.jlm", "f32").path)
    assert jlm.arch == "bert" and (jlm.config["num_labels"], jlm.config["score_activation"]) == (1, "sigmoid")
    assert {n for n in jlm.names if n.startswith("head.")} == {
        "head.pooler.dense.weight", "head.pooler.dense.bias", "head.classifier.weight", "head.classifier.bias"}
    assert jlm.tensor("head.classifier.weight").shape == (1, 64)


def test_rerank_matches_transformers(server, cross_dir: Path) -> None:
    want = torch.sigmoid(logits(cross_dir, [(QUERY, d) for d in DOCS])).tolist()
    assert max(want) - min(want) > 0.2  # scores spread enough that an order is asserted
    r = post(server, "/v1/rerank", {"model": "cross", "query": QUERY, "documents": DOCS})
    assert r["id"].startswith("rerank-") and r["model"] == "cross" and r["jitllm"]["host_blocks"] + r["jitllm"]["device_blocks"] > 0
    results = r["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    assert [x["relevance_score"] for x in results] == sorted((x["relevance_score"] for x in results), reverse=True)
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for x in results:
        assert abs(x["relevance_score"] - want[x["index"]]) <= TOL
        assert x["document"] == {"text": DOCS[x["index"]]}
    # each pair as [CLS] query [SEP] document [SEP]
    words = lambda t: len(t.split())
    assert r["usage"] == {"prompt_tokens": sum(3 + words(QUERY) + words(d) for d in DOCS), "total_tokens": r["usage"]["prompt_tokens"]}


def test_a_cross_encoder_is_no_embedding_model(server) -> None:
    """Its vectors are pair scores: /v1/embeddings (and Connect's Embed) refuse it, naming the routes that take it."""
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "cross", "input": "a text"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "/v1/rerank" in r.json()["error"]["message"], r.text


def test_top_n_and_return_documents(server) -> None:
    full = post(server, "/v1/rerank", {"model": "cross", "query": QUERY, "documents": DOCS})["results"]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = post(server, path, {"model": "cross", "query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False})
        assert r["results"] == [{"index": x["index"], "relevance_score": x["relevance_score"]} for x in full[:2]]
    assert post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "model": "cross", "top_n": 100})["results"] == full
    [one] = post(server, "/v1/rerank", {"model": "cross", "query": QUERY, "documents": DOCS[3]})["results"]  # one string, as vLLM takes
    assert (one["index"], one["document"]) == (0, {"text": DOCS[3]})
    assert one["relevance_score"] == pytest.approx(next(x["relevance_score"] for x in full if x["index"] == 3), abs=1e-6)  # alone: other sums


def test_connect_rerank_is_the_same_path(server) -> None:
    """Connect's InferenceService.Rerank answers as /v1/rerank does; its bad input is invalid_argument naming the field."""
    from connectrpc.code import Code
    from connectrpc.errors import ConnectError

    from jitllmd.gen.jitllm.v1 import inference_pb2 as inf
    from jitllmd.gen.jitllm.v1.inference_connect import InferenceServiceClientSync

    http = post(server, "/v1/rerank", {"model": "cross", "query": QUERY, "documents": DOCS, "top_n": 3})
    with InferenceServiceClientSync(server.url, send_compression=None) as client:
        r = client.rerank(inf.RerankRequest(model="cross", query=QUERY, documents=DOCS, top_n=3))
        assert [(x.index, x.relevance_score) for x in r.results] == [(x["index"], x["relevance_score"]) for x in http["results"]]
        assert r.prompt_tokens == http["usage"]["prompt_tokens"]
        assert len(client.rerank(inf.RerankRequest(model="cross", query=QUERY, documents=DOCS)).results) == len(DOCS)
        for request, words in ((inf.RerankRequest(model="cross", query=QUERY), "documents"),
                               (inf.RerankRequest(model="tiny", query=QUERY, documents=DOCS), "generates text"),
                               (inf.RerankRequest(model="cross", query=QUERY, documents=["w1 " * 5000]), "documents[0]")):
            with pytest.raises(ConnectError) as e:
                client.rerank(request)
            assert e.value.code == Code.INVALID_ARGUMENT and words in e.value.message, e.value.message


def test_score_pairs_match_transformers(server, cross_dir: Path) -> None:
    lefts = ["w1 w2", "w40 w41 w42", "", "w9 w8 w7 w6 w5"]
    want_one = torch.sigmoid(logits(cross_dir, [(QUERY, d) for d in DOCS])).tolist()
    want_each = torch.sigmoid(logits(cross_dir, list(zip(lefts, DOCS[:4], strict=True)))).tolist()
    for path in ("/v1/score", "/score"):
        r = post(server, path, {"model": "cross", "text_1": QUERY, "text_2": DOCS})
        assert r["id"].startswith("score-") and r["object"] == "list" and isinstance(r["created"], int) and r["model"] == "cross"
        assert [d["index"] for d in r["data"]] == list(range(len(DOCS))) and {d["object"] for d in r["data"]} == {"score"}
        assert np.abs(np.array([d["score"] for d in r["data"]]) - want_one).max() <= TOL
        assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] > 0
    each = post(server, "/v1/score", {"model": "cross", "text_1": lefts, "text_2": DOCS[:4]})["data"]
    assert np.abs(np.array([d["score"] for d in each]) - want_each).max() <= TOL
    listed_one = post(server, "/v1/score", {"model": "cross", "text_1": [QUERY], "text_2": DOCS})["data"]
    single = post(server, "/v1/score", {"model": "cross", "text_1": QUERY, "text_2": DOCS[1]})["data"]
    assert len(single) == 1 and single[0]["score"] == pytest.approx(listed_one[1]["score"], abs=1e-6)


def test_identity_activation_gives_the_logit(tmp_path: Path) -> None:
    """A sentence-transformers CrossEncoder that names Identity scores with the raw logit (vLLM's and ST's reading)."""
    d = write_cross_encoder(tmp_path / "hf", sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    loaded = load_model(convert(d, tmp_path / "c.jlm", "f32").path)
    assert loaded.model.cfg.score_activation == "identity"
    tok = loaded.tokenizer
    batch = [tok.encode(QUERY) + tok.encode(doc)[1:] for doc in DOCS]
    want = logits(d, [(QUERY, doc) for doc in DOCS])
    assert (loaded.model.embed(batch)[:, 0] - want).abs().max().item() <= TOL


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"id2label": {"0": "a", "1": "b"}, "label2id": {"a": 0, "b": 1}}, "2 labels"),
        ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}}, "activation_fn"),
    ],
)
def test_unsupported_cross_encoders_are_refused(cross_dir: Path, tmp_path: Path, change: dict, words: str) -> None:
    d = tmp_path / "hf"
    shutil.copytree(cross_dir, d)
    doc = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(doc | change))
    with pytest.raises(ConvertError, match=words):
        convert(d, tmp_path / "c.jlm", "f32")


def test_a_missing_head_tensor_is_named(cross_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    d = tmp_path / "hf"
    shutil.copytree(cross_dir, d)
    state = load_file(d / "model.safetensors")
    del state["classifier.bias"]
    save_file(state, d / "model.safetensors")
    with pytest.raises(ConvertError, match=r"tensor head\.classifier\.bias is missing"):
        convert(d, tmp_path / "c.jlm", "f32")


# -- bad requests ------------------------------------------------------------------------------------------------------

LONG = " ".join(["w10"] * 70)  # 72 tokens: the tiny models take 64


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"model": "cross", "query": QUERY}, "documents"),
        ("/v1/rerank", {"model": "cross", "query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"model": "cross", "query": QUERY, "documents": {"text": "w1"}}, "documents"),
        ("/v1/rerank", {"model": "cross", "query": QUERY, "documents": ["w1", 3]}, "documents[1]"),
        ("/v1/rerank", {"model": "cross", "query": QUERY, "documents": ["w1", {"text": "w2"}]}, "documents[1]"),
        ("/v1/rerank", {"model": "cross", "query": QUERY, "documents": ["w1"] * (MOST_TEXTS + 1)}, "documents"),
        ("/v1/rerank", {"model": "cross", "documents": DOCS}, "query"),
        ("/v1/rerank", {"model": "cross", "query": ["w1"], "documents": DOCS}, "query"),
        ("/v1/rerank", {"model": "cross", "query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
        ("/v1/rerank", {"model": "cross", "query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
        ("/v1/rerank", {"model": "cross", "query": QUERY, "documents": DOCS, "top_n": "2"}, "top_n"),
        ("/v1/rerank", {"model": "cross", "query": QUERY, "documents": DOCS, "top_n": 1.5}, "top_n"),
        ("/v1/rerank", {"model": "cross", "query": QUERY, "documents": DOCS, "return_documents": "yes"}, "return_documents"),
        ("/v1/rerank", {"model": 7, "query": QUERY, "documents": DOCS}, "model"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS}, "model"),  # two models loaded
        ("/v1/rerank", {"model": "tiny", "query": QUERY, "documents": DOCS}, "model"),
        ("/v1/rerank", {"model": "cross", "query": QUERY, "documents": ["w1", LONG]}, "documents[1]"),
        ("/v1/rerank", {"model": "cross", "query": LONG, "documents": ["w1"]}, "query"),
        ("/v1/rerank", {"model": "cross", "query": " ".join(["w1"] * 30), "documents": ["w2", " ".join(["w3"] * 40)]}, "documents[1]"),
        ("/v1/rerank", {"model": "cross", "query": "w1 [SEP] w2", "documents": DOCS}, "query"),
        ("/v1/score", {"model": "cross", "text_1": QUERY}, "text_2"),
        ("/v1/score", {"model": "cross", "text_2": DOCS}, "text_1"),
        ("/v1/score", {"model": "cross", "text_1": [], "text_2": DOCS}, "text_1"),
        ("/v1/score", {"model": "cross", "text_1": QUERY, "text_2": [None]}, "text_2[0]"),
        ("/v1/score", {"model": "cross", "text_1": ["w1", "w2"], "text_2": DOCS}, "text_1"),
        ("/v1/score", {"model": "cross", "text_1": ["w1", "w2"], "text_2": "w3"}, "text_1"),
        ("/v1/score", {"model": "cross", "text_1": ["w1", "w2 [SEP]"], "text_2": ["w3", "w4"]}, "text_1[1]"),
        ("/v1/score", {"model": "cross", "text_1": "w1", "text_2": ["w2", LONG]}, "text_2[1]"),
        ("/v1/score", {"model": "tiny", "text_1": "w1", "text_2": "w2"}, "model"),
    ],
)
def test_bad_fields_are_a_400_naming_them(server, path: str, body: dict, param: str) -> None:
    error = post(server, path, body, 400)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"].startswith(param.split("[")[0]), error


def test_unknown_model_is_a_404(server) -> None:
    for path, body in (("/v1/rerank", {"query": "a", "documents": ["b"]}), ("/v1/score", {"text_1": "a", "text_2": "b"})):
        error = post(server, path, {"model": "nope", **body}, 404)["error"]
        assert error["param"] == "model" and error["code"] == "model_not_found", error


def test_too_long_names_both_numbers(server) -> None:
    error = post(server, "/v1/rerank", {"model": "cross", "query": QUERY, "documents": [LONG]}, 400)["error"]
    assert error["code"] == "context_length_exceeded" and "72" in error["message"] and "64" in error["message"], error


# -- all-MiniLM-L6-v2: the cosine of its vectors, as vLLM's score API gives it for an embedding model ------------------


@pytest.fixture(scope="module")
def minilm_server(tmp_path_factory, minilm_jlm):
    models = tmp_path_factory.mktemp("rerank_minilm")
    shutil.copyfile(minilm_jlm, models / "minilm.jlm")
    s = InProcessServer("-models", str(models), "-load", "minilm.jlm", "-id", "minilm")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def st_model(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


def st_cosines(st_model, left: list[str], right: list[str]) -> np.ndarray:
    """sentence-transformers' cosine of left[0] (or left[i]) and right[i]."""
    from sentence_transformers import util

    a, b = st_model.encode(left, convert_to_tensor=True), st_model.encode(right, convert_to_tensor=True)
    sims = util.cos_sim(a, b)  # [len(left), len(right)]
    return (sims[0] if len(left) == 1 else sims.diagonal()).numpy()


@pytest.mark.slow
def test_minilm_rerank_matches_sentence_transformers(minilm_server, st_model) -> None:
    query, docs = SENTENCES[0], SENTENCES[1:]
    want = st_cosines(st_model, [query], docs)
    r = post(minilm_server, "/v1/rerank", {"model": "minilm", "query": query, "documents": docs})
    results = r["results"]
    assert [x["index"] for x in results] == list(np.argsort(-want, kind="stable"))
    assert np.abs(np.array([x["relevance_score"] for x in results]) - want[[x["index"] for x in results]]).max() <= TOL
    assert results[0]["document"] == {"text": "Paris is the capital and largest city of France."}
    top = post(minilm_server, "/v2/rerank", {"model": "minilm", "query": query, "documents": docs, "top_n": 3, "return_documents": False})
    assert top["results"] == [{"index": x["index"], "relevance_score": x["relevance_score"]} for x in results[:3]]
    # the query is embedded once, each document once
    tokens = int(st_model.tokenize(SENTENCES)["attention_mask"].sum())
    assert r["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


@pytest.mark.slow
def test_minilm_score_matches_sentence_transformers(minilm_server, st_model) -> None:
    one = post(minilm_server, "/v1/score", {"model": "minilm", "text_1": SENTENCES[0], "text_2": SENTENCES[1:]})["data"]
    assert np.abs(np.array([d["score"] for d in one]) - st_cosines(st_model, SENTENCES[:1], SENTENCES[1:])).max() <= TOL
    left, right = SENTENCES[:4], SENTENCES[4:]
    each = post(minilm_server, "/score", {"model": "minilm", "text_1": left, "text_2": right})["data"]
    assert np.abs(np.array([d["score"] for d in each]) - st_cosines(st_model, left, right)).max() <= TOL
    same = post(minilm_server, "/v1/score", {"model": "minilm", "text_1": "w1 w2", "text_2": "w1 w2"})["data"]
    assert abs(same[0]["score"] - 1.0) <= 1e-5


@pytest.mark.slow
def test_minilm_runs_more_texts_than_one_job_takes(minilm_server, st_model) -> None:
    """text_1 and text_2 of MOST_TEXTS each are 2 x MOST_TEXTS texts to embed: two engine jobs, one answer."""
    words = ["river", "bank", "money", "tree", "sky", "stone", "music", "bread"]
    left = [f"{words[i % 8]} {words[(i // 8) % 8]}" for i in range(MOST_TEXTS)]
    right = [f"{words[(i // 8) % 8]} {words[i % 8]}" for i in range(MOST_TEXTS)]
    r = post(minilm_server, "/v1/score", {"model": "minilm", "text_1": left, "text_2": right})
    scores = np.array([d["score"] for d in r["data"]])
    assert len(scores) == MOST_TEXTS and r["usage"]["prompt_tokens"] == 2 * MOST_TEXTS * 4
    sample = list(range(0, MOST_TEXTS, 97))
    assert np.abs(scores[sample] - st_cosines(st_model, [left[i] for i in sample], [right[i] for i in sample])).max() <= TOL


def test_run_rerank_here_and_on_a_server(minilm_server, minilm_jlm) -> None:
    """`jitllmd run -rerank DOC ... QUERY`: /v1/rerank's order and scores, in this process and on a server (Connect)."""
    from typer.testing import CliRunner

    from jitllmd.cli import app

    docs = ["The cat sat on the mat.", "Stock markets fell sharply today.", "A kitten was sleeping on a rug."]
    http = post(minilm_server, "/v1/rerank", {"model": "minilm", "query": "a cat on a carpet", "documents": docs})
    want = [(x["index"], x["relevance_score"]) for x in http["results"]]
    for where in (["-model", str(minilm_jlm)], ["-addr", minilm_server.url.removeprefix("http://"), "-model", "minilm"]):
        r = CliRunner().invoke(app, ["run", *where, *[a for d in docs for a in ("-rerank", d)], "-json", "a cat on a carpet"])
        assert r.exit_code == 0, r.output
        got = json.loads(r.stdout)
        assert [x["index"] for x in got["results"]] == [i for i, _ in want]
        assert [x["relevance_score"] for x in got["results"]] == pytest.approx([s for _, s in want], abs=1e-6)
        assert got["prompt_tokens"] == http["usage"]["prompt_tokens"] and got["results"][0]["document"] == docs[want[0][0]]
    r = CliRunner().invoke(app, ["run", "-addr", minilm_server.url.removeprefix("http://"), "-model", "minilm", "-rerank", "x", "-chat", "q"])
    assert r.exit_code == 2 and "drop -chat" in r.output

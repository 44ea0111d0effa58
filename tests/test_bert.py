"""BERT encoders: parity of pooled embeddings with transformers (tiny random) and sentence-transformers (all-MiniLM-L6-v2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from jitllmd.engine.convert import ConvertError, convert
from jitllmd.engine.jlm import JLMFile
from jitllmd.engine.loader import load_model
from jitllmd.engine.models import bert, build_model, family_for
from jitllmd.engine.models.bert import BertConfig, BertModel

TOL = 1e-4
VOCAB = 96
WORDS = [f"w{i}" for i in range(VOCAB - 5)]  # after [PAD] [UNK] [CLS] [SEP] [MASK]

# name -> (1_Pooling flag or None for no sentence-transformers files, Normalize module, config overrides)
CASES = {
    "mean-normalize": ("pooling_mode_mean_tokens", True, {}),
    "cls-gelu-tanh": ("pooling_mode_cls_token", False, {"hidden_act": "gelu_new"}),
    "last-normalize": ("pooling_mode_lasttoken", True, {}),
    "plain-bertmodel": (None, None, {}),
}
# sequences of different lengths, [CLS]=2 first and [SEP]=3 last, as the tokenizer wraps them
BATCH = [[2, 17, 33, 64, 80, 11, 3], [2, 40, 3], [2, 5, 6, 7, 8, 9, 10, 12, 13, 14, 90, 3], [2, 95, 3]]


def tiny_bert_tokenizer_json() -> str:
    """A whitespace word-level tokenizer that wraps texts as [CLS] ... [SEP], saved padding to 16 and truncating
    at 8 as sentence-transformers checkpoints do (the converter must turn both off)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.enable_padding(length=16, pad_id=0, pad_token="[PAD]")
    tok.enable_truncation(8)
    return tok.to_str()


def write_tiny_bert(path: Path, pooling: str | None, normalize: bool | None, **overrides) -> tuple[Path, object]:
    """A 2-layer, hidden-64 random BertModel as a (sentence-transformers) directory; returns (dir, the HF model)."""
    import transformers

    torch.manual_seed(0)
    cfg = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, type_vocab_size=2, initializer_range=0.15, pad_token_id=0,
    )
    cfg.update(overrides)
    model = transformers.BertModel(transformers.BertConfig(**cfg)).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a missing one shows
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(tiny_bert_tokenizer_json())
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        flags = {f: f == pooling for f in ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_lasttoken")}
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48, "do_lower_case": False}))
    return path, model


def reference(hf_model, batch: list[list[int]], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' last_hidden_state over the right-padded batch, pooled as sentence-transformers pools it."""
    S = max(map(len, batch))
    ids = torch.tensor([row + [0] * (S - len(row)) for row in batch])
    mask = torch.tensor([[1] * len(row) + [0] * (S - len(row)) for row in batch])
    with torch.no_grad():
        h = hf_model(input_ids=ids, attention_mask=mask).last_hidden_state.float()  # [B, S, hidden]
    if pooling == "mean":
        out = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    elif pooling == "cls":
        out = h[:, 0]
    else:
        out = h[torch.arange(len(batch)), mask.sum(1) - 1]
    return F.normalize(out, dim=-1) if normalize else out


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory):
    """(the loaded model, the transformers model, pooling, normalize) for each case, converted in f32."""
    flag, normalize, overrides = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    hf_dir, hf_model = write_tiny_bert(d / "hf", flag, normalize, **overrides)
    out = convert(hf_dir, d / "tiny.jlm", "f32")
    pooling = {None: "mean", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
               "pooling_mode_lasttoken": "last"}[flag]
    return load_model(out.path), hf_model, pooling, normalize is not False


def test_batch_matches_transformers(tiny) -> None:
    loaded, hf, pooling, normalize = tiny
    ours = loaded.model.embed(BATCH)
    assert ours.dtype == torch.float32 and ours.shape == (len(BATCH), 64)
    assert (ours - reference(hf, BATCH, pooling, normalize)).abs().max().item() <= TOL


def test_padding_changes_no_row(tiny) -> None:
    loaded, hf, pooling, normalize = tiny
    together = loaded.model.embed(BATCH)
    for i, row in enumerate(BATCH):
        alone = loaded.model.embed([row])[0]
        assert (alone - together[i]).abs().max().item() <= TOL
        assert (alone - reference(hf, [row], pooling, normalize)[0]).abs().max().item() <= TOL


def test_normalised_when_the_model_says_so(tiny) -> None:
    loaded, _, _, normalize = tiny
    norms = loaded.model.embed(BATCH).norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5) == normalize


def test_bad_batches_are_refused_naming_the_input(tiny) -> None:
    loaded = tiny[0]
    limit = loaded.model.cfg.max_seq_length
    for batch, words in [([], "empty"), ([[2, 3], []], "input 1"), ([[2] * (limit + 1)], f"at most {limit}"),
                         ([[2, VOCAB, 3]], "vocabulary")]:
        with pytest.raises(ValueError, match=words):
            loaded.model.embed(batch)


# -- conversion --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory) -> Path:
    d, _ = write_tiny_bert(tmp_path_factory.mktemp("st") / "hf", "pooling_mode_cls_token", True)
    return d


def test_convert_keeps_pooling_in_the_config(st_dir: Path, tmp_path: Path) -> None:
    jlm = JLMFile(convert(st_dir, tmp_path / "t.jlm", "f32").path)
    assert jlm.arch == "bert" and family_for(jlm.arch).embeds
    c = jlm.config
    assert (c["pooling"], c["normalize"], c["max_seq_length"], c["max_position_embeddings"]) == ("cls", True, 48, 64)
    assert BertConfig.from_dict(c).max_seq_length == 48
    assert not any(n.startswith("head.") for n in jlm.names)
    assert "embed.word_embeddings.weight" in jlm.names and "blocks.1.output.LayerNorm.bias" in jlm.names
    assert jlm.meta["chat_template"] is None
    special = jlm.meta["special_tokens"]
    assert (special["cls_token_id"], special["sep_token_id"], special["pad_token_id"], special["eos_token_ids"]) == (2, 3, 0, [])


def test_plain_bertmodel_pools_the_mean_and_normalises(tmp_path: Path) -> None:
    d, _ = write_tiny_bert(tmp_path / "hf", None, None)
    c = JLMFile(convert(d, tmp_path / "t.jlm", "f32").path).config
    assert (c["pooling"], c["normalize"], c["max_seq_length"]) == ("mean", True, 64)


def test_stored_tokenizer_neither_pads_nor_truncates(st_dir: Path, tmp_path: Path) -> None:
    path = convert(st_dir, tmp_path / "t.jlm", "f32").path
    doc = json.loads(JLMFile(path).meta["tokenizer"])  # as stored (a loaded model's meta lets it go: its Tokenizer holds it)
    loaded = load_model(path)
    assert doc["padding"] is None and doc["truncation"] is None
    words = " ".join(WORDS[:20])
    assert loaded.tokenizer.encode(words) == [2, *range(5, 25), 3]
    assert loaded.tokenizer.encode("w0", add_special_tokens=False) == [5]


def test_prefixed_names_and_extra_heads(tmp_path: Path) -> None:
    """A BertForMaskedLM-style checkpoint: `bert.` prefixes, an MLM head and a pooler, all dropped but the encoder."""
    from safetensors.torch import load_file, save_file

    d, hf = write_tiny_bert(tmp_path / "hf", None, None)
    plain = JLMFile(convert(d, tmp_path / "plain.jlm", "f32").path)
    state = load_file(d / "model.safetensors")
    state = {f"bert.{k}": v for k, v in state.items()} | {"cls.predictions.bias": torch.zeros(VOCAB)}
    save_file(state, d / "model.safetensors")
    prefixed = JLMFile(convert(d, tmp_path / "prefixed.jlm", "f32").path)
    assert prefixed.names == plain.names
    assert not any("pooler" in n or "cls." in n or "position_ids" in n for n in prefixed.names)


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    """The family lists every tensor the encoder reads (bert.required_tensors); convert names the first one absent."""
    from safetensors.torch import load_file, save_file

    d, _ = write_tiny_bert(tmp_path / "hf", None, None)
    state = load_file(d / "model.safetensors")
    del state["encoder.layer.1.attention.output.LayerNorm.bias"]
    save_file(state, d / "model.safetensors")
    with pytest.raises(ConvertError, match=r"tensor blocks\.1\.attention\.output\.LayerNorm\.bias is missing \(1 missing in all\)"):
        convert(d, tmp_path / "t.jlm", "f32")


@pytest.mark.parametrize("native", [False, True], ids=["upcast", "native-bf16"])
def test_bf16_conversion_still_matches(st_dir: Path, tmp_path: Path, monkeypatch, native: bool) -> None:
    """bf16 weights computed in f32 where bf16 GEMM is emulated, in bf16 where the device has it."""
    _, hf = write_tiny_bert(tmp_path / "hf", "pooling_mode_cls_token", True)
    monkeypatch.setattr(bert, "bf16_matmul_native", lambda device_type="cpu": native)
    loaded = load_model(convert(st_dir, tmp_path / "t.jlm", "bf16").path)
    assert loaded.jlm.tensor("blocks.0.intermediate.dense.weight").dtype == torch.bfloat16
    assert loaded.model.act == (torch.bfloat16 if native else torch.float32)
    ours = loaded.model.embed(BATCH)
    assert ours.dtype == torch.float32
    assert (ours - reference(hf, BATCH, "cls", True)).abs().max().item() <= 2e-2


def test_build_model_builds_an_encoder(st_dir: Path, tmp_path: Path) -> None:
    jlm = JLMFile(convert(st_dir, tmp_path / "t.jlm", "f32").path)
    model = build_model(jlm, torch.float32, torch.device("cpu"))
    assert isinstance(model, BertModel) and model.weight_nbytes() > 0


@pytest.mark.parametrize(
    ("where", "change", "words"),
    [
        ("1_Pooling/config.json", {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
        ("config.json", {"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ("config.json", {"hidden_act": "relu"}, "hidden_act"),
    ],
)
def test_unsupported_encoders_are_refused(st_dir: Path, tmp_path: Path, where: str, change: dict, words: str) -> None:
    import shutil

    d = tmp_path / "hf"
    shutil.copytree(st_dir, d)
    doc = json.loads((d / where).read_text())
    (d / where).write_text(json.dumps(doc | change))
    with pytest.raises(ConvertError, match=words):
        convert(d, tmp_path / "t.jlm", "f32")
    assert not (tmp_path / "t.jlm").exists()


def test_dense_module_is_refused(st_dir: Path, tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "hf"
    shutil.copytree(st_dir, d)
    modules = json.loads((d / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (d / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConvertError, match="Dense"):
        convert(d, tmp_path / "t.jlm", "f32")


# -- all-MiniLM-L6-v2 against sentence-transformers ---------------------------------------------------------------------

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "a",
    "What is the capital of France?",
    "Embeddings turn sentences into vectors that can be compared with a cosine.",
    " ".join(
        "The history of the printing press begins in the fifteenth century, when movable type changed how books "
        "were made, and scribes who had copied every page by hand found their craft replaced within a generation."
        .split()
        * 5
    ),  # ~200 tokens
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Größenordnung, Straße, Ärger und Übermut",
    "我爱自然语言处理。今天天气很好。",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "Привет, как дела?",
    "I love pizza 🍕🍕 and rockets 🚀!",
    "?!... ---- ;;; (((",
    "...",
    "buffalo buffalo buffalo buffalo buffalo buffalo buffalo buffalo",
    "THE SAME WORDS IN CAPITALS",
    "C++ vs. Rust: 3.14159 > 2.71828, e-mail: someone@example.com",
    "café naïve résumé coöperate",
    "  leading and trailing spaces   ",
    "newlines\nand\ttabs\tinside",
]


@pytest.fixture(scope="session")
def minilm(minilm_jlm: Path):
    """all-MiniLM-L6-v2 (conftest converts it in f32), loaded."""
    return load_model(minilm_jlm)


@pytest.mark.slow
def test_minilm_matches_sentence_transformers(minilm, minilm_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_dir), device="cpu")
    ids = [minilm.tokenizer.encode(s) for s in SENTENCES]
    assert max(map(len, ids)) <= 256 and max(map(len, ids)) >= 150
    features = st.tokenize(SENTENCES)
    assert ids == [row[mask.bool()].tolist() for row, mask in zip(features["input_ids"], features["attention_mask"], strict=True)]
    theirs = torch.from_numpy(st.encode(SENTENCES, batch_size=len(SENTENCES), convert_to_numpy=True)).float()
    ours = minilm.model.embed(ids)
    cos = F.cosine_similarity(ours, theirs, dim=-1)
    assert cos.min().item() >= 0.99999
    assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_minilm_config(minilm) -> None:
    c = minilm.model.cfg
    assert (c.pooling, c.normalize, c.max_seq_length, c.max_position_embeddings, c.num_layers) == ("mean", True, 256, 512, 6)
    assert minilm.tokenizer.encode("hello world") == [101, 7592, 2088, 102]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_heads": 5}, "hidden_size"),
        ({"pooling": "max"}, "pooling"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"max_seq_length": 65}, "max_seq_length"),
        ({"pad_token_id": VOCAB}, "pad_token_id"),
        ({"num_layers": 0}, "num_layers"),
        ({"layer_norm_eps": 0.0}, "layer_norm_eps"),
    ],
)
def test_config_errors_name_the_field(change: dict, field: str) -> None:
    base = {"vocab_size": VOCAB, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 96,
            "max_position_embeddings": 64, "unknown_key": 1}
    assert BertConfig.from_dict(base).max_seq_length == 64
    with pytest.raises(ValueError, match=f"config.{field}"):
        BertConfig.from_dict(base | change)

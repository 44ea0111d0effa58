"""/tokenize, /detokenize and /tokenizer_info on real servers, in llama-server's shape (content, add_special,
with_pieces) and vLLM's (prompt or messages, add_special_tokens, return_token_strs), as lm-eval's remote tokenizer
reads them, and the same path behind ModelService's Tokenize and Detokenize."""

from __future__ import annotations

import json
import shutil

import anthropic
import httpx
import jinja2
import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError

from jitllmd.gen.jitllm.v1 import model_pb2 as mdl
from jitllmd.gen.jitllm.v1.model_connect import ModelServiceClientSync
from jitllmd.serve import tokenize

from .conftest import write_tiny_llama
from .serving import InProcessServer, openai_sdk

TEXTS = ["Hello world", "The capital of France is Paris.\n\nNext line, tabs\tand  spaces.", "日本語 é ü 🚀✨ naïve", ""]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three primes."},
     {"role": "assistant", "content": "2, 3, 5."}, {"role": "user", "content": "And the next one?"}],
    [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
]
# The tiny template, with what chat_template_kwargs may set: `suffix`, and eos_token (the template variable) in place of "</s>".
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}{{ suffix | default('') }}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def post(server, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def refused(server, path: str, body: dict, param: str, status: int = 400) -> dict:
    """An error in OpenAI's shape naming `param`."""
    error = post(server, path, body, status)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param.split("[")[0] in error["message"], error
    return error


def as_bytes(pieces: list[dict]) -> bytes:
    return b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)


@pytest.fixture(scope="module")
def several(tmp_path_factory, serve, tiny_serve_jlm):
    """Two tiny models on one server: `tiny` (no BOS added) and `bos` (add_bos_token, a template that writes none)."""
    from jitllmd.engine.convert import convert

    root = tmp_path_factory.mktemp("tokenize")
    hf_dir, _ = write_tiny_llama(root / "hf", chat_template=TEMPLATE, max_position_embeddings=512)
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    models = root / "models"
    models.mkdir()
    convert(hf_dir, models / "bos.jlm", "f32")
    shutil.copyfile(tiny_serve_jlm, models / "tiny.jlm")
    return serve("-models", str(models), "-load", "bos.jlm", "-id", "bos", "-load", "tiny.jlm", "-id", "tiny", "-max-seq", "512")


# -- llama-server's shape -------------------------------------------------------------------------------------------------


def test_llama_round_trip_and_pieces(smol_server):
    for text in TEXTS:
        ids = post(smol_server, "/tokenize", {"content": text})["tokens"]  # the one model: no `model` needed
        assert all(isinstance(i, int) for i in ids) and (len(ids) > 0) == bool(text)
        assert post(smol_server, "/detokenize", {"tokens": ids}) == {"content": text, "prompt": text}
        pieces = post(smol_server, "/tokenize", {"model": "smol", "content": text, "with_pieces": True})["tokens"]
        assert [p["id"] for p in pieces] == ids
        assert as_bytes(pieces) == text.encode()  # byte-level: each piece's bytes, in order, are the text's
    pieces = post(smol_server, "/tokenize", {"content": "🚀"})["tokens"]
    split = post(smol_server, "/tokenize", {"content": "🚀", "with_pieces": True})["tokens"]
    assert len(pieces) > 1 and any(isinstance(p["piece"], list) for p in split)  # a character over tokens: bytes, as llama-server gives them
    assert all(isinstance(b, int) and 0 <= b < 256 for p in split if isinstance(p["piece"], list) for b in p["piece"])
    words = post(smol_server, "/tokenize", {"content": "Hello world", "with_pieces": True})["tokens"]
    assert [p["piece"] for p in words] == ["Hello", " world"]
    special = post(smol_server, "/tokenize", {"content": "<|im_start|>user", "with_pieces": True})["tokens"]
    assert special[0]["piece"] == "<|im_start|>"  # parse_special (llama-server's default): the special token's one id


def test_add_special_differs_by_the_bos(several):
    info = httpx.get(several.url + "/tokenizer_info", params={"model": "bos"}, timeout=60).json()
    assert info["bos_token"] == "<s>" and info["add_bos_token"] is True
    bos = post(several, "/tokenize", {"model": "bos", "prompt": "<s>", "add_special_tokens": False})["tokens"]
    assert len(bos) == 1
    bare = post(several, "/tokenize", {"model": "bos", "content": "hello there"})["tokens"]  # add_special defaults to false
    special = post(several, "/tokenize", {"model": "bos", "content": "hello there", "add_special": True})["tokens"]
    assert special == bos + bare
    assert post(several, "/tokenize", {"model": "bos", "prompt": "hello there"})["tokens"] == special  # vLLM's default: true
    assert post(several, "/tokenize", {"model": "bos", "prompt": "hello there", "add_special_tokens": False})["tokens"] == bare
    assert post(several, "/detokenize", {"model": "bos", "tokens": special})["content"] == "<s>hello there"  # special tokens kept, as both servers do
    assert post(several, "/detokenize", {"model": "bos", "tokens": bare})["prompt"] == "hello there"
    # a model that adds no BOS: the same either way
    tiny = [post(several, "/tokenize", {"model": "tiny", "content": "hello", "add_special": add})["tokens"] for add in (False, True)]
    assert tiny[0] == tiny[1]


def test_pieces_of_a_sentencepiece_vocabulary():
    """SentencePiece's decoder strips the text's first space: a piece reads as it does mid-text; byte-fallback tokens
    that each hold part of a character are bytes."""
    from tokenizers import Tokenizer, decoders, models

    from jitllmd.engine.tokenizer import Tokenizer as JTokenizer

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "<0xE6>": 3, "<0x97>": 4, "<0xA5>": 5, "!": 6}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok = JTokenizer(backend.to_str(), bos_token_id=None, eos_token_ids=[], add_bos_token=False)
    assert tok.decode([1, 2, 6]) == "Hello world!" and tok.decode([3, 4, 5]) == "日"
    assert [tokenize.piece(tok, i) for i in (1, 2, 6)] == [" Hello", " world", "!"]
    assert [tokenize.piece(tok, i) for i in (3, 4, 5)] == [[0xE6], [0x97], [0xA5]]


# -- vLLM's shape ---------------------------------------------------------------------------------------------------------


def test_vllm_prompt_round_trip_and_token_strs(smol_server):
    for text in TEXTS:
        r = post(smol_server, "/tokenize", {"model": "smol", "prompt": text})
        assert set(r) == {"count", "max_model_len", "tokens", "token_strs"}
        assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024 and r["token_strs"] is None
        assert post(smol_server, "/detokenize", {"model": "smol", "tokens": r["tokens"]})["prompt"] == text
    r = post(smol_server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert r["token_strs"] == ["Hello", "Ġworld"]  # the vocabulary's strings, as vLLM's convert_ids_to_tokens


@pytest.mark.parametrize("chat", CHATS, ids=["one-turn", "multi-turn", "developer-and-parts"])
def test_messages_count_is_what_the_chat_route_feeds(smol_server, chat):
    tokenized = post(smol_server, "/tokenize", {"model": "smol", "messages": chat})
    with openai_sdk(smol_server) as client:
        usage = client.chat.completions.create(model="smol", messages=chat, max_tokens=1).usage
        assert tokenized["count"] == usage.prompt_tokens
        with_tools = post(smol_server, "/tokenize", {"model": "smol", "messages": chat, "tools": [WEATHER]})
        assert with_tools["count"] == client.chat.completions.create(model="smol", messages=chat, tools=[WEATHER], max_tokens=1).usage.prompt_tokens
    bare = post(smol_server, "/tokenize", {"model": "smol", "messages": chat, "add_generation_prompt": False})
    assert bare["tokens"] == tokenized["tokens"][: bare["count"]] and bare["count"] < tokenized["count"]  # less the assistant's header


def test_messages_template_options(smol_server, several):
    chat = [{"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": "Because"}]
    continued = post(smol_server, "/tokenize", {"model": "smol", "messages": chat, "continue_final_message": True, "add_generation_prompt": False})
    with anthropic.Anthropic(base_url=smol_server.url, api_key="unused", max_retries=0) as client:  # Anthropic continues a final assistant turn too
        assert continued["count"] == client.messages.count_tokens(model="smol", messages=chat).input_tokens
    text = post(smol_server, "/detokenize", {"tokens": continued["tokens"]})["prompt"]
    assert text.endswith("<|im_start|>assistant\nBecause")
    # chat_template_kwargs reach the template
    kw = {"model": "bos", "messages": [{"role": "user", "content": "hi"}]}
    plain = post(several, "/tokenize", kw)["tokens"]
    assert post(several, "/tokenize", {**kw, "chat_template_kwargs": {"unused_flag": True}})["tokens"] == plain
    suffix = post(several, "/tokenize", {"model": "bos", "content": "ab!"})["tokens"]
    assert post(several, "/tokenize", {**kw, "chat_template_kwargs": {"suffix": "ab!"}})["tokens"] == plain + suffix
    eos = post(several, "/tokenize", {"model": "bos", "content": "</s>"})["tokens"]
    bang = post(several, "/tokenize", {"model": "bos", "content": "!"})["tokens"]
    assert post(several, "/tokenize", {**kw, "chat_template_kwargs": {"eos_token": "!"}})["tokens"] == [bang[0] if t == eos[0] else t for t in plain]
    # the default add_special_tokens is the chat route's: a BOS where the model wants one; false leaves it out
    with openai_sdk(several) as client:
        assert len(plain) == client.chat.completions.create(model="bos", messages=kw["messages"], max_tokens=1).usage.prompt_tokens
    assert post(several, "/tokenize", {**kw, "add_special_tokens": False})["tokens"] == plain[1:]


# -- /tokenizer_info, as lm-eval's local-completions reads it ---------------------------------------------------------------


def test_tokenizer_info_as_lm_eval_reads_it(smol_server):
    base = smol_server.url  # lm-eval strips /v1/completions from its base_url
    info = httpx.get(base + "/tokenizer_info", timeout=60).json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>" and info["add_bos_token"] is False
    assert info["model_max_length"] == 8192 and info["max_model_len"] == 1024 and info["vocab_size"] == 49152
    assert httpx.get(base + "/tokenizer_info", params={"model": "smol"}, timeout=60).json() == info
    # eos_token_id: the one id of eos_token, through /tokenize without a model, as RemoteTokenizer.encode sends it
    eos = post(smol_server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})["tokens"]
    assert len(eos) == 1
    with ModelServiceClientSync(base, send_compression=None) as models:
        assert list(models.tokenize(mdl.TokenizeRequest(model="smol", text="<|im_end|>")).token_ids) == eos
    # apply_chat_template: lm-eval renders chat_template itself, then tokenizes the text
    chat = CHATS[1]
    rendered = jinja2.Environment().from_string(info["chat_template"]).render(messages=chat, add_generation_prompt=True)
    ids = post(smol_server, "/tokenize", {"prompt": rendered, "add_special_tokens": False})["tokens"]
    assert ids == post(smol_server, "/tokenize", {"messages": chat})["tokens"]
    assert post(smol_server, "/detokenize", {"tokens": ids})["prompt"] == rendered


def test_tokenizer_info_names_the_model_where_several_are_loaded(several):
    error = httpx.get(several.url + "/tokenizer_info", timeout=60).json()["error"]
    assert error["param"] == "model" and "several models" in error["message"]
    r = httpx.get(several.url + "/tokenizer_info", params={"model": "nope"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    tiny = httpx.get(several.url + "/tokenizer_info", params={"model": "tiny"}, timeout=60).json()
    assert tiny["add_bos_token"] is False and tiny["eos_token"] == "</s>" and tiny["vocab_size"] == 96 and "<|assistant|>" in tiny["chat_template"]


# -- the one path behind Connect's Tokenize and Detokenize ------------------------------------------------------------------


def test_connect_and_http_agree(several):
    with ModelServiceClientSync(several.url, send_compression=None) as models:
        for model in ("bos", "tiny"):
            for text in ("hello there", "Mixed CASE, digits 123!", ""):
                for add in (False, True):
                    got = models.tokenize(mdl.TokenizeRequest(model=model, text=text, add_special_tokens=add))
                    http = post(several, "/tokenize", {"model": model, "prompt": text, "add_special_tokens": add, "return_token_strs": True})
                    llama = post(several, "/tokenize", {"model": model, "content": text, "add_special": add})
                    assert list(got.token_ids) == http["tokens"] == llama["tokens"] and list(got.tokens) == http["token_strs"]
                    back = models.detokenize(mdl.DetokenizeRequest(model=model, token_ids=got.token_ids)).text
                    assert back == post(several, "/detokenize", {"model": model, "tokens": http["tokens"]})["content"]
        with pytest.raises(ConnectError) as exc:
            models.detokenize(mdl.DetokenizeRequest(model="tiny", token_ids=[5, 96]))
        assert exc.value.code == Code.INVALID_ARGUMENT and "token_ids[1]" in exc.value.message


def test_a_text_longer_than_the_room(several):
    """Counting and splitting a document longer than a prompt can be (lm-eval's rolling windows): the bound is not the
    room (512 here). Its long answers are written off the event loop, and read back the same."""
    text = "Hello there, the other one. " * 400
    ids = post(several, "/tokenize", {"model": "tiny", "prompt": text})["tokens"]
    assert len(ids) > 4096
    assert post(several, "/tokenize", {"model": "tiny", "content": text})["tokens"] == ids
    pieces = post(several, "/tokenize", {"model": "tiny", "content": text, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == ids and as_bytes(pieces) == text.encode()
    assert post(several, "/detokenize", {"model": "tiny", "tokens": ids})["content"] == text


def test_bounds(several, monkeypatch):
    """Past the bound (the model's room where that is more, here 512): a 400 saying so (RESOURCE_EXHAUSTED over Connect),
    for a text encoded whole and for one counted a piece at a time; within it, texts longer than the room tokenize."""
    monkeypatch.setattr(tokenize, "MOST_TOKENS", 0)  # the server runs in this process: its bound is the room, 512
    assert len(post(several, "/tokenize", {"model": "tiny", "content": "a" * 512})["tokens"]) == 512
    for text in ("a" * 600, "a " * 20000):
        for body, param in (({"content": text}, "content"), ({"prompt": text}, "prompt")):
            error = refused(several, "/tokenize", {"model": "tiny", **body}, param)
            assert error["code"] == "context_length_exceeded" and "512" in error["message"]
    refused(several, "/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "a" * 600}]}, "messages")
    refused(several, "/detokenize", {"model": "tiny", "tokens": [5] * 513}, "tokens")
    with ModelServiceClientSync(several.url, send_compression=None) as models, pytest.raises(ConnectError) as exc:
        models.tokenize(mdl.TokenizeRequest(model="tiny", text="a" * 600))
    assert exc.value.code == Code.RESOURCE_EXHAUSTED


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"model": 5, "content": "x"}, "model"),
        ("/tokenize", {"content": "x"}, "model"),  # several models loaded
        ("/tokenize", {"model": "tiny"}, "prompt"),
        ("/tokenize", {"model": "tiny", "content": 5}, "content"),
        ("/tokenize", {"model": "tiny", "content": ["x"]}, "content"),
        ("/tokenize", {"model": "tiny", "content": "x", "add_special": "yes"}, "add_special"),
        ("/tokenize", {"model": "tiny", "content": "x", "with_pieces": 1}, "with_pieces"),
        ("/tokenize", {"model": "tiny", "content": "x", "parse_special": False}, "parse_special"),
        ("/tokenize", {"model": "tiny", "content": "x", "prompt": "y"}, "prompt"),
        ("/tokenize", {"model": "tiny", "content": "x", "messages": USER}, "messages"),
        ("/tokenize", {"model": "tiny", "prompt": 1}, "prompt"),
        ("/tokenize", {"model": "tiny", "prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
        ("/tokenize", {"model": "tiny", "prompt": "x", "return_token_strs": 1}, "return_token_strs"),
        ("/tokenize", {"model": "tiny", "prompt": "x", "messages": USER}, "messages"),
        ("/tokenize", {"model": "tiny", "messages": "hi"}, "messages"),
        ("/tokenize", {"model": "tiny", "messages": []}, "messages"),
        ("/tokenize", {"model": "tiny", "messages": [{"role": "user"}]}, "messages[0].content"),
        ("/tokenize", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"model": "tiny", "messages": USER, "add_generation_prompt": 1}, "add_generation_prompt"),
        ("/tokenize", {"model": "tiny", "messages": USER, "continue_final_message": "true"}, "continue_final_message"),
        ("/tokenize", {"model": "tiny", "messages": USER, "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"model": "tiny", "messages": [*USER, {"role": "assistant", "content": "x"}], "continue_final_message": True,
                       "add_generation_prompt": True}, "add_generation_prompt"),
        ("/tokenize", {"model": "tiny", "messages": USER, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ("/tokenize", {"model": "tiny", "messages": USER, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ("/tokenize", {"model": "tiny", "messages": USER, "tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ("/tokenize", {"model": "tiny", "messages": USER, "add_special_tokens": None, "return_token_strs": "x"}, "return_token_strs"),
        ("/detokenize", {"model": "tiny"}, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": "1 2"}, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": [1, "a"]}, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": [1, True]}, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": [1, 1.5]}, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"model": "tiny", "tokens": [1, 96]}, "tokens"),  # the vocabulary is 96
        ("/detokenize", {"model": "tiny", "tokens": [[1]]}, "tokens"),
        ("/detokenize", {"tokens": [1]}, "model"),  # several models loaded
    ],
)
def test_bad_input_is_a_400_naming_the_field(several, path, body, param):
    refused(several, path, body, param)


def test_a_model_without_a_template(tmp_path_factory, serve):
    from jitllmd.engine.convert import convert

    root = tmp_path_factory.mktemp("untemplated")
    hf_dir, _ = write_tiny_llama(root / "hf", chat_template=None, max_position_embeddings=256)
    jlm = convert(hf_dir, root / "plain.jlm", "f32").path
    plain = serve("-load", str(jlm), "-id", "plain", "-max-seq", "256")
    refused(plain, "/tokenize", {"messages": USER}, "messages")
    r = post(plain, "/tokenize", {"prompt": "hello"})
    assert r["count"] == len(r["tokens"]) > 0
    assert "chat_template" not in httpx.get(plain.url + "/tokenizer_info", timeout=60).json()


@pytest.mark.parametrize(("path", "body"), [("/tokenize", {"content": "x"}), ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})])
def test_unknown_model_is_a_404(several, path, body):
    error = post(several, path, {"model": "nope", **body}, 404)["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "nope" in error["message"]


def test_no_v1_aliases(several):
    """vLLM and llama-server serve these at the root only: /v1/tokenize is an unknown path, in OpenAI's shape."""
    r = httpx.post(several.url + "/v1/tokenize", json={"model": "tiny", "prompt": "x"}, timeout=60)
    assert r.status_code == 404 and "no such route" in r.json()["error"]["message"]
    assert httpx.get(several.url + "/tokenize", timeout=60).status_code == 405


# -- an embedding model -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm(tmp_path_factory, minilm_jlm):
    s = InProcessServer("-load", str(minilm_jlm), "-id", "minilm")
    yield s
    s.stop()


@pytest.mark.slow
def test_an_embedding_model_tokenizes(minilm, minilm_dir):
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    reference.no_padding()
    text = "Tokenizers split words: unaffable, naïve!"
    info = httpx.get(minilm.url + "/tokenizer_info", timeout=60).json()
    assert info["cls_token"] == "[CLS]" and info["sep_token"] == "[SEP]" and info["pad_token"] == "[PAD]" and info["eos_token"] is None
    assert "chat_template" not in info
    wrapped = post(minilm, "/tokenize", {"prompt": text})
    assert wrapped["tokens"] == reference.encode(text).ids and wrapped["count"] == len(wrapped["tokens"])
    bare = post(minilm, "/tokenize", {"content": text, "with_pieces": True})["tokens"]  # llama-server's default: no [CLS] ... [SEP]
    assert [p["id"] for p in bare] == reference.encode(text, add_special_tokens=False).ids == wrapped["tokens"][1:-1]
    assert all(isinstance(p["piece"], str) for p in bare)
    assert post(minilm, "/detokenize", {"tokens": wrapped["tokens"]})["content"] == reference.decode(wrapped["tokens"], skip_special_tokens=False)
    refused(minilm, "/tokenize", {"messages": USER}, "messages")


def test_run_tokenize_on_a_server_and_here(smol_server, smollm2_jlm):
    """`jitllmd run -tokenize`: the ids /tokenize gives (add_special_tokens as /v1/completions feeds the prompt), and with
    -chat the ids the chat route feeds; on a server (ModelService) and in this process alike."""
    from typer.testing import CliRunner

    from jitllmd.cli import app

    addr = smol_server.url.removeprefix("http://")
    want = post(smol_server, "/tokenize", {"model": "smol", "prompt": TEXTS[1]})["tokens"]
    chat = post(smol_server, "/tokenize", {"model": "smol", "messages": CHATS[0]})["tokens"]
    for where in (["-addr", addr, "-model", "smol"], ["-model", str(smollm2_jlm)]):
        r = CliRunner().invoke(app, ["run", *where, "-tokenize", "-json", TEXTS[1]])
        assert r.exit_code == 0, r.output
        got = json.loads(r.stdout)
        assert got["tokens"] == want and got["count"] == len(want) and len(got["pieces"]) == len(want)
        r = CliRunner().invoke(app, ["run", *where, "-tokenize", "-chat", "-json", CHATS[0][0]["content"]])
        assert r.exit_code == 0 and json.loads(r.stdout)["tokens"] == chat, r.output
    r = CliRunner().invoke(app, ["run", "-addr", addr, "-model", "smol", "-tokenize"])
    assert r.exit_code == 2 and "needs a prompt" in r.output

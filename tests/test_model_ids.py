"""Model ids as users name them (org/name, as Hugging Face and vLLM do) through every route and verb of a real server,
and the rule that keeps ids apart from the file names of -models."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from jitllmd.commands.run import _is_local
from jitllmd.engine.catalog import Catalog, check_id
from jitllmd.engine.config import EngineConfig

from .serving import jitllmd, tiny_models_dir

QWEN = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve, tiny_serve_jlm):
    """tiny.jlm served as QWEN; -models also holds spare.jlm and Qwen/nested.jlm (a file in a folder named like an org)."""
    models = tiny_models_dir(tmp_path_factory.mktemp("ids"), tiny_serve_jlm)
    (models / "Qwen").mkdir()
    shutil.copyfile(tiny_serve_jlm, models / "Qwen" / "nested.jlm")
    return serve("-models", str(models), "-load", "tiny.jlm", "-id", QWEN, "-max-seq", "256")


@pytest.fixture(scope="module")
def addr(server) -> str:
    return server.url.removeprefix("http://")


def as_json(*args: str) -> dict:
    p = jitllmd(*args, "-json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


# -- the rule, no server --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_id", ["qwen3", QWEN, "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", "library/llama3:8b", "m-1a2b", "x.y_z:1-2"])
def test_ids_users_write(model_id):
    check_id(model_id)


@pytest.mark.parametrize(
    "model_id",
    ["/etc/passwd", "../x", "a/../b", "a/./b", "a//b", "a/", "a\\b", "a b", "-x", "", "tiny\n", "x" * 257, "Qwen/.hidden"],
)
def test_ids_that_read_as_paths_are_refused(model_id):
    with pytest.raises(ValueError, match="model id"):
        check_id(model_id)


@pytest.mark.parametrize("model_id", ["tiny.jlm", "Qwen/x.gguf", "X.GGUF"])
def test_ids_that_read_as_files_are_refused(model_id):
    with pytest.raises(ValueError, match="may not end in .jlm or .gguf"):
        check_id(model_id)


def test_run_sends_an_id_that_is_no_path_here_to_the_server(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen" / "here.jlm").parent.mkdir()
    (tmp_path / "Qwen" / "here.jlm").write_bytes(b"")
    assert not _is_local(QWEN) and not _is_local("Qwen/elsewhere") and not _is_local("library/llama3:8b")
    assert _is_local("Qwen/here.jlm") and _is_local("Qwen/missing.gguf") and _is_local("MISSING.JLM")


def test_run_names_the_server_when_a_folder_has_the_id(tmp_path):
    """A folder named like the id (a Hugging Face checkout) is a path here: the error says how to reach the server's model."""
    (tmp_path / QWEN).mkdir(parents=True)
    p = subprocess.run([sys.executable, "-m", "jitllmd", "run", "-model", QWEN, "hi"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 1 and "is a directory" in p.stderr and f"-addr runs a server's model {QWEN}" in p.stderr


def test_a_loaded_name_wins_over_a_file_and_errors_say_which(tmp_path, tiny_serve_jlm):
    models = tmp_path / "models"
    models.mkdir()
    for name in ("tiny.jlm", "spare.jlm", "other.jlm"):
        shutil.copyfile(tiny_serve_jlm, models / name)
    cat = Catalog(models, EngineConfig(max_seq=64), tmp_path / "cache")
    try:
        served = cat.load("tiny.jlm", id="spare")
        assert served.aliases == ("tiny",)
        assert cat.get("spare") is served and cat.get("tiny") is served
        # spare.jlm is not loaded: listed by its file name, as "spare" is the loaded model's
        assert [(e.id, e.loaded) for e in cat.entries()] == [("spare", True), ("other", False), ("spare.jlm", False)]
        with pytest.raises(KeyError, match=r"'spare.jlm' is not loaded: it is spare.jlm of the model directory"):
            cat.get("spare.jlm")
        with pytest.raises(KeyError, match=r"'other' is not loaded: it is other.jlm of the model directory.*loaded: spare \(also tiny\)"):
            cat.get("other")
        with pytest.raises(KeyError, match=r"'tiny.jlm' names a file: send a loaded model's id, or its file name without .jlm"):
            cat.get("tiny.jlm")
        second = cat.load("spare.jlm")  # its file name is taken: it answers to its id alone
        assert second.id.startswith("m-") and second.aliases == ()
        with pytest.raises(ValueError, match=r"'tiny' is already loaded \(model spare answers to it\)"):
            cat.load("other.jlm", id="tiny")
        with pytest.raises(ValueError, match="may not end in .jlm"):
            cat.load("other.jlm", id="other.jlm")
        assert [e.id for e in cat.entries()] == ["spare", second.id, "other"]
    finally:
        cat.stop()


# -- HTTP -----------------------------------------------------------------------------------------------------------------


def test_openai_routes(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(QWEN).id == QWEN
    assert QWEN in [m.id for m in client.models.list()]
    card = httpx.get(f"{server.url}/v1/models/{QWEN}", timeout=30).json()
    assert card["id"] == QWEN and card["jitllm"]["loaded"] is True
    assert httpx.get(server.url + "/v1/models/tiny", timeout=30).json()["jitllm"]["aliases"] == [QWEN]  # its file name
    chat = client.chat.completions.create(model=QWEN, messages=HI, max_tokens=3, temperature=0)
    assert chat.model == QWEN and chat.usage.completion_tokens <= 3
    text = client.completions.create(model=QWEN, prompt="abc", max_tokens=3, temperature=0)
    assert text.model == QWEN
    with pytest.raises(openai.NotFoundError, match=QWEN):  # a near miss names what is loaded
        client.chat.completions.create(model="Qwen/Qwen2.5-Coder-7B-Instruct", messages=HI, max_tokens=3)
    missing = httpx.get(server.url + "/v1/models/Qwen/nope", timeout=30)
    assert missing.status_code == 404 and QWEN in missing.json()["error"]["message"]


def test_anthropic_routes(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        msg = client.messages.create(model=QWEN, max_tokens=3, messages=HI, extra_body={"temperature": 0})
        assert msg.model == QWEN
        assert client.messages.count_tokens(model=QWEN, messages=HI).input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


# -- the Connect verbs ----------------------------------------------------------------------------------------------------


def test_models_lists_and_loads_ids_with_a_slash(addr):
    listed = {m["id"]: m for m in as_json("models", "-addr", addr)["models"]}
    assert listed[QWEN]["loaded"] is True and listed[QWEN]["file"] == "tiny.jlm" and listed["spare"]["loaded"] is False
    model = as_json("models", "-load", "Qwen/nested.jlm", "-id", "org/nested", "-max-seq", "64", "-addr", addr)
    assert model["id"] == "org/nested" and model["file"] == "Qwen/nested.jlm" and model["aliases"] == ["nested"]
    try:
        out = as_json("run", "-addr", addr, "-model", "org/nested", "-n", "2", "-temp", "0", "abc")
        assert out["usage"]["completion_tokens"] <= 2
    finally:
        gone = jitllmd("models", "-unload", "org/nested", "-addr", addr)
    assert gone.returncode == 0 and "unloaded org/nested" in gone.stdout


@pytest.mark.parametrize(("bad", "says"), [("../evil", "model id '../evil'"), ("Qwen/x.gguf", "may not end in .jlm or .gguf")])
def test_models_load_refuses_ids_that_read_as_paths_or_files(addr, bad, says):
    p = jitllmd("models", "-load", "spare.jlm", "-id", bad, "-addr", addr)
    assert p.returncode == 1 and says in p.stderr and "Traceback" not in p.stderr


def test_sessions_place_stats_and_run(addr):
    session = as_json("sessions", "-new", "-model", QWEN, "-addr", addr)
    assert session["model"] == QWEN
    assert jitllmd("sessions", "-close", session["id"], "-addr", addr).returncode == 0
    assert as_json("place", "-model", QWEN, "-addr", addr)["model"] == QWEN
    assert QWEN in [m["model"] for m in as_json("stats", "-addr", addr)["models"]]
    out = as_json("run", "-addr", addr, "-model", QWEN, "-chat", "-n", "3", "-temp", "0", "hello")
    assert out["usage"]["completion_tokens"] <= 3


def test_serve_refuses_a_path_as_id(tiny_serve_jlm):
    p = jitllmd("serve", "-addr", "127.0.0.1:0", "-load", str(tiny_serve_jlm), "-id", "/abs/id")
    assert p.returncode == 1 and "model id '/abs/id'" in p.stderr

"""The README's examples, run as written against servers started the way the README starts them."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.serving import Server

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parent.parent / "README.md"
README_ADDR = "127.0.0.1:8080"


def section(title: str) -> str:
    """The README's text under `## title`, up to the next `## ` heading."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def blocks(text: str, lang: str = "") -> list[str]:
    """The fenced code blocks of `text` whose info string is `lang`."""
    found = re.findall(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)
    return [body for info, body in found if info == lang]


def shell(script: str, addr: str, cwd: Path, *, local: bool = False) -> subprocess.CompletedProcess[str]:
    """Run README shell lines with `jitllmd` as this checkout's CLI; unless `local`, verbs that reach a server get
    `-addr` (the README's server is on the default 127.0.0.1:8080, the test's on a free port), and `stats -watch` ends
    with a Ctrl-C."""
    remote = "__none__" if local else "*"
    prelude = f"""
set -euo pipefail
jitllmd() {{
  case "$1" in
    convert|serve|{"run" if local else "__none__"}) {shlex.quote(sys.executable)} -m jitllmd "$@" ;;
    stats) timeout -s INT 5 {shlex.quote(sys.executable)} -m jitllmd "$@" -addr {addr} || [ $? = 124 ] ;;
    {remote}) {shlex.quote(sys.executable)} -m jitllmd "$@" -addr {addr} ;;
  esac
}}
"""
    script = script.replace(README_ADDR, addr)
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(["bash", "-c", prelude + script], cwd=cwd, capture_output=True, text=True, env=env, timeout=900,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def command_one(smollm2_gguf):
    """README command 1's server: `jitllmd serve`, the embedded default (here on a free loopback port)."""
    s = Server()
    yield s
    s.stop()


def test_serve_section_examples_against_command_one(command_one) -> None:
    addr = command_one.url.removeprefix("http://")
    serve = section("Serve")
    [python] = blocks(serve, "python")
    ns: dict = {}
    exec(compile(python.replace(README_ADDR, addr), "README.md", "exec"), ns)  # the SDK snippet, as written
    assert ns["r"].choices[0].message.content and ns["r"].model == "smol"
    assert ns["msg"].content[0].text and ns["msg"].stop_reason in ("end_turn", "max_tokens")
    [curl] = [b for b in blocks(serve) if b.startswith("curl ")]
    p = shell(curl, addr, Path.cwd())
    assert p.returncode == 0, p.stderr
    assert '"finish_reason":' in p.stdout and p.stdout.rstrip().endswith("data: [DONE]")


def test_model_names_are_listed_and_named_in_the_404(command_one) -> None:
    [card] = httpx.get(command_one.url + "/v1/models").json()["data"]
    assert card["id"] == "smollm2-135m-instruct" and "smol" in card["jitllm"]["aliases"]
    assert httpx.get(command_one.url + "/v1/models/smol").json()["jitllm"]["loaded"] is True
    r = httpx.post(command_one.url + "/v1/chat/completions", json={"model": "smoll", "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "smollm2-135m-instruct" in message and "smol" in message.split("also", 1)[1]


def test_manage_section_runs_as_written(tmp_path: Path, smollm2_gguf) -> None:
    """Its first line converts the models, its second starts the server (here by the test, on a free port, waiting
    for its start line), and every other line runs against it with exit code 0."""
    block = blocks(section("Manage a running server"))[0]
    lines = block.strip().splitlines()
    assert lines[1].startswith("jitllmd serve ") and lines[1].split("#")[0].rstrip().endswith("&")
    p = shell(lines[0], README_ADDR, tmp_path)
    assert p.returncode == 0, p.stderr
    args = shlex.split(lines[1].split("#")[0].rstrip().removesuffix("&"))[2:]
    server = Server(*args, cwd=tmp_path)
    try:
        addr = server.url.removeprefix("http://")
        p = shell("\n".join(lines[2:]), addr, tmp_path)
        assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
        out = p.stdout
        assert "loaded other from other.jlm" in out and "spendable GB" in out  # models -load other.jlm -id other; devices
        assert "model  requests" in out  # stats -watch drew its table before the Ctrl-C
        assert re.search(r"^\s*20\s+blocks\.19\s+host", out, re.M)  # place -move 20:29 -to host
        assert "blocks on devices: " in out and '"devices"' in out  # place -tune; the ListDevices curl
    finally:
        server.signal(signal.SIGINT)
        server.wait()


def test_use_section_runs_as_written(tmp_path: Path, smollm2_gguf) -> None:
    """Every line of "Use" but the Hugging Face directory's, with the GGUF files it names put in the working directory
    (the packaged SmolLM2 under both names); interactive chats read an empty stdin and end as at Ctrl-D."""
    for name in ("SmolLM2-135M-Instruct.Q4_1.gguf", "some.gguf"):
        (tmp_path / name).symlink_to(smollm2_gguf)
    block = blocks(section("Use"))[0]
    lines = [line for line in block.strip().splitlines() if "some-hf-model-dir" not in line]
    p = shell("\n".join(lines), README_ADDR, tmp_path, local=True)
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    assert (tmp_path / "models" / "smollm2.jlm").is_file() and (tmp_path / "models" / "smol-f32.jlm").is_file()
    assert p.stderr.count(" prompt tokens (") >= 3  # the three one-shot runs answered (sampled: the words vary)
    assert json.loads(p.stdout.splitlines()[-1])["finish_reason"] in ("stop", "length")  # run -json: one JSON object

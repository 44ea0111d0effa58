"""The README's examples and those of the docs it links to, run as written against servers started the way they start
them; and the README's tour, links and speed table checked against the docs."""

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

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SERVING = DOCS / "serving.md"
CLI = DOCS / "cli.md"
PERFORMANCE = DOCS / "performance.md"
README_ADDR = "127.0.0.1:8080"


def section(path: Path, title: str, level: int = 2) -> str:
    """The text of `path` under the heading `title` (`## title` at level 2), up to the next heading of that level or
    above."""
    text = path.read_text()
    start = text.index(f"\n{'#' * level} {title}\n")
    after = re.compile(rf"^#{{2,{level}}} ", re.M).search(text, start + 2)
    return text[start : after.start() - 1 if after else len(text)]


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
    serve = section(SERVING, "Serve")
    ns: dict = {}
    for python in blocks(serve, "python"):  # the SDK snippets, as written, in order
        exec(compile(python.replace(README_ADDR, addr), str(SERVING), "exec"), ns)
    assert ns["r"].choices[0].message.content and ns["r"].model == "smol"
    assert ns["msg"].content[0].text and ns["msg"].stop_reason in ("end_turn", "max_tokens")
    assert ns["resp"].output_text and ns["resp2"].previous_response_id == ns["resp"].id
    assert ns["resp2"].usage.input_tokens_details.cached_tokens >= ns["resp"].usage.input_tokens  # the first turn is not fed again
    assert ns["events"][:2] == ["response.created", "response.in_progress"] and ns["events"][-1] in ("response.completed", "response.incomplete")
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
    block = blocks(section(CLI, "Manage a running server"))[0]
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
    block = blocks(section(SERVING, "Use"))[0]
    lines = [line for line in block.strip().splitlines() if "some-hf-model-dir" not in line]
    p = shell("\n".join(lines), README_ADDR, tmp_path, local=True)
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    assert (tmp_path / "models" / "smollm2.jlm").is_file() and (tmp_path / "models" / "smol-f32.jlm").is_file()
    assert p.stderr.count(" prompt tokens (") >= 3  # the three one-shot runs answered (sampled: the words vary)
    assert json.loads(p.stdout.splitlines()[-1])["finish_reason"] in ("stop", "length")  # run -json: one JSON object


def command(line: str) -> str:
    """A shell line without its trailing `# comment`."""
    return re.split(r"\s+# ", line, maxsplit=1)[0].rstrip()


def test_readme_tour_lines_are_the_docs_examples() -> None:
    """Every line of the README's tour is a line of an example in docs/ (the Serve, Use and Manage ones run above)."""
    documented = {command(line) for doc in DOCS.glob("*.md") for block in blocks(doc.read_text()) for line in block.splitlines()}
    tour = blocks(section(README, "Tour"))
    assert len(tour) == 4  # serve, run, place, the cluster
    for block in tour:
        for line in block.strip().splitlines():
            assert command(line) in documented, line


def test_readme_speed_table_and_links_match_the_docs() -> None:
    """The README's speed table is performance.md's first, figure for figure, and every link from the README and
    docs/ names a file that exists and, with `#`, a heading in it."""
    table = re.compile(r"^\|.*\|$", re.M)
    readme_table = table.findall(section(README, "Speed"))
    assert readme_table and readme_table == table.findall(PERFORMANCE.read_text())[: len(readme_table)]

    def anchors(path: Path) -> set[str]:
        headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.S | re.M), re.M)
        return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}

    for page in [README, *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            assert path.is_file(), f"{page.name}: {target}"
            assert not anchor or anchor in anchors(path), f"{page.name}: {target}"


def test_readme_tour_place_runs_as_written(tmp_path: Path, smollm2_gguf) -> None:
    """The tour's Place example after the Serve example's convert line: its first line starts the server (here by the
    test, on a free port), and the others run against it; the conversation goes on after its blocks moved."""
    convert = blocks(section(README, "Serve", level=3))[0].splitlines()[0]
    lines = blocks(section(README, "Place", level=3))[0].strip().splitlines()
    assert convert.startswith("jitllmd convert ") and lines[0].split("#")[0].rstrip().endswith("&")
    p = shell(convert, README_ADDR, tmp_path)
    assert p.returncode == 0, p.stderr
    args = shlex.split(lines[0].split("#")[0].rstrip().removesuffix("&"))[2:]
    server = Server(*args, cwd=tmp_path)
    try:
        p = shell("\n".join(lines[1:]), server.url.removeprefix("http://"), tmp_path)
        assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
        assert re.search(r"^\s*20\s+blocks\.19\s+host", p.stdout, re.M)  # place -move 20:29 -to host
        assert "page budget 120 MiB" in p.stdout  # place -model smol -maxmem 120M
        summaries = re.findall(r"(\d+) prompt tokens \((\d+) fed\)", p.stderr)
        assert len(summaries) == 2  # run -chat, then run -continue after the move
        prompt, fed = map(int, summaries[1])
        assert fed < prompt  # the moved session kept its KV: only the new text was fed
    finally:
        server.signal(signal.SIGINT)
        server.wait()

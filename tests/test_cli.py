"""The command line: help without torch, convert and run through Typer's CliRunner and as `python -m jitllmd`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jitllmd.cli import app
from jitllmd.engine.request import Generation

from .conftest import seeded_cache, write_tiny_gguf, write_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
FIGURE_KEYS = {
    "session_id", "queued_ms", "queue_depth_on_entry", "device_blocks", "host_blocks", "device_ids",
    "prefill_ms", "decode_ms", "decode_tokens_per_second", "bytes_per_token", "drafted_tokens", "accepted_tokens",
}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """Keep `run -model x.gguf` conversions out of the user's cache (the kernels come from the suite's)."""
    monkeypatch.setenv("JITLLMD_CACHE", str(seeded_cache(tmp_path_factory.mktemp("cache"))))


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """(HF dir, .jlm, loaded model) of the shared tiny llama."""
    from jitllmd.engine.loader import load_model

    hf_dir, _, jlm = tiny_llama
    return hf_dir, jlm, load_model(jlm, max_seq=128)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory) -> Path:
    """The shared tiny llama as an F32 GGUF file."""
    hf_dir, hf_model, _ = tiny_llama
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", hf_dir, hf_model)


@pytest.fixture(scope="module")
def no_template_jlm(tmp_path_factory) -> Path:
    from jitllmd.engine.convert import convert

    d = tmp_path_factory.mktemp("notpl")
    hf_dir, _ = write_tiny_llama(d / "hf", chat_template=None)
    return convert(hf_dir, d / "notpl.jlm", "f32").path


def greedy_text(loaded, ids: list[int], n: int, session=None) -> str:
    """What the engine generates greedily: the reference for the CLI's output."""
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.request import Delta
    from jitllmd.engine.sampler import SamplingParams

    e = Engine(loaded).start()
    try:
        return "".join(ev.text for ev in e.generate(Generation(ids, SamplingParams(temperature=0), max_tokens=n)) if isinstance(ev, Delta))
    finally:
        e.stop()


def cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def python_m(*args: str, cwd: Path, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "jitllmd", *map(str, args)],
        cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=timeout,
    )


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# -- help -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("verb", [[], ["convert"], ["run"]])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_cli_runner(verb: list[str], flag: str) -> None:
    r = cli(*verb, flag)
    assert r.exit_code == 0, r.output
    assert "Usage:" in r.stdout
    if not verb:
        assert "convert" in r.stdout and "run" in r.stdout
    elif verb == ["convert"]:
        assert "-dtype" in r.stdout and "-force" in r.stdout and "-json" in r.stdout
    else:
        for opt in ("-model", "-chat", "-n", "-temp", "-top-p", "-top-k", "-min-p", "-seed", "-max-seq", "-system", "-json"):
            assert opt in r.stdout, opt


def test_no_arguments_shows_help() -> None:
    r = cli()
    assert "Usage:" in r.output and "convert" in r.output


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["convert", "-h"], ["run", "--help"], ["convert", "--help"], ["run", "-h"]])
def test_help_subprocess(tmp_path: Path, args: list[str]) -> None:
    p = python_m(*args, cwd=tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "Usage:" in p.stdout and p.stderr == ""


def test_help_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from jitllmd.cli import app\n"
        "for args in (['--help'], ['-h'], ['convert', '--help'], ['run', '-h']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0, args\n"
        "import json\n"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'gguf', 'safetensors', 'tokenizers') if m in sys.modules)))\n"
        "CliRunner().invoke(app, ['convert', 'absent.gguf'])  # a real command does load the engine\n"
        "print(json.dumps('torch' in sys.modules))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    after_help, after_convert = map(json.loads, p.stdout.splitlines())
    assert after_help == [], after_help
    assert after_convert is True  # the check can see torch when it is there


def test_help_importtime_has_no_torch(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "jitllmd", "run", "--help"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "typer" in imported
    assert not any(m == "torch" or m.startswith("torch.") for m in imported)


# -- convert ----------------------------------------------------------------------------------------------------------


def test_convert_prints_a_summary(tiny, tmp_path: Path) -> None:
    from jitllmd.engine.jlm import JLMFile

    hf_dir, _, _ = tiny
    out = tmp_path / "x.jlm"
    r = cli("convert", hf_dir, "-o", out)
    assert r.exit_code == 0, r.output
    assert re.search(r"hf -> .*x\.jlm: llama, 21 tensors, 0\.\dM params, [\d.]+ MB in [\d.]+ s", r.stdout), r.stdout
    assert "stored as: BF16 x21" in r.stdout  # auto: a Hugging Face directory as bf16
    assert JLMFile(out).tensor("embed.weight").dtype.is_floating_point
    assert "Traceback" not in r.output


def test_convert_quantizes_and_says_where_it_fell_back(tiny, tmp_path: Path) -> None:
    """Rows of 64 and 96 inputs: -dtype q4_k takes Q5_0 (the head Q8_0), and the summary says so."""
    from jitllmd.engine.jlm import JLMFile

    hf_dir, _, _ = tiny
    out = tmp_path / "q.jlm"
    r = cli("convert", hf_dir, "-o", out, "-dtype", "q4_k")
    assert r.exit_code == 0, r.output
    assert re.search(r"stored as: .*Q5_0 x\d+.*", r.stdout) and "F32 x5" in r.stdout and "Q8_0 x1" in r.stdout, r.stdout
    assert "note: 15 tensors stored as Q5_0, not Q4_K" in r.stdout, r.stdout
    assert JLMFile(out).meta["quantization"]["head.lm_head.weight"]["type"] == "Q8_0"
    r = cli("convert", hf_dir, "-o", tmp_path / "z.jlm", "-dtype", "q3")
    assert r.exit_code != 0 and "-dtype 'q3' is not one of auto, f32, bf16, f16, q8_0, q4_0, q4_k" in r.output


def test_convert_json(tiny, tmp_path: Path) -> None:
    hf_dir, _, _ = tiny
    out = tmp_path / "j.jlm"
    r = cli("convert", hf_dir, "-o", out, "-json", "-dtype", "f32")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["output"] == str(out) and summary["arch"] == "llama" and summary["dtype"] == "f32"
    assert summary["tensors"] == 21 and summary["bytes"] == out.stat().st_size
    assert summary["params"] * 4 < summary["bytes"]


def test_convert_default_output_name(tiny, tmp_path: Path, monkeypatch) -> None:
    hf_dir, _, _ = tiny
    monkeypatch.chdir(tmp_path)
    r = cli("convert", hf_dir, "-json")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "hf.jlm").is_file()


def test_convert_gguf_long_options(tiny_gguf, tmp_path: Path) -> None:
    import torch

    from jitllmd.engine.jlm import JLMFile

    r = cli("convert", tiny_gguf, "--output", tmp_path / "g.jlm", "--dtype", "f16", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["dtype"] == "f16"
    assert JLMFile(tmp_path / "g.jlm").tensor("embed.weight").dtype == torch.float16


def test_convert_refuses_to_overwrite(tiny, tmp_path: Path) -> None:
    hf_dir, _, _ = tiny
    out = tmp_path / "exists.jlm"
    out.write_bytes(b"precious")
    r = cli("convert", hf_dir, "-o", out)
    assert r.exit_code == 1
    assert "exists" in r.stderr and "-force" in r.stderr and str(out) in r.stderr
    assert out.read_bytes() == b"precious"
    r = cli("convert", hf_dir, "-o", out, "-force", "-json")
    assert r.exit_code == 0, r.output
    assert out.stat().st_size > 1000


@pytest.mark.parametrize(
    "args, needle",
    [
        (["-dtype", "f64"], "f64"),
        (["-o", "model.bin"], ".jlm"),
    ],
)
def test_convert_bad_options(tiny, tmp_path: Path, args: list[str], needle: str) -> None:
    hf_dir, _, _ = tiny
    r = cli("convert", hf_dir, *(a if a != "model.bin" else str(tmp_path / a) for a in args))
    assert r.exit_code == 1
    assert needle in r.stderr and "Traceback" not in r.output
    assert list(tmp_path.iterdir()) == []


def test_convert_missing_input(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model.gguf"
    r = cli("convert", missing, "-o", tmp_path / "o.jlm")
    assert r.exit_code == 1
    assert str(missing) in r.stderr and r.stderr.strip().startswith("error:")
    assert "Traceback" not in r.output
    assert not (tmp_path / "o.jlm").exists()


def test_convert_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 300)
    r = cli("convert", bad, "-o", tmp_path / "o.jlm")
    assert r.exit_code == 1
    lines = _error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:") and "bad.gguf" in lines[0], r.stderr
    assert "Traceback" not in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_convert_subprocess(tiny, tmp_path: Path) -> None:
    """A real process: the JSON summary on stdout, then errors (existing output, missing input) with exit 1."""
    hf_dir, _, _ = tiny
    p = python_m("convert", hf_dir, "-o", "x.jlm", "-json", "-dtype", "f32", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    assert summary["tensors"] == 21 and (tmp_path / "x.jlm").stat().st_size == summary["bytes"]
    before = (tmp_path / "x.jlm").read_bytes()
    p = python_m("convert", hf_dir, "-o", "x.jlm", cwd=tmp_path)
    assert p.returncode == 1 and "exists" in p.stderr
    assert (tmp_path / "x.jlm").read_bytes() == before
    missing = tmp_path / "missing.gguf"
    p = python_m("convert", missing, "-o", "y.jlm", cwd=tmp_path)
    assert p.returncode == 1
    assert str(missing) in p.stderr and "Traceback" not in p.stderr + p.stdout
    assert not (tmp_path / "y.jlm").exists()


def test_convert_corrupt_gguf_subprocess(tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 300)
    p = python_m("convert", bad, "-o", "o.jlm", cwd=tmp_path)
    assert p.returncode == 1
    assert "Traceback" not in p.stderr + p.stdout
    lines = _error_lines(p.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:") and "corrupt.gguf" in lines[0], p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["corrupt.gguf"]


def test_convert_error_is_exactly_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 300)
    r = cli("convert", bad, "-o", tmp_path / "o.jlm")
    assert r.exit_code == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error:"), repr(r.stderr)


# -- run --------------------------------------------------------------------------------------------------------------


def test_run_streams_text(tiny) -> None:
    _, jlm, loaded = tiny
    want = greedy_text(loaded, loaded.tokenizer.encode("abc"), 8)
    r = cli("run", "-model", jlm, "-n", "8", "-temp", "0", "abc")
    assert r.exit_code == 0, r.output
    assert r.stdout == want + "\n"
    assert re.search(r"3 prompt tokens \(3 fed\) · \d+ generated · .* · (length|stop)", r.stderr), r.stderr


def test_run_json(tiny) -> None:
    _, jlm, loaded = tiny
    ids = loaded.tokenizer.encode("Hello there")
    r = cli("run", "-json", "-temp", "0", "-n", "5", "-model", jlm, "Hello there")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "finish_reason", "usage", "jitllm"}
    assert out["text"] == greedy_text(loaded, ids, 5)
    assert out["finish_reason"] in ("length", "stop")
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["usage"]["completion_tokens"] <= 5
    assert out["usage"]["fed_tokens"] == len(ids)
    assert FIGURE_KEYS <= set(out["jitllm"])


def test_run_chat_one_shot(tiny) -> None:
    _, jlm, loaded = tiny
    text = loaded.chat.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
    ids = loaded.tokenizer.encode(text)
    r = cli("run", "-model", jlm, "-chat", "-system", "Be brief.", "-temp", "0", "-n", "6", "-json", "Hi there")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["text"] == greedy_text(loaded, ids, 6)


@pytest.mark.parametrize(
    "spelling",
    [
        ["-model", "{jlm}", "-n", "3", "-temp", "0", "-max-seq", "50", "-json"],
        ["--model", "{jlm}", "--n", "3", "--temp", "0", "--max-seq", "50", "--json"],
        ["--model", "{jlm}", "-n", "3", "--temp", "0", "-max-seq", "50", "-json"],
        ["-model", "{jlm}", "--n", "3", "-temp", "0", "--max-seq", "50", "--json"],
    ],
)
def test_single_and_double_dash_spellings(tiny, spelling: list[str]) -> None:
    _, jlm, loaded = tiny
    r = cli("run", *[a.format(jlm=jlm) for a in spelling], "abc")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["text"] == greedy_text(loaded, loaded.tokenizer.encode("abc"), 3)
    assert out["usage"]["completion_tokens"] <= 3


def test_run_seed_reproducible(tiny) -> None:
    _, jlm, _ = tiny
    a = cli("run", "-model", jlm, "-json", "-temp", "1", "-seed", "7", "-n", "12", "-top-k", "0", "-top-p", "1", "-min-p", "0", "abc")
    b = cli("run", "-model", jlm, "-json", "-temp", "1", "-seed", "7", "-n", "12", "-top-k", "0", "-top-p", "1", "-min-p", "0", "abc")
    assert a.exit_code == b.exit_code == 0
    assert json.loads(a.stdout)["text"] == json.loads(b.stdout)["text"]


def test_run_chat_without_template(no_template_jlm: Path) -> None:
    r = cli("run", "-model", no_template_jlm, "-chat", "-n", "3", "Hi")
    assert r.exit_code == 1
    assert "no chat template" in r.stderr and "Traceback" not in r.output
    # interactive chat refuses too, before reading anything
    r = cli("run", "-model", no_template_jlm, "-chat")
    assert r.exit_code == 1 and "no chat template" in r.stderr
    # a completion works on the same model
    assert cli("run", "-model", no_template_jlm, "-temp", "0", "-n", "2", "Hi").exit_code == 0


def test_run_prompt_longer_than_max_seq(tiny) -> None:
    _, jlm, loaded = tiny
    prompt = "Hello there, the winter in Oslo is long and dark."
    n = len(loaded.tokenizer.encode(prompt))
    assert n > 12
    r = cli("run", "-model", jlm, "-max-seq", "12", "-temp", "0", prompt)
    assert r.exit_code == 1
    assert str(n) in r.stderr and "12" in r.stderr, r.stderr
    assert "Traceback" not in r.output and r.stdout == ""


def test_run_missing_model(tmp_path: Path) -> None:
    missing = tmp_path / "absent.jlm"
    r = cli("run", "-model", missing, "hi")
    assert r.exit_code == 1
    assert str(missing) in r.stderr and "no such file" in r.stderr
    assert "Traceback" not in r.output


def test_run_not_a_model(tmp_path: Path) -> None:
    junk = tmp_path / "junk.jlm"
    junk.write_bytes(b"\x00" * 64)
    r = cli("run", "-model", junk, "hi")
    assert r.exit_code == 1 and "junk.jlm" in r.stderr and "Traceback" not in r.output


@pytest.mark.parametrize(
    "args, needle",
    [
        (["-temp", "3"], "-temp"),
        (["-top-p", "0"], "-top-p"),
        (["-min-p", "2"], "-min-p"),
        (["-top-k", "-1"], "-top-k"),
        (["-n", "0"], "-n"),
        (["-max-seq", "0"], "-max-seq"),
        (["-system", "x"], "-system"),
    ],
)
def test_run_bad_options(tiny, args: list[str], needle: str) -> None:
    _, jlm, _ = tiny
    r = cli("run", "-model", jlm, *args, "abc")
    assert r.exit_code == 1, r.output
    assert needle in r.stderr and "Traceback" not in r.output


def test_run_needs_a_prompt(tiny) -> None:
    _, jlm, _ = tiny
    r = cli("run", "-model", jlm)
    assert r.exit_code == 1 and "prompt" in r.stderr
    r = cli("run", "-model", jlm, "-chat", "-json")
    assert r.exit_code == 1 and "-json" in r.stderr


def test_run_gguf_converts_once_into_the_cache(tiny_gguf, tmp_path: Path, monkeypatch, bf16_path) -> None:
    """A .gguf converts once (bf16) and runs on both bf16 paths, whatever this CPU has, with no dtype warning."""
    cache = seeded_cache(tmp_path / "cache")
    monkeypatch.setenv("JITLLMD_CACHE", str(cache))
    g = tiny_gguf
    a = cli("run", "-model", g, "-json", "-temp", "0", "-n", "4", "abc")
    assert a.exit_code == 0, a.output
    made = list(cache.glob("*.jlm"))
    assert len(made) == 1 and made[0].name.startswith("tiny-")
    mtime = made[0].stat().st_mtime_ns
    b = cli("run", "-model", g, "-json", "-temp", "0", "-n", "4", "abc")
    assert b.exit_code == 0
    assert list(cache.glob("*.jlm")) == made and made[0].stat().st_mtime_ns == mtime
    assert json.loads(a.stdout)["text"] == json.loads(b.stdout)["text"]


def test_a_changed_gguf_replaces_its_cached_conversion(tiny_gguf, tmp_path: Path, monkeypatch) -> None:
    """The same path with new contents (a reinstalled package's file) converts again and the stale .jlm goes; a file
    of the same name elsewhere keeps its own."""
    import os

    from jitllmd.engine.loader import cached_conversion

    cache = tmp_path / "cache"
    cache.mkdir()
    here, there = tmp_path / "a" / "tiny.gguf", tmp_path / "b" / "tiny.gguf"
    for g in (here, there):
        g.parent.mkdir()
        g.write_bytes(tiny_gguf.read_bytes())
    first, other = cached_conversion(here, cache), cached_conversion(there, cache)
    assert first != other and cached_conversion(here, cache) == first
    os.utime(here, ns=(here.stat().st_atime_ns, here.stat().st_mtime_ns + 10**9))  # the file changed
    second = cached_conversion(here, cache)
    assert second != first and second.exists() and not first.exists() and other.exists()
    assert sorted(cache.glob("*.jlm")) == sorted([second, other])


def test_run_subprocess_stream_and_json(tiny, tmp_path: Path) -> None:
    _, jlm, loaded = tiny
    want = greedy_text(loaded, loaded.tokenizer.encode("abc"), 8)
    p = python_m("run", "-model", jlm, "-n", "8", "-temp", "0", "abc", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout == want + "\n"
    assert "prompt tokens" in p.stderr
    p = python_m("run", "--json", "--temp", "0", "--n", "5", "--model", jlm, "abc", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)  # stdout is exactly one JSON object
    assert out["text"] == greedy_text(loaded, loaded.tokenizer.encode("abc"), 5)
    assert out["finish_reason"] in ("length", "stop") and FIGURE_KEYS <= set(out["jitllm"])


def test_run_subprocess_errors(tmp_path: Path) -> None:
    missing = tmp_path / "absent.jlm"
    p = python_m("run", "-model", missing, "hi", cwd=tmp_path)
    assert p.returncode == 1
    assert str(missing) in p.stderr and "Traceback" not in p.stderr + p.stdout


def test_interactive_chat_subprocess(tiny, tmp_path: Path) -> None:
    """Two lines on stdin, then EOF: two answers, one session (the second turn feeds only what the cache lacks)."""
    _, jlm, loaded = tiny
    first, second = "Hello there", "What is on?"
    msgs = [{"role": "user", "content": first}]
    a1 = greedy_text(loaded, loaded.tokenizer.encode(loaded.chat.render(msgs)), 4)
    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": second}]
    ids2 = loaded.tokenizer.encode(loaded.chat.render(msgs))
    a2 = greedy_text(loaded, ids2, 4)
    p = python_m("run", "-chat", "-temp", "0", "-n", "4", "-model", jlm, cwd=tmp_path, stdin=f"{first}\n{second}\n")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert p.stdout.count("> ") >= 3  # a prompt for each line and one that met EOF
    assert a1 + "\n" in p.stdout and a2 + "\n" in p.stdout
    assert p.stdout.index(a1 + "\n") < p.stdout.rindex(a2 + "\n")
    figures = [line for line in p.stderr.splitlines() if "prompt tokens" in line]
    assert len(figures) == 2, p.stderr
    m = re.search(r"(\d+) prompt tokens \((\d+) fed\)", figures[1])
    assert m and int(m.group(1)) == len(ids2) and int(m.group(2)) < len(ids2)


def test_convert_force_failure_keeps_the_old_output(tmp_path: Path) -> None:
    out = tmp_path / "keep.jlm"
    out.write_bytes(b"old")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 300)
    r = cli("convert", bad, "-o", out, "-force")
    assert r.exit_code == 1 and "bad.gguf" in r.stderr
    assert out.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "keep.jlm"]


def test_run_corrupt_gguf_model(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("JITLLMD_CACHE", str(cache))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 300)
    r = cli("run", "-model", bad, "hi")
    assert r.exit_code == 1 and "broken.gguf" in r.stderr and "Traceback" not in r.output
    assert not cache.exists() or list(cache.iterdir()) == []


def test_run_model_is_a_directory(tiny) -> None:
    hf_dir, _, _ = tiny
    r = cli("run", "-model", hf_dir, "hi")
    assert r.exit_code == 1 and "directory" in r.stderr and "Traceback" not in r.output


def test_run_empty_prompt_is_a_one_line_error(tiny) -> None:
    _, jlm, _ = tiny
    r = cli("run", "-model", jlm, "-temp", "0", "-n", "3", "")
    assert r.exit_code == 1
    assert "empty" in r.stderr
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_run_malformed_jlm_is_a_one_line_error(tmp_path: Path) -> None:
    import struct

    bad = tmp_path / "odd.jlm"
    bad.write_bytes(struct.pack("<Q", 3) + b"123")
    r = cli("run", "-model", bad, "hi")
    assert r.exit_code == 1
    assert "odd.jlm" in r.stderr
    assert r.exception is None or isinstance(r.exception, SystemExit)


def _imported(stderr: str) -> set[str]:
    """Top-level modules a `python -X importtime` process imported, from its stderr."""
    return {m.group(1) for m in re.finditer(r"^import time:.*\|\s+(\w+)", stderr, re.M)}


def test_serve_says_what_is_wrong_before_loading(tiny_gguf, tmp_path: Path) -> None:
    """A missing -load file and an address in use are said before torch is imported or anything converted."""
    import socket

    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.gguf").write_bytes(tiny_gguf.read_bytes())
    cmd = [sys.executable, "-X", "importtime", "-m", "jitllmd", "serve", "-models", "models"]
    p = subprocess.run([*cmd, "-load", "absent.jlm", "-addr", "127.0.0.1:0"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "absent.jlm: no such model file in models" in p.stderr
    assert "typer" in _imported(p.stderr) and "torch" not in _imported(p.stderr)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([*cmd, "-load", "tiny.gguf", "-addr", f"127.0.0.1:{port}"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in p.stderr
    assert "torch" not in _imported(p.stderr) and not (models / ".cache").exists()


def test_serve_relative_models_dir_loads_a_gguf_into_its_cache(tiny_gguf, tmp_path: Path) -> None:
    """`serve -models ./models -load tiny.gguf` converts into models/.cache once, and loads it, then and again."""
    from tests.serving import Server

    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.gguf").write_bytes(tiny_gguf.read_bytes())
    made = []
    for _ in range(2):
        server = Server("-models", "./models", "-load", "tiny.gguf", cwd=tmp_path)
        try:
            assert "as m-" in server.log and ", tiny," in server.log
            # a random model samples its end token now and then: three tokens whatever it samples
            r = httpx_post(server.url + "/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 3, "ignore_eos": True})
            assert r["usage"]["completion_tokens"] == 3
        finally:
            server.stop()
        made.append(sorted(p.name for p in (models / ".cache").glob("*.jlm")))
    assert len(made[0]) == 1 and made[0] == made[1]


def httpx_post(url: str, body: dict) -> dict:
    import httpx

    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(("args", "typed", "suggested"), [
    (["run", "-chta"], "-chta", "-chat"),
    (["serve", "-adr", "x"], "-adr", "-addr"),
    (["place", "-sesion", "S"], "-sesion", "-session"),
    (["convert", "x.gguf", "-dtpye", "f32"], "-dtpye", "-dtype"),
    (["run", "-model", "x.jlm", "-max-tokens", "5", "hi"], "-max-tokens", "-max-seq"),  # not the valid -model before it
])
def test_a_misspelt_single_dash_flag_is_named_whole_with_a_suggestion(args, typed, suggested) -> None:
    r = cli(*args)
    assert r.exit_code == 2
    assert f"No such option: {typed}" in r.stderr and suggested in r.stderr.split(typed, 1)[1]


def test_short_options_still_parse() -> None:
    assert cli("run", "-h").exit_code == 0
    r = cli("run", "-n", "x")  # a bad value for -n is about -n, not a missing option
    assert r.exit_code == 2 and "No such option" not in r.stderr


def _rendered(renderable, width: int) -> list[str]:
    import io

    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def test_stats_fit_80_columns() -> None:
    """Every header and figure of `stats`, untruncated, within 80 columns."""
    from jitllmd.commands.stats import _table
    from jitllmd.gen.jitllm.v1 import telemetry_pb2 as pb

    m = pb.ModelStats(
        model="smollm2-135m-instruct", requests=123456, generated_tokens=98765432, tokens_per_second=1234.5, active_rows=16, queue_depth=128,
        rows_per_step=15.25, prompt_tokens_per_step=256.0, weight_bytes=1_234_567_890, kv_bytes=987_654_321, sessions=16, joint_steps="auto",
        joint=[pb.JointStep(rows=r, choice="joint") for r in range(2, 17)],
    )
    resp = pb.GetStatsResponse(uptime_s=3600, requests=123456, generated_tokens=98765432, tokens_per_second=1234.5, models=[m], rss_bytes=2 << 30)
    lines = _rendered(_table(resp), 80)
    text = "\n".join(lines)
    assert max(map(len, lines)) <= 80 and "…" not in text
    for header in ("requests", "generated", "tok/s", "active", "queue", "sessions", "rows/step", "prompt/step", "weight MB", "KV MB", "joint steps"):
        assert header in text
    assert "98765432" in text and "1234.6" in text and "16:j" in text


def test_progress_bar_fits_80_columns(monkeypatch) -> None:
    """convert's bar, label and figures on one line of a terminal 80 columns wide."""
    import io

    from rich.console import Console

    from jitllmd import console

    buf = io.StringIO()
    monkeypatch.setattr(console, "err_console", Console(file=buf, width=80, force_terminal=True, color_system=None))
    with console.progress_bar("converting SmolLM2-135M-Instruct.Q4_1.gguf", as_bytes=True) as update:
        update(70_800_000, 269_000_000)
    frames = [f for f in re.split(r"\r|\n|\x1b\[[0-9;]*[A-Za-z?]|\x1b\[\?25[lh]", buf.getvalue()) if f.strip()]
    assert frames and all(len(f) <= 80 for f in frames)
    assert any("70.8/269.0 MB" in f and f.startswith("converting") for f in frames)


def test_convert_names_the_embedded_default(smollm2_gguf, tmp_path: Path) -> None:
    r = cli("convert", "smol", "-o", tmp_path / "models" / "smollm2.jlm", "-json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["source"] == str(smollm2_gguf) and out["arch"] == "llama" and (tmp_path / "models" / "smollm2.jlm").is_file()


def test_interactive_chat_on_both_bf16_paths(tiny_gguf, tmp_path: Path, monkeypatch, bf16_path) -> None:
    """Two turns of `run -chat` on a bf16 conversion, in this process (so a dtype warning inside the engine would be
    an error, and the turn a failure), on the upcast path and on the path of CPUs with bf16 units."""
    monkeypatch.setenv("JITLLMD_CACHE", str(seeded_cache(tmp_path / "cache")))
    r = CliRunner().invoke(app, ["run", "-model", str(tiny_gguf), "-chat", "-temp", "0", "-n", "4"], input="Hello there\nWhat is on?\n")
    assert r.exit_code == 0, r.output
    assert "internal error" not in r.output and r.stderr.count(" prompt tokens (") == 2, r.stderr

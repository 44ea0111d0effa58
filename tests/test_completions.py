"""Shell completions: fresh from the app, valid in each shell, and completing verbs and a verb's options."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DIR = ROOT / "completions"


def test_completions_are_fresh():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_completions.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def bash_complete(line: str) -> list[str]:
    words = line.split(" ")
    script = (
        f"source {DIR / 'jitllmd.bash'}; COMP_WORDS=({' '.join(repr(w) for w in words)}); "
        f"COMP_CWORD={len(words) - 1}; _jitllmd; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    )
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    return out.split()


def test_bash_completes_verbs_and_options():
    assert bash_complete("jitllmd se") == ["serve", "sessions"]
    assert set(bash_complete("jitllmd serve -")) >= {"-addr", "-models", "-load", "-joint-steps", "-h"}
    assert bash_complete("jitllmd serve -joint-steps a") == ["auto", "always"]
    assert "-continue" in bash_complete("jitllmd run -c")


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_script_parses():
    subprocess.run(["zsh", "-n", str(DIR / "_jitllmd")], check=True)


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_completes():
    subprocess.run(["fish", "-n", str(DIR / "jitllmd.fish")], check=True)
    out = subprocess.run(["fish", "-c", f"source {DIR / 'jitllmd.fish'}; complete -C 'jitllmd serve -max'"], capture_output=True, text=True, check=True).stdout
    assert "-max-seq" in out and "-max-batch" in out

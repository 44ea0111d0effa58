"""`python tests/stall_serve.py serve ARGS`: `jitllmd serve` whose engine steps hold while the file named by
$JITLLMD_TEST_STALL exists, as an engine stuck inside a long step would (a loaded machine, a slow device)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jitllmd  # noqa: F401,E402  (before torch)
from jitllmd.cli import main  # noqa: E402
from jitllmd.engine.engine import Engine  # noqa: E402

_flag = Path(os.environ["JITLLMD_TEST_STALL"])
_run = Engine._run


def _stalling_run(self, rows):
    if _flag.exists():
        print(f"stall: {self.loaded.name} held inside a step", file=sys.stderr, flush=True)
        while _flag.exists():
            time.sleep(0.05)
    return _run(self, rows)


Engine._run = _stalling_run  # type: ignore[method-assign]
main()

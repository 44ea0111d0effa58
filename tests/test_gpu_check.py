"""scripts/gpu_check's dry run on the CPU, so the GPU machine's one prepared run cannot rot between loans; and the code
paths it checks stay device-agnostic (what a device is, only memory/devices.py asks)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path) -> None:
    """Every section (the tiny families against the CPU, placement and moves, relocation, serve with the SDKs and 32
    streams, speed beside transformers) passes with the CPU as the device, and the report has its tables."""
    out = tmp_path / "out"
    r = subprocess.run([str(ROOT / "scripts" / "gpu_check"), "--device", "cpu", "--size", "small", "--rounds", "1", "--out", str(out)],
                       env={**os.environ, "PYTHON": sys.executable}, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    rows = report["rows"]
    assert {row["section"] for row in rows} == {"env", "models", "correctness", "placement", "serve", "speed", "spec"}
    assert not [row for row in rows if row["status"] == "FAIL"]
    assert sum(row["section"] == "correctness" for row in rows) == 8  # seven models, then batching and chunks
    titles = [title for title, _, _ in report["tables"]]
    assert any("streaming clients" in t for t in titles) and any("synthetic small Llama" in t for t in titles)
    assert "| speed |" in (out / "report.md").read_text()


def test_what_a_device_is_is_asked_only_in_devices_py() -> None:
    """No module but memory/devices.py tests a device by its name's `cuda`: the rest take what it says (kind, memory,
    how quantized blocks multiply), so the CPU suite runs the same code a GPU does."""
    pattern = re.compile(r"""(startswith\(\s*["']cuda|==\s*["']cuda|["']cuda["']\s*==|in\s*\(\s*["']cuda)""")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "jitllmd").rglob("*.py")
                 if "gen" not in p.parts and p.name != "devices.py" and pattern.search(p.read_text())]
    assert offenders == []

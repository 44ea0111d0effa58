"""The built wheel installed into a fresh venv: it ships the kernels' sources and headers, so they build and load there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Run in the fresh venv: which jitllmd it imports, and the kernels it builds into the cache dir given as argv[1].
_PROBE = """
import json, sys
from pathlib import Path
import jitllmd
from jitllmd.engine import kernels
kernels.configure(Path(sys.argv[1]))
print(json.dumps({"file": jitllmd.__file__, "loaded": kernels.rows_kernel() is not None, "kernels": kernels.describe()}))
"""


@pytest.mark.slow
def test_the_wheel_builds_and_loads_its_kernels(tmp_path: Path) -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler (cc or gcc): the kernels cannot be built anywhere here")
    # A copy of what the wheel is made from: pip builds in the source tree, and others share /work/main's.
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "jitllmd", src / "jitllmd", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)])
    (wheel,) = (tmp_path / "dist").glob("jitllmd-*.whl")
    shipped = {Path(n).name for n in zipfile.ZipFile(wheel).namelist() if n.startswith("jitllmd/engine/kernels/")}
    assert {"rows.c", "panels.c", "simd.h"} <= shipped

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)])
    # torch and the rest from this venv's site-packages as a plain sys.path entry: its .pth files (the editable
    # jitllmd's finder among them) are not processed, so the wheel's jitllmd is the only one importable.
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path).stdout.strip())
    paths = sysconfig.get_paths()
    (site / "deps.pth").write_text("".join(f"{d}\n" for d in dict.fromkeys((paths["purelib"], paths["platlib"]))))

    cache = tmp_path / "kernels"
    # -I and cwd: neither PYTHONPATH nor the working directory brings /work/main's jitllmd in
    probe = json.loads(run([str(python), "-I", "-c", _PROBE, str(cache)], cwd=tmp_path).stdout)
    assert Path(probe["file"]).resolve().is_relative_to(venv.resolve()), probe["file"]
    if probe["kernels"].startswith(("torch ops (CPU lacks", "torch ops (not x86-64")):
        pytest.skip(f"the kernels never run on this CPU: {probe['kernels']}")
    assert probe["loaded"], probe["kernels"]
    assert [f"({f.name})" in probe["kernels"] for f in cache.glob("kernels-*.so")] == [True]


def run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert p.returncode == 0, f"{' '.join(cmd)}:\n{p.stdout}{p.stderr}"
    return p

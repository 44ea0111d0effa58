"""Logits of this tree against another commit's, bit for bit: for refactors that must not change a number.

    python scripts/logits_ab.py [REV]        (default HEAD; a worktree of REV is made under a temp dir)

Converts tiny random models (llama, llama with 64-wide heads, mistral with a window, qwen2, qwen3, a tied head; f32
and bf16) and the embedded SmolLM2 (f32, bf16), then in both trees, each in its own process and with each bf16 path
forced (native: bf16 units; upcast: none), runs a whole prompt, three decode steps, a packed decode row beside a
joining chunk, and a prompt asking for its last token's logits, and compares every logit tensor with torch.equal.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = r'''
import importlib, sys, torch
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from jitllmd.engine.kv import RowSpan
from jitllmd.engine.loader import load_model
native = sys.argv[3] == "native"
for name in ("jitllmd.engine.models.llama", "jitllmd.engine.layers.linear"):  # wherever this tree asks the hardware
    try:
        importlib.import_module(name).bf16_matmul_native = lambda device="cpu": native
    except ImportError:
        pass
out = {}
for jlm in sorted(Path(sys.argv[2]).glob("*.jlm")):
    L = load_model(jlm, max_seq=256)
    fwd = L.runner.forward if getattr(L, "runner", None) is not None else L.model.forward
    P = list(range(100, 140)) if jlm.name.startswith("smol") else [5, 17, 33, 2, 64, 80, 11, 11, 42, 9, 90, 3, 27]
    res, kv = [], L.new_kv()
    res.append(fwd(torch.tensor(P), torch.arange(len(P)), [RowSpan(0, len(P), kv)]))
    for i in range(3):
        res.append(fwd(torch.tensor([7 + i]), torch.tensor([kv.length]), [RowSpan(0, 1, kv)]))
    a, b = L.new_kv(), L.new_kv()
    fwd(torch.tensor(P[:5]), torch.arange(5), [RowSpan(0, 5, a)])
    fwd(torch.tensor(P[:3]), torch.arange(3), [RowSpan(0, 3, b)])
    res.append(fwd(torch.tensor([P[5]] + P[3:9]), torch.tensor([5, *range(3, 9)]), [RowSpan(0, 1, a), RowSpan(1, 6, b)], torch.tensor([0, 6])))
    res.append(fwd(torch.tensor(P), torch.arange(len(P)), [RowSpan(0, len(P), L.new_kv())], torch.tensor([len(P) - 1])))
    out[jlm.name] = res
torch.save(out, sys.argv[4])
'''


def write_models(d: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from jitllmd.embedded import default_gguf
    from jitllmd.engine.convert import convert
    from tests.conftest import write_tiny_hf

    cases = [("llama", "llama", {}), ("llama64", "llama", {"head_dim": 64}), ("mistralw", "mistral", {"sliding_window": 5}),
             ("qwen2", "qwen2", {}), ("qwen3", "qwen3", {}), ("tied", "llama", {"tie_word_embeddings": True})]
    for name, arch, kw in cases:
        hf, _ = write_tiny_hf(d / f"hf-{name}", arch, **kw)
        for dtype in ("f32", "bf16"):
            convert(hf, d / "models" / f"{name}-{dtype}.jlm", dtype)
    gguf = default_gguf()
    if gguf is not None:
        for dtype in ("f32", "bf16"):
            convert(gguf, d / "models" / f"smol-{dtype}.jlm", dtype)


def main() -> None:
    import torch

    rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "models").mkdir()
        write_models(d)
        base = d / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), rev], check=True)
        try:
            bad = []
            for path in ("native", "upcast"):
                got = {}
                for tree, where in (("base", base), ("this", ROOT)):
                    out = d / f"{tree}-{path}.pt"
                    subprocess.run([sys.executable, "-c", WORKER, str(where), str(d / "models"), path, str(out)], check=True, cwd=tmp)
                    got[tree] = torch.load(out)
                n = sum(len(v) for v in got["base"].values())
                diff = [(m, i) for m in got["base"] for i, (x, y) in enumerate(zip(got["base"][m], got["this"][m])) if not torch.equal(x, y)]
                print(f"{path}: {len(got['base'])} models, {n} logit tensors, {len(diff)} differ {diff or ''}")
                bad += diff
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

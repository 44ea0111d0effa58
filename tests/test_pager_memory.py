"""The host pager bounds the process's memory: SmolLM2 (f32) with a page budget of a third of its bytes generates the
tokens of the unbounded run, and the peak RSS of a 64-token generation stays under budget + KV + a fixed overhead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Run in a fresh process so the peak is this model's alone. VmHWM is reset (clear_refs 5) after a warm-up generation
# has started the thread pools, so it covers the 64-token generation only.
PROBE = r"""
import json, sys
import torch
from jitllmd.engine.engine import Engine
from jitllmd.engine.request import Generation
from jitllmd.engine.sampler import SamplingParams

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

path, budget = sys.argv[1], (None if sys.argv[2] == "none" else int(sys.argv[2]))
torch.ones(64, 64) @ torch.ones(64, 64)
base = status("VmRSS")  # the interpreter, torch and the engine's modules, before the model
engine = Engine.load(path, max_seq=256, page_budget=budget)
greedy = SamplingParams(temperature=0.0)
prompt = engine.loaded.tokenizer.encode("The capital of France is")
list(engine.generate(Generation(prompt, greedy, max_tokens=4)))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
session = engine.new_session()
ids = [t for ev in engine.generate(Generation(prompt, greedy, max_tokens=64, ignore_eos=True, session=session)) for t in getattr(ev, "token_ids", [])]
placement = engine.loaded.placement
print(json.dumps({
    "ids": ids, "base": base, "peak": status("VmHWM"), "resident": placement.pager.resident_bytes(),
    "working": placement.pager.working_bytes(), "kv": session.kv.nbytes(), "total": sum(placement.block_bytes),
    "largest": max(placement.block_bytes[1:]),
}))
engine.stop()  # before the interpreter goes: a daemon thread still inside torch at exit can abort it
"""

# What the process holds beyond weights, KV and the pager's buffers: the tokenizer and chat template (SmolLM2's 49k
# vocabulary), the .jlm metadata, a step's activations and logits, and allocator slack. Measured here at 35-55 MB
# (an unbounded run: peak - base - resident weights - KV); the bound allows 80 MiB.
FIXED_OVERHEAD = 80 << 20


def _probe(path: Path, budget: int | None) -> dict:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    p = subprocess.run([sys.executable, "-c", PROBE, str(path), "none" if budget is None else str(budget)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_third_of_the_model_resident_bounds_peak_rss(smollm2_jlm: Path) -> None:
    full = _probe(smollm2_jlm, None)
    budget = full["total"] // 3
    paged = _probe(smollm2_jlm, budget)
    assert paged["ids"] == full["ids"] and len(full["ids"]) == 64
    assert paged["resident"] <= budget
    # the pager's buffers: the block running and the one read ahead; the largest host block is the tied head's table
    assert paged["working"] <= 2 * paged["largest"]
    bound = paged["base"] + budget + paged["kv"] + paged["working"] + FIXED_OVERHEAD
    assert paged["peak"] <= bound, {k: v for k, v in paged.items() if k != "ids"}
    # and the bound means something: the unbounded run's peak is well above it
    assert full["peak"] > bound

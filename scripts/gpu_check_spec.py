"""scripts/gpu_check's `spec` section: speculative decoding (prompt lookup) on the device under test, on the synthetic
Llama. One engine drafting with ngram; each round a greedy request with guesses off, with the adaptive k (the default)
and with guesses forced every step. It compares their tokens (the synthetic model's weights are dense bf16: a verifying
row's products, a GEMM of k + 1 rows, may round apart from a decode row's, and random weights leave near ties, so a
difference is reported, with where it starts, not failed; quantized weights on the CPU kernels give the same tokens,
tests/test_speculative.py), and reports each one's decode tok/s,
guesses taken, and where a step's time goes (drafting steps and plain ones apart): the forward (the runner's own
clock), sampling and verifying (Outputs.postprocess), the drafter (Speculator.draft), the whole step from one
draft() to the next; then what the speculator learned: each token count's measured step, and what drafting steps
showed its model misses a guess (Speculator._miss). On a CUDA device the adaptive k must keep at least 0.95x plain
decoding (speculative decoding's floor).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def speculative(r: Any, device: str, jlm: Path, rounds: int, greedy: Any) -> None:
    """`r`: gpu_check's Report; `greedy`: its greedy(engine, prompt, n, **generation) -> (ids, Done)."""
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.speculative import SpecConfig

    engine = Engine.load(jlm, devices=[device], sessions=2, max_seq=1024, spec=SpecConfig("ngram"))
    spec = engine.speculator
    clocks: dict[str, dict[str, list[float]]] = {"plain": defaultdict(list), "drafting": defaultdict(list)}
    state: dict[str, Any] = {"kind": None, "t0": None}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args)
            if name == "draft":  # a step begins: the last one's whole time, and what this one is
                if state["kind"] is not None:
                    clocks[state["kind"]]["step"].append(t0 - state["t0"])
                drafting = any(getattr(row, "draft", ()) for row in out)
                state["kind"], state["t0"] = ("drafting" if drafting else "plain"), t0
            if state["kind"] is not None:
                clocks[state["kind"]][name].append(time.perf_counter() - t0)
            return out
        return wrapper

    try:
        assert spec is not None, "no speculator: ngram asked for"
        spec.draft = timed("draft", spec.draft)  # type: ignore[method-assign]
        engine._run = timed("forward", engine._run)  # type: ignore[method-assign]
        engine.outputs.postprocess = timed("verify", engine.outputs.postprocess)  # type: ignore[method-assign]
        prompt = [(7 * i) % 40 + 3 for i in range(48)]  # repeats: prompt lookup finds what follows
        got: dict[str, list[dict[str, float]]] = {"off": [], "adaptive": [], "forced": []}
        tokens: dict[str, list[int]] = {}
        with r.check("spec", f"ngram on {device}: greedy decoding with guesses off, adaptive and forced") as row:
            greedy(engine, prompt[:16], 8)  # warm-up
            for _ in range(rounds):
                for name, kw in (("off", {"speculative": False}), ("adaptive", {}), ("forced", {"speculative": True})):
                    ids, done = greedy(engine, prompt, 128, **kw)
                    tokens.setdefault(name, ids)
                    f = done.figures
                    got[name].append({"tps": f.decode_tokens_per_second, "drafted": f.drafted_tokens, "accepted": f.accepted_tokens})
            row["detail"] = ", ".join(f"{k} {statistics.median(x['tps'] for x in v):.1f} tok/s" for k, v in got.items())
        if not all(got.values()):
            return
        med = {k: statistics.median(x["tps"] for x in v) for k, v in got.items()}
        with r.check("spec", "the same greedy tokens with guesses as without") as row:
            same = [name for name in ("adaptive", "forced") if tokens[name] == tokens["off"]]
            starts = {name: next((i for i, (a, b) in enumerate(zip(tokens[name], tokens["off"])) if a != b), len(tokens["off"]))
                      for name in ("adaptive", "forced") if name not in same}
            row["detail"] = "equal" if not starts else ", ".join(f"{k} differs from token {i}" for k, i in starts.items()) + " (dense weights)"
            if starts:
                row["status"] = "INFO"
        rows = []
        for name, runs in got.items():
            drafted, accepted = sum(x["drafted"] for x in runs), sum(x["accepted"] for x in runs)
            rows.append([name, f"{med[name]:.1f}", f"{med[name] / med['off']:.2f}x", f"{accepted}/{drafted}" if drafted else ""])
        r.table(f"prompt lookup on {device}, synthetic Llama, greedy 128 tokens (medians of {rounds})", ["guesses", "tok/s", "x off", "taken"], rows)
        r.table(f"a step's time on {device}, ms (means; whole: one draft() to the next)", ["steps", "count", "whole", "forward", "verify", "draft"],
                [[kind, str(len(c["forward"])), *(f"{1000 * statistics.fmean(c[k]):.2f}" if c[k] else "" for k in ("step", "forward", "verify", "draft"))]
                 for kind, c in clocks.items()])
        measured = {t: spec.steps.measured(t) for t in (1, 2, 3, 5, 9)}
        one = measured[1]
        with r.check("spec", "what the speculator learned") as row:
            row["status"] = "INFO"
            row["detail"] = ("step x one token's: " + ", ".join(f"t={t} {s / one:.2f}" for t, s in measured.items() if s is not None and one)
                             + f"; model's miss a guess, by decode rows: {({k: round(v[0], 3) for k, v in spec._miss.items()})}")
        if device.startswith("cuda"):
            with r.check("targets", "adaptive prompt lookup >= 0.95x guesses off") as row:
                assert med["adaptive"] >= 0.95 * med["off"], f"{med['adaptive'] / med['off']:.2f}x"
    finally:
        engine.stop()

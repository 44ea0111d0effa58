"""What the HTTP surface costs: time to first token and decode speed through `jitllmd serve` against the engine
called directly, on the same SmolLM2 weights, interleaved in one run.

    python bench/serve.py                       # bf16, 128-token prompt, 128 generated tokens, 5 rounds
    python bench/serve.py --dtype f32 --rounds 3

The server runs as its own process (as users run it); the direct engine runs in this one, idle while the server
works and the other way round. The HTTP client times tokens as a streaming SDK sees them (first content chunk,
last content chunk); the direct side times Delta events as `jitllmd run` sees them.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode import cache, prepare, prompt_ids  # noqa: E402


def start_server(path: Path, model_id: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """`jitllmd serve` of `path` as `model_id` on a free loopback port: (the process, its URL)."""
    cmd = [sys.executable, "-m", "jitllmd", "serve", "-addr", "127.0.0.1:0", "-load", str(path), "-id", model_id, *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "400"})
    assert proc.stderr is not None
    for line in proc.stderr:
        if " at http://" in line:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining the log
            return proc, line.split(" at ")[-1].strip()
    sys.exit(f"the server did not start (exit {proc.wait()})")


def stream_completion(client, url: str, body: dict) -> tuple[float, list[float]]:
    """Stream a completion: (the send time, the time each content chunk arrived)."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                obj = json.loads(line[6:])
                if obj["choices"] and obj["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
    return t0, stamps


def run_http(client, url: str, ids: list[int], n: int) -> dict[str, float]:
    body = {"model": "bench", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    return _figures(*stream_completion(client, url, body))


def run_direct(engine, ids: list[int], n: int) -> dict[str, float]:
    from jitllmd.engine.request import Delta, Done, Generation
    from jitllmd.engine.sampler import SamplingParams

    events: queue.SimpleQueue = queue.SimpleQueue()
    t0 = time.perf_counter()
    engine.submit(Generation(ids, SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True), events.put)
    stamps: list[float] = []
    while True:
        ev = events.get()
        if isinstance(ev, Delta) and ev.text:
            stamps.append(time.perf_counter())
        elif isinstance(ev, Done):
            return _figures(t0, stamps)


def _figures(t0: float, stamps: list[float]) -> dict[str, float]:
    return {"ttft_ms": (stamps[0] - t0) * 1000, "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f32"))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()

    import httpx
    import torch

    from jitllmd.engine.engine import Engine

    path = prepare()[a.dtype]
    engine = Engine.load(path, max_seq=2048)
    ids = prompt_ids(engine.loaded.tokenizer.encode, a.prompt)
    proc, url = start_server(path, "bench", "-max-seq", "2048")
    results: dict[str, list[dict[str, float]]] = {"direct": [], "http": []}
    try:
        with httpx.Client() as client:
            run_http(client, url, ids, 8)  # warm both sides up
            run_direct(engine, ids, 8)
            for r in range(a.rounds):
                for side in ("direct", "http"):
                    res = run_direct(engine, ids, a.decode) if side == "direct" else run_http(client, url, ids, a.decode)
                    results[side].append(res)
                    print(f"round {r + 1} {side:6s} ttft {res['ttft_ms']:.1f} ms, decode {res['decode_tps']:.2f} tok/s", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait()
        engine.stop()
    med = {side: {k: statistics.median(x[k] for x in v) for k in v[0]} for side, v in results.items()}
    d, h = med["direct"], med["http"]
    per_token = (1 / h["decode_tps"] - 1 / d["decode_tps"]) * 1000
    print(f"\nSmolLM2-135M-Instruct {a.dtype}, {torch.get_num_threads()} threads, prompt {a.prompt} tokens, "
          f"{a.decode} generated, median of {a.rounds} interleaved rounds (cache: {cache()})")
    print("| path | time to first token ms | decode tok/s |")
    print("|---|---:|---:|")
    print(f"| engine, direct | {d['ttft_ms']:.1f} | {d['decode_tps']:.2f} |")
    print(f"| HTTP (OpenAI stream) | {h['ttft_ms']:.1f} | {h['decode_tps']:.2f} |")
    print(f"| **HTTP / direct** | **{h['ttft_ms'] / d['ttft_ms']:.3f}x** | **{h['decode_tps'] / d['decode_tps']:.3f}x** |")
    print(f"\nHTTP overhead per generated token: {per_token:+.2f} ms ({per_token / (1000 / d['decode_tps']) * 100:+.1f}% of a direct token)")


if __name__ == "__main__":
    main()

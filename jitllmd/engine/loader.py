"""Loading a .jlm (or a .gguf, converted on the way in) into a runnable model with its tokenizer and template."""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from . import kernels
from .chat import ChatTemplate
from .figures import Where
from .grammar import Grammars
from .jlm import FORMAT_VERSION, JLMFile
from .kv import META, PAGE, SessionKV
from .layers.quant import short_feed
from .memory.devices import compute_dtype, device_info, is_remote, own_memory, spendable_bytes, trim_heap
from .memory.pager import BlockReader, Pager
from .memory.placement import HOST, Placement, Room, layer_of
from .models import DecoderModel, EncoderModel, build_model, family_for
from .pages import KV_DTYPES, KVPages
from .runner import ModelRunner
from .sessions import default_max_seq
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .cluster.link import Cluster

T = TypeVar("T")

__all__ = ["LoadedModel", "cached_conversion", "load_model", "on_own_thread", "spendable_bytes"]


@dataclass
class LoadedModel:
    name: str
    path: Path
    jlm: JLMFile
    model: DecoderModel
    tokenizer: Tokenizer
    chat: ChatTemplate
    context_length: int
    max_seq: int  # default KV capacity of a session
    devices: list[str]  # the devices it was loaded with: its blocks may be placed on these (empty: host only)
    placement: Placement | None = None  # a decoder's blocks on their places; an encoder runs whole on its device
    runner: ModelRunner | None = None  # a decoder's forward over its placed blocks
    cluster: Cluster | None = None  # rank 0's, where the model may have blocks on other ranks

    @property
    def device_ids(self) -> list[str]:
        """The devices holding its blocks now; empty: every block is a host block."""
        return self.placement.device_ids if self.placement is not None else list(self.devices)

    def close(self) -> None:
        """Let go of the weights, the pager's thread and its file now (the engine has stopped)."""
        if self.placement is not None:
            self.placement.close()

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Constrained sampling for this model (engine/grammar.py), its vocabulary side built on first use."""
        return Grammars(self.tokenizer, self.model.cfg.vocab_size)

    @property
    def embeds(self) -> bool:
        """An embedding model (an encoder that pools), not one that generates."""
        return family_for(self.jlm.arch).embeds

    @functools.cached_property
    def num_blocks(self) -> int:
        """Transformer layers plus embed and head, which are blocks too (an encoder has no head)."""
        return len(self.jlm.block_names)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation (the tokenizer holds them)."""
        return list(self.tokenizer.eos_token_ids)

    def new_kv(self, max_seq: int | None = None) -> SessionKV:
        if self.embeds:
            raise ValueError(f"model {self.name} is an embedding model: it keeps no sessions")
        cap = self.max_seq if max_seq is None else max_seq
        if cap < 1:
            raise ValueError(f"max_seq must be >= 1, got {cap}")
        assert self.runner is not None  # a decoder's
        return self.runner.new_kv(min(cap, self.context_length))

    def kv_bytes(self) -> int:
        """Bytes of the KV pages its sessions hold or the prefix cache keeps (a shared page once); read from any
        thread, as a figure."""
        return self.runner.kv_pool.used_bytes() if self.runner is not None else 0

    def kv_pages(self) -> KVPages:
        """Its KV pages and prefix cache now, as figures."""
        if self.runner is None:
            return KVPages(0, 0, 0, 0, 0, 0)
        pool = self.runner.kv_pool
        held, shared, cached, free = pool.counts()
        host, file = pool.store.counts() if pool.store is not None else (0, 0)
        return KVPages(held, shared, cached, free, pool.hits, pool.queries, host, file)

    def largest_session_file(self) -> int:
        """The most bytes a session file of this model takes (engine/session_file.py): K/V of its whole context in
        every layer, its tokens and conversation, and some."""
        assert self.runner is not None  # a decoder's
        pool = self.runner.kv_pool
        return self.context_length * (len(pool.windows) * pool.page_bytes // PAGE + 64) + (1 << 20)

    def where(self) -> Where:
        """Its blocks on devices or the host now, and which devices."""
        if self.placement is None:  # an encoder: whole on its device, or the host
            device_blocks = self.num_blocks if self.device_ids else 0
        else:
            device_blocks = self.placement.num_device_blocks
        return Where(device_blocks, self.num_blocks - device_blocks, tuple(self.device_ids))

    def decode_bytes(self) -> int:
        """Bytes a decode step reads besides KV: the weights, wherever they are, and the hidden state over each seam."""
        if self.placement is None:
            return self.weight_nbytes()
        width = int(self.model.cfg.hidden_size) * 4  # the f32 residual stream crosses each seam
        return self.weight_nbytes() + self.placement.num_seams * width

    def weight_nbytes(self) -> int:
        """Weight bytes a decode step (or an encoder's pass) reads: for a decoder every block but the embedding table,
        of which it reads a row."""
        if self.placement is not None:
            return self.placement.decode_bytes()
        return cast(EncoderModel, self.model).weight_nbytes()


def cached_conversion(gguf_path: Path, cache_dir: Path, on_progress: Callable[[int, int], None] | None = None) -> Path:
    """A .gguf's .jlm in `cache_dir`, converted once: named by the file's path, then its size and mtime (and how it
    converts: a quantized file keeps its quantization). A new conversion removes the ones made from the same path
    before the file changed (a reinstalled package's model, say), so they do not pile up; a process still using one
    keeps its open file. (The .jlm format's version is in the name too: a new one converts again.)"""
    from .convert import convert

    st = gguf_path.stat()
    source = hashlib.sha256(f"{gguf_path.resolve()}".encode()).hexdigest()[:8]
    version = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:auto:{FORMAT_VERSION}".encode()).hexdigest()[:8]
    out = cache_dir / f"{gguf_path.stem}-{source}-{version}.jlm"
    if not out.exists():
        on_own_thread(lambda: convert(gguf_path, out, "auto", on_progress=on_progress))
        for stale in cache_dir.glob(f"{glob.escape(gguf_path.stem)}-{source}-*.jlm"):
            if stale != out:
                stale.unlink(missing_ok=True)
    return out


def on_own_thread(work: Callable[[], T]) -> T:
    """Run torch work on a thread that then exits, taking its CPU thread pool with it.

    The pool belongs to the thread that first runs a parallel op; a pool left on the caller's thread keeps its
    workers spinning against the engine thread's (measured: decode 30 -> 19 tok/s after converting on the main thread).
    """
    box: dict[str, Any] = {}

    def main() -> None:
        try:
            box["result"] = work()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=main, name="convert", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)  # a timeout keeps Ctrl-C responsive
    if "error" in box:
        raise box["error"]
    return box["result"]


def load_model(
    path: str | Path,
    *,
    name: str | None = None,
    devices: list[str] | None = None,
    gpu_layers: int = -1,
    sessions: int = 1,
    max_seq: int | None = None,
    page_budget: int | None = None,
    read_ahead: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    kv_dtype: torch.dtype | str | None = None,
    kv_mem: int | None = None,
    room: Room | None = None,
    cluster: Cluster | None = None,
    shared: tuple[str, str | None] | None = None,
) -> LoadedModel:
    """Open a .jlm and place its blocks: on `devices` (names from the device grammar, `cpu` included) from the head
    backwards, at most `gpu_layers` of them (-1: as many as fit beside the KV of `sessions` sessions), the rest on the
    host, where at most `page_budget` bytes stay resident (None: all) and the others are read for their turn
    (`read_ahead`, the next one while this one runs; None: only where the CPU has cores torch's pool leaves free).
    An encoder runs whole on the first device, or the host. `kv_dtype`: the sessions' K/V (None: the model's own
    choice, f16 for a kept-quantized model, else its compute dtype). `room`: the server's (memory/placement.py): what a
    device may take within -device-mem, and idle models demoted to make it (None: the driver's figure). `cluster`: rank 0's (engine/cluster/link.py),
    where `devices` name other ranks' (`1:cpu`); `shared`: how those ranks find the file in their own -models (the .jlm's
    path, and the .gguf it was converted from, if any). Raises JLMError / ValueError with one-line messages."""
    path = Path(path)
    devices = list(devices or [])
    name = name or path.name.removesuffix(".jlm")
    jlm = JLMFile(path)
    meta = jlm.meta
    first = torch.device(next((d for d in devices if not is_remote(d)), "cpu"))  # another rank's device computes there
    quantized = meta.get("quantization") or {}
    # a quantized model computes in f32 around its projections (its float tensors, norms and biases, are f32)
    # the blocks' weights' dtype (a family may keep its norms in f32 beside bf16 weights: Gemma's 1 + w)
    weights = (jlm.locate(n) for n in jlm.names if n.startswith("blocks.") and n not in quantized)
    stored = next((dtype for dtype, shape, *_ in weights if len(shape) == 2), torch.float32)  # the first is enough
    dtype = compute_dtype(stored, first)
    special = meta.get("special_tokens", {})
    try:
        tokenizer = Tokenizer(
            meta.pop("tokenizer"),  # its JSON lives on in the Tokenizer: the meta lets it go (SmolLM2's: ~5 MB of RSS)
            bos_token_id=special.get("bos_token_id"),
            eos_token_ids=list(special.get("eos_token_ids") or []),
            add_bos_token=bool(special.get("add_bos_token", False)),
        )
    except (ValueError, TypeError, KeyError) as exc:  # a damaged or crafted file's tokenizer or special tokens
        raise ValueError(f"{path}: {exc}") from None
    trim_heap()  # what parsing the tokenizer's JSON freed goes back before the weights come in (Gemma's: ~370 MB at peak)
    chat = ChatTemplate(meta.get("chat_template"), bos_token=special.get("bos_token"), eos_token=special.get("eos_token"))
    context = int(jlm.config.get("max_position_embeddings", 4096))
    if max_seq is not None and max_seq < 1:
        raise ValueError(f"max_seq must be >= 1, got {max_seq}")
    placement = runner = None
    model = build_model(jlm, dtype, first, on_progress)
    if family_for(jlm.arch).embeds:  # an encoder keeps no KV: its room is the longest input it takes
        cap = int(jlm.config.get("max_seq_length", context))
    else:
        if isinstance(kv_dtype, str) and kv_dtype != "auto":  # -kv-dtype's name
            if kv_dtype not in KV_DTYPES:
                raise ValueError(f"kv_dtype must be one of auto, {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
            kv_dtype = KV_DTYPES[kv_dtype]
        if isinstance(kv_dtype, torch.dtype):
            model.kv_dtype = kv_dtype
        sizing = SessionKV(model.kv_pool([META] * model.cfg.num_layers), context)  # no storage: its arithmetic, with the windows it keeps
        cap = min(max_seq, context) if max_seq else default_max_seq(context, sizing.bytes_at)
        kv_layer_bytes = sessions * sizing.bytes_at(cap) // max(1, model.cfg.num_layers)
        remote = _remote_opener(cluster, shared or (str(path), None), jlm, model) if cluster is not None else None
        placement, room_left = _place(model, jlm, name, devices, gpu_layers, kv_layer_bytes, page_budget, read_ahead, on_progress, room, remote, cluster)
        if kv_mem is None:  # a pool wholly in GPU memory: bounded by it, so sessions wait and spill rather than run it out
            kv_mem = _device_kv_room(placement, kv_layer_bytes, room_left)
        types = {str(e.get("type")) for e in quantized.values() if isinstance(e, dict)}
        runner = ModelRunner(model, placement, *short_feed(types, kernels.variant()), sessions=sessions, max_seq=cap, kv_mem=kv_mem)
    trim_heap()  # the tokenizer's JSON parse leaves ~25 MB freed in the heap (SmolLM2's): back to the OS
    return LoadedModel(
        name=name,
        path=path,
        jlm=jlm,
        model=model,
        tokenizer=tokenizer,
        chat=chat,
        context_length=context,
        max_seq=cap,
        devices=devices,
        placement=placement,
        runner=runner,
        cluster=cluster,
    )


def _remote_opener(cluster: Cluster, shared: tuple[str, str | None], jlm: JLMFile, model: Any) -> Callable[[int], Any]:
    """Opens the model on another rank, from that rank's own copy (engine/cluster/remote.py)."""
    from .cluster.remote import RemoteModel

    return lambda rank: RemoteModel.open(cluster.link(rank), shared[0], shared[1], jlm, model.dtype, model.kv_dtype)


def _place(model, jlm: JLMFile, name: str, devices: list[str], gpu_layers: int, kv_layer_bytes: int, page_budget: int | None, read_ahead: bool | None,
           on_progress, room: Room | None, remote: Callable[[int], Any] | None = None, cluster: Cluster | None = None) -> tuple[Placement, Callable[[str], int]]:
    if read_ahead is None:
        # From the page cache a read is a memcpy: on a CPU whose every core runs torch's pool, a reader thread only
        # competes with the step (measured, bench/pager.py on 2 cores: 10% resident 16.5 tok/s without, 13.3 with).
        read_ahead = (os.cpu_count() or 1) > torch.get_num_threads()
    pager = Pager(BlockReader(jlm), model.layouts, budget=page_budget, read_ahead=read_ahead)
    placement = Placement(list(model.layouts), pager, model.build, devices, kv_layer_bytes, remote)
    remote_free = cluster.free_bytes if cluster is not None else None
    driver: Callable[[str], int] = lambda d: spendable_bytes(d, pager.unspent_bytes(), remote_free)  # noqa: E731
    spendable = driver
    if room is not None:
        spendable = lambda d: room.spendable(placement, d, driver(d))  # noqa: E731
        room.prepare(placement, name, devices, gpu_layers, driver, f"room to load {name}")
    places = placement.plan(devices, gpu_layers, spendable)
    placement.gpu_layers = gpu_layers
    try:
        placement.apply(places, [], on_progress)
    except BaseException:
        placement.close()
        raise
    return placement, spendable


_KV_SHARE = 0.9  # of a GPU's memory left free after the weights, what its KV pool may take (vLLM's default share)


def _device_kv_room(placement: Placement, kv_layer_bytes: int, spendable: Callable[[str], int]) -> int | None:
    """-kv-mem's default where every KV layer is on devices with memory of their own (GPUs): the KV placement reserved
    there and a share of what they have free after the weights (within -device-mem); None elsewhere (the host's pages,
    and the CPU's as a device, grow as sessions want them)."""
    places = [p for name, p in zip(placement.names, placement.places) if layer_of(name) is not None]
    if not places or any(p == HOST or is_remote(p) or not own_memory(device_info(p).kind) for p in set(places)):
        return None
    return kv_layer_bytes * len(places) + int(_KV_SHARE * sum(spendable(d) for d in set(places)))

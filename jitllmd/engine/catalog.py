"""The models a server holds: the -models directory, the loaded models by id and file name, and where each runs."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .config import EngineConfig, find_model_file
from .engine import Engine
from .kv import RoomError
from .loader import cached_conversion
from .memory.devices import available_devices, parse_devices, release_host_memory, trim_heap
from .memory.placement import HOST
from .memory.relocation import Relocation, block_held
from .session_dir import SessionDir
from .sessions import Session
from .speculative import SpecConfig

if TYPE_CHECKING:
    from .cluster.link import Cluster

__all__ = ["Catalog", "ModelEntry", "ModelLoading", "ServedModel", "check_id"]

# A model id: parts of letters, digits and . _ : - joined by '/' (org/name, as Hugging Face and vLLM name models), each
# part starting with a letter or digit, so no id reads as a path that leaves a directory ('/x', 'a/../b', 'a//b', 'a/').
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*(?:/[A-Za-z0-9][A-Za-z0-9._:-]*)*")
_MAX_ID = 256
_FILE_SUFFIXES = (".jlm", ".gguf")  # what names a file: never the end of an id


class ModelLoading(LookupError):
    """A request names a model that is still loading: it can run in a moment (a 503, not a 404)."""


@dataclass(frozen=True)
class ServedModel:
    """A loaded model: its id, the other names that reach it, and its engine."""

    id: str
    aliases: tuple[str, ...]
    engine: Engine
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class ModelEntry:
    """One line of the model list: a loaded model, or a .jlm in -models that is not loaded."""

    id: str
    created: int
    loaded: bool
    path: Path
    aliases: tuple[str, ...] = ()  # the other names a loaded model answers to


class Catalog:
    """Loads models with the server's EngineConfig and finds them by the name a client sends.

    A relative file is looked up in `models_dir`; `inside_only` loads (from clients) may not leave it.
    A .gguf is converted once into `cache_dir`.
    """

    def __init__(self, models_dir: Path | None, config: EngineConfig, cache_dir: Path, cluster: Cluster | None = None):
        self.models_dir = models_dir.resolve() if models_dir else None
        self.config = config
        self.cache_dir = cache_dir.resolve()  # a relative -models gives a relative cache; its files are named absolute
        self.cluster = cluster  # rank 0's: other ranks' devices (1:cpu) may hold blocks
        self.devices = self.parse_devices(config.devices)  # raises on unknown names, at start-up
        self.relocation = Relocation(config.device_mem, config.relocate_idle, config.relocate_horizon, config.relocate)
        self._models: dict[str, ServedModel] = {}
        self._loading: dict[str, tuple[str, ...]] = {}  # id -> the names of a model being loaded
        self._lock = threading.Lock()
        self.session_dir = SessionDir(config.session_dir) if config.session_dir is not None else None

    def parse_devices(self, spec: str) -> list[str]:
        """The device grammar, other ranks' devices included where the server is in a cluster."""
        return parse_devices(spec, self.cluster.devices() if self.cluster is not None else None)

    def all_devices(self) -> list[str]:
        """Every device a spec may name: this host's, then each rank's."""
        return available_devices() + (self.cluster.devices() if self.cluster is not None else [])

    def _shared(self, file: str | Path, path: Path) -> tuple[str, str | None]:
        """How another rank finds a model in its own -models: the .jlm's path relative to -models (absolute where it is
        outside), and the .gguf it was converted from (the rank converts its own copy where it lacks the .jlm)."""

        def named(p: Path) -> str:
            return str(p.relative_to(self.models_dir)) if self.models_dir is not None and p.is_relative_to(self.models_dir) else str(p)

        original = self.resolve(str(file))
        return named(path), (named(original) if original != path else None)

    # -- names ----------------------------------------------------------------------------------

    def inside(self, name: str) -> Path:
        """A path clients may name: relative to -models (or absolute) and, links resolved, still inside it."""
        if self.models_dir is None:
            raise PermissionError("the server has no -models directory")
        path = (self.models_dir / Path(name).expanduser()).resolve()
        if not path.is_relative_to(self.models_dir):
            raise PermissionError(f"{name}: outside the -models directory")
        return path

    def resolve(self, file: str, *, inside_only: bool = False) -> Path:
        """The model file a -load argument names: absolute, or relative to -models (else to the working directory).
        `inside_only` (a client's request) may not leave -models."""
        if not inside_only:
            return find_model_file(file, self.models_dir)
        path = self.inside(file)
        if not path.is_file():
            where = " in the model directory" if not Path(file).expanduser().is_absolute() else ""
            raise FileNotFoundError(f"{file}: no such model file{where}")
        return path

    def get(self, name: str) -> ServedModel:
        """The loaded model a client names: by its id, else by another name it answers to (its file name without .jlm).
        No two loaded models share a name (see load). KeyError names what is loaded, and says when `name` is a file."""
        models = self.loaded()
        for m in models:
            if name == m.id:
                return m
        for m in models:
            if name in m.aliases:
                return m
        with self._lock:
            loading = next((i for i, names in self._loading.items() if name in names), None)
        if loading is not None:
            raise ModelLoading(f"model {name!r} is still loading" + (f" (as {loading})" if loading != name else "") + ": try again in a moment")
        loaded = "; ".join(m.id + (f" (also {', '.join(m.aliases)})" if m.aliases else "") for m in models) or "none"
        file = next((e.path.name for e in self.entries() if not e.loaded and name in (e.id, e.path.name)), None)
        if file is not None:
            raise KeyError(f"model {name!r} is not loaded: it is {file} of the model directory, which `jitllmd models -load {file}` loads (loaded: {loaded})")
        if name.lower().endswith(_FILE_SUFFIXES):
            raise KeyError(f"model {name!r} names a file: send a loaded model's id, or its file name without {Path(name).suffix} (loaded: {loaded})")
        raise KeyError(f"model {name!r} is not loaded (loaded: {loaded})")

    def find_session(self, session_id: str) -> tuple[ServedModel, Session]:
        """A named session and the model it belongs to. KeyError when no loaded model has it."""
        for m in self.loaded():
            try:
                return m, m.engine.sessions.get(session_id)
            except KeyError:
                continue
        raise KeyError(f"no session {session_id!r}")

    def loaded(self) -> list[ServedModel]:
        with self._lock:
            return list(self._models.values())

    def entries(self) -> list[ModelEntry]:
        """Loaded models first, then the .jlm files of -models that none of them came from, each named by its file
        name without .jlm, or with it where a loaded model already answers to that (a loaded name wins; no id ends in
        .jlm, so the file's name stays its own). A link that resolves outside -models is not one of them (as a client
        cannot load it, none sees it)."""
        out = [ModelEntry(m.id, m.created, True, m.engine.loaded.path, m.aliases) for m in self.loaded()]
        paths = {e.path.resolve() for e in out}
        names = {name for e in out for name in (e.id, *e.aliases)}
        if self.models_dir is not None and self.models_dir.is_dir():
            for p in sorted(self.models_dir.glob("*.jlm")):
                inside = p.resolve().is_relative_to(self.models_dir)
                if inside and p.is_file() and p.resolve() not in paths:
                    out.append(ModelEntry(p.name if p.stem in names else p.stem, int(p.stat().st_mtime), False, p))
        return out

    # -- loading --------------------------------------------------------------------------------

    def prepare(self, file: str | Path, *, inside_only: bool = False, on_progress: Callable[[int, int], None] | None = None) -> Path:
        """The .jlm a -load argument names: resolved, and converted once into `cache_dir` if it is a GGUF file."""
        path = self.resolve(str(file), inside_only=inside_only)
        if path.suffix == ".gguf" or _is_gguf(path):
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            path = cached_conversion(path, self.cache_dir, on_progress=on_progress)
        return path

    def load(
        self,
        file: str | Path,
        *,
        id: str | None = None,
        aliases: tuple[str, ...] = (),
        inside_only: bool = False,
        on_convert: Callable[[int, int], None] | None = None,
        on_load: Callable[[int, int], None] | None = None,
        devices: str | None = None,
        gpu_layers: int | None = None,
        max_seq: int | None = None,
        draft: str | Path | None = None,
        spec: str | None = None,
        draft_max: int | None = None,
        kv_dtype: str | None = None,
    ) -> ServedModel:
        """Load a model file under `id` (default: m-<hash of its path>; see check_id), also answering to `aliases` and
        its file name without .jlm where no other loaded model does. devices, gpu_layers, max_seq, spec, draft_max and kv_dtype
        override the server's flags for this model; `draft`: its draft model's file, found as a model file is (for
        speculative decoding: spec draft unless spec says otherwise). Raises ValueError/OSError with one-line messages."""
        config = dataclasses.replace(  # validates
            self.config,
            devices=self.config.devices if devices is None else devices,
            gpu_layers=self.config.gpu_layers if gpu_layers is None else gpu_layers,
            max_seq=self.config.max_seq if max_seq is None else max_seq,
            spec=spec or ("draft" if draft else self.config.spec),  # a draft named for this model is its drafter
            draft_max=self.config.draft_max if draft_max is None else draft_max,
            kv_dtype=kv_dtype or self.config.kv_dtype,
        )
        speculative = SpecConfig(config.spec, str(self.prepare(draft, inside_only=inside_only)) if draft else None, config.draft_max)
        placed_on = self.devices if devices is None else self.parse_devices(devices)
        if id is not None:
            check_id(id)
        path = self.prepare(file, inside_only=inside_only, on_progress=on_convert)
        model_id = id or "m-" + hashlib.sha256(str(path).encode()).hexdigest()[:8]
        with self._lock:
            self._names(model_id, (*aliases, path.stem))  # refuses a taken id before the load, which takes a while
            if model_id in self._loading:
                raise ValueError(f"a model named {model_id!r} is already being loaded")
            self._loading[model_id] = (model_id, *aliases, path.stem)
        try:
            engine = self._engine(path, model_id, config, placed_on, file, on_load, speculative)
        finally:
            with self._lock:
                del self._loading[model_id]
        try:
            with self._lock:
                names = self._names(model_id, (*aliases, path.stem))  # again: another load may have finished meanwhile
                served = ServedModel(model_id, names, engine)
                self._models[model_id] = served
                self.relocation.register(model_id, engine)
                engine.after_step = functools.partial(self.relocation.promote, engine)
        except ValueError:
            engine.stop()
            raise
        return served

    def _engine(self, path: Path, model_id: str, config: EngineConfig, placed_on: list[str], file: str | Path,
                on_load: Callable[[int, int], None] | None, spec: SpecConfig | None = None) -> Engine:
        return Engine.load(
            path,
            name=model_id,
            devices=placed_on,
            gpu_layers=config.gpu_layers,
            sessions=config.sessions,
            max_seq=config.max_seq,
            page_budget=config.maxmem,
            max_batch=0 if config.max_batch == 0 else min(config.max_batch, config.sessions),
            host_rows=config.host_concurrency,
            split_rows=config.device_concurrency,
            row_limit=config.sessions,
            prompt_chunk=config.prompt_chunk,
            joint_steps=config.joint_steps,
            spec=spec,
            prefix_cache=config.prefix_cache,
            kv_dtype=config.kv_dtype,
            kv_mem=config.kv_mem,
            on_progress=on_load,
            room=self.relocation,
            cluster=self.cluster,
            shared=self._shared(file, path) if self.cluster is not None else None,
        )

    def _names(self, model_id: str, aliases: tuple[str, ...]) -> tuple[str, ...]:
        """The aliases a new model gets: those no loaded model answers to. ValueError when one answers to its id.
        The caller holds the lock."""
        taken = {name for m in self._models.values() for name in (m.id, *m.aliases)}
        if model_id in taken:
            owner = next(m.id for m in self._models.values() if model_id in (m.id, *m.aliases))
            raise ValueError(f"a model named {model_id!r} is already loaded" + (f" (model {owner} answers to it)" if owner != model_id else ""))
        return tuple(a for a in dict.fromkeys(aliases) if a != model_id and a not in taken)

    # -- placement that may take room from other models (blocking: the caller runs it off its event loop) ----------

    def replace(self, served: ServedModel, devices: list[str], gpu_layers: int = -1, session: Session | None = None) -> None:
        """Re-place a model's blocks over `devices` (SetPlacement): idle relocation-enabled models first give up what
        the new placement wants of the devices, then its engine re-places them between steps."""
        placement = served.engine.loaded.placement
        if placement is not None:
            self.relocation.prepare(placement, served.id, devices, gpu_layers, served.engine.spendable_driver, f"room to place {served.id}")
        served.engine.replace(devices, gpu_layers, session).result()

    def relocate(self, served: ServedModel, first: int, last: int, to: str, session: Session | None = None) -> None:
        """Blocks first..last of a model to `to` (RelocateBlocks): where a device is short, idle relocation-enabled
        models make room; under -device-mem a move that still does not fit is refused (RoomError, both figures named).
        The engine's job checks the range and the device."""
        placement = served.engine.loaded.placement
        if placement is not None and to != HOST and to in placement.devices and 0 <= first <= last < len(placement.places):
            need = sum(block_held(placement, i) for i in range(first, last + 1) if placement.places[i] != to)
            room = lambda: self.relocation.room(to, served.engine.spendable_driver(to))  # noqa: E731
            if need > room():
                self.relocation.make_room(to, need - room(), served.id, f"room to move {served.id}'s blocks {first}:{last}")
            budget = self.relocation.device_mem
            if budget is not None and need > room():
                raise RoomError(f"blocks {first}:{last} of {served.id} need {need / 2**20:.1f} MiB of {to}, which has "
                                f"{room() / 2**20:.1f} MiB left of its {budget / 2**20:.0f} MiB (-device-mem)")
        served.engine.relocate(first, last, to, session).result()

    def unload(self, name: str, timeout: float | None = None) -> None:
        """Stop a model's engine (its requests end as cancelled) and forget it. `timeout`: see Engine.stop."""
        served = self.get(name)
        if self.session_dir is not None:  # its named sessions outlive it
            self.session_dir.keep(served.engine)
        with self._lock:
            self._models.pop(served.id, None)
            self.relocation.unregister(served.id)
            served.engine.after_step = None
        served.engine.stop(timeout)
        weakref.finalize(served.engine, trim_heap)  # requests still streaming hold it a moment longer
        del served
        release_host_memory()

    def bring_back_sessions(self) -> list[str]:
        """The named sessions -session-dir kept, restored into the loaded models they were saved from."""
        return self.session_dir.bring_back([m.engine for m in self.loaded()]) if self.session_dir is not None else []

    def cancel_all(self) -> None:
        """Cancel every request of every model (a server that must stop now)."""
        for m in self.loaded():
            m.engine.cancel_all()

    def stop(self, timeout: float | None = None) -> None:
        """Unload every model; an engine still inside a step after `timeout` seconds is left to a process on its way out."""
        for m in self.loaded():
            self.unload(m.id, timeout)


def check_id(model_id: str) -> None:
    """A model id clients can send: letters, digits and . _ : - in parts joined by '/' (Qwen/Qwen2.5-0.5B-Instruct),
    each part starting with a letter or digit; not ending in .jlm or .gguf, which name files. ValueError says which."""
    if len(model_id) > _MAX_ID or not _ID.fullmatch(model_id):
        raise ValueError(f"model id {model_id!r}: use letters, digits and . _ : - (at most {_MAX_ID}), in parts joined by '/' "
                         "(as in Qwen/Qwen2.5-0.5B-Instruct), each starting with a letter or digit")
    if model_id.lower().endswith(_FILE_SUFFIXES):
        raise ValueError(f"model id {model_id!r}: an id may not end in .jlm or .gguf, which name model files")


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"

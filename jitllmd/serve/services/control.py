"""The Connect control plane: its error mapping, lookups, and the model, device and session services."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from ...engine import session_file
from ...engine.catalog import Catalog, ModelLoading, ServedModel
from ...engine.chat import ChatTemplateError
from ...engine.cluster.link import RankError
from ...engine.convert import ConvertError, convert
from ...engine.jlm import JLMError, JLMFile
from ...engine.kernels import describe as describe_kernels
from ...engine.kv import RoomError
from ...engine.loader import on_own_thread
from ...engine.memory.devices import available_devices, cpu_name, device_info, host_memory, is_remote, own_memory, quantized_products
from ...engine.request import RequestState
from ...engine.sessions import Session
from ...gen.jitllm.v1 import device_pb2 as dev
from ...gen.jitllm.v1 import model_pb2 as mdl
from ...gen.jitllm.v1 import session_pb2 as ses
from ...gen.jitllm.v1.device_connect import DeviceService
from ...gen.jitllm.v1.model_connect import ModelService
from ...gen.jitllm.v1.session_connect import SessionService
from ..prompt import off_loop
from ..tokenize import detokenize_ids, token_strs, tokenize_text

__all__ = ["Devices", "ErrorMapper", "Models", "Sessions", "model_of", "session_of"]

log = logging.getLogger("jitllmd.serve")

_CHUNK = 1 << 20  # bytes of a session file per message
_STATE = {RequestState.WAITING: ses.REQUEST_STATE_WAITING, RequestState.PREFILL: ses.REQUEST_STATE_PREFILL, RequestState.DECODE: ses.REQUEST_STATE_DECODE}


class ErrorMapper:
    """Interceptor: the engine's one-line errors become Connect codes; anything else is a bug, logged, and
    reaches the client as `internal` with a generic message (never the exception's text). Paths in messages are
    named relative to -models (a client never learns where the server keeps its files)."""

    def __init__(self, catalog: Catalog | None = None):
        self.models_dir = catalog.models_dir if catalog is not None else None

    def _error(self, exc: Exception, ctx: Any) -> ConnectError:
        err = _connect_error(exc, ctx)
        message = _hide_paths(self.models_dir, err.message)
        return err if message == err.message else ConnectError(err.code, message)

    async def intercept_unary(self, call_next, request, ctx):  # type: ignore[no-untyped-def]
        try:
            return await call_next(request, ctx)
        except Exception as exc:
            raise self._error(exc, ctx) from None

    async def intercept_client_stream(self, call_next, request, ctx):  # type: ignore[no-untyped-def]
        try:
            return await call_next(request, ctx)
        except Exception as exc:
            raise self._error(exc, ctx) from None

    async def intercept_server_stream(self, call_next, request, ctx):  # type: ignore[no-untyped-def]
        try:
            async for msg in call_next(request, ctx):
                yield msg
        except Exception as exc:
            raise self._error(exc, ctx) from None


def _connect_error(exc: Exception, ctx: Any) -> ConnectError:
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, RoomError):
        return ConnectError(Code.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, (RankError, ModelLoading)):  # another rank is gone or does not answer; a model still loading
        return ConnectError(Code.UNAVAILABLE, str(exc))
    if isinstance(exc, FileNotFoundError):
        return ConnectError(Code.NOT_FOUND, str(exc))
    if isinstance(exc, PermissionError):
        return ConnectError(Code.PERMISSION_DENIED, str(exc))
    if isinstance(exc, (ValueError, ChatTemplateError, JLMError, ConvertError)):
        return ConnectError(Code.INVALID_ARGUMENT, str(exc))
    log.exception("%s failed", getattr(ctx.method, "name", "rpc"), exc_info=exc)
    return ConnectError(Code.INTERNAL, "internal error (logged on the server)")


def _not_found(what: str) -> ConnectError:
    return ConnectError(Code.NOT_FOUND, what)


def model_of(catalog: Catalog, name: str) -> ServedModel:
    if not name:
        raise ConnectError(Code.INVALID_ARGUMENT, "model: this field is required")
    try:
        return catalog.get(name)
    except KeyError as exc:
        raise _not_found(str(exc.args[0])) from None


def session_of(catalog: Catalog, session_id: str) -> tuple[ServedModel, Session]:
    if not session_id:
        raise ConnectError(Code.INVALID_ARGUMENT, "session_id: this field is required")
    try:
        return catalog.find_session(session_id)
    except KeyError:
        raise _not_found(f"no session {session_id!r}") from None


def _hide_paths(models_dir: Path | None, message: str) -> str:
    """`message` with the model directory's own path taken out of the paths it names: relative to -models."""
    return message.replace(str(models_dir) + os.sep, "") if models_dir is not None else message


def _relative(catalog: Catalog, path: Path) -> str:
    if catalog.models_dir is not None and path.resolve().is_relative_to(catalog.models_dir):
        return str(path.resolve().relative_to(catalog.models_dir))
    return str(path)


def _model_message(catalog: Catalog, served: ServedModel) -> mdl.Model:
    loaded = served.engine.loaded
    return mdl.Model(
        id=served.id,
        aliases=list(served.aliases),
        file=_relative(catalog, loaded.path),
        loaded=True,
        arch=loaded.jlm.arch,
        num_blocks=loaded.num_blocks,
        weight_bytes=loaded.weight_nbytes(),
        context_length=loaded.context_length,
        max_seq=loaded.max_seq,
        device_ids=list(loaded.device_ids),
        has_chat_template=loaded.chat.available,
        created_unix=served.created,
        vocab_size=loaded.tokenizer.vocab_size,
        dtype=str(loaded.model.dtype).removeprefix("torch."),
        sessions=len(served.engine.sessions.list()),
        weight_types=loaded.jlm.stored_types(),
    )


def _file_model(catalog: Catalog, entry_id: str, path: Path, created: int) -> mdl.Model:
    jlm = JLMFile(path)
    try:
        return mdl.Model(
            id=entry_id, file=_relative(catalog, path), loaded=False, arch=jlm.arch, num_blocks=len(jlm.block_names),
            weight_bytes=path.stat().st_size, context_length=int(jlm.config.get("max_position_embeddings", 0)),
            has_chat_template=bool(jlm.meta.get("chat_template")), created_unix=created, weight_types=jlm.stored_types(),
        )
    finally:
        jlm.close()


def _session_message(served: ServedModel, s: Session) -> ses.Session:
    return ses.Session(
        id=s.id, model=served.id, position=s.position, max_seq=s.max_seq, device_ids=list(served.engine.loaded.device_ids),
        busy=s.busy, created_unix=int(s.created), kv_bytes=s.kv.nbytes(), num_messages=len(s.messages),
    )


# -- ModelService ---------------------------------------------------------------------------------------------


class Models(ModelService):
    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    async def list_models(self, request: mdl.ListModelsRequest, ctx: Any) -> mdl.ListModelsResponse:
        out = []
        for e in self.catalog.entries():
            if e.loaded:
                out.append(_model_message(self.catalog, self.catalog.get(e.id)))
            else:
                out.append(self._listed_file(e.id, e.path, e.created))
        return mdl.ListModelsResponse(models=out)

    def _listed_file(self, entry_id: str, path: Path, created: int) -> mdl.Model:
        """A file of the model directory as the list shows it. One that cannot be read (damaged, crafted) is listed
        plainly, without an arch and with its `error`: one file never breaks the list."""
        try:
            return _file_model(self.catalog, entry_id, path, created)
        except (ValueError, OSError) as exc:  # JLMError; or what the wire cannot carry
            error = _hide_paths(self.catalog.models_dir, str(exc))
        except Exception:  # a reader's bug: logged, and still only this file's
            log.exception("listing %s", _relative(self.catalog, path))
            error = "cannot be read (logged on the server)"
        return mdl.Model(id=entry_id, file=_relative(self.catalog, path), loaded=False, created_unix=created, error=error)

    async def get_model(self, request: mdl.GetModelRequest, ctx: Any) -> mdl.GetModelResponse:
        """A loaded model by id or alias, else a .jlm of -models by the name the list gives it (a loaded name wins)."""
        if not request.model:
            raise ConnectError(Code.INVALID_ARGUMENT, "model: this field is required")
        try:
            return mdl.GetModelResponse(model=_model_message(self.catalog, self.catalog.get(request.model)))
        except KeyError as exc:
            for e in self.catalog.entries():
                if e.id == request.model:
                    return mdl.GetModelResponse(model=_file_model(self.catalog, e.id, e.path, e.created))
            raise _not_found(str(exc.args[0])) from None

    async def load_model(self, request: mdl.LoadModelRequest, ctx: Any) -> mdl.LoadModelResponse:
        if not request.file:
            raise ConnectError(Code.INVALID_ARGUMENT, "file: this field is required")
        kw: dict[str, Any] = {"inside_only": True, "id": request.id or None}
        if request.devices:
            kw["devices"] = request.devices
        if request.HasField("gpu_layers"):
            kw["gpu_layers"] = request.gpu_layers
        if request.HasField("max_seq"):
            kw["max_seq"] = request.max_seq
        if request.draft:
            kw["draft"] = request.draft  # inside the model directory, as file is
        if request.spec:
            kw["spec"] = request.spec
        if request.HasField("draft_max"):
            kw["draft_max"] = request.draft_max
        if request.kv_dtype:
            kw["kv_dtype"] = request.kv_dtype
        served = await asyncio.to_thread(self.catalog.load, request.file, **kw)
        log.info("loaded %s as %s", request.file, served.id)
        return mdl.LoadModelResponse(model=_model_message(self.catalog, served))

    async def unload_model(self, request: mdl.UnloadModelRequest, ctx: Any) -> mdl.UnloadModelResponse:
        served = model_of(self.catalog, request.model)
        running, waiting = served.engine.snapshot()
        sessions = len(served.engine.sessions.list())
        await asyncio.to_thread(self.catalog.unload, served.id)
        log.info("unloaded %s", served.id)
        return mdl.UnloadModelResponse(cancelled_requests=len(running) + len(waiting), closed_sessions=sessions)

    async def convert(self, request: mdl.ConvertRequest, ctx: Any) -> mdl.ConvertResponse:
        if self.catalog.models_dir is None:
            raise ConnectError(Code.FAILED_PRECONDITION, "the server has no -models directory to convert in")
        if not request.source or not request.output:
            raise ConnectError(Code.INVALID_ARGUMENT, "source and output are required")
        src, dst = self.catalog.inside(request.source), self.catalog.inside(request.output)  # PermissionError: permission_denied
        if dst.suffix != ".jlm":
            raise ConnectError(Code.INVALID_ARGUMENT, f"output {request.output!r}: the file name must end in .jlm")
        if dst.exists() and not request.force:
            raise ConnectError(Code.ALREADY_EXISTS, f"output {request.output!r} exists: set force to overwrite it")
        result = await asyncio.to_thread(on_own_thread, lambda: convert(src, dst, request.dtype or "auto"))
        return mdl.ConvertResponse(
            output=_relative(self.catalog, result.path), arch=result.arch, num_tensors=result.num_tensors,
            num_params=result.num_params, bytes=result.nbytes, seconds=result.seconds,
        )

    async def tokenize(self, request: mdl.TokenizeRequest, ctx: Any) -> mdl.TokenizeResponse:
        """/tokenize's path (serve/tokenize.py): past its bound, RoomError is resource_exhausted."""
        served = model_of(self.catalog, request.model)
        ids = await tokenize_text(served, request.text, add_special_tokens=request.add_special_tokens, param="text")
        tokens = await off_loop(token_strs, served.engine.loaded.tokenizer, ids, size=len(ids))
        return mdl.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def detokenize(self, request: mdl.DetokenizeRequest, ctx: Any) -> mdl.DetokenizeResponse:
        """/detokenize's path: an id outside the vocabulary is invalid_argument (its ValueError)."""
        served = model_of(self.catalog, request.model)
        text = await detokenize_ids(served, list(request.token_ids), skip_special_tokens=request.skip_special_tokens, param="token_ids")
        return mdl.DetokenizeResponse(text=text)

    async def apply_chat_template(self, request: mdl.ApplyChatTemplateRequest, ctx: Any) -> mdl.ApplyChatTemplateResponse:
        loaded = model_of(self.catalog, request.model).engine.loaded
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        text = await off_loop(loaded.chat.render, messages, add_generation_prompt=request.add_generation_prompt)
        return mdl.ApplyChatTemplateResponse(text=text, token_ids=await off_loop(loaded.tokenizer.encode, text))


# -- DeviceService --------------------------------------------------------------------------------------------


class Devices(DeviceService):
    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def _budgets(self) -> tuple[int | None, int]:
        """The loaded models' host page budgets together (None when none has one), and the part not yet resident."""
        pagers = [m.engine.loaded.placement.pager for m in self.catalog.loaded() if m.engine.loaded.placement is not None]
        budgeted = [p for p in pagers if p.budget is not None]
        if not budgeted:
            return self.catalog.config.maxmem, self.catalog.config.maxmem or 0
        return sum(p.budget or 0 for p in budgeted), sum(p.unspent_bytes() for p in budgeted)

    def _device(self, device_id: str) -> dev.Device:
        if is_remote(device_id):
            return self._remote_device(device_id)
        info = device_info(device_id)
        unspent = self._budgets()[1]  # the pager may still read this much into host memory
        spendable = max(0, info.free_bytes - unspent) if info.kind == "cpu" else info.free_bytes
        relocation = self.catalog.relocation
        out = dev.Device(
            id=info.id, kind=info.kind, name=info.name, total_bytes=info.total_bytes, free_bytes=info.free_bytes,
            spendable_bytes=relocation.room(info.id, spendable), opened=info.id in self.catalog.devices, held_bytes=relocation.used(info.id),
            quantized=quantized_products(info.kind),
        )
        out.reachable = True
        if relocation.device_mem is not None:
            out.budget_bytes = relocation.device_mem
        return out

    def _remote_device(self, device_id: str) -> dev.Device:
        """Another rank's device, with the memory it last reported (engine/cluster/link.py asks every few seconds)."""
        assert self.catalog.cluster is not None
        link, info = self.catalog.cluster.device(device_id)
        relocation = self.catalog.relocation
        out = dev.Device(
            id=device_id, kind=info["kind"], name=info["name"], total_bytes=info["total"], free_bytes=info["free"],
            spendable_bytes=relocation.room(device_id, info["free"]) if link.alive else 0, opened=device_id in self.catalog.devices,
            held_bytes=relocation.used(device_id), rank=link.rank, host=link.host, reachable=link.alive, quantized=quantized_products(info["kind"]),
        )
        if relocation.device_mem is not None:
            out.budget_bytes = relocation.device_mem
        return out

    async def list_devices(self, request: dev.ListDevicesRequest, ctx: Any) -> dev.ListDevicesResponse:
        total, available = host_memory()
        kernels = await asyncio.to_thread(describe_kernels)  # a build, if no model has made one yet (seconds, once)
        host = dev.HostMemory(total_bytes=total, available_bytes=available, num_cpus=os.cpu_count() or 1, cpu_name=cpu_name(), kernels=kernels)
        budget = self._budgets()[0]
        if budget is not None:
            host.page_budget_bytes = budget
        return dev.ListDevicesResponse(devices=[self._device(d) for d in self.catalog.all_devices()], host=host)

    async def get_device(self, request: dev.GetDeviceRequest, ctx: Any) -> dev.GetDeviceResponse:
        if request.device not in self.catalog.all_devices():
            raise _not_found(f"no device {request.device!r} here (devices: {', '.join(self.catalog.all_devices())})")
        return dev.GetDeviceResponse(device=self._device(request.device))

    async def get_memory_topology(self, request: dev.GetMemoryTopologyRequest, ctx: Any) -> dev.GetMemoryTopologyResponse:
        total, available = host_memory()
        infos = [device_info(d) for d in available_devices()]
        shared = [i.id for i in infos if not own_memory(i.kind)]
        domains = [dev.MemoryDomain(name="host", device_ids=shared, total_bytes=total, free_bytes=available)]
        for info in infos:
            if own_memory(info.kind):
                domains.append(dev.MemoryDomain(name=info.id, device_ids=[info.id], total_bytes=info.total_bytes, free_bytes=info.free_bytes))
        cluster = self.catalog.cluster
        for rank, link in sorted(cluster.links.items()) if cluster is not None else []:  # each other rank's host memory, then its GPUs
            cpus = [r for r in link.devices if not own_memory(r["kind"])]
            if cpus:
                domains.append(dev.MemoryDomain(name=f"{rank}:host", device_ids=[f"{rank}:{r['id']}" for r in cpus], total_bytes=cpus[0]["total"], free_bytes=cpus[0]["free"]))
            for r in link.devices:
                if own_memory(r["kind"]):
                    domains.append(dev.MemoryDomain(name=f"{rank}:{r['id']}", device_ids=[f"{rank}:{r['id']}"], total_bytes=r["total"], free_bytes=r["free"]))
        return dev.GetMemoryTopologyResponse(domains=domains)


# -- SessionService -------------------------------------------------------------------------------------------


class Sessions(SessionService):
    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    async def create_session(self, request: ses.CreateSessionRequest, ctx: Any) -> ses.CreateSessionResponse:
        served = model_of(self.catalog, request.model)
        loaded = served.engine.loaded
        asked = self.catalog.parse_devices(request.devices) if request.devices else []
        if any(d not in loaded.devices for d in asked):
            where = ", ".join(loaded.devices) or "no device"
            raise ConnectError(
                Code.FAILED_PRECONDITION,
                f"devices {request.devices!r}: model {served.id} was loaded with {where}; a session's KV lives with its model's blocks, on those devices or the host",
            )
        max_seq = request.max_seq if request.HasField("max_seq") else None
        if max_seq is not None and not 1 <= max_seq <= loaded.context_length:
            raise ConnectError(Code.INVALID_ARGUMENT, f"max_seq must be between 1 and the model's context {loaded.context_length}, got {max_seq}")
        session = served.engine.new_session(max_seq)
        return ses.CreateSessionResponse(session=_session_message(served, session))

    async def get_session(self, request: ses.GetSessionRequest, ctx: Any) -> ses.GetSessionResponse:
        return ses.GetSessionResponse(session=_session_message(*session_of(self.catalog, request.session_id)))

    async def list_sessions(self, request: ses.ListSessionsRequest, ctx: Any) -> ses.ListSessionsResponse:
        models = [model_of(self.catalog, request.model)] if request.model else self.catalog.loaded()
        return ses.ListSessionsResponse(sessions=[_session_message(m, s) for m in models for s in m.engine.sessions.list()])

    async def close_session(self, request: ses.CloseSessionRequest, ctx: Any) -> ses.CloseSessionResponse:
        served, session = session_of(self.catalog, request.session_id)
        if session.busy:
            raise ConnectError(Code.FAILED_PRECONDITION, f"session {session.id} is running a request: cancel it or let it finish first")
        served.engine.sessions.close(session.id)
        session.reset()
        if self.catalog.session_dir is not None:
            self.catalog.session_dir.forget(session.id)
        return ses.CloseSessionResponse()

    async def reset_session(self, request: ses.ResetSessionRequest, ctx: Any) -> ses.ResetSessionResponse:
        served, session = session_of(self.catalog, request.session_id)
        if session.busy:
            raise ConnectError(Code.FAILED_PRECONDITION, f"session {session.id} is running a request: cancel it or let it finish first")
        session.reset()
        return ses.ResetSessionResponse(session=_session_message(served, session))

    async def save_session(self, request: ses.SaveSessionRequest, ctx: Any) -> AsyncIterator[ses.SessionChunk]:
        served, session = session_of(self.catalog, request.session_id)
        data = await asyncio.wrap_future(served.engine.save_session(session))
        for at in range(0, len(data), _CHUNK):
            yield ses.SessionChunk(data=data[at : at + _CHUNK])

    async def restore_session(self, request: AsyncIterator[ses.SessionChunk], ctx: Any) -> ses.RestoreSessionResponse:
        parts: list[bytes] = []
        model, size = "", 0
        largest = max((m.engine.loaded.largest_session_file() for m in self.catalog.loaded() if m.engine.loaded.runner is not None), default=0)
        async for chunk in request:
            model = model or chunk.model
            size += len(chunk.data)
            if size > largest:  # no loaded model holds a session this big
                raise ConnectError(Code.INVALID_ARGUMENT, f"a session file of more than {largest} bytes: larger than any loaded model's longest session")
            parts.append(chunk.data)
        saved = await off_loop(session_file.load, b"".join(parts), size=size)
        served = model_of(self.catalog, model) if model else self._saved_from(saved)
        sid = str(saved.meta.get("id") or "")
        free = bool(sid) and not any(s.id == sid for m in self.catalog.loaded() for s in m.engine.sessions.list())
        session = await asyncio.wrap_future(served.engine.restore_session(saved, sid if free else None))
        return ses.RestoreSessionResponse(session=_session_message(served, session), positions=saved.length)

    def _saved_from(self, saved: session_file.SavedSession) -> ServedModel:
        """The loaded model a session file was saved from: by its name, else by its weights."""
        wanted = saved.model
        models = [m for m in self.catalog.loaded() if m.engine.loaded.runner is not None]
        for m in models:
            if m.id == wanted.get("name") or session_file.identity(m.engine.loaded)["fingerprint"] == wanted.get("fingerprint"):
                return m
        raise ConnectError(Code.NOT_FOUND, f"the session was saved from model {wanted.get('name')!r} ({wanted.get('file')}), which is not loaded here: "
                                           "load it, or name a model")

    async def get_device_queue(self, request: ses.GetDeviceQueueRequest, ctx: Any) -> ses.GetDeviceQueueResponse:
        models = [model_of(self.catalog, request.model)] if request.model else self.catalog.loaded()
        now = time.perf_counter()
        queues = []
        for m in models:
            running, waiting = m.engine.snapshot()
            entry = lambda r: ses.QueueEntry(
                request_id=r.request_id, session_id=r.session.id, state=_STATE.get(r.state, ses.REQUEST_STATE_UNSPECIFIED),
                prompt_tokens=len(r.prompt_ids), generated_tokens=len(r.output_ids), age_ms=(now - r.t_arrival) * 1000,
            )
            queues.append(ses.ModelQueue(
                model=m.id, device_ids=list(m.engine.loaded.device_ids), max_rows=m.engine.scheduler.max_batch,
                running=[entry(r) for r in running], waiting=[entry(r) for r in waiting],
            ))
        return ses.GetDeviceQueueResponse(queues=queues)

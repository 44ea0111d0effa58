"""The Connect control plane of a real server: the generated clients (JSON and binary), a stock grpcio channel over
h2c, gRPC-Web, curl-shaped JSON, error codes per service, and sessions continued through the OpenAI route."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from connectrpc.code import Code
from connectrpc.compat import google_protobuf_json_codec
from connectrpc.errors import ConnectError

from jitllmd.gen.jitllm.v1 import common_pb2 as common
from jitllmd.gen.jitllm.v1 import device_pb2 as dev
from jitllmd.gen.jitllm.v1 import inference_pb2 as inf
from jitllmd.gen.jitllm.v1 import model_pb2 as mdl
from jitllmd.gen.jitllm.v1 import placement_pb2 as plc
from jitllmd.gen.jitllm.v1 import session_pb2 as ses
from jitllmd.gen.jitllm.v1 import telemetry_pb2 as tel
from jitllmd.gen.jitllm.v1.device_connect import DeviceServiceClientSync
from jitllmd.gen.jitllm.v1.inference_connect import InferenceServiceClientSync
from jitllmd.gen.jitllm.v1.model_connect import ModelServiceClientSync
from jitllmd.gen.jitllm.v1.placement_connect import PlacementServiceClientSync
from jitllmd.gen.jitllm.v1.session_connect import SessionServiceClientSync
from jitllmd.gen.jitllm.v1.telemetry_connect import TelemetryServiceClientSync

ROOT = Path(__file__).resolve().parent.parent
GREEDY = common.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["binary", "json"])
def clients(request, tiny_server):
    kw = {"send_compression": None}
    if request.param == "json":
        kw["codec"] = google_protobuf_json_codec()
    made = {
        "models": ModelServiceClientSync(tiny_server.url, **kw),
        "devices": DeviceServiceClientSync(tiny_server.url, **kw),
        "sessions": SessionServiceClientSync(tiny_server.url, **kw),
        "placement": PlacementServiceClientSync(tiny_server.url, **kw),
        "inference": InferenceServiceClientSync(tiny_server.url, **kw),
        "telemetry": TelemetryServiceClientSync(tiny_server.url, **kw),
    }
    yield made
    for c in made.values():
        c.close()


def code_of(call) -> Code:
    with pytest.raises(ConnectError) as exc:
        call()
    return exc.value.code


def test_every_service_through_the_generated_client(clients, tiny_server):
    models = clients["models"].list_models(mdl.ListModelsRequest()).models
    assert [(m.id, m.loaded) for m in models] == [("tiny", True), ("spare", False)]
    tiny = clients["models"].get_model(mdl.GetModelRequest(model="tiny")).model
    assert tiny.num_blocks == 4 and tiny.arch == "llama" and tiny.has_chat_template and tiny.dtype == "float32"
    ids = clients["models"].tokenize(mdl.TokenizeRequest(model="tiny", text="hello there")).token_ids
    assert clients["models"].detokenize(mdl.DetokenizeRequest(model="tiny", token_ids=ids)).text == "hello there"
    chat = clients["models"].apply_chat_template(mdl.ApplyChatTemplateRequest(model="tiny", messages=[common.ChatMessage(role="user", content="hi")], add_generation_prompt=True))
    assert chat.text == "<|user|>hi</s><|assistant|>"

    listed = clients["devices"].list_devices(dev.ListDevicesRequest())
    assert listed.devices[0].id == "cpu" and listed.host.total_bytes > 0 and listed.host.num_cpus >= 1
    assert listed.host.kernels and f"  kernels: {listed.host.kernels}\n" in tiny_server.log  # and serve's start line names them
    assert clients["devices"].get_device(dev.GetDeviceRequest(device="cpu")).device.total_bytes == listed.devices[0].total_bytes
    assert clients["devices"].get_memory_topology(dev.GetMemoryTopologyRequest()).domains[0].name == "host"

    placement = clients["placement"].get_placement(plc.GetPlacementRequest(model="tiny")).placement
    assert [b.name for b in placement.blocks] == ["embed", "blocks.0", "blocks.1", "head"] and placement.host_blocks == 4
    assert len(clients["placement"].get_residency(plc.GetResidencyRequest(model="tiny")).blocks) == 4

    done = clients["inference"].complete(inf.GenerateRequest(model="tiny", prompt="abc", max_tokens=5, sampling=GREEDY, ignore_eos=True))
    assert done.finished.finish_reason == common.FINISH_REASON_LENGTH and len(done.token_ids) == 5
    assert done.finished.usage.completion_tokens == 5 and done.finished.figures.host_blocks == 4
    events = list(clients["inference"].generate(inf.GenerateRequest(model="tiny", prompt="abc", max_tokens=5, sampling=GREEDY, ignore_eos=True)))
    assert events[0].WhichOneof("event") == "started" and events[-1].WhichOneof("event") == "finished"
    assert "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta") == done.text

    stats = clients["telemetry"].get_stats(tel.GetStatsRequest())
    assert stats.models[0].model == "tiny" and stats.generated_tokens >= 10 and stats.rss_bytes > 0
    watched = clients["telemetry"].watch_stats(tel.WatchStatsRequest(interval_ms=100))
    first, second = next(watched), next(watched)
    watched.close()
    assert second.uptime_s > first.uptime_s
    info = clients["telemetry"].get_server_info(tel.GetServerInfoRequest())
    assert info.version and info.address.startswith("http://127.0.0.1:") and info.models_dir.endswith("models")


def test_error_codes_per_service(clients):
    m, s, p, i = clients["models"], clients["sessions"], clients["placement"], clients["inference"]
    assert code_of(lambda: m.get_model(mdl.GetModelRequest(model="nope"))) == Code.NOT_FOUND
    assert code_of(lambda: m.load_model(mdl.LoadModelRequest(file="../../etc/passwd"))) == Code.PERMISSION_DENIED
    assert code_of(lambda: m.load_model(mdl.LoadModelRequest(file="missing.jlm"))) == Code.NOT_FOUND
    assert code_of(lambda: m.load_model(mdl.LoadModelRequest(file=""))) == Code.INVALID_ARGUMENT
    assert code_of(lambda: m.unload_model(mdl.UnloadModelRequest(model="nope"))) == Code.NOT_FOUND
    assert code_of(lambda: m.detokenize(mdl.DetokenizeRequest(model="tiny", token_ids=[10**6]))) == Code.INVALID_ARGUMENT
    assert code_of(lambda: m.convert(mdl.ConvertRequest(source="../x.gguf", output="y.jlm"))) == Code.PERMISSION_DENIED
    assert code_of(lambda: clients["devices"].get_device(dev.GetDeviceRequest(device="cuda:9"))) == Code.NOT_FOUND
    assert code_of(lambda: s.get_session(ses.GetSessionRequest(session_id="s-0-0"))) == Code.NOT_FOUND
    assert code_of(lambda: s.create_session(ses.CreateSessionRequest(model="tiny", max_seq=10**6))) == Code.INVALID_ARGUMENT
    assert code_of(lambda: s.create_session(ses.CreateSessionRequest(model="tiny", devices="cuda:0"))) == Code.INVALID_ARGUMENT  # no such device
    assert code_of(lambda: s.create_session(ses.CreateSessionRequest(model="tiny", devices="cpu"))) == Code.FAILED_PRECONDITION  # not the model's
    assert code_of(lambda: p.get_placement(plc.GetPlacementRequest())) == Code.INVALID_ARGUMENT
    assert code_of(lambda: p.relocate_blocks(plc.RelocateBlocksRequest(model="tiny", first=2, last=9, to="host"))) == Code.INVALID_ARGUMENT
    assert code_of(lambda: p.set_page_budget(plc.SetPageBudgetRequest(model="tiny", budget_bytes=1))) == Code.INVALID_ARGUMENT  # below one block
    assert code_of(lambda: p.set_page_budget(plc.SetPageBudgetRequest(model="tiny"))) == Code.INVALID_ARGUMENT
    assert code_of(lambda: i.complete(inf.GenerateRequest(model="tiny"))) == Code.INVALID_ARGUMENT
    assert code_of(lambda: i.complete(inf.GenerateRequest(model="tiny", prompt="a" * 20000))) == Code.RESOURCE_EXHAUSTED
    assert code_of(lambda: i.complete(inf.GenerateRequest(model="tiny", prompt="a", sampling=common.SamplingParams(temperature=9)))) == Code.INVALID_ARGUMENT
    assert code_of(lambda: i.embed(inf.EmbedRequest(model="tiny", inputs=["x"]))) == Code.FAILED_PRECONDITION
    assert code_of(lambda: list(i.generate(inf.GenerateRequest(model="nope", prompt="a")))) == Code.NOT_FOUND


def test_curl_shaped_json(tiny_server):
    r = httpx.post(tiny_server.url + "/jitllm.v1.DeviceService/ListDevices", json={})
    assert r.status_code == 200 and r.json()["devices"][0]["id"] == "cpu"
    r = httpx.post(tiny_server.url + "/jitllm.v1.ModelService/GetModel", json={"model": "nope"})
    assert r.status_code == 404 and r.json()["code"] == "not_found" and "nope" in r.json()["message"]
    r = httpx.post(tiny_server.url + "/jitllm.v1.ModelService/GetModel", content=b"{bad", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"


def test_stock_grpcio_over_h2c(tiny_server):
    target = tiny_server.url.removeprefix("http://")
    with grpc.insecure_channel(target) as channel:
        get_model = channel.unary_unary("/jitllm.v1.ModelService/GetModel", request_serializer=mdl.GetModelRequest.SerializeToString, response_deserializer=mdl.GetModelResponse.FromString)
        assert get_model(mdl.GetModelRequest(model="tiny"), timeout=30).model.id == "tiny"
        with pytest.raises(grpc.RpcError) as exc:
            get_model(mdl.GetModelRequest(model="nope"), timeout=30)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        generate = channel.unary_stream("/jitllm.v1.InferenceService/Generate", request_serializer=inf.GenerateRequest.SerializeToString, response_deserializer=inf.GenerateResponse.FromString)
        events = list(generate(inf.GenerateRequest(model="tiny", prompt="abc", max_tokens=4, sampling=GREEDY, ignore_eos=True), timeout=30))
        assert events[-1].finished.usage.completion_tokens == 4
        watch = channel.unary_stream("/jitllm.v1.TelemetryService/WatchStats", request_serializer=tel.WatchStatsRequest.SerializeToString, response_deserializer=tel.GetStatsResponse.FromString)
        stream = watch(tel.WatchStatsRequest(interval_ms=100), timeout=30)
        assert next(stream).models[0].model == "tiny" and next(stream).uptime_s > 0
        stream.cancel()


def test_grpc_web_unary(tiny_server):
    body = mdl.GetModelRequest(model="tiny").SerializeToString()
    r = httpx.post(tiny_server.url + "/jitllm.v1.ModelService/GetModel", content=struct.pack(">BI", 0, len(body)) + body, headers={"content-type": "application/grpc-web+proto"})
    assert r.status_code == 200
    frames, data = [], r.content
    while data:
        flag, n = struct.unpack(">BI", data[:5])
        frames.append((flag, data[5 : 5 + n]))
        data = data[5 + n :]
    assert mdl.GetModelResponse.FromString(frames[0][1]).model.id == "tiny"
    assert frames[-1][0] & 0x80 and b"grpc-status: 0" in frames[-1][1]


def test_cancel_by_request_id(clients):
    inference = clients["inference"]
    seen: list[inf.GenerateResponse] = []

    def run() -> None:
        seen.extend(inference.generate(inf.GenerateRequest(model="tiny", prompt="abc", sampling=GREEDY, ignore_eos=True, request_id="long-one")))

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 120  # bounds a wait for an event; claims no speed
    while not inference.cancel(inf.CancelRequest(request_id="long-one")).cancelled:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t.join(120)
    assert seen[-1].finished.finish_reason == common.FINISH_REASON_CANCELLED
    assert not inference.cancel(inf.CancelRequest(request_id="long-one")).cancelled


def test_session_continues_through_the_openai_route(clients, tiny_server):
    """Three turns through jitllm_session: each prompt holds the earlier turns, and only new tokens are fed."""
    session = clients["sessions"].create_session(ses.CreateSessionRequest(model="tiny", max_seq=1024)).session
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
    usages = []
    for turn in ("first question", "second question", "third question"):
        r = client.chat.completions.create(model="ignored", messages=[{"role": "user", "content": turn}], max_tokens=6, temperature=0, extra_body={"jitllm_session": session.id})
        usages.append(r.usage)
        assert r.model_extra["jitllm"]["session_id"] == session.id
    client.close()
    got = clients["sessions"].get_session(ses.GetSessionRequest(session_id=session.id)).session
    assert got.num_messages == 6 and got.position > 0
    assert usages[2].prompt_tokens > usages[1].prompt_tokens > usages[0].prompt_tokens
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    for before, now in zip(usages, usages[1:]):  # the earlier turns came from the cache
        assert now.prompt_tokens_details.cached_tokens >= before.prompt_tokens
    tokenized = clients["inference"].complete(inf.GenerateRequest(session_id=session.id, prompt=" and then", max_tokens=2, continue_session=True, sampling=GREEDY))
    assert tokenized.finished.usage.cached_tokens == got.position
    reset = clients["sessions"].reset_session(ses.ResetSessionRequest(session_id=session.id)).session
    assert reset.position == 0 and reset.num_messages == 0
    clients["sessions"].close_session(ses.CloseSessionRequest(session_id=session.id))
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "jitllm_session": session.id})
    assert r.status_code == 404 and r.json()["error"]["param"] == "jitllm_session"


def test_load_a_second_model_and_unload_it_mid_stream(clients, tiny_server):
    models = clients["models"]
    loaded = models.load_model(mdl.LoadModelRequest(file="spare.jlm", id="second", max_seq=2048)).model
    assert loaded.loaded and loaded.max_seq == 2048
    ids = [m.id for m in openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0).models.list()]
    assert "second" in ids and "spare" not in ids  # loaded from spare.jlm: listed once, by its id
    body = {"model": "second", "prompt": "abc", "stream": True, "ignore_eos": True}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        gone = models.unload_model(mdl.UnloadModelRequest(model="second"))
        rest = [line for line in lines if line]
    assert gone.cancelled_requests == 1
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "cancelled" and rest[-1] == "data: [DONE]"
    assert [m.id for m in models.list_models(mdl.ListModelsRequest()).models] == ["tiny", "spare"]
    r = httpx.post(tiny_server.url + "/v1/completions", json={"model": "second", "prompt": "abc"})
    assert r.status_code == 404


def test_generated_code_is_fresh():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def jitllmd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jitllmd", *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_run_on_the_server(tiny_server):
    """`run` by model name and by session streams through the server; the session keeps its history."""
    addr = tiny_server.url.removeprefix("http://")
    r = jitllmd("run", "-addr", addr, "-model", "tiny", "-chat", "-n", "6", "-temp", "0", "-json", "hello")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["usage"]["completion_tokens"] <= 6 and out["jitllm"]["host_blocks"] == 4
    streamed = jitllmd("run", "-addr", addr, "-model", "tiny", "-chat", "-n", "6", "-temp", "0", "hello")
    assert streamed.returncode == 0 and streamed.stdout.rstrip("\n") == out["text"]

    made = jitllmd("sessions", "-new", "-model", "tiny", "-addr", addr, "-json")
    assert made.returncode == 0, made.stderr
    sid = json.loads(made.stdout)["id"]
    turns = [jitllmd("run", "-addr", addr, "-session", sid, "-chat", "-n", "4", "-temp", "0", "-json", q) for q in ("one", "two", "three")]
    usage = [json.loads(t.stdout)["usage"] for t in turns]
    assert usage[2]["prompt_tokens"] > usage[1]["prompt_tokens"] > usage[0]["prompt_tokens"]  # the history grows
    assert usage[2]["fed_tokens"] < usage[2]["prompt_tokens"] - usage[0]["prompt_tokens"]  # the earlier turns are cached
    more = jitllmd("run", "-addr", addr, "-session", sid, "-continue", "-n", "3", "-temp", "0", "-json", " and then?")
    assert json.loads(more.stdout)["usage"]["fed_tokens"] < 10
    assert jitllmd("sessions", "-close", sid, "-addr", addr).returncode == 0


def test_run_errors_against_a_server(tiny_server):
    addr = tiny_server.url.removeprefix("http://")
    r = jitllmd("run", "-addr", addr, "-model", "nope", "hi")
    assert r.returncode == 1 and "nope" in r.stderr and "Traceback" not in r.stderr
    r = jitllmd("run", "-addr", "127.0.0.1:9", "-model", "tiny", "hi")
    assert r.returncode == 1 and "no server at 127.0.0.1:9" in r.stderr
    r = jitllmd("run", "-continue", "x")
    assert r.returncode == 2 and "-session" in r.stderr
    r = jitllmd("run", "-addr", "host:http", "-model", "tiny", "hi")
    assert r.returncode == 2 and "-addr" in r.stderr and "Traceback" not in r.stderr


def test_convert_list_sessions_queue_and_placement_on_a_host_model(clients, tiny_server, tmp_path):
    from tests.conftest import write_tiny_llama

    models_dir = Path(clients["telemetry"].get_server_info(tel.GetServerInfoRequest()).models_dir)
    write_tiny_llama(models_dir / "hf-src")
    out = clients["models"].convert(mdl.ConvertRequest(source="hf-src", output="converted.jlm", dtype="f32"))
    try:
        assert out.output == "converted.jlm" and out.arch == "llama" and out.num_tensors > 0
        assert "converted" in [m.id for m in clients["models"].list_models(mdl.ListModelsRequest()).models]
        assert code_of(lambda: clients["models"].convert(mdl.ConvertRequest(source="hf-src", output="converted.jlm"))) == Code.ALREADY_EXISTS
    finally:
        (models_dir / "converted.jlm").unlink()

    made = clients["sessions"].create_session(ses.CreateSessionRequest(model="tiny")).session
    assert made.id in [s.id for s in clients["sessions"].list_sessions(ses.ListSessionsRequest(model="tiny")).sessions]
    clients["sessions"].close_session(ses.CloseSessionRequest(session_id=made.id))

    stream = clients["inference"].generate(inf.GenerateRequest(model="tiny", prompt="abc", sampling=GREEDY, ignore_eos=True, request_id="queued-view"))
    assert next(stream).HasField("started")  # sent once it is queued: the engine may not have taken it up yet
    assert next(stream).HasField("delta")  # it has run a step: a row now, for the thousands of tokens its room holds
    queue = clients["sessions"].get_device_queue(ses.GetDeviceQueueRequest(model="tiny")).queues[0]
    assert queue.model == "tiny" and queue.max_rows == 1
    assert [e.request_id for e in queue.running] == ["queued-view"] and queue.running[0].prompt_tokens == 3
    stream.close()  # the client goes away: the server cancels the generation
    deadline = time.monotonic() + 120  # bounds a wait for an event; claims no speed
    while clients["sessions"].get_device_queue(ses.GetDeviceQueueRequest(model="tiny")).queues[0].running:
        assert time.monotonic() < deadline, "the abandoned Generate kept running"
        time.sleep(0.05)

    p = clients["placement"]  # tiny was loaded without devices: its blocks stay on the host
    assert code_of(lambda: p.set_placement(plc.SetPlacementRequest(model="tiny", devices="cpu"))) == Code.INVALID_ARGUMENT
    assert code_of(lambda: p.tune_seam(plc.TuneSeamRequest(model="tiny"))) == Code.INVALID_ARGUMENT
    assert code_of(lambda: p.set_relocation(plc.SetRelocationRequest(model="tiny", enabled=True))) == Code.FAILED_PRECONDITION
    home = p.set_placement(plc.SetPlacementRequest(model="tiny")).placement  # no devices: every block home, as it is
    assert home.host_blocks == 4 and home.device_blocks == 0
    budget = p.get_residency(plc.GetResidencyRequest(model="tiny"))
    assert not budget.HasField("page_budget_bytes") and all(b.residency == plc.RESIDENCY_RESIDENT for b in budget.blocks)


def test_session_through_the_anthropic_route_and_a_resent_history(clients, tiny_server):
    """Anthropic requests continue a session too; a client that resends the whole history is not doubled."""
    import anthropic

    session = clients["sessions"].create_session(ses.CreateSessionRequest(model="tiny")).session
    extra = {"jitllm_session": session.id, "temperature": 0}
    with anthropic.Anthropic(base_url=tiny_server.url, api_key="unused", max_retries=0) as client:
        first = client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "one"}], extra_body=extra)
        history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "two"}]
        resent = client.messages.create(model="tiny", max_tokens=5, messages=history, extra_body=extra)
        assert resent.usage.cache_read_input_tokens > 0
        got = clients["sessions"].get_session(ses.GetSessionRequest(session_id=session.id)).session
        assert got.num_messages == 4  # the resent history replaced, not appended
        with pytest.raises(anthropic.NotFoundError) as exc:
            client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "x"}], extra_body={"jitllm_session": "s-0-0"})
        assert exc.value.body["type"] == "error" and "jitllm_session" in exc.value.body["error"]["message"]
    clients["sessions"].close_session(ses.CloseSessionRequest(session_id=session.id))

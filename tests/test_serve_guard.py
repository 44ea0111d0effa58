"""What every request passes (jitllmd/serve/guard.py) on a real server: the API key in each dialect, the Host check, a
body that must arrive in time, gRPC over HTTP/1.1, request ids; and prompts refused before they are tokenized."""

from __future__ import annotations

import json
import socket
import threading

import anthropic
import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from jitllmd.cli import app
from jitllmd.gen.jitllm.v1 import model_pb2 as mdl
from tests.serving import InProcessServer, Server, wait_for

KEY = "k-3f9a-test"


@pytest.fixture(scope="module")
def keyed(tiny_serve_jlm, tmp_path_factory):
    """The tiny model served with an API key read from a file (a mounted secret)."""
    secret = tmp_path_factory.mktemp("secret") / "key"
    secret.write_text(KEY + "\n")
    server = Server("-load", str(tiny_serve_jlm), "-id", "tiny", "-max-seq", "3000", "-api-key-file", str(secret))  # a process: its log is read
    yield server
    server.stop()


def _raw(server, request: bytes) -> bytes:
    """Send bytes on one connection; everything the server sends until it closes the connection."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=120) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def test_every_dialect_asks_for_the_key(keyed):
    url = keyed.url
    # OpenAI and Anthropic SDKs: the right key works, a wrong one is each SDK's own authentication error
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as oa:
        # ignore_eos: the tiny random model's sampled reply may end at its first token
        done = oa.completions.create(model="tiny", prompt="abc", max_tokens=2, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 2  # type: ignore[union-attr]
    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as oa, pytest.raises(openai.AuthenticationError) as oe:
        oa.models.list()
    assert oe.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    hi = [{"role": "user", "content": "hi"}]
    with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0) as an:
        said = an.messages.create(model="tiny", max_tokens=2, messages=hi, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
        assert said.usage.output_tokens == 2
    with anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as an, pytest.raises(anthropic.AuthenticationError) as ae:
        an.messages.create(model="tiny", max_tokens=2, messages=hi)  # type: ignore[arg-type]
    assert ae.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # Connect JSON, /metrics; /healthz stays open
    r = httpx.post(url + "/jitllm.v1.DeviceService/ListDevices", json={})
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.post(url + "/jitllm.v1.DeviceService/ListDevices", json={}, headers={"x-api-key": KEY}).status_code == 200
    both = {"authorization": "Bearer a-proxy-token", "x-api-key": KEY}  # either header may carry it
    assert httpx.post(url + "/jitllm.v1.DeviceService/ListDevices", json={}, headers=both).status_code == 200
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(url + "/healthz").text == "ok"
    # gRPC (stock grpcio over h2c): UNAUTHENTICATED without the key, served with it
    with grpc.insecure_channel(url.removeprefix("http://")) as channel:
        get_model = channel.unary_unary("/jitllm.v1.ModelService/GetModel", request_serializer=mdl.GetModelRequest.SerializeToString, response_deserializer=mdl.GetModelResponse.FromString)
        with pytest.raises(grpc.RpcError) as ge:
            get_model(mdl.GetModelRequest(model="tiny"), timeout=30)
        assert ge.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert get_model(mdl.GetModelRequest(model="tiny"), timeout=30, metadata=[("authorization", f"Bearer {KEY}")]).model.id == "tiny"


def test_the_cli_verbs_send_the_key(keyed, monkeypatch):
    addr = keyed.url.removeprefix("http://")
    r = CliRunner().invoke(app, ["models", "-addr", addr])
    assert r.exit_code == 1 and "asks for an API key" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["models", "-addr", addr, "-api-key", "wrong"])
    assert r.exit_code == 1 and "refused the API key" in r.output
    r = CliRunner().invoke(app, ["models", "-addr", addr, "-json", "-api-key", KEY])
    assert r.exit_code == 0 and json.loads(r.output)["models"][0]["id"] == "tiny"
    monkeypatch.setenv("JITLLMD_API_KEY", KEY)
    r = CliRunner().invoke(app, ["run", "-addr", addr, "-model", "tiny", "-n", "3", "-json", "abc"])
    assert r.exit_code == 0 and json.loads(r.output)["usage"]["completion_tokens"] == 3


def test_host_names_other_than_the_servers_are_refused(keyed):
    port = keyed.url.rsplit(":", 1)[1]
    auth = {"x-api-key": KEY}
    r = httpx.get(keyed.url + "/v1/models", headers={**auth, "host": f"rebound.example:{port}"})
    assert r.status_code == 403 and "-allow-host rebound.example" in r.json()["error"]["message"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]"):
        assert httpx.get(keyed.url + "/v1/models", headers={**auth, "host": host}).status_code == 200, host


def test_allow_host_names_are_accepted(tiny_serve_jlm):
    server = InProcessServer("-load", str(tiny_serve_jlm), "-id", "tiny", "-allow-host", "box.lan")
    try:
        assert httpx.get(server.url + "/v1/models", headers={"host": "box.lan:8080"}).status_code == 200
        assert httpx.get(server.url + "/v1/models", headers={"host": "other.lan"}).status_code == 403
    finally:
        server.stop()


def test_a_body_that_does_not_arrive_is_cut_off(keyed):
    """Content-Length 100 and then one byte: a 408 in the route's dialect, and the connection closes. The three
    routes wait out the body's time (guard.BODY_SECONDS) side by side, on connections of their own."""
    routes = (("/v1/chat/completions", "error"), ("/v1/messages", "type"), ("/jitllm.v1.DeviceService/ListDevices", "code"))
    replies: dict[str, str] = {}

    def send(path: str) -> None:
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: {KEY}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
        replies[path] = _raw(keyed, head.encode()).decode()

    threads = [threading.Thread(target=send, args=(path,)) for path, _ in routes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for path, shape in routes:
        reply = replies[path]
        status, _, body = reply.partition("\r\n\r\n")
        assert status.startswith("HTTP/1.1 408") and "connection: close" in status.lower(), reply
        assert shape in json.loads(body) and "did not arrive" in body, reply
    assert "Traceback" not in keyed.log


def test_grpc_over_http1_is_told_it_needs_http2(keyed):
    body = b"\x00\x00\x00\x00\x00"
    head = (f"POST /jitllm.v1.DeviceService/ListDevices HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: {KEY}\r\n"
            f"Content-Type: application/grpc\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    reply = _raw(keyed, head + body).decode().lower()
    assert reply.startswith("http/1.1 200") and "grpc-status: 12" in reply and "grpc needs http/2" in reply, reply
    assert "Traceback" not in keyed.log and "trailers" not in keyed.log


def test_an_unknown_grpc_method_is_unimplemented(keyed):
    with grpc.insecure_channel(keyed.url.removeprefix("http://")) as channel:
        nope = channel.unary_unary("/jitllm.v1.ModelService/Nope", request_serializer=mdl.GetModelRequest.SerializeToString, response_deserializer=mdl.GetModelResponse.FromString)
        with pytest.raises(grpc.RpcError) as exc:
            nope(mdl.GetModelRequest(model="tiny"), timeout=30, metadata=[("authorization", f"Bearer {KEY}")])
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_request_ids_reach_the_sdks_the_engine_and_the_log(keyed):
    with openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0) as oa:
        raw = oa.chat.completions.with_raw_response.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    rid = raw.headers["x-request-id"]
    assert rid.startswith("req_") and raw.parse()._request_id == rid and raw.headers["request-id"] == rid
    wait_for(lambda: rid in keyed.log, "the request's log line")
    with anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0) as an:
        msg = an.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert msg._request_id and msg._request_id.startswith("req_")  # type: ignore[attr-defined]
    # the engine's request is named by the same id (a client's own X-Request-Id is kept)
    seen: dict[str, str] = {}

    def long() -> None:
        with httpx.stream("POST", keyed.url + "/v1/completions", headers={"x-api-key": KEY, "x-request-id": "mine-42"},
                          json={"model": "tiny", "prompt": "abc", "max_tokens": 2000, "ignore_eos": True, "stream": True}, timeout=120) as r:
            seen["header"] = r.headers["x-request-id"]
            for _ in r.iter_lines():
                pass

    t = threading.Thread(target=long)
    t.start()
    try:
        keyed_queue = lambda: device_queue_with_key(keyed)
        wait_for(lambda: keyed_queue()["running"], "the stream to run")
        assert keyed_queue()["running"][0]["requestId"] == "mine-42"
    finally:
        t.join(300)
    assert seen["header"] == "mine-42"


def device_queue_with_key(server) -> dict:
    r = httpx.post(server.url + "/jitllm.v1.SessionService/GetDeviceQueue", json={"model": "tiny"}, headers={"x-api-key": KEY}, timeout=60).json()
    return {"running": [], "waiting": [], **r["queues"][0]}


def test_requests_are_counted_in_metrics(keyed):
    auth = {"x-api-key": KEY}
    httpx.get(keyed.url + "/v1/models/tiny", headers=auth)
    httpx.get(keyed.url + "/v1/nowhere", headers=auth)
    text = httpx.get(keyed.url + "/metrics", headers=auth).text
    counts = {(s.labels["method"], s.labels["route"], s.labels["status"]): s.value
              for f in text_string_to_metric_families(text) if f.name == "http_requests" for s in f.samples if s.name == "http_requests_total"}
    assert counts[("GET", "/v1/models/{model:path}", "200")] >= 1 and counts[("GET", "unmatched", "404")] >= 1
    assert not any("nowhere" in route for _, route, _ in counts)


def test_a_prompt_far_over_the_room_is_refused_before_it_is_tokenized(keyed):
    """10 MiB of chat against 3000 positions: a 400 that counts characters (no tokenizer ran over them), while
    /healthz keeps answering."""
    big = "x " * (5 << 20)
    answers: dict[str, httpx.Response] = {}

    def send(name: str, path: str, body: dict) -> None:
        answers[name] = httpx.post(keyed.url + path, json=body, headers={"x-api-key": KEY}, timeout=300)

    threads = [threading.Thread(target=send, args=("chat", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": big}]})),
               threading.Thread(target=send, args=("completion", "/v1/completions", {"model": "tiny", "prompt": big})),
               threading.Thread(target=send, args=("messages", "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": big}]}))]
    for t in threads:
        t.start()
    assert httpx.get(keyed.url + "/healthz", timeout=60).text == "ok"
    for t in threads:
        t.join(300)
    for name, r in answers.items():
        assert r.status_code == 400, (name, r.text[:300])
        message = r.json()["error"]["message"]
        assert "characters make at least" in message and "room for 3000" in message, (name, message)
    assert answers["chat"].json()["error"]["code"] == "context_length_exceeded"


def test_errors_name_files_relative_to_models(tiny_serve_jlm, tmp_path):
    """LoadModel, GetModel and Convert of damaged files: the message names the file as the client did, never the
    server's absolute path, and never a library's raw exception text."""
    models = tmp_path / "models"
    models.mkdir()
    data = tiny_serve_jlm.read_bytes()
    (models / "cut.jlm").write_bytes(data[: len(data) // 2])
    (models / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    server = InProcessServer("-models", str(models), "-load", str(tiny_serve_jlm), "-id", "tiny")
    try:
        calls = [("LoadModel", {"file": "cut.jlm"}), ("GetModel", {"model": "cut"}), ("LoadModel", {"file": "bad.gguf"}),
                 ("Convert", {"source": "bad.gguf", "output": "out.jlm"})]
        for method, body in calls:
            r = httpx.post(f"{server.url}/jitllm.v1.ModelService/{method}", json=body, timeout=120)
            message = r.json()["message"]
            assert r.status_code == 400 and r.json()["code"] == "invalid_argument", (method, r.text)
            assert str(tmp_path) not in message and message.startswith(("cut.jlm:", "bad.gguf:")), (method, message)
            assert "Error:" not in message and "dtype" not in message, (method, message)
    finally:
        server.stop()

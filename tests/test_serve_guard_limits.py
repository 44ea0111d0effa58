"""What a request may hold the server with (issue 39): a declared body over the limit, a body that stops arriving, a
big body being parsed; and who may reach it: the Host check of a server on every interface, JSON routes' Content-Type,
the cluster store's address."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pytest

from jitllmd.engine.cluster.link import ClusterAddress, join_store
from jitllmd.serve.body import MAX_BODY
from jitllmd.serve.guard import BODY_RATE, BODY_SECONDS

# the old deadline of a body that declares MAX_BODY: a pause in it is answered long before
_WHOLE_BODY_S = BODY_SECONDS + MAX_BODY / BODY_RATE
_PAUSE_ANSWERED_S = BODY_SECONDS * 4  # a generous wait for the answer to a body that stopped, well short of that


@pytest.fixture(scope="module")
def tiny(serve, tiny_serve_jlm):
    return serve("-load", str(tiny_serve_jlm), "-id", "tiny", "-max-seq", "3000")


def _address(server) -> tuple[str, int]:
    return "127.0.0.1", int(server.url.rsplit(":", 1)[1])


def _raw(server, request: bytes, timeout: float) -> bytes:
    """Send bytes on one connection; everything the server sends until it closes the connection (socket.timeout where
    it has not closed it within `timeout`)."""
    with socket.create_connection(_address(server), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def _head(path: str, media: str, length: str) -> bytes:
    framing = f"Content-Length: {length}" if length else "Transfer-Encoding: chunked"
    return f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {media}\r\n{framing}\r\n\r\n".encode()


def _in_threads(work: dict[str, object]) -> dict[str, object]:
    """Each callable of `work` on a thread of its own, side by side: name -> what it returned, or raised."""
    out: dict[str, object] = {}

    def run(name: str, fn) -> None:
        try:
            out[name] = fn()
        except Exception as exc:  # the test reads it
            out[name] = exc

    threads = [threading.Thread(target=run, args=item) for item in work.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize(
    ("path", "media"),
    [
        ("/jitllm.v1.ModelService/ListModels", "application/json"),
        ("/jitllm.v1.ModelService/ListModels", "application/proto"),
        ("/jitllm.v1.ModelService/ListModels", "application/grpc-web+proto"),
        ("/v1/chat/completions", "application/json"),
    ],
)
def test_a_declared_length_over_the_limit_is_refused_at_once(tiny, path, media):
    """Content-Length 10^12 and one byte: refused before the body is waited for, in the path's dialect, and the
    connection closed (the client may still be sending). It held a Connect connection for weeks before."""
    reply = _raw(tiny, _head(path, media, str(10**12)) + b"{", timeout=_PAUSE_ANSWERED_S)
    head, _, body = reply.decode().partition("\r\n\r\n")
    assert "connection: close" in head.lower(), reply
    if media.startswith("application/grpc-web"):  # gRPC's answer is trailers-only: RESOURCE_EXHAUSTED in the headers
        assert head.startswith("HTTP/1.1 200") and "grpc-status: 8" in head.lower() and str(MAX_BODY) in head, reply
    elif path.startswith("/jitllm.v1."):
        assert head.startswith("HTTP/1.1 413") and json.loads(body)["code"] == "resource_exhausted", reply
    else:
        assert head.startswith("HTTP/1.1 413") and str(MAX_BODY) in json.loads(body)["error"]["message"], reply


def test_a_body_that_stops_arriving_is_cut_off_after_a_pause(tiny):
    """MAX_BODY declared and nothing sent, or a chunked body that stops after its first chunk: a 408 after a pause of
    BODY_SECONDS, not after the whole body's time (BODY_SECONDS plus a second per BODY_RATE bytes declared: 138 s)."""
    assert _PAUSE_ANSWERED_S < _WHOLE_BODY_S
    chunk = b"1\r\n{\r\n"
    work = {
        "connect": lambda: _raw(tiny, _head("/jitllm.v1.ModelService/ListModels", "application/json", str(MAX_BODY)), _PAUSE_ANSWERED_S),
        "openai": lambda: _raw(tiny, _head("/v1/chat/completions", "application/json", str(MAX_BODY)), _PAUSE_ANSWERED_S),
        "chunked": lambda: _raw(tiny, _head("/v1/messages", "application/json", "") + chunk, _PAUSE_ANSWERED_S),
    }
    replies = _in_threads(work)
    for name, reply in replies.items():
        assert isinstance(reply, bytes), (name, reply)  # not a socket timeout: the server answered and closed
        head, _, body = reply.decode().partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 408") and "connection: close" in head.lower(), (name, reply)
        assert "did not arrive" in body, (name, reply)


def test_healthz_answers_while_a_big_body_is_parsed(tiny):
    """A ~20 MiB logit_bias map (ending in a lone surrogate, so its answer, a 400, comes as soon as it is parsed and
    checked): /healthz, asked once the server has read the big body whole, is answered first. The parse held the event
    loop before, so the big request's answer came first."""
    bias = b", ".join(b'"%d": 1.5' % i for i in range(1_400_000))
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {' + bias + b'}, "user": "\\ud800"}'
    assert len(raw) > 20 << 20
    with socket.create_connection(_address(tiny), timeout=120) as big, socket.create_connection(_address(tiny), timeout=120) as health:
        big.sendall(_head("/v1/chat/completions", "application/json", str(len(raw))) + raw)
        _wait_read(big)  # the body is whole in the server: it parses it now
        health.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        ready, _, _ = select.select([big, health], [], [], 120)
        assert ready == [health], "the big request was answered before /healthz"
        assert health.recv(65536).startswith(b"HTTP/1.1 200")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += big.recv(65536)
        assert answer.startswith(b"HTTP/1.1 400") and b"surrogate" in answer + big.recv(65536)


def _wait_read(conn: socket.socket) -> None:
    """Until the server has read every byte sent on `conn`: none waits in either end's kernel queue (/proc/net/tcp's
    tx_queue and rx_queue of the connection's two sockets)."""
    ends = {conn.getsockname()[1], conn.getpeername()[1]}
    for _ in range(12000):
        queued = 0
        with open("/proc/net/tcp") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if {int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)} == ends:
                    tx, rx = fields[4].split(":")
                    queued += int(tx, 16) + int(rx, 16)
        if queued == 0:
            return
        time.sleep(0.01)
    raise AssertionError("the server did not read the request")


def test_json_routes_refuse_a_body_with_no_content_type(tiny):
    """A POST with no Content-Type was read as JSON; a page can post one without asking (as text/plain or a form)."""
    body = json.dumps({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}).encode()
    r = httpx.post(tiny.url + "/v1/chat/completions", content=body, timeout=60)
    assert "content-type" not in r.request.headers
    assert r.status_code == 415 and "Content-Type" in r.json()["error"]["message"], r.text
    r = httpx.post(tiny.url + "/v1/messages", content=body, timeout=60)
    assert r.status_code == 415 and r.json()["type"] == "error", r.text
    r = httpx.post(tiny.url + "/v1/chat/completions", json=json.loads(body), timeout=60)  # json= sends application/json
    assert r.status_code == 200, r.text


def test_a_server_on_every_interface_checks_the_host_without_a_key(serve, tiny_serve_jlm):
    """The default address (:8080) listens on every interface, where the Host check was off: a web page that renamed
    itself (DNS rebinding) could unload models. The machine's own names, and IP addresses, still reach it."""
    server = serve("-addr", ":0", "-load", str(tiny_serve_jlm), "-id", "tiny", "-max-seq", "3000")
    assert server.url.startswith("http://0.0.0.0:")
    host, port = _address(server)
    url = f"http://{host}:{port}"
    rebound = {"host": f"attacker.example:{port}"}
    r = httpx.post(url + "/jitllm.v1.ModelService/UnloadModel", json={"model": "tiny"}, headers=rebound)
    assert r.status_code == 403 and r.json()["code"] == "permission_denied" and "-allow-host attacker.example" in r.json()["message"], r.text
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}, headers=rebound)
    assert r.status_code == 403, r.text
    for name in (socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1"):
        r = httpx.post(url + "/jitllm.v1.ModelService/GetModel", json={"model": "tiny"}, headers={"host": f"{name}:{port}"})
        assert r.status_code == 200 and r.json()["model"]["id"] == "tiny", (name, r.text)


def _listening(port: int) -> set[str]:
    """The local addresses of the sockets listening on `port` (/proc/net/tcp and tcp6, hex as the kernel writes them)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    found.add(local.rsplit(":", 1)[0])
    return found


def test_the_cluster_store_listens_only_where_it_was_told():
    """-cluster tcp://127.0.0.1:PORT: rank 0's store listened on every interface (torch's TCPStore binds them all)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = join_store(ClusterAddress("127.0.0.1", port), master=True, timeout=30)
    assert _listening(port) == {"0100007F"}  # 127.0.0.1, as /proc/net/tcp writes it
    worker = join_store(ClusterAddress("127.0.0.1", port), master=False, timeout=30)  # and it is the store
    worker.set("k", "v")
    assert store.get("k") == b"v"

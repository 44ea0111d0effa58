"""One cleartext HTTP/2 connection, many streams (jitllmd/serve/http2.py): a stream answered before its body came (no
key, an unknown path) takes that late body without cutting the connection's other streams."""

from __future__ import annotations

import json
import socket

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import hypercorn.protocol
import pytest
from hyperframe.frame import DataFrame

from jitllmd.gen.jitllm.v1 import model_pb2 as mdl
from jitllmd.serve.http2 import EarlyAnswerH2Protocol

KEY = "k-h2-test"
WINDOW = 64  # stream 1 may send this many bytes before the client hands out more: it stays open until then


@pytest.fixture(scope="module")
def keyed(serve, tiny_serve_jlm):
    return serve("-load", str(tiny_serve_jlm), "-id", "tiny", "-max-seq", "3000", "-api-key", KEY)


class Client:
    """An HTTP/2 client (prior knowledge) on a raw socket: what each stream got, and whether the connection ended."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=60)  # bounds every read: a server that stops answering fails the test
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW})
        self.headers: dict[int, dict[str, str]] = {}
        self.body: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.resets: dict[int, int] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.eof = False
        self.pings = 0
        self.held: dict[int, int] = {}  # streams whose data is not acknowledged yet: bytes read and not handed back
        self.flush()

    def flush(self) -> None:
        self.sock.sendall(self.h2.data_to_send())

    def request(self, path: str, headers: dict[str, str], body: bytes | None, method: str = "POST", hold: bool = False) -> int:
        """Open a stream: HEADERS, then the body with END_STREAM unless it is None (sent later, with send_late). A
        held stream's answer gets WINDOW bytes until release()."""
        sid = self.h2.get_next_available_stream_id()
        head = {":method": method, ":scheme": "http", ":authority": "127.0.0.1", ":path": path, "content-type": "application/json", **headers}
        self.h2.send_headers(sid, list(head.items()), end_stream=False)
        if body == b"":
            self.h2.end_stream(sid)
        elif body is not None:
            self.h2.send_data(sid, body, end_stream=True)
        self.flush()
        if hold:
            self.held[sid] = 0
        return sid

    def release(self, sid: int) -> None:
        if (got := self.held.pop(sid)) and sid not in self.ended:
            self.h2.acknowledge_received_data(got, sid)
            self.flush()

    def send_late(self, sid: int, body: bytes, end: bool) -> None:
        """Part of a stream's body after its answer, as a raw frame (the client's own state may count the stream
        closed by now); then a PING, whose ack says the server has taken the frame."""
        self.sock.sendall(DataFrame(sid, data=body, flags=["END_STREAM"] if end else []).serialize())
        self.h2.ping(b"%08d" % self.pings)
        self.flush()
        pings = self.pings
        self.until(lambda: self.pings > pings, "the PING's ack")

    def until(self, done, what: str) -> None:
        """Read and handle frames until done() holds or the connection ends."""
        while not done():
            assert not self.eof and self.goaway is None, f"the connection ended before {what}: {self.goaway or 'closed'}"
            data = self.sock.recv(65536)
            if not data:
                self.eof = True
                continue
            for event in self.h2.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    self.headers[event.stream_id] = dict(event.headers)  # type: ignore[arg-type]
                elif isinstance(event, h2.events.DataReceived):
                    self.body[event.stream_id] = self.body.get(event.stream_id, b"") + event.data
                    if event.stream_id in self.held:
                        self.held[event.stream_id] += event.flow_controlled_length
                    elif event.flow_controlled_length:
                        self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    self.ended.add(event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    self.resets[event.stream_id] = event.error_code
                elif isinstance(event, h2.events.PingAckReceived):
                    self.pings += 1
                elif isinstance(event, h2.events.ConnectionTerminated):
                    self.goaway = event
            self.flush()

    def close(self) -> None:
        self.sock.close()


def _chat() -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 32, "ignore_eos": True}).encode()


LATE = [
    ("/v1/chat/completions", {}, 401),  # no key: the guard answers before reading the body
    ("/v1/nowhere", {"authorization": f"Bearer {KEY}"}, 404),  # the router answers an unknown path unread
    ("/jitllm.v1.ModelService/ListModels", {}, 401),  # a Connect route, no key
]


@pytest.mark.parametrize(("path", "headers", "status"), LATE, ids=["no-key", "unknown-path", "connect-no-key"])
def test_a_late_body_on_an_answered_stream_leaves_the_others_running(keyed, path, headers, status):
    c = Client(keyed.url)
    try:
        chat = c.request("/v1/chat/completions", {"authorization": f"Bearer {KEY}"}, _chat(), hold=True)
        c.until(lambda: chat in c.body, "the chat's first data")  # WINDOW keeps the rest of it waiting on the client
        assert c.headers[chat][":status"] == "200" and chat not in c.ended
        late = c.request(path, headers, None)
        c.until(lambda: late in c.ended or late in c.resets, "the early answer")
        assert c.headers[late][":status"] == str(status)
        # the late body is refused on its own stream, never on the connection: its first part gets RST_STREAM(NO_ERROR)
        # (RFC 9113 §8.1: stop sending, the answer stands); the rest is dropped (or gets STREAM_CLOSED)
        c.send_late(late, b'{"model": "tiny", ', end=False)
        assert c.resets.get(late) == h2.errors.ErrorCodes.NO_ERROR
        c.send_late(late, b'"messages": []}', end=True)
        assert chat not in c.ended
        c.release(chat)
        c.until(lambda: chat in c.ended, "the rest of the chat")
        assert c.goaway is None and not c.eof
        events = [line.removeprefix("data: ") for line in c.body[chat].decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        # and the connection still takes new streams
        again = c.request("/v1/models", {"authorization": f"Bearer {KEY}"}, b"", method="GET")
        c.until(lambda: again in c.ended, "a later request's answer")
        assert c.headers[again][":status"] == "200" and json.loads(c.body[again])["data"][0]["id"] == "tiny"
    finally:
        c.close()


def test_the_server_serves_http2_with_its_own_protocol(keyed):
    """hypercorn builds each HTTP/2 connection from hypercorn.protocol.H2Protocol: the class http2.install() puts there.
    A hypercorn that builds it elsewhere fails here (and the late-body test above)."""
    assert hypercorn.protocol.H2Protocol is EarlyAnswerH2Protocol
    assert "H2Protocol" in hypercorn.protocol.ProtocolWrapper.__init__.__code__.co_names
    assert "H2Protocol" in hypercorn.protocol.ProtocolWrapper.handle.__code__.co_names


def test_grpc_still_works_with_and_without_the_key(keyed):
    with grpc.insecure_channel(keyed.url.removeprefix("http://")) as channel:
        get_model = channel.unary_unary("/jitllm.v1.ModelService/GetModel", request_serializer=mdl.GetModelRequest.SerializeToString, response_deserializer=mdl.GetModelResponse.FromString)
        for _ in range(3):  # one channel, one connection: each refusal's late body must not cut it
            with pytest.raises(grpc.RpcError) as ge:
                get_model(mdl.GetModelRequest(model="tiny"), timeout=30)
            assert ge.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert get_model(mdl.GetModelRequest(model="tiny"), timeout=30, metadata=[("authorization", f"Bearer {KEY}")]).model.id == "tiny"

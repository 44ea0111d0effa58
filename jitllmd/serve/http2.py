"""HTTP/2 connections as hypercorn serves them, but a body that comes after its stream's answer cuts only that stream."""

from __future__ import annotations

import h2.errors
import h2.events
import h2.stream
import hypercorn.protocol
from hypercorn.protocol.h2 import H2Protocol

__all__ = ["EarlyAnswerH2Protocol", "install"]


class EarlyAnswerH2Protocol(H2Protocol):
    """hypercorn's H2Protocol, where DATA on a stream it has finished with is dropped instead of ending the connection.

    A route may answer before it reads the body (the guard's 401, a 404) and RFC 9113 §8.1 lets the client go on
    sending it. hypercorn (0.18 here) forgets the stream once the answer is out and looks the late DATA up (KeyError), which
    closes the connection and every stream on it (an authorised chat beside a refused call)."""

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        for event in events:  # one at a time: handling one event may finish the stream the next one is for
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                self._drop(event)
            else:
                await super()._handle_events([event])
        await self._flush()

    def _drop(self, event: h2.events.DataReceived) -> None:
        """Take the late DATA: its bytes back to the connection's window (the other streams share it), and a
        RST_STREAM(NO_ERROR) that asks the client to stop sending the body once the answer has gone in full."""
        self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        stream = self.connection.streams.get(event.stream_id)
        # only once this side's END_STREAM is out: a reset before it would cut the answer
        if stream is not None and stream.state_machine.state == h2.stream.StreamState.HALF_CLOSED_LOCAL:
            self.connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)


def install() -> None:
    """Have hypercorn serve HTTP/2 with EarlyAnswerH2Protocol: hypercorn.protocol.ProtocolWrapper builds every HTTP/2
    connection (ALPN, prior knowledge, h2c upgrade) from the name H2Protocol in its module, and has no setting for it.
    tests/test_serve_h2.py fails when a hypercorn release builds it otherwise."""
    current = hypercorn.protocol.H2Protocol
    if current is not EarlyAnswerH2Protocol and current is not H2Protocol:
        raise RuntimeError(f"hypercorn.protocol.H2Protocol is {current!r}, not hypercorn's own: something else replaced it")
    hypercorn.protocol.H2Protocol = EarlyAnswerH2Protocol  # type: ignore[misc]  # the one name ProtocolWrapper reads


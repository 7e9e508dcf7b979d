"""The fast HTTP path: uvicorn's httptools protocol, answering each request in one write and binary
proposals inline in the parser's callbacks.

The only module that subclasses uvicorn's private classes, so it is written for the uvicorn minor
versions in WRITTEN_FOR. Importing it under any other raises ImportError, and `serve` then runs uvicorn's
own protocol: slower, the same answers."""

from __future__ import annotations

import functools
import time

import httptools
import uvicorn

from .requests import BINARY_TYPE, length_within, media_type, route
from .read_guard import ReadGuard, guarded_connections, limits_of

WRITTEN_FOR = ("0.54", "0.55")
"""The uvicorn minor versions whose httptools protocol internals (callbacks, cycle, flow control,
keep-alive timer) these classes were written and tested against. 0.55 changed none that they use: it
strips trailing whitespace from header values (which `_inline_propose` reads, and `media_type` strips
anyway) and hands an upgraded connection its data after, not before, switching protocols. The `test`
extra pins uvicorn below the next minor, so that a new one is read and added here before CI meets it."""
if ".".join(uvicorn.__version__.split(".")[:2]) not in WRITTEN_FOR:
    raise ImportError(f"echospec's fast HTTP path was written for uvicorn {' or '.join(WRITTEN_FOR)}, "
                      f"not {uvicorn.__version__}")

from uvicorn.protocols.http.httptools_impl import (  # noqa: E402  (only once the version is known)
    STATUS_LINE, HttpToolsProtocol, RequestResponseCycle)

INLINE_BODY_LIMIT = 64 << 10  # uvicorn's read high-water mark: larger bodies take its flow-controlled path


class OneWriteHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, writing each response's head and body in one `transport.write`.

    uvicorn writes the head when the app sends `http.response.start` and the body when it sends
    `http.response.body`: two send syscalls and two TCP segments per response, and the client often
    wakes up and reads twice. Joined, a propose costs one syscall less on each end (measured with
    tools/benchmarks/bench_service.py). Everything else, parsing, keep-alive, flow control, pipelining,
    is uvicorn's."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app) -> None:
        # uvicorn builds the cycle itself (in on_headers_complete); this is the one hook that sees every
        # cycle, pipelined ones included, before its app runs. _OneWriteCycle adds no state of its own.
        cycle.__class__ = _OneWriteCycle
        super()._start_asgi_task(cycle, app)


class ServiceHttpProtocol(OneWriteHttpToolsProtocol):
    """OneWriteHttpToolsProtocol that answers binary proposals inline, in the parser's callbacks.

    uvicorn runs every request as an asyncio task through a request-response cycle and the ASGI
    calls: about 24 us of CPU a request on this project's 2-core machine, against 12 us answering in
    `on_message_complete` (measured with a fixed answer), and a propose's own work is ~40 us. So a
    request that is a binary propose (POST .../propose, Content-Type application/x-echospec, a
    Content-Length of at most INLINE_BODY_LIMIT, no Expect or Transfer-Encoding header, nothing else
    in flight on the connection, the client reading its answers) is answered by
    `Service.answer_binary_propose` when its body is in, head and body in one write. Everything else,
    JSON proposals included, takes uvicorn's path. Either way a request must arrive in time and its head
    within its size limit (`ReadGuard`)."""

    _inline: tuple[str, bytes, float, list[bytes]] | None = None  # (store, query, started, body parts)
    guard: ReadGuard | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.limits = limits_of(self.app)
        self.guard = ReadGuard(transport, self.loop, self.limits, guarded_connections(self.server_state),
                               self._answering)

    def _answering(self) -> bool:
        return (self.cycle is not None and not self.cycle.response_complete) or bool(self.pipeline)

    def connection_lost(self, exc) -> None:
        if self.guard is not None:
            self.guard.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        heads = self.guard.heads
        super().data_received(data)
        self.guard.received(len(data), heads)

    def on_message_begin(self) -> None:
        self.guard.begin()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self.guard.head_read()
        self._inline = self._inline_propose()
        if self._inline is None:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._inline is None:
            return super().on_body(body)
        self._inline[3].append(body)

    def on_message_complete(self) -> None:
        self.guard.end()
        if self._inline is None:
            return super().on_message_complete()
        (store, query, started, parts), self._inline = self._inline, None
        status, content_type, body = self.app.answer_binary_propose(store, query, b"".join(parts), started)
        keep_alive = self.parser.should_keep_alive() and self.parser.get_http_version() != "1.0"  # as uvicorn's
        head = [STATUS_LINE[status], *(b"%s: %s\r\n" % header for header in self.server_state.default_headers),
                b"content-type: %s\r\ncontent-length: %d\r\n" % (content_type, len(body)),
                b"" if keep_alive else b"connection: close\r\n", b"\r\n", body]
        self.transport.write(b"".join(head))
        self.server_state.total_requests += 1
        if not keep_alive:
            self.transport.close()
        else:  # as uvicorn's on_response_complete: close the connection if it then idles too long
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def _inline_propose(self) -> tuple[str, bytes, float, list[bytes]] | None:
        """(store, query, started, []) when the request whose headers just ended can be answered inline."""
        if not hasattr(self.app, "answer_binary_propose") or self.parser.get_method() != b"POST" \
                or self.expect_100_continue:
            return None
        if self.cycle is not None and not self.cycle.response_complete:
            return None  # an earlier request on this connection is still being answered: keep the order
        if self.flow.write_paused:
            return None  # the client is not reading its answers: uvicorn's path waits, and stops reading
        if self.limit_concurrency is not None and (len(self.connections) >= self.limit_concurrency
                                                   or len(self.tasks) >= self.limit_concurrency):
            return None  # every connection is busy: uvicorn's path answers 503, as for any other request
        url = httptools.parse_url(self.url)
        store = proposed_store(url.path)
        if store is None:
            return None
        content_type = length = None
        for name, value in self.headers:
            if name == b"content-type" and content_type is None:
                content_type = value
            elif name == b"content-length":
                length = value
            elif name in (b"transfer-encoding", b"upgrade"):
                return None
        if media_type(content_type) != BINARY_TYPE or length is None \
                or not length_within(length, min(INLINE_BODY_LIMIT, self.limits.max_body_bytes)):
            return None  # uvicorn's path reads it with flow control, or refuses it (413)
        return store, url.query or b"", time.perf_counter(), []


@functools.lru_cache(maxsize=4096)  # workers send the same few paths over and over
def proposed_store(path: bytes) -> str | None:
    """The store a raw request path proposes to (requests.route), or None for any other route; None too
    for a path that needs decoding, which uvicorn's path does."""
    if not path.isascii() or b"%" in path:
        return None
    endpoint, match = route(path.decode("ascii"))
    return match.group(1) if endpoint == "propose" else None


class _OneWriteCycle(RequestResponseCycle):
    """Holds the head written for `http.response.start` and writes it with the next body message.

    The head leaves alone only when no body write follows it: after a HEAD request (when the body
    message is sent) or when the connection closes. An app failing between its start and body
    messages gets its connection closed without the head, where uvicorn would send the head first:
    the client sees an incomplete answer either way."""

    _held: _HeldWrites | None = None

    async def send(self, message) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            self.transport = held = _HeldWrites(self.transport)
            try:
                await super().send(message)
            finally:
                self.transport, self._held = held.transport, held
            return
        held, self._held = self._held, None
        if held is None:
            return await super().send(message)
        self.transport = held  # the body joins the head
        try:
            await super().send(message)
        finally:
            self.transport = held.transport
            held.flush()


class _HeldWrites:
    """Stands in for a transport in `_OneWriteCycle.send`: keeps what is written until `flush`."""

    def __init__(self, transport):
        self.transport, self.parts = transport, []

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def flush(self) -> None:
        if self.parts:
            self.transport.write(b"".join(self.parts))
            self.parts = []

    def close(self) -> None:  # a `connection: close` answer: send it, then close
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

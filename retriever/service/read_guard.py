"""Slow, oversized and idle connections: a request must arrive whole, head and body, within
`Limits.read_timeout` seconds of its first byte (a new connection must send one within as long), and its
head must fit in `Limits.max_head_bytes`; past either the connection is closed. And at most
`Limits.max_connections` connections are held: when a new one would pass that, the connections idle
longest (none of their requests being read or answered: fresh ones that sent nothing yet, kept-alive ones
between requests) are closed, down to 7/8 of the limit, so idle clients never starve health checks or
proposals. Only when every connection is busy does a request get uvicorn's 503.

uvicorn times out only idle kept-alive connections, and its parser keeps a head however long it grows,
so without this a client sending a byte now and then holds a connection for ever, and one sending an
endless header holds the service's memory. fast_http's protocol calls `ReadGuard` from its own parser
callbacks; `StockHttpProtocol` brings the same guard to uvicorn's own protocol when the fast path cannot
be used, watching request boundaries with a parser of its own. Both follow one rule."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

import httptools

from .requests import Limits

log = logging.getLogger("echospec.service")


class ReadGuard:
    """Guards one connection's reads. A protocol calls `begin` at a request's first byte, `head_read`
    when its head is in, `end` when the whole request is, and `received` after each chunk it parsed.

    The deadline is one timer per connection at a time, re-armed lazily when it fires, so a request
    costs a few attribute writes, not a timer. A head's size is counted in whole chunks that lie inside
    it (one in which a request began is not counted), so a refusal comes at most one read's worth of
    bytes past the limit and never for a head within it. `answering` says whether the protocol is still
    answering a request whose reading ended (so the connection is not idle)."""

    __slots__ = ("transport", "loop", "limits", "started", "timer", "heads", "in_head", "head_bytes", "reading",
                 "idle_since", "answering", "held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, limits: Limits,
                 held: set, answering: Callable[[], bool]):
        self.transport, self.loop, self.limits, self.answering = transport, loop, limits, answering
        self.heads, self.in_head, self.head_bytes = 0, False, 0  # heads begun so far; the current one's state
        self.started = self.idle_since = loop.time()  # the connection's first request is due within the timeout too
        self.reading = False
        self.timer: asyncio.TimerHandle | None = loop.call_at(self.started + limits.read_timeout, self._check)
        self.held = held  # the server's guarded connections, this one among them until it closes
        held.add(self)
        if len(held) > limits.max_connections:
            make_room(held, limits.max_connections * 7 // 8, self)

    def begin(self) -> None:
        self.started = self.loop.time()
        self.reading = True
        self.heads += 1
        self.in_head, self.head_bytes = True, 0
        if self.timer is None:
            self.timer = self.loop.call_at(self.started + self.limits.read_timeout, self._check)

    def head_read(self) -> None:
        self.in_head = False

    def end(self) -> None:
        self.started, self.reading = None, False
        self.idle_since = self.loop.time()

    def idle(self) -> bool:
        """No request being read or answered: closing the connection loses nothing."""
        return not self.reading and not self.answering()

    def received(self, size: int, heads_before: int) -> bool:
        """After a chunk of `size` bytes was parsed (`heads_before`: `heads` before it): False, and the
        connection closed, when the head in progress has outgrown the limit."""
        if not self.in_head or self.heads != heads_before:
            return True
        self.head_bytes += size
        if self.head_bytes <= self.limits.max_head_bytes:
            return True
        self._close(f"a request head over {self.limits.max_head_bytes} bytes")
        return False

    def cancel(self) -> None:
        """The connection is closing: no timer, and it no longer counts against the connection limit."""
        self.held.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check(self) -> None:
        self.timer = None
        if self.started is None:  # between requests: uvicorn's keep-alive timeout watches idle connections
            return
        due = self.started + self.limits.read_timeout
        if self.loop.time() < due:
            self.timer = self.loop.call_at(due, self._check)
            return
        self._close(f"no whole request within {self.limits.read_timeout} s")

    def _close(self, why: str) -> None:
        log.info("closing a connection from %s: %s", self.transport.get_extra_info("peername"), why)
        self.transport.abort()  # not close(): a client that sends badly may not read either


class StockHttpProtocol(asyncio.Protocol):
    """uvicorn's own HTTP protocol (what `--http auto` picks), with the read guard.

    The wrapped protocol gets every event; a second httptools parser, the one uvicorn itself uses,
    only watches where requests and their heads begin and end. It parses each request twice: this is
    the fallback."""

    def __init__(self, config, **kwargs):
        self.inner = stock_protocol_class()(config=config, **kwargs)  # loads the config: loaded_app is set
        self.limits = limits_of(config.loaded_app)
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.guard: ReadGuard | None = None

    def connection_made(self, transport) -> None:
        self.inner.connection_made(transport)
        self.guard = ReadGuard(transport, asyncio.get_running_loop(), self.limits,
                               guarded_connections(self.inner.server_state), self._answering)

    def _answering(self) -> bool:
        cycle = getattr(self.inner, "cycle", None)
        return (cycle is not None and not cycle.response_complete) or bool(getattr(self.inner, "pipeline", None))

    def data_received(self, data: bytes) -> None:
        if self.parser is not None:
            heads = self.guard.heads
            try:
                self.parser.feed_data(data)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade):
                self.parser = None  # uvicorn answers a malformed request (400) and closes; an upgrade is its own
                self.guard.end()
            if not self.guard.received(len(data), heads):
                return
        self.inner.data_received(data)

    def on_message_begin(self) -> None:  # the parser's callbacks
        self.guard.begin()

    def on_headers_complete(self) -> None:
        self.guard.head_read()

    def on_message_complete(self) -> None:
        self.guard.end()

    def connection_lost(self, exc) -> None:
        if self.guard is not None:
            self.guard.cancel()
        self.inner.connection_lost(exc)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def make_room(held: set[ReadGuard], keep: int, newcomer: ReadGuard) -> None:
    """Close the connections idle longest until at most `keep` are held (fewer are closed when fewer are idle)."""
    idle = sorted((guard for guard in held if guard is not newcomer and guard.idle()), key=lambda g: g.idle_since)
    closing = idle[:len(held) - keep]
    if closing:
        log.info("%d connections held, over the limit of %d: closing the %d idle longest", len(held),
                 newcomer.limits.max_connections, len(closing))
    for guard in closing:
        guard.cancel()
        guard.transport.close()  # a clean close: a kept-alive client sends its next request on a new connection


def guarded_connections(server_state) -> set[ReadGuard]:
    """The server's guarded connections (one set per uvicorn server, kept on its state)."""
    held = getattr(server_state, "echospec_guarded", None)
    if held is None:
        held = server_state.echospec_guarded = set()
    return held


def limits_of(app) -> Limits:
    """The limits of the app a protocol serves: the Service's own, the defaults for any other app (or a
    Service behind a middleware)."""
    limits = getattr(app, "limits", None)
    return limits if isinstance(limits, Limits) else Limits()


@functools.cache
def stock_protocol_class() -> type[asyncio.Protocol]:
    """The protocol uvicorn runs for `http="auto"` (httptools when installed)."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    return import_from_string(HTTP_PROTOCOLS["auto"])

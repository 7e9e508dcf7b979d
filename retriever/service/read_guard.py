"""Slow clients: a request must arrive whole, head and body, within `Limits.read_timeout` seconds of its
first byte, and a new connection must send one within as long; past that the connection is closed.

Without this a client sending a byte now and then holds a connection (and its buffers) for ever:
uvicorn times out only idle kept-alive connections. fast_http's protocol calls `ReadDeadline` from its
own parser callbacks; `StockHttpProtocol` brings the same deadline to uvicorn's own protocol when the
fast path cannot be used, watching request boundaries with a parser of its own."""

from __future__ import annotations

import asyncio
import functools
import logging

import httptools

from .requests import Limits

log = logging.getLogger("echospec.service")


class ReadDeadline:
    """One connection's deadline, from its start and from each request's first byte (`begin`) to that
    request's last (`end`). One timer per connection at a time, re-armed lazily when it fires, so a
    request costs two attribute writes, not a timer."""

    __slots__ = ("transport", "loop", "seconds", "started", "timer")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, seconds: float):
        self.transport, self.loop, self.seconds = transport, loop, seconds
        self.timer: asyncio.TimerHandle | None = None
        self.begin()

    def begin(self) -> None:
        self.started = self.loop.time()
        if self.timer is None:
            self.timer = self.loop.call_at(self.started + self.seconds, self._check)

    def end(self) -> None:
        self.started = None

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check(self) -> None:
        self.timer = None
        if self.started is None:  # between requests: uvicorn's keep-alive timeout watches idle connections
            return
        due = self.started + self.seconds
        if self.loop.time() < due:
            self.timer = self.loop.call_at(due, self._check)
            return
        log.info("closing a connection from %s: no whole request within %s s",
                 self.transport.get_extra_info("peername"), self.seconds)
        self.transport.abort()  # not close(): a client that sends slowly may not read either


class StockHttpProtocol(asyncio.Protocol):
    """uvicorn's own HTTP protocol (what `--http auto` picks), with the read deadline.

    The wrapped protocol gets every event; a second httptools parser, the one uvicorn itself uses,
    only watches where requests begin and end. It parses each request twice: this is the fallback."""

    def __init__(self, config, **kwargs):
        self.inner = stock_protocol_class()(config=config, **kwargs)  # loads the config: loaded_app is set
        self.seconds = limits_of(config.loaded_app).read_timeout
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.deadline: ReadDeadline | None = None

    def connection_made(self, transport) -> None:
        self.deadline = ReadDeadline(transport, asyncio.get_running_loop(), self.seconds)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.parser is not None:
            try:
                self.parser.feed_data(data)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade):
                self.parser = None  # uvicorn answers a malformed request (400) and closes; an upgrade is its own

                self.deadline.end()
        self.inner.data_received(data)

    def on_message_begin(self) -> None:  # the parser's callbacks
        self.deadline.begin()

    def on_message_complete(self) -> None:
        self.deadline.end()

    def connection_lost(self, exc) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.inner.connection_lost(exc)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


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

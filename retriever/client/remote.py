"""RemoteRetriever: the in-process `Retriever`'s interface, answered by an `echospec serve` service.

    r = RemoteRetriever("http://127.0.0.1:8750", store="voices", timeout=0.05)
    tree = r.propose(context, speaker="ann")       # the same CandidateTree the service's Retriever makes

A decoder uses either unchanged. When the service is slow or down, `propose` raises
`RetrieverUnavailable` within `timeout`, and then, while a back-off runs (doubling with each
consecutive failure, up to `max_backoff`), immediately without touching the network: the decoder
steps autoregressively meanwhile and proposals resume on the first successful trial call.

HTTP/1.1 on a plain socket (each request in one send, answers parsed by httptools), one kept-alive
connection per thread: on loopback a request costs the client a fraction of the CPU it costs through
httpx (see tools/benchmarks/bench_service.py), and connections are never shared between threads, so
any number of threads may call one RemoteRetriever.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import struct
import sys
import threading
import time
from typing import Sequence
from urllib.parse import quote, urlencode, urlsplit

import httptools
import numpy as np

from ..tree import CandidateTree
from .wire import BINARY, JSON, WireError, decode_trees, encode_contexts

PAYLOADS = ("binary", "json")
MAX_KEPT_PATHS = 1024


class RetrieverUnavailable(RuntimeError):
    """The service did not answer in time, is unreachable, failed (5xx), or is in its back-off window."""


class ServiceRequestError(ValueError):
    """The service refused the request (4xx): bad ids, unknown store or speaker, missing API key, ...

    A ValueError, as the in-process Retriever raises for bad ids or an unknown speaker."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code = status, code


class CircuitBreaker:
    """Refuses calls for a while after a failure, so a dead service costs one timeout, not one a step.

    After the n-th consecutive failure, calls fail fast for min(max_backoff, backoff * 2**(n-1))
    seconds; the first call after that is a trial (others keep failing fast while it runs). A success
    closes the breaker."""

    def __init__(self, backoff: float = 0.05, max_backoff: float = 2.0):
        self.backoff, self.max_backoff = backoff, max_backoff
        self._lock = threading.Lock()
        self._failures = 0
        self._retry_at = 0.0

    @property
    def is_open(self) -> bool:
        return self._failures > 0

    def check(self) -> None:
        if not self._failures:  # the common case, without the lock
            return
        with self._lock:
            now = time.monotonic()
            if self._failures and now < self._retry_at:
                raise RetrieverUnavailable(f"service unavailable ({self._failures} consecutive failures); "
                                           f"next try in {self._retry_at - now:.3f} s")
            self._retry_at = now + self._delay()

    def success(self) -> None:
        if self._failures:
            with self._lock:
                self._failures = 0

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            self._retry_at = time.monotonic() + self._delay()

    def _delay(self) -> float:
        return min(self.max_backoff, self.backoff * 2 ** max(self._failures - 1, 0))


class RemoteRetriever:
    """Proposes candidate trees through the datastore service; same `propose` as `Retriever`.

    url          the service, e.g. "http://127.0.0.1:8750"
    store        the store's name on the service
    timeout      seconds a call may wait on the network (connect, send, and each read)
    api_key      for `enroll` (the service's ECHOSPEC_API_KEY)
    payload      "binary" (default: the faster one, see tools/benchmarks/bench_service.py) or "json"
    backoff, max_backoff   the circuit breaker's first and longest fail-fast windows, in seconds
    """

    def __init__(self, url: str, store: str, timeout: float = 0.1, api_key: str | None = None,
                 payload: str = "binary", backoff: float = 0.05, max_backoff: float = 2.0):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http://host:port or https://host:port, got {url!r}")
        if payload not in PAYLOADS:
            raise ValueError(f"payload must be one of {PAYLOADS}, got {payload!r}")
        self.url, self.store, self.timeout, self.payload = url.rstrip("/"), store, float(timeout), payload
        if api_key is not None and not (api_key.isascii() and api_key.isprintable() and " " not in api_key):
            raise ValueError("api_key must be printable ASCII without spaces")
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None
        self._host, self._port = parts.hostname, parts.port or (443 if self._tls else 80)
        self._prefix = f"{parts.path.rstrip('/')}/v1/stores/{quote(store, safe='')}"
        self._api_key = api_key
        self.breaker = CircuitBreaker(backoff, max_backoff)
        self._local = threading.local()
        self._connections: list[_Connection] = []
        self._connections_lock = threading.Lock()
        self._vocab_size: int | None = None
        self._paths: dict[tuple, str] = {}  # (speaker, max_nodes, max_depth): binary propose path

    # -- the Retriever interface --

    def propose(self, context, speaker: str | None = None, max_nodes: int | None = None,
                max_depth: int | None = None, timeout: float | None = None) -> CandidateTree:
        """Candidate continuations of `context` (1-D store-local ids), as `Retriever.propose`.

        Raises RetrieverUnavailable when the service is slow, down or backing off, and
        ServiceRequestError (a ValueError) when it refuses the request."""
        return self.propose_batch([context], speaker, max_nodes, max_depth, timeout)[0]

    def propose_batch(self, contexts: Sequence, speaker: str | Sequence[str | None] | None = None,
                      max_nodes: int | None = None, max_depth: int | None = None,
                      timeout: float | None = None) -> list[CandidateTree]:
        """One tree per context, in one request. `speaker`: one speaker for every context, or one per
        context (None: the general store alone), as an engine's batch mixes requests of many speakers."""
        if speaker is not None and not isinstance(speaker, str):  # per context: binary, whatever the payload
            speakers = [s or "" for s in speaker]
            if len(speakers) != len(contexts):
                raise ValueError(f"{len(speakers)} speakers for {len(contexts)} contexts")
            path = f"{self._prefix}/propose?" + urlencode({"speakers": ",".join(speakers),
                                                           **_options(None, max_nodes, max_depth)})
        elif self.payload == "binary":
            path = self._paths.get((speaker, max_nodes, max_depth)) or self._binary_path(speaker, max_nodes, max_depth)
        else:
            body = json.dumps({"contexts": [np.asarray(c).tolist() for c in contexts],
                               **_options(speaker, max_nodes, max_depth)}).encode()
            _, data = self._call("POST", f"{self._prefix}/propose", body, JSON, timeout)
            return [CandidateTree.from_dict(t) for t in json.loads(data)["trees"]]
        _, data = self._call("POST", path, encode_contexts(contexts), BINARY, timeout)
        try:
            return decode_trees(data)
        except WireError as e:
            raise RetrieverUnavailable(f"{self.url}: malformed propose answer ({e})") from None

    def _binary_path(self, speaker, max_nodes, max_depth) -> str:
        """The binary propose's path, options in the query string; kept per option set (a worker sends
        the same few over and over)."""
        options = _options(speaker, max_nodes, max_depth)
        path = f"{self._prefix}/propose" + (f"?{urlencode(options)}" if options else "")
        if len(self._paths) < MAX_KEPT_PATHS:
            self._paths[speaker, max_nodes, max_depth] = path
        return path

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            self._vocab_size = int(self.info()["vocabulary"]["size"])
        return self._vocab_size

    @property
    def speakers(self) -> tuple[str, ...]:
        """The store's speakers now (asks the service: a new enrollment shows at once)."""
        return tuple(sorted(self.info()["speakers"]))

    def info(self, timeout: float | None = None) -> dict:
        """The store's description: vocabulary, sizes, speakers with their stats."""
        return json.loads(self._call("GET", self._prefix, None, None, timeout)[1])

    # -- writes --

    def enroll(self, speaker: str, utterances: Sequence[dict], replace: bool = False,
               timeout: float = 120.0) -> dict:
        """Add utterances (`{"id": str, "tokens": [raw model ids]}`) to a speaker, or replace its
        utterances; returns once the service has them on disk and answers from them. Needs api_key."""
        body = json.dumps({"utterances": [{"id": str(u["id"]), "tokens": np.asarray(u["tokens"]).tolist()}
                                          for u in utterances], "replace": replace}).encode()
        path = f"{self._prefix}/speakers/{quote(speaker, safe='')}"
        return json.loads(self._call("POST", path, body, JSON, timeout, breaker=False)[1])

    # -- plumbing --

    def _call(self, method: str, path: str, body: bytes | None, content_type: str | None,
              timeout: float | None, breaker: bool = True) -> tuple[int, bytes]:
        if breaker:
            self.breaker.check()
        try:
            timeout = self.timeout if timeout is None else timeout
            status, data = self._exchange(method, path, body, content_type, timeout)
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, garbled
            if breaker:
                self.breaker.failure()
            raise RetrieverUnavailable(f"{self.url}: {type(e).__name__}: {e or 'no answer'}") from None
        if status >= 500:
            if breaker:
                self.breaker.failure()
            raise RetrieverUnavailable(f"{self.url}: service error {status}: {_message(data)}")
        if breaker:
            self.breaker.success()
        if status >= 400:
            raise ServiceRequestError(status, _error(data).get("code", "error"), _message(data))
        return status, data

    def _exchange(self, method, path, body, content_type, timeout) -> tuple[int, bytes]:
        headers = {"Content-Type": content_type} if content_type else {}
        if self._api_key and method != "GET":
            headers["Authorization"] = f"Bearer {self._api_key}"
        conn = self._connection()
        reused = conn.is_open
        try:
            try:
                return conn.request(method, path, body, headers, timeout)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if not reused:
                    raise
                # The service closed an idle kept-alive connection (or restarted): retry once, fresh socket.
                conn.close()
                return conn.request(method, path, body, headers, timeout)
        except BaseException:
            conn.close()  # never reuse a connection in an unknown state
            raise

    def _connection(self) -> "_Connection":
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = _Connection(self._host, self._port, self._tls)
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    @property
    def connections_opened(self) -> int:
        """Sockets opened so far, all threads together (one per thread while keep-alive holds)."""
        with self._connections_lock:
            return sum(conn.opened for conn in self._connections)

    def close(self) -> None:
        """Close every thread's connection (a later call opens a new one)."""
        with self._connections_lock:
            for conn in self._connections:
                conn.close()

    def __enter__(self) -> "RemoteRetriever":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteRetriever({self.url!r}, store={self.store!r}, payload={self.payload!r})"


class _Connection:
    """One kept-alive HTTP/1.1 connection. A request leaves in one send on a TCP_NODELAY socket
    (http.client sends headers and body separately, and Nagle's algorithm may hold the second
    segment back until the first is acknowledged); the answer is parsed by httptools, uvicorn's C
    parser (content-length or chunked), at a fraction of http.client's header-parsing cost.

    The socket is blocking with the kernel's send and receive timeouts (SO_SNDTIMEO, SO_RCVTIMEO),
    set again only when the timeout changes: a request is then two system calls, send and recv.
    Python's own socket timeout would add a poll() before each of them and an ioctl per request."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None):
        self.host, self.port, self.tls = host, port, tls
        self.host_header = f"Host: {host}:{port}\r\n"
        self.sock: socket.socket | None = None
        self.timeout: float | None = None  # the kernel timeouts now set on sock
        self.opened = 0  # sockets opened so far: stays 1 while keep-alive works

    @property
    def is_open(self) -> bool:
        return self.sock is not None

    def request(self, method: str, path: str, body: bytes | None, headers: dict, timeout: float) -> tuple[int, bytes]:
        if self.sock is None:
            self._open(timeout)
        if timeout != self.timeout:
            _set_kernel_timeouts(self.sock, timeout)
            self.timeout = timeout
        body = body or b""
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        answer = _Answer()
        parser = answer.parser = httptools.HttpResponseParser(answer)
        received = False
        try:
            self.sock.sendall(f"{method} {path} HTTP/1.1\r\n{self.host_header}Content-Length: {len(body)}\r\n"
                              f"{head}\r\n".encode("latin-1") + body)
            while not answer.complete:
                data = self.sock.recv(1 << 16)
                if not data:
                    raise (http.client.IncompleteRead(b"") if received else
                           http.client.RemoteDisconnected("the service closed the connection without an answer"))
                received = True
                try:
                    parser.feed_data(data)
                except httptools.HttpParserError as e:
                    raise http.client.HTTPException(f"malformed answer: {e}") from None
        except BlockingIOError:  # what a kernel timeout looks like on a blocking socket
            raise TimeoutError(f"timed out: no answer within {timeout} s") from None
        if not answer.keep_alive:
            self.close()
        return parser.get_status_code(), b"".join(answer.body)

    def _open(self, timeout: float) -> None:
        sock = socket.create_connection((self.host, self.port), timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = self.tls.wrap_socket(sock, server_hostname=self.host) if self.tls else sock
        self.sock.settimeout(None)  # blocking from now on: the kernel timeouts take over
        self.timeout = None
        self.opened += 1

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _set_kernel_timeouts(sock: socket.socket, timeout: float) -> None:
    if sys.platform == "win32":  # SO_RCVTIMEO takes milliseconds as a DWORD there: keep Python's own timeout
        sock.settimeout(timeout)
        return
    microseconds = max(1, round(timeout * 1e6))  # a zero timeval would mean "wait forever"
    timeval = struct.pack("ll", *divmod(microseconds, 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


class _Answer:
    """httptools callbacks collecting one response's body."""

    __slots__ = ("parser", "body", "complete", "keep_alive")

    def __init__(self):
        self.parser: httptools.HttpResponseParser | None = None
        self.body: list[bytes] = []
        self.complete = self.keep_alive = False

    def on_body(self, chunk: bytes) -> None:
        self.body.append(chunk)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # only valid here: the parser resets after


def _options(speaker, max_nodes, max_depth) -> dict:
    return {k: v for k, v in (("speaker", speaker), ("max_nodes", max_nodes), ("max_depth", max_depth))
            if v is not None}


def _error(data: bytes) -> dict:
    try:
        error = json.loads(data).get("error")
        return error if isinstance(error, dict) else {}
    except (ValueError, AttributeError):
        return {}


def _message(data: bytes) -> str:
    return _error(data).get("message") or data[:200].decode(errors="replace")

"""Hostile clients against a real service on loopback, on both HTTP paths: slow ones (a byte at a time)
are cut off within the read timeout."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest
from service_testing import Server, copy_store, make_store, post_json

from echospec.retriever.wire import BINARY, encode_contexts

READ_TIMEOUT = 1.0
MODES = {"fast": {}, "stock": {"uvicorn_version": "0.0.1"}}  # see test_service.MODES


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("hostile"), n_tokens=5000, n_speakers=2)


@pytest.fixture(scope="module", params=sorted(MODES))
def server(request, built, tmp_path_factory):
    store = copy_store(built[0], tmp_path_factory.mktemp(request.param) / "voices")
    options = {**MODES[request.param], "limits": {"read_timeout": READ_TIMEOUT}}
    with Server(store, options=options) as server:
        yield server


def seconds_until_closed(port: int, at_once: bytes, trickled: bytes, interval: float = 0.05,
                         give_up: float = 5.0) -> float:
    """Send `at_once`, then `trickled` a byte every `interval` seconds, then nothing: the seconds until
    the service closes the connection (`give_up` if it does not)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=give_up) as sock:
        sock.sendall(at_once)
        sent = 0
        while time.monotonic() - started < give_up:
            try:
                if sent < len(trickled):
                    sent += sock.send(trickled[sent:sent + 1])
                if select.select([sock], [], [], interval)[0] and sock.recv(65536) == b"":
                    break
            except (ConnectionResetError, BrokenPipeError):
                break
        return time.monotonic() - started


def read_answer(sock: socket.socket) -> bytes:
    """One whole answer (Content-Length framed) from a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
            data.lower().partition(b"content-length: ")[2].split(b"\r\n")[0]):
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


def test_slow_clients_are_cut_off_within_the_read_timeout(server):
    """A head, a binary body (answered inline when whole) and a JSON body sent a byte at a time, and a
    connection that sends nothing: each is closed about READ_TIMEOUT after it started, never later; a
    kept-alive client idling between requests is not (idle connections are the keep-alive's business)."""
    binary, json_body = encode_contexts([[1, 2, 3] * 100]), json.dumps({"context": [1, 2, 3] * 100}).encode()
    propose = b"POST /v1/stores/voices/propose HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
    cases = {"head": (b"", b"POST /v1/stores/voices/propose HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000),
             "binary body": (propose % (BINARY.encode(), len(binary)), binary),
             "json body": (propose % (b"application/json", len(json_body)), json_body),
             "nothing": (b"", b"")}
    seconds = {}

    def measure(name: str, at_once: bytes, trickled: bytes) -> None:
        seconds[name] = seconds_until_closed(server.port, at_once, trickled)

    threads = [threading.Thread(target=measure, args=(name, *data)) for name, data in cases.items()]
    for thread in threads:
        thread.start()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        for _ in range(2):  # a request, READ_TIMEOUT * 1.5 of idling, a request: both answered
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_answer(sock).startswith(b"HTTP/1.1 200")
            time.sleep(READ_TIMEOUT * 1.5)
    for thread in threads:
        thread.join()
    assert all(READ_TIMEOUT * 0.9 < s < READ_TIMEOUT + 1.0 for s in seconds.values()), seconds
    assert post_json(server.url, "/v1/stores/voices/propose", {"context": [1, 2, 3]})[0] == 200


"""Hostile clients against a real service on loopback, on both HTTP paths: slow ones (a byte at a time)
are cut off within the read timeout, and random or malformed requests get a 4xx, never a 5xx, with
the service still answering the next good request."""

from __future__ import annotations

import json
from collections import Counter
import select
import socket
import threading
import time

import numpy as np
import pytest
from service_testing import API_KEY, Server, copy_store, make_store, post_json, request

from echospec.retriever import Retriever
from echospec.retriever.client.wire import BINARY, encode_contexts

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


def resident_mb(pid: int) -> float:
    status = open(f"/proc/{pid}/status").read()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def test_an_endless_head_is_cut_off_at_the_head_limit(server):
    """A header sent as fast as loopback takes it: closed once the head passes Limits.max_head_bytes
    (64 kB) plus a read or two, long before the read timeout, where uvicorn alone would keep reading it
    (~200 MB in 20 s here), and the service's memory does not grow with it."""
    before = resident_mb(server.process.pid)
    sent, started = 0, time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        try:
            while sent < 256 << 20 and time.monotonic() - started < 10:
                sent += sock.send(b"a" * (1 << 16))
            assert sock.recv(65536) == b""
        except (ConnectionResetError, BrokenPipeError):
            pass
    elapsed = time.monotonic() - started
    assert sent < 16 << 20 and elapsed < READ_TIMEOUT / 2, (sent, elapsed)  # ~3 MB (socket buffers), ~10 ms
    assert resident_mb(server.process.pid) - before < 16
    assert post_json(server.url, "/v1/stores/voices/propose", {"context": [1, 2, 3]})[0] == 200


# ---------------------------------------------------------------------------------------------------
# Fuzz


def exchange(port: int, data: bytes, framed: bool) -> int | None:
    """Send `data` on a fresh connection; the status of the answer, or None if the service closed
    without one. A `framed` request is whole, so it waits for its answer; anything else is followed by
    the end of the stream (half-close), and the service may answer it or just close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            sock.sendall(data)
            if not framed:
                sock.shutdown(socket.SHUT_WR)
            answer = read_answer(sock) if framed else b"".join(iter(lambda: sock.recv(65536), b""))
        except (ConnectionResetError, BrokenPipeError, AssertionError):
            return None
    return int(answer[9:12]) if answer.startswith(b"HTTP/1.") else None


def framed_request(method: str, path: str, body: bytes, headers: dict) -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "x", "Content-Length": len(body), **headers}.items())
    return f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode("latin-1") + body


def wrong_value(rng: np.random.Generator):
    """A JSON value of a random wrong (or hostile) kind."""
    return [None, True, -1, 2**63, 2**64, -2**63 - 1, 10**400, 1.5, 1e308, "x", "", "../..", [], [[]], [None],
            ["1"], [1.5], [True], [[1, [2]]], {}, {"a": 1}, [2**70], "\u0000", "\n" * 3, -0.0,
            list(range(5))][int(rng.integers(26))]


def fuzz_cases(rng: np.random.Generator):
    """(what, bytes, framed) for a few hundred hostile requests."""
    binary = encode_contexts([[1, 2, 3], [4, 5]])
    fields = {"context": [1, 2, 3], "contexts": [[1, 2]], "speaker": "spk00", "max_nodes": 4, "max_depth": 2}
    key = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for i in range(80):  # random bytes, some after a plausible start
        junk = rng.bytes(int(rng.integers(1, 300)))
        yield "random bytes", (b"POST /v1/stores/voices/propose HTTP/1.1\r\n" if i % 2 else b"") + junk, False
    for i in range(60):  # a propose's head cut anywhere
        whole = framed_request("POST", "/v1/stores/voices/propose", binary, {"Content-Type": BINARY})
        yield "truncated head", whole[:int(rng.integers(1, len(whole) - len(binary)))], False
    for i in range(60):  # the wire format's own header cut or lying, in a whole HTTP request
        body = bytearray(binary[:int(rng.integers(0, len(binary) + 1))])
        if body and i % 2:
            body[int(rng.integers(len(body)))] = int(rng.integers(256))
        yield "binary body", framed_request("POST", "/v1/stores/voices/propose", bytes(body),
                                            {"Content-Type": BINARY}), True
    for length in ("99999999999999999999999", str(2**63), str(10**12), "-1", "1e3", " 12", "0x10", "8388609"):
        yield "huge length", (b"POST /v1/stores/voices/propose HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\n"
                              b"Content-Length: %s\r\n\r\n[1,2" % (BINARY.encode(), length.encode())), False
    for i in range(80):  # wrong JSON types in propose and enroll
        if i % 2:
            payload = {**{k: v for k, v in fields.items() if k != "contexts" or i % 4 == 1}}
            payload[list(payload)[int(rng.integers(len(payload)))]] = wrong_value(rng)
            yield "json propose", framed_request("POST", "/v1/stores/voices/propose", json.dumps(payload).encode(),
                                                 {"Content-Type": "application/json"}), True
        else:
            utterance = {"id": "u", "tokens": [1, 2, 3]}
            utterance[["id", "tokens"][i % 4 // 2]] = wrong_value(rng)
            payload = {"utterances": [utterance], "replace": wrong_value(rng) if i % 8 == 0 else False}
            yield "json enroll", framed_request("POST", f"/v1/stores/voices/speakers/fz{i}",
                                                json.dumps(payload).encode(), key), True
    for i in range(30):  # odd methods and paths
        method = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"][i % 7]
        path = ["/v1/stores/%00", "/v1/stores/voices/speakers/%2e%2e/x", "/%ff%fe", "/v1/stores/" + "a" * 5000,
                "/metrics?x=1", "/v1/stores/voices/propose?max_nodes=-1", "//", "/v1/stores/voices/propose;x"][i % 8]
        yield "odd path", framed_request(method, path, b"{}", {"Content-Type": "application/json"}), method != "HEAD"


def test_fuzz_gets_no_5xx_and_the_next_good_request_is_answered(server, built):
    rng = np.random.default_rng(12)
    cases = list(fuzz_cases(rng))
    assert len(cases) >= 300
    started = time.monotonic()
    statuses = {}
    for what, data, framed in cases:
        status = exchange(server.port, data, framed)
        statuses.setdefault(what, []).append(status)
        assert status is None or status < 500, (what, data[:200], status)
        assert status is not None or not framed, (what, data[:200])
    assert time.monotonic() - started < 20
    refused = Counter(s for got in statuses.values() for s in got if s is not None and 400 <= s < 500)
    assert sum(refused.values()) >= 200, statuses  # the requests reached the service and were refused
    assert "Traceback" not in server.output() and "unexpected error" not in server.output(), server.output()[-3000:]
    store = built[0]
    status, answer = post_json(server.url, "/v1/stores/voices/propose", {"context": [1, 2, 3]})
    assert status == 200 and answer == {"tree": Retriever(store).propose([1, 2, 3]).to_dict()}


# --- idle connections, HTTP/1.0, resent enrollments ----------------------------------------------------------


def closed_by_server(sockets: list[socket.socket], wait: float) -> list[socket.socket]:
    """Those of `sockets` the service has closed (read end-of-file or a reset) within `wait` seconds."""
    closed, open_ = [], list(sockets)
    deadline = time.monotonic() + wait
    while open_ and time.monotonic() < deadline:
        readable = select.select(open_, [], [], 0.05)[0]
        for sock in readable:
            try:
                gone = sock.recv(65536) == b""
            except ConnectionResetError:
                gone = True
            if gone:
                closed.append(sock)
                open_.remove(sock)
    return closed


@pytest.mark.parametrize("mode", sorted(MODES))
def test_idle_connections_never_starve_health_checks_or_proposals(built, tmp_path, mode):
    """The issue's case, scaled down: far more idle connections than the limit (kept-alive ones between
    requests, then fresh ones that send nothing). The service closes the idle longest to make room, so
    /healthz, JSON and binary proposals are answered (with uvicorn's limit they were 503 for 30-75 s), on
    both HTTP paths, and it never holds more than the limit."""
    limit, kept_alive, fresh = 64, 40, 300
    store = copy_store(built[0], tmp_path / "voices")
    sockets = []
    with Server(store, options={**MODES[mode], "limits": {"max_connections": limit}}) as server:
        try:
            for _ in range(kept_alive):
                sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert read_answer(sock).startswith(b"HTTP/1.1 200")
                sockets.append(sock)
            sockets += [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(fresh)]
            context = [1, 2, 3]
            for _ in range(3):
                assert request(server.url, "GET", "/healthz")[0] == 200
                assert post_json(server.url, "/v1/stores/voices/propose", {"context": context})[0] == 200
                status, _, _ = request(server.url, "POST", "/v1/stores/voices/propose", encode_contexts([context]),
                                       {"Content-Type": BINARY})
                assert status == 200
            closed = closed_by_server(sockets, wait=2.0)
            assert len(sockets) - len(closed) <= limit  # what the service still holds of ours
            assert set(sockets[:kept_alive]) <= set(closed)  # the idle longest went first
        finally:
            for sock in sockets:
                sock.close()
        assert "Traceback" not in server.output()


@pytest.mark.parametrize("content_type, body", [
    (BINARY.encode(), encode_contexts([[1, 2, 3]])),  # the fast path answers it inline
    (b"application/json", json.dumps({"context": [1, 2, 3]}).encode()),
])
def test_http_1_0_keep_alive_is_answered_and_closed_on_both_paths(server, content_type, body):
    """An HTTP/1.0 client asking to keep the connection alive gets its answer with `connection: close` and the
    connection closed, whichever path answers (the fast path kept it open without saying so)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/stores/voices/propose HTTP/1.0\r\nConnection: keep-alive\r\nContent-Type: %s\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (content_type, len(body), body))
        answer = read_answer(sock)
        assert answer.startswith(b"HTTP/1.1 200") and b"\r\nconnection: close\r\n" in answer.lower()
        sock.settimeout(2)
        assert sock.recv(1) == b""


def test_resent_enrollments_leave_one_copy(server):
    """8 clients send the same 5 utterances at once (a retry after a lost acknowledgement, many times over):
    every one is told success, one copy is kept, and an id sent again with other tokens is a 409."""
    path = "/v1/stores/voices/speakers/retry"
    utterances = [{"id": f"u{i}", "tokens": [1 + i, 2, 3, 4]} for i in range(5)]
    answers = []

    def send():
        answers.append(post_json(server.url, path, {"utterances": utterances}, api_key=API_KEY))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [status for status, _ in answers] == [200] * 8, answers
    assert sorted((a["enrolled"], a["unchanged"]) for _, a in answers) == [(0, 5)] * 7 + [(5, 0)]
    assert all(a["utterances"] == 5 for _, a in answers)
    status, info = post_json(server.url, path, {"utterances": utterances[:1]}, api_key=API_KEY)
    assert (status, info["enrolled"], info["unchanged"]) == (200, 0, 1)
    changed = [{"id": "u2", "tokens": [9, 9, 9]}]
    status, answer = post_json(server.url, path, {"utterances": changed}, api_key=API_KEY)
    assert (status, answer["error"]["code"]) == (409, "utterance_conflict")
    assert answer["error"]["message"] == ("utterances[0]: speaker 'retry' already has utterance 'u2' with other "
                                          "tokens; nothing was enrolled (replace the speaker's utterances to change it)")
    status, answer = post_json(server.url, path, {"utterances": changed, "replace": True}, api_key=API_KEY)
    assert (status, answer["utterances"], answer["enrolled"]) == (200, 1, 1)

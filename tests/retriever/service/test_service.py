"""The datastore service over real HTTP: a real `echospec serve` subprocess, nothing mocked."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from service_testing import API_KEY, VOCAB, Server, copy_store, make_store, post_json, request, resident_bytes, vm_flags

from echospec.retriever import Retriever
from echospec.retriever.client import RemoteRetriever, RetrieverUnavailable
from echospec.retriever.tree import FIELDS, CandidateTree
from echospec.retriever.client.wire import BINARY, WireError, decode_contexts, decode_trees, encode_contexts, encode_trees


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("service"))


MODES = ("fast", "stock")
"""Each server-backed test runs against the service on its fast HTTP path (fast_http.py) and on uvicorn's
own protocol, which `serve` falls back to under a uvicorn the fast path was not written for (made so
here by service_testing.SERVE's uvicorn_version: the real version check fails)."""


@pytest.fixture(scope="module", params=MODES)
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def store(built, mode, tmp_path_factory):
    """A copy this module's server may enroll into."""
    return copy_store(built[0], tmp_path_factory.mktemp(f"served-{mode}") / "voices")


@pytest.fixture(scope="module")
def corpus(built):
    return built[1]


@pytest.fixture(scope="module")
def server(store, mode):
    with Server(store, options=None if mode == "fast" else {"uvicorn_version": "0.0.1"}) as server:
        yield server


@pytest.fixture(scope="module")
def remote(server):
    with RemoteRetriever(server.url, store="voices", timeout=5.0) as r:
        yield r


def fast_only(mode: str) -> None:
    if mode != "fast":
        pytest.skip("a property of the fast HTTP path")


def test_the_http_path_is_the_one_the_uvicorn_version_allows(server, mode):
    """The fallback is logged once, and only when it happens."""
    fallbacks = server.output().count("serving with uvicorn's own HTTP protocol")
    assert fallbacks == (mode == "stock"), server.output()
    if mode == "stock":
        assert "written for uvicorn 0.54 or 0.55, not 0.0.1" in server.output()


def contexts_of(corpus, n: int, seed: int = 0) -> list[tuple[np.ndarray, str | None]]:
    """(context, speaker) pairs cut from the corpus at random points; every third without a speaker."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        utt = corpus[int(rng.integers(len(corpus)))]
        cut = int(rng.integers(1, len(utt["tokens"])))
        out.append((np.array(utt["tokens"][:cut]), None if i % 3 == 0 else utt["speaker"]))
    return out


def test_health_and_store_listing(server, corpus):
    status, _, body = request(server.url, "GET", "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok", "stores": ["voices"], "pid": server.process.pid}
    status, _, body = request(server.url, "GET", "/v1/stores")
    (listed,) = json.loads(body)["stores"]
    assert listed["name"] == "voices" and listed["vocabulary"]["size"] == VOCAB
    assert set(listed["speakers"]) >= {u["speaker"] for u in corpus}
    spk = corpus[0]["speaker"]
    assert listed["speakers"][spk]["utterances"] == sum(u["speaker"] == spk for u in corpus)
    assert listed["tokens"] == sum(len(u["tokens"]) for u in corpus)
    status, _, body = request(server.url, "GET", "/v1/stores/voices")
    assert status == 200 and json.loads(body)["name"] == "voices"


def test_propose_json_and_binary_equal_in_process(server, store, corpus):
    local = Retriever(store)
    pairs = contexts_of(corpus, 30, seed=1)
    for context, speaker in pairs:
        expected = local.propose(context, speaker=speaker).to_dict()
        status, answer = post_json(server.url, "/v1/stores/voices/propose",
                                   {"context": context.tolist(), "speaker": speaker})
        assert status == 200 and answer == {"tree": expected}
    contexts = [c for c, _ in pairs]
    status, answer = post_json(server.url, "/v1/stores/voices/propose",
                               {"contexts": [c.tolist() for c in contexts], "max_nodes": 5, "max_depth": 3})
    assert answer["trees"] == [local.propose(c, max_nodes=5, max_depth=3).to_dict() for c in contexts]
    status, _, body = request(server.url, "POST", "/v1/stores/voices/propose?max_nodes=7",
                              encode_contexts(contexts), {"Content-Type": BINARY})
    assert status == 200
    assert [t.to_dict() for t in decode_trees(body)] == [local.propose(c, max_nodes=7).to_dict() for c in contexts]
    long = [np.random.default_rng(i).integers(0, VOCAB, 2000) for i in range(10)]  # 80 kB: past the inline limit
    status, _, body = request(server.url, "POST", "/v1/stores/voices/propose", encode_contexts(long),
                              {"Content-Type": BINARY})
    assert status == 200 and [t.to_dict() for t in decode_trees(body)] == [local.propose(c).to_dict() for c in long]


@pytest.mark.parametrize("payload", ["binary", "json"])
def test_remote_retriever_equals_in_process(server, store, corpus, payload):
    local = Retriever(store)
    with RemoteRetriever(server.url, store="voices", timeout=5.0, payload=payload) as remote:
        assert remote.vocab_size == local.vocab_size
        assert set(remote.speakers) >= set(local.speakers)
        for context, speaker in contexts_of(corpus, 40, seed=2):
            for options in ({}, {"max_nodes": 4, "max_depth": 2}, {"max_nodes": 0}):
                got = remote.propose(context, speaker=speaker, **options)
                want = local.propose(context, speaker, **options)
                assert got.to_dict() == want.to_dict()
                assert [getattr(got, f).dtype for f in ("tokens", "parents", "depths", "counts", "probs", "sources")] \
                    == [getattr(want, f).dtype for f in ("tokens", "parents", "depths", "counts", "probs", "sources")]
        assert remote.connections_opened == 1  # one kept-alive connection served every call
        assert len(remote.propose([])) == 0  # as in-process: an empty context has no root
        with pytest.raises(ValueError, match="0..511"):
            remote.propose([1, 2, VOCAB])
        with pytest.raises(ValueError, match="unknown_speaker"):
            remote.propose([1, 2], speaker="nobody")


def test_wire_round_trip_and_malformed_trees(store, corpus):
    """Any number of trees survives the trip; a tree that breaks CandidateTree's promises does not."""
    local = Retriever(store)
    for n in range(4):  # 1 is the header fast path; 2 leaves the token column unaligned in the body
        trees = [local.propose(c, speaker=s) for c, s in contexts_of(corpus, n, seed=n)]
        assert [t.to_dict() for t in decode_trees(encode_trees(trees))] == [t.to_dict() for t in trees]
    tree = local.propose(contexts_of(corpus, 1)[0][0])
    assert len(tree) >= 3
    for field, index, value in (("parents", 1, 1), ("parents", 2, 5), ("parents", 1, -2), ("depths", 0, 2),
                                ("depths", 2, 9), ("sources", 1, 4)):
        broken = {name: getattr(tree, name).copy() for name in FIELDS}
        broken[field][index] = value
        with pytest.raises(WireError, match="malformed"):
            decode_trees(encode_trees([CandidateTree.trusted([broken[name] for name in FIELDS])]))
    contexts = decode_contexts(encode_contexts([np.array([2**31 - 1, 0]), [], np.array([-5], np.int8)]), 3)
    assert [c.tolist() for c in contexts] == [[2**31 - 1, 0], [], [-5]] and contexts[0].dtype == np.int64
    with pytest.raises(ValueError, match="int32"):
        encode_contexts([np.array([1, 2**31])])


def run_clients(url: str, store, cases, n_clients: int, per_client: int) -> None:
    """`n_clients` threads, each its own RemoteRetriever, each `per_client` proposals checked against
    the in-process answers; zero errors allowed."""
    local = Retriever(store)
    expected = [local.propose(c, speaker=s).to_dict() for c, s in cases]
    errors, mismatches = [], []

    def client(k: int) -> None:
        try:
            with RemoteRetriever(url, store="voices", timeout=30.0) as remote:
                for i in range(per_client):
                    j = (k * 7919 + i) % len(cases)
                    context, speaker = cases[j]
                    if remote.propose(context, speaker=speaker).to_dict() != expected[j]:
                        mismatches.append((k, i))
                if remote.connections_opened != 1:
                    errors.append(f"client {k} opened {remote.connections_opened} connections")
        except Exception as e:  # noqa: BLE001 — collected and asserted below
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and mismatches == []


def test_32_concurrent_clients_x1000(server, store, corpus, mode):
    """32 threads, each its own client and connection, 1000 proposals each (200 on the slower stock
    path): about 4 s here."""
    run_clients(server.url, store, contexts_of(corpus, 500, seed=4), n_clients=32,
                per_client=1000 if mode == "fast" else 200)


GOOD = (b'{"context": [1, 2, 3]}', {"Content-Type": "application/json"})
KEY = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
ENROLL = "/v1/stores/voices/speakers/newcomer"
UTTERANCE = {"utterances": [{"id": "u1", "tokens": [1, 2, 3, 4]}]}
MALFORMED = [  # (what, method, path, body, headers, status, error code)
    ("bad json", "POST", "/v1/stores/voices/propose", b'{"context": [1, 2', {}, 400, "bad_json"),
    ("not an object", "POST", "/v1/stores/voices/propose", b'[1, 2, 3]', {}, 422, "invalid_request"),
    ("string ids", "POST", "/v1/stores/voices/propose", b'{"context": ["1", "2"]}', {}, 422, "invalid_request"),
    ("float ids", "POST", "/v1/stores/voices/propose", b'{"context": [1.5, 2]}', {}, 422, "invalid_request"),
    ("bool ids", "POST", "/v1/stores/voices/propose", b'{"context": [true, 2]}', {}, 422, "invalid_request"),
    ("nested ids", "POST", "/v1/stores/voices/propose", b'{"context": [[1], 2]}', {}, 422, "invalid_request"),
    ("huge id", "POST", "/v1/stores/voices/propose", b'{"context": [1, 99999999999999999999999]}', {}, 422,
     "id_out_of_range"),
    ("unknown field", "POST", "/v1/stores/voices/propose", b'{"context": [1], "evil": 1}', {}, 422,
     "invalid_request"),
    ("both context and contexts", "POST", "/v1/stores/voices/propose", b'{"context": [1], "contexts": [[1]]}', {},
     422, "invalid_request"),
    ("neither", "POST", "/v1/stores/voices/propose", b'{"speaker": "spk00"}', {}, 422, "invalid_request"),
    ("id out of range", "POST", "/v1/stores/voices/propose", b'{"context": [1, 512]}', {}, 422, "id_out_of_range"),
    ("negative id", "POST", "/v1/stores/voices/propose", b'{"context": [-1, 2]}', {}, 422, "id_out_of_range"),
    ("node budget", "POST", "/v1/stores/voices/propose", b'{"context": [1], "max_nodes": 100000}', {}, 422,
     "out_of_range"),
    ("negative depth", "POST", "/v1/stores/voices/propose", b'{"context": [1], "max_depth": -1}', {}, 422,
     "out_of_range"),
    ("batch too large", "POST", "/v1/stores/voices/propose",
     json.dumps({"contexts": [[1]] * 257}).encode(), {}, 422, "batch_too_large"),
    ("context too long", "POST", "/v1/stores/voices/propose",
     json.dumps({"context": [1] * 70_000}).encode(), {}, 422, "context_too_long"),
    ("unknown store", "POST", "/v1/stores/nostore/propose", GOOD[0], {}, 404, "unknown_store"),
    ("traversal store", "POST", "/v1/stores/..%2F..%2Fetc/propose", GOOD[0], {}, 404, "http_error"),
    ("dotted store", "POST", "/v1/stores/../propose", GOOD[0], {}, 422, "invalid_name"),
    ("unknown speaker", "POST", "/v1/stores/voices/propose", b'{"context": [1], "speaker": "nobody"}', {}, 404,
     "unknown_speaker"),
    ("traversal speaker", "POST", "/v1/stores/voices/propose", b'{"context": [1], "speaker": "../../etc"}', {}, 422,
     "invalid_name"),
    ("binary truncated", "POST", "/v1/stores/voices/propose", encode_contexts([[1, 2, 3]])[:-2],
     {"Content-Type": BINARY}, 400, "bad_body"),
    ("binary trailing bytes", "POST", "/v1/stores/voices/propose", encode_contexts([[1, 2, 3]]) + b"\0",
     {"Content-Type": BINARY}, 400, "bad_body"),
    ("binary lying count", "POST", "/v1/stores/voices/propose", b"\xff\xff\xff\x00" + b"\0" * 8,
     {"Content-Type": BINARY}, 400, "bad_body"),
    ("binary id out of range", "POST", "/v1/stores/voices/propose", encode_contexts([[1, 4096]]),
     {"Content-Type": BINARY}, 422, "id_out_of_range"),
    ("binary bad query", "POST", "/v1/stores/voices/propose?max_nodes=abc", encode_contexts([[1]]),
     {"Content-Type": BINARY}, 422, "invalid_request"),
    ("binary unknown query", "POST", "/v1/stores/voices/propose?path=/etc", encode_contexts([[1]]),
     {"Content-Type": BINARY}, 422, "invalid_request"),
    ("media type", "POST", "/v1/stores/voices/propose", GOOD[0], {"Content-Type": "text/plain"}, 415,
     "unsupported_media_type"),
    ("enroll without key", "POST", ENROLL, json.dumps(UTTERANCE).encode(), {}, 401, "unauthenticated"),
    ("enroll wrong key", "POST", ENROLL, json.dumps(UTTERANCE).encode(), {"Authorization": "Bearer nope"}, 403,
     "forbidden"),
    ("enroll other scheme", "POST", ENROLL, json.dumps(UTTERANCE).encode(), {"Authorization": f"Basic {API_KEY}"},
     403, "forbidden"),
    ("enroll traversal speaker", "POST", "/v1/stores/voices/speakers/..%2E", json.dumps(UTTERANCE).encode(), KEY,
     422, "invalid_name"),
    ("enroll dotfile speaker", "POST", "/v1/stores/voices/speakers/.hidden", json.dumps(UTTERANCE).encode(), KEY,
     422, "invalid_name"),
    ("enroll ids out of range", "POST", ENROLL, json.dumps({"utterances": [{"id": "a", "tokens": [1, 600]}]}).encode(),
     KEY, 422, "id_out_of_range"),
    *[(f"enroll id {what}", "POST", ENROLL, b'{"utterances": [{"id": "a", "tokens": [%d]}]}' % value, KEY, 422,
       "id_out_of_range") for what, value in (("2^64", 2**64), ("2^63", 2**63), ("10^400", 10**400),
                                               ("-2^63-1", -2**63 - 1))],
    ("enroll no utterances", "POST", ENROLL, b'{"utterances": []}', KEY, 422, "invalid_request"),
    ("enroll bad json", "POST", ENROLL, b'{"utterances": ', KEY, 400, "bad_json"),
    ("enroll unknown store", "POST", "/v1/stores/nostore/speakers/x", json.dumps(UTTERANCE).encode(), KEY, 404,
     "unknown_store"),
    ("unknown route", "GET", "/v1/nothing", None, {}, 404, "http_error"),
    *[(f"{path} unless asked", "GET", path, None, {}, 404, "http_error")
      for path in ("/docs", "/redoc", "/openapi.json")],
    ("enroll trailing slash", "POST", ENROLL + "/", json.dumps(UTTERANCE).encode(), KEY, 404, "http_error"),
    ("propose trailing slash", "POST", "/v1/stores/voices/propose/", GOOD[0], {}, 404, "http_error"),
    ("store trailing slash", "GET", "/v1/stores/voices/", None, {}, 404, "http_error"),
    ("stores trailing slash", "GET", "/v1/stores/", None, {}, 404, "http_error"),
    ("json propose, options conflict", "POST", "/v1/stores/voices/propose?max_nodes=2",
     b'{"context": [1], "max_nodes": 3}', {}, 400, "conflicting_options"),
    ("json propose, unknown query", "POST", "/v1/stores/voices/propose?evil=1", GOOD[0], {}, 422, "invalid_request"),
    ("wrong method", "DELETE", "/v1/stores/voices", None, KEY, 405, "http_error"),
]


@pytest.mark.parametrize("what,method,path,body,headers,status,code", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_request_gets_json_4xx_and_service_keeps_serving(server, what, method, path, body, headers,
                                                                   status, code):
    got, _, answer = request(server.url, method, path, body, {"Content-Type": "application/json", **headers})
    error = json.loads(answer)["error"]
    assert (got, error["code"]) == (status, code), error
    assert error["status"] == status and error["message"]
    got, answer = post_json(server.url, "/v1/stores/voices/propose", {"context": [1, 2, 3]})
    assert got == 200 and "tree" in answer


def test_a_json_propose_honours_its_query_string(server, store, corpus):
    """Options in the query string count for JSON as for binary proposals, beside the body's own."""
    local = Retriever(store)
    context, speaker = corpus[0]["tokens"][:30], corpus[0]["speaker"]
    assert len(local.propose(context, speaker=speaker)) > 3  # so a budget of 2 or 3 shows
    for query, in_body, expected in ((f"?max_nodes=2&speaker={speaker}", {}, dict(speaker=speaker, max_nodes=2)),
                                     ("?max_depth=1", {"max_nodes": 3}, dict(max_nodes=3, max_depth=1)),
                                     ("?max_nodes=3", {"max_nodes": 3}, dict(max_nodes=3))):
        status, answer = post_json(server.url, f"/v1/stores/voices/propose{query}", {"context": context, **in_body})
        assert status == 200 and answer == {"tree": local.propose(context, **expected).to_dict()}, query


def test_a_body_is_what_its_content_type_says_whatever_its_size(server, store):
    """One rule on both HTTP paths and at any size (64 kB is where the fast path stops answering binary
    proposals inline): a body without Content-Type is refused with a 415, as is any other type than the
    route's; a media type is case-insensitive and may carry parameters."""
    local, rng = Retriever(store), np.random.default_rng(5)
    small = [[1, 2, 3]]
    large = [rng.integers(0, VOCAB, 2000).tolist() for _ in range(10)]  # ~100 kB as JSON, 80 kB binary
    for contexts in (small, large):
        expected = {"trees": [local.propose(c).to_dict() for c in contexts]}
        for body in (json.dumps({"contexts": contexts}).encode(), encode_contexts(contexts)):
            status, _, answer = request(server.url, "POST", "/v1/stores/voices/propose", body)
            assert (status, json.loads(answer)["error"]["code"]) == (415, "unsupported_media_type")
            assert "none was given" in json.loads(answer)["error"]["message"]
        status, _, answer = request(server.url, "POST", "/v1/stores/voices/propose",
                                    json.dumps({"contexts": contexts}).encode(),
                                    {"Content-Type": "Application/JSON; charset=utf-8"})
        assert status == 200 and json.loads(answer) == expected
        status, _, answer = request(server.url, "POST", "/v1/stores/voices/propose", encode_contexts(contexts),
                                    {"Content-Type": "Application/X-Echospec"})
        assert status == 200 and [t.to_dict() for t in decode_trees(answer)] == expected["trees"]
    for headers in ({}, {"Content-Type": BINARY}):
        status, _, answer = request(server.url, "POST", ENROLL, json.dumps(UTTERANCE).encode(),
                                    {"Authorization": f"Bearer {API_KEY}", **headers})
        assert (status, json.loads(answer)["error"]["code"]) == (415, "unsupported_media_type")


def test_huge_body_is_refused_before_it_is_read(server):
    """A Content-Length over the limit gets its 413 while the client is still sending."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/stores/voices/propose HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n" + b"[1," * 20000)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and json.loads(body)["error"]["code"] == "body_too_large"
    assert post_json(server.url, "/v1/stores/voices/propose", {"context": [1, 2, 3]})[0] == 200


def test_body_limit_holds_for_binary_proposals_too(built, tmp_path):
    """A binary propose under the inline path's own size limit but over a configured smaller one gets its 413."""
    context = encode_contexts([np.arange(3000) % 50])  # ~12 kB
    with Server(copy_store(built[0], tmp_path / "voices"), args=("--max-body-mb", "0.005")) as small:  # ~5 kB
        got, _, answer = request(small.url, "POST", "/v1/stores/voices/propose", context,
                                 {"Content-Type": BINARY})
        assert got == 413 and json.loads(answer)["error"]["code"] == "body_too_large"
        short = encode_contexts([np.arange(10) % 50])
        got, _, answer = request(small.url, "POST", "/v1/stores/voices/propose", short, {"Content-Type": BINARY})
        assert got == 200 and decode_trees(answer)


def test_huge_chunked_body_is_refused(server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    chunks = (b"1," * 65536 for _ in range(100))  # 13 MB, no Content-Length
    try:
        conn.request("POST", "/v1/stores/voices/propose", body=chunks, encode_chunked=True,
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 413 and json.loads(response.read())["error"]["code"] == "body_too_large"
    except (BrokenPipeError, ConnectionResetError):
        pass  # the service answered 413 and closed before the client finished sending: also a refusal
    finally:
        conn.close()
    assert post_json(server.url, "/v1/stores/voices/propose", {"context": [1, 2, 3]})[0] == 200


def test_enroll_append_replace_and_atomic_swap(server, store, corpus):
    remote = RemoteRetriever(server.url, store="voices", timeout=5.0)
    writer = RemoteRetriever(server.url, store="voices", api_key=API_KEY)
    donor = [u for u in corpus if u["speaker"] == corpus[0]["speaker"]]
    first = [{"id": f"a{i}", "tokens": u["tokens"]} for i, u in enumerate(donor[:5])]
    answer = writer.enroll("carol", first)
    assert answer["speaker"] == "carol" and answer["utterances"] == 5 and "carol" in remote.speakers
    context = np.array(donor[3]["tokens"][:20])
    assert remote.propose(context, speaker="carol").to_dict() == Retriever(store).propose(context, "carol").to_dict()

    # Proposals keep flowing, each from the old snapshot or the new one, while an append runs.
    before = Retriever(store).propose(context, speaker="carol").to_dict()
    seen, errors, stop = [], [], threading.Event()

    def propose_until_stopped():
        with RemoteRetriever(server.url, store="voices", timeout=5.0) as r:
            while not stop.is_set():
                try:
                    seen.append((time.monotonic(), r.propose(context, speaker="carol").to_dict()))
                except Exception as e:  # noqa: BLE001
                    errors.append(repr(e))

    thread = threading.Thread(target=propose_until_stopped, daemon=True)
    thread.start()
    try:
        time.sleep(0.2)
        more = [{"id": f"b{i}", "tokens": u["tokens"][::-1]} for i, u in enumerate(donor[5:])]
        assert writer.enroll("carol", more)["utterances"] == len(first) + len(more)
        acknowledged = time.monotonic()
        after = Retriever(store).propose(context, speaker="carol").to_dict()
        time.sleep(0.2)
    finally:
        stop.set()
        thread.join()
    assert errors == [] and len(seen) > 10
    assert before != after
    assert all(tree in (before, after) for _, tree in seen)
    assert all(tree == after for t, tree in seen if t > acknowledged)

    answer = writer.enroll("carol", first[:2], replace=True)
    assert answer["utterances"] == 2 and remote.info()["speakers"]["carol"]["utterances"] == 2
    assert remote.propose(context, speaker="carol").to_dict() == Retriever(store).propose(context, "carol").to_dict()


def raw_exchange(port: int, data: bytes, answers: int) -> list[bytes]:
    """Send `data` as is on a fresh connection; read until `answers` complete responses (content-length) are in."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        received = b""
        while True:
            out, rest = [], received
            while b"\r\n\r\n" in rest:
                head, _, rest = rest.partition(b"\r\n\r\n")
                length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), b"0"))
                if len(rest) < length:
                    break
                out.append(head + b"\r\n\r\n" + rest[:length])
                rest = rest[length:]
            if len(out) >= answers:
                return out
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {received!r}"
            received += chunk


def writes_so_far(pid: int) -> int:
    """Write system calls a process has made (Linux /proc/PID/io)."""
    lines = (Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(dict(line.split(": ") for line in lines)["syscw"])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/PID/io")
def test_a_proposal_leaves_the_service_in_one_write(server, remote, mode):
    """Head and body of each answer go out together (OneWriteHttpToolsProtocol): one send system call
    and one TCP segment per proposal, where plain uvicorn (the stock path) makes two."""
    remote.propose([1, 2, 3])
    before = writes_so_far(server.process.pid)
    for _ in range(50):
        remote.propose([1, 2, 3])
    writes = writes_so_far(server.process.pid) - before
    assert writes <= 52 if mode == "fast" else writes >= 100


def propose_request(payload: str, headers: bytes = b"", context=(1, 2, 3)) -> bytes:
    """A raw propose of one context, binary or JSON, with extra header lines."""
    body = encode_contexts([context]) if payload == "binary" else json.dumps({"context": list(context)}).encode()
    content_type = BINARY.encode() if payload == "binary" else b"application/json"
    return (b"POST /v1/stores/voices/propose HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\n%sContent-Length: %d\r\n"
            b"\r\n%s" % (content_type, headers, len(body), body))


def read_until(sock: socket.socket, done) -> bytes:
    received = b""
    while not done(received):
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {received!r}"
        received += chunk
    return received


@pytest.mark.parametrize("payload", ["binary", "json"])
def test_head_pipelined_expect_continue_and_close_are_answered(server, store, payload):
    """What ServiceHttpProtocol must keep right, binary proposals being answered inline and everything
    else by uvicorn's tasks: a HEAD (head, no body); pipelined requests mixing both paths (answered in
    order, on one connection); `Expect: 100-continue` (the interim answer first); `Connection: close`."""
    expected = (encode_trees([Retriever(store).propose([1, 2, 3])]) if payload == "binary" else
                json.dumps({"tree": Retriever(store).propose([1, 2, 3]).to_dict()}, separators=(",", ":")).encode())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head = read_until(sock, lambda got: got.endswith(b"\r\n\r\n"))
        assert head.startswith(b"HTTP/1.1 ") and b"content-length:" in head  # FastAPI answers HEAD with 405
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # the same connection goes on
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    propose, health, missing = (propose_request(payload), b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
                                b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n")
    answers = raw_exchange(server.port, propose + propose + health + propose + missing + propose, 6)
    assert [a[9:12] for a in answers] == [b"200", b"200", b"200", b"200", b"404", b"200"]
    assert [answers[i].partition(b"\r\n\r\n")[2] for i in (0, 1, 3, 5)] == [expected] * 4
    assert json.loads(answers[2].partition(b"\r\n\r\n")[2])["status"] == "ok"
    head, _, body = propose_request(payload, b"Expect: 100-continue\r\n").partition(b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + b"\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        answer = read_until(sock, lambda got: got.endswith(expected))
        assert answer.startswith(b"HTTP/1.1 200")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(propose_request(payload, b"Connection: close\r\n"))
        answer = read_until(sock, lambda got: got.endswith(expected))
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer.lower()
        assert sock.recv(65536) == b""  # closed by the service


def test_a_client_not_reading_its_answers_gets_them_all_in_order(server, store, mode):
    """30,000 pipelined binary proposals (~15 MB of answers) sent before any answer is read: once the
    service's write buffer is full it stops answering inline and waits on uvicorn's path, which stops
    reading; every answer still arrives, in order. About 3 s."""
    fast_only(mode)
    n, contexts = 30000, [[1, 2, 3], [4, 5]]
    requests = [propose_request("binary", context=contexts[i % 2]) for i in range(n)]
    expected = [encode_trees([Retriever(store).propose(c)]) for c in contexts]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sender = threading.Thread(target=sock.sendall, args=(b"".join(requests),))
        sender.start()
        time.sleep(0.5)  # let the service fill its buffers before anything is read
        answers, received = [], b""
        while len(answers) < n:
            chunk = sock.recv(1 << 16)
            assert chunk, f"closed after {len(answers)} answers"
            received += chunk
            while b"\r\n\r\n" in received:
                head, _, rest = received.partition(b"\r\n\r\n")
                length = int(head.lower().partition(b"content-length: ")[2].split(b"\r\n")[0])
                if len(rest) < length:
                    break
                assert head.startswith(b"HTTP/1.1 200")
                answers.append(rest[:length])
                received = rest[length:]
        sender.join()
    assert answers == [expected[i % 2] for i in range(n)]


def test_metrics(server):
    post_json(server.url, "/v1/stores/voices/propose", {"context": [1, 2, 3]})
    request(server.url, "POST", "/v1/stores/voices/propose", b"{", {"Content-Type": "application/json"})
    status, headers, body = request(server.url, "GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert 'echospec_requests_total{endpoint="propose",status="200"}' in text
    assert 'echospec_request_seconds_bucket{endpoint="propose",le="0.001"}' in text
    assert 'echospec_errors_total{code="bad_json",endpoint="propose"}' in text
    tokens = [line for line in text.splitlines() if line.startswith('echospec_store_tokens{store="voices"}')]
    assert tokens and float(tokens[0].split()[-1]) > 0


def test_the_api_description_is_served_when_asked(built, tmp_path):
    with Server(copy_store(built[0], tmp_path / "voices"), args=("--docs",)) as server:
        status, headers, body = request(server.url, "GET", "/openapi.json")
        assert status == 200 and "/v1/stores/{store}/speakers/{speaker}" in json.loads(body)["paths"]
        for path in ("/docs", "/redoc"):
            status, headers, body = request(server.url, "GET", path)
            assert status == 200 and headers["content-type"].startswith("text/html")


def test_enrollment_disabled_without_api_key(built, tmp_path):
    with Server(copy_store(built[0], tmp_path / "voices"), api_key=None) as server:
        status, answer = post_json(server.url, ENROLL, UTTERANCE, api_key="anything")
        assert status == 403 and answer["error"]["code"] == "writes_disabled"


def test_remote_fails_fast_when_down_and_recovers(built, tmp_path):
    store = copy_store(built[0], tmp_path / "voices")
    server = Server(store).start()
    remote = RemoteRetriever(server.url, store="voices", timeout=0.5, backoff=0.2, max_backoff=0.4)
    context = np.array(built[1][0]["tokens"][:12])
    expected = Retriever(store).propose(context).to_dict()
    try:
        assert remote.propose(context).to_dict() == expected  # opens a kept-alive connection
        server.stop()
        started = time.monotonic()
        with pytest.raises(RetrieverUnavailable):
            remote.propose(context)  # refused at once on loopback: no timeout to wait for
        with pytest.raises(RetrieverUnavailable, match="next try"):
            remote.propose(context)  # in the back-off window: not even a connection attempt
        assert time.monotonic() - started < 0.2
        server.start()  # same port; the client's kept-alive connection is dead now
        deadline = time.monotonic() + 5
        while True:
            try:
                assert remote.propose(context).to_dict() == expected
                break
            except RetrieverUnavailable:
                assert time.monotonic() < deadline, "did not recover after the service came back"
                time.sleep(0.05)
        assert not remote.breaker.is_open
    finally:
        remote.close()
        server.stop()


def test_remote_times_out_on_a_stalled_service(built, tmp_path):
    """A service that accepts but never answers (SIGSTOP) costs one timeout, then fails fast."""
    import signal

    store = copy_store(built[0], tmp_path / "voices")
    with Server(store) as server:
        remote = RemoteRetriever(server.url, store="voices", timeout=0.3, backoff=1.0)
        expected = Retriever(store).propose([1, 2, 3]).to_dict()
        assert remote.propose([1, 2, 3]).to_dict() == expected
        server.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(RetrieverUnavailable, match="timed out"):
                remote.propose([1, 2, 3])
            assert 0.25 < time.monotonic() - started < 1.0
            started = time.monotonic()
            with pytest.raises(RetrieverUnavailable, match="next try"):
                remote.propose([1, 2, 3])
            assert time.monotonic() - started < 0.05
        finally:
            server.process.send_signal(signal.SIGCONT)
        time.sleep(1.0)
        assert remote.propose([1, 2, 3]).to_dict() == expected
        remote.close()


def test_writes_by_another_process_are_picked_up(server, store, corpus, tmp_path):
    """`echospec enroll`-style writes straight to the directory show up within the reload interval."""
    from echospec.datastore import enroll
    from service_testing import write_jsonl

    remote = RemoteRetriever(server.url, store="voices", timeout=5.0)
    assert "zed" not in remote.speakers
    utterances = [{"id": f"z{i}", "speaker": "zed", "tokens": u["tokens"]} for i, u in enumerate(corpus[:8])]
    enroll(store, "zed", write_jsonl(utterances, tmp_path / "zed.jsonl"))
    deadline = time.monotonic() + 10
    while "zed" not in remote.speakers:
        assert time.monotonic() < deadline, "the service did not notice the new speaker"
        time.sleep(0.1)
    context = np.array(corpus[2]["tokens"][:30])
    assert remote.propose(context, speaker="zed").to_dict() == Retriever(store).propose(context, "zed").to_dict()


@pytest.mark.parametrize("args,message", [
    (["/nonexistent/store"], "no such datastore directory"),
    (["bad/name=/tmp"], "store name 'bad/name' must match"),
])
def test_serve_refuses_bad_arguments_clearly(args, message):
    import subprocess

    from service_testing import ECHOSPEC

    done = subprocess.run([ECHOSPEC, "serve", *args, "--port", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the advice back from Linux's smaps")
def test_serve_access_says_how_the_stores_read_from_disk(tmp_path):
    store, _ = make_store(tmp_path, n_tokens=5_000, n_speakers=1)
    tokens, sa = ((store / "general" / name).resolve() for name in ("tokens.npy", "sa.npy"))
    for access, advised in (("random", (True, True)), ("stream", (False, True)), ("readahead", (False, False))):
        with Server(store, args=("--access", access)) as server:
            for path, random_advice in zip((tokens, sa), advised):
                flags = vm_flags(path, server.process.pid)
                assert flags and all(("rr" in f) == random_advice for f in flags), (access, path.name, flags)
            if access == "stream":
                assert resident_bytes(tokens, server.process.pid) >= tokens.stat().st_size - 4096

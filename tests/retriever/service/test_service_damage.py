"""A store damaged under a running service, or found damaged when it starts: its requests are refused with
a 503 naming it, the service stays up, and every other store keeps answering."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from service_testing import API_KEY, VOCAB, Server, copy_store, make_store, post_json, request, write_jsonl

from echospec.datastore import build, open_datastore
from echospec.retriever import Retriever
from echospec.retriever.client import RemoteRetriever, RetrieverUnavailable


def test_a_damaged_speaker_store_is_refused_and_the_others_answer(tmp_path):
    store, corpus = make_store(tmp_path / "built", n_tokens=5000, n_speakers=2)
    store = copy_store(store, tmp_path / "voices")
    damaged, healthy = sorted({u["speaker"] for u in corpus})
    context = corpus[0]["tokens"][:20]
    expected = {s: Retriever(store).propose(context, speaker=s).to_dict() for s in (None, healthy)}
    with Server(store) as server:
        sa = np.load(open_datastore(store).speaker_store(damaged).directory / "sa.npy", mmap_mode="r+")
        sa[::5] = 2**31 - 5  # in place: the service's memory map sees it
        sa.flush()
        for _ in range(3):
            status, answer = post_json(server.url, "/v1/stores/voices/propose", {"context": context,
                                                                                "speaker": damaged})
            assert (status, answer["error"]["code"]) == (503, "store_damaged")
            assert "store is damaged" in answer["error"]["message"]
        with RemoteRetriever(server.url, store="voices", timeout=5.0) as remote:
            with pytest.raises(RetrieverUnavailable, match="503"):  # the decoder then steps autoregressively
                remote.propose(context, speaker=damaged)
        for speaker in (None, healthy):
            status, answer = post_json(server.url, "/v1/stores/voices/propose", {"context": context,
                                                                                "speaker": speaker})
            assert status == 200 and answer == {"tree": expected[speaker]}
        assert server.output().count("store is damaged") == 1  # logged once, not once a request
        assert "Traceback" not in server.output()


def spoil_header(path):
    data = bytearray(path.read_bytes())
    data[10:20] = b"\xff" * 10  # same size, the header's dict unreadable
    path.write_bytes(bytes(data))


def damage(store, how):
    """Damage `store` as the issue found: a missing shard file, a bad .npy header, a damaged catalog."""
    if how == "missing general file":
        (store / "general" / "sa.npy").unlink()
    elif how == "bad npy header":
        spoil_header(store / "general" / "tokens.npy")
    else:
        import sqlite3

        with sqlite3.connect(store / "catalog.sqlite") as db:
            db.execute("DELETE FROM meta WHERE key = 'vocab_size'")


@pytest.mark.parametrize("how", ["missing general file", "bad npy header", "damaged catalog"])
def test_a_store_damaged_at_start_up_is_refused_and_the_others_served(tmp_path, how):
    """`echospec serve good=a dmg=b` with b damaged starts: good answers, dmg is a 503 `store_damaged`, /healthz
    says which is damaged (200: the service is up). A rebuild of dmg is picked up; --strict refuses to start."""
    store, corpus = make_store(tmp_path / "built", n_tokens=5000, n_speakers=2)
    good, bad = copy_store(store, tmp_path / "good"), copy_store(store, tmp_path / "dmg")
    damage(bad, how)
    context = corpus[0]["tokens"][:20]
    with Server(f"good={good}", f"dmg={bad}") as server:
        status, _, body = request(server.url, "GET", "/healthz")
        health = json.loads(body)
        assert status == 200 and health["status"] == "degraded" and list(health["damaged"]) == ["dmg"]
        assert post_json(server.url, "/v1/stores/good/propose", {"context": context}) == \
            (200, {"tree": Retriever(good).propose(context).to_dict()})
        for path in ("/v1/stores/dmg/propose", "/v1/stores/dmg/speakers/ann"):
            payload = {"context": context} if path.endswith("propose") else {"utterances": [{"id": "a", "tokens": [1]}]}
            status, answer = post_json(server.url, path, payload, api_key=API_KEY)
            assert (status, answer["error"]["code"]) == (503, "store_damaged"), answer
            assert answer["error"]["message"].startswith("store 'dmg' is damaged: ")
        listing = json.loads(request(server.url, "GET", "/v1/stores")[2])["stores"]
        assert [s["name"] for s in listing] == ["good", "dmg"] and "damaged" in listing[1]
        build(write_jsonl(corpus, tmp_path / "c.jsonl"), bad, vocab_size=VOCAB, faiss=False, force=True, progress=False)
        deadline = time.monotonic() + 10
        while post_json(server.url, "/v1/stores/dmg/propose", {"context": context})[0] != 200:
            assert time.monotonic() < deadline, server.output()[-2000:]
            time.sleep(0.2)
        assert json.loads(request(server.url, "GET", "/healthz")[2])["status"] == "ok"
        assert "Traceback" not in server.output()
    damage(bad, how)
    strict = Server(f"dmg={bad}", f"good={good}", args=("--strict",))  # the damaged one first: refused at once
    with pytest.raises(RuntimeError, match="server exited with 1") as refused:
        strict.start()
    assert "Traceback" not in str(refused.value) and "Error: " in str(refused.value)


def test_a_store_path_that_is_no_datastore_stops_the_start(tmp_path):
    """A typo is no damage: the service refuses to start, in one line."""
    store, _ = make_store(tmp_path / "built", n_tokens=3000, n_speakers=1)
    with pytest.raises(RuntimeError, match=r"server exited with 1:\nError: .*nowhere: no such datastore directory"):
        Server(f"typo={tmp_path / 'nowhere'}", f"good={store}").start()


def test_a_speaker_store_damaged_at_start_up_is_refused_alone(tmp_path):
    """A bad .npy header in one speaker's store: the datastore is served, that speaker's proposals are a 503."""
    store, corpus = make_store(tmp_path / "built", n_tokens=5000, n_speakers=2)
    store = copy_store(store, tmp_path / "voices")
    damaged, healthy = sorted({u["speaker"] for u in corpus})
    spoil_header(open_datastore(store).speaker_store(damaged).directory / "sa.npy")
    context = corpus[0]["tokens"][:20]
    with Server(store) as server:
        assert json.loads(request(server.url, "GET", "/healthz")[2])["status"] == "ok"
        status, answer = post_json(server.url, "/v1/stores/voices/propose", {"context": context, "speaker": damaged})
        assert (status, answer["error"]["code"]) == (503, "store_damaged")
        for speaker in (None, healthy):
            status, answer = post_json(server.url, "/v1/stores/voices/propose", {"context": context, "speaker": speaker})
            assert status == 200
        enroll = f"/v1/stores/voices/speakers/{damaged}"
        utterances = [{"id": "new", "tokens": context}]
        status, answer = post_json(server.url, enroll, {"utterances": utterances}, api_key=API_KEY)
        assert (status, answer["error"]["code"]) == (503, "store_damaged")  # appending reads the damaged store
        status, answer = post_json(server.url, enroll, {"utterances": utterances, "replace": True}, api_key=API_KEY)
        assert status == 200  # replacing it does not, and repairs it
        status, answer = post_json(server.url, "/v1/stores/voices/propose", {"context": context, "speaker": damaged})
        assert status == 200
        assert f"speaker {damaged}'s store is damaged" in server.output() and "Traceback" not in server.output()

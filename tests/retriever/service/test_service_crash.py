"""kill -9 of the service in the middle of enrollments: nothing acknowledged is lost, nothing is half there."""

from __future__ import annotations

import sqlite3
import threading
import time

import numpy as np
import pytest
from service_testing import API_KEY, Server, make_store

from echospec.datastore import open_datastore
from echospec.retriever import Retriever
from echospec.retriever.client import RemoteRetriever, RetrieverUnavailable

UTTERANCES_PER_ENROLL = 20


def batch(corpus: list[dict], round_: int, k: int) -> list[dict]:
    """The k-th enrollment's utterances: distinct ids, tokens taken from the corpus."""
    start = (round_ * 50 + k) * UTTERANCES_PER_ENROLL
    return [{"id": f"r{round_}-e{k}-u{i}", "tokens": corpus[(start + i) % len(corpus)]["tokens"]}
            for i in range(UTTERANCES_PER_ENROLL)]


def catalog_ids(store, speaker: str) -> set[str]:
    conn = sqlite3.connect(f"file:{store / 'catalog.sqlite'}?mode=ro", uri=True)
    try:
        return {row[0] for row in conn.execute("SELECT id FROM utterances WHERE speaker = ?", [speaker])}
    finally:
        conn.close()


def store_listing(store) -> list[str]:
    return sorted(p.relative_to(store).as_posix() for p in store.rglob("*"))


def enroll_until_killed(server: Server, corpus, round_: int, kill_after: float):
    """Enroll back to back from a thread; kill -9 the service after `kill_after` seconds. Returns the
    acknowledged batches and the one in flight at the kill (if any)."""
    writer = RemoteRetriever(server.url, store="voices", api_key=API_KEY)
    acknowledged, in_flight = [], []

    def run():
        for k in range(1000):
            utterances = batch(corpus, round_, k)
            in_flight[:] = [utterances]
            try:
                writer.enroll("ann", utterances)
            except RetrieverUnavailable:
                return  # the kill
            acknowledged.append(utterances)
            in_flight.clear()

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(kill_after)
    while not in_flight:  # land inside a request, not in the microseconds between two
        time.sleep(0.0005)
    server.kill()
    thread.join(30)
    assert not thread.is_alive()
    return acknowledged, (in_flight[0] if in_flight else None)


@pytest.mark.parametrize("round_,kill_after", [(0, 0.7), (1, 1.3)])
def test_kill_during_enrollment_loses_nothing_acknowledged(tmp_path, round_, kill_after):
    store, corpus = make_store(tmp_path, n_tokens=30_000)
    store = store.rename(tmp_path / "voices")
    server = Server(store).start()
    acknowledged, unacknowledged = enroll_until_killed(server, corpus, round_, kill_after)
    assert acknowledged, "no enrollment finished before the kill: the test did not exercise anything"
    assert unacknowledged is not None, "no enrollment was in flight at the kill"

    ds = open_datastore(store, verify=True)  # every catalogued file present, sizes and checksums right
    ids = catalog_ids(store, "ann")
    acked_ids = {u["id"] for b in acknowledged for u in b}
    pending_ids = {u["id"] for u in unacknowledged}
    assert acked_ids <= ids, "an acknowledged enrollment is missing"
    assert ids - acked_ids in (set(), pending_ids), "the unacknowledged enrollment is half there"
    n_utts = len(ids)
    assert ds.info()["speakers"]["ann"]["utterances"] == n_utts
    # the speaker's store holds exactly the catalogued utterances' tokens, no more, no less
    by_id = {u["id"]: u["tokens"] for b in acknowledged + [unacknowledged] for u in b}
    stored = ds.speaker_store("ann").segments()
    assert sum(len(s) for s in stored) == sum(len(by_id[i]) for i in ids) == ds.info()["speakers"]["ann"]["tokens"]
    # What a kill can leave behind is one unreferenced directory (the interrupted enrollment's new
    # store, or the old one it was about to delete), which no reader ever opens.
    referenced = {s["directory"] for s in ds.info()["stores"]}
    on_disk = {p.relative_to(store).as_posix() for p in [*store.glob(".enroll-*"), *(store / "speakers").iterdir()]}
    assert referenced <= on_disk | {"general"} and len(on_disk - referenced) <= 1

    server.start()  # restarts on the same store and port
    try:
        remote = RemoteRetriever(server.url, store="voices", timeout=5.0)
        assert remote.info()["speakers"]["ann"]["utterances"] == n_utts
        local = Retriever(store)
        for u in corpus[:20]:
            context = np.array(u["tokens"][:15])
            got, want = remote.propose(context, speaker="ann").to_dict(), local.propose(context, "ann").to_dict()
            assert got == want, f"{context.tolist()}: service {got}, in-process {want}; files {store_listing(store)}"
        # and the service still takes writes
        writer = RemoteRetriever(server.url, store="voices", api_key=API_KEY)
        assert writer.enroll("ann", batch(corpus, round_, 999))["utterances"] == n_utts + UTTERANCES_PER_ENROLL
    finally:
        server.stop()

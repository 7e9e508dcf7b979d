"""A store damaged under a running service: its proposals are refused with a 503 naming it, the service
stays up, and every other store keeps answering."""

from __future__ import annotations

import numpy as np
import pytest
from service_testing import Server, copy_store, make_store, post_json

from echospec.datastore import open_datastore
from echospec.retriever import Retriever
from echospec.retriever.remote import RemoteRetriever, RetrieverUnavailable


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

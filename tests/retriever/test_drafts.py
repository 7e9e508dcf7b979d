"""Chains for engines that verify chains (echospec.retriever.engines): the best branch of a real store's
tree, the speaker chosen from the prompt, per-row speakers over a real service on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
from service_testing import ECHOSPEC, Server, make_store, post_json

from echospec.retriever import RemoteRetriever, Retriever, RetrieverUnavailable
from echospec.retriever.engines import DRAFT_WEIGHTS, ChainDrafter, NullMemory, RequestMemory, SpeakerChoice
from echospec.retriever.engines.chains import replay_chain
from echospec.retriever.engines.proposer import make_drafter, read_options
from echospec.retriever.engines.speakers import contains
from echospec.retriever.kernels import best_chain


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("drafts"), n_tokens=30_000, n_speakers=3)


@pytest.fixture(scope="module")
def retriever(built):
    return Retriever(built[0])


def by_speaker(corpus) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for u in corpus:
        out.setdefault(u["speaker"], []).append(u["tokens"])
    return out


def test_best_chain_maximises_the_expected_gain_and_stops_where_nothing_pays():
    #   0 (.6) -> 2 (.4) -> 4 (.35)       the deeper branch beats its sibling 1 (.3)
    #          -> 3 (.15)
    #   1 (.3)
    parents = np.array([-1, -1, 0, 0, 2], np.int32)
    probs = np.array([.6, .3, .4, .15, .35], np.float32)
    assert best_chain(parents, probs, 0.15).tolist() == [0, 2, 4]
    assert best_chain(parents, probs, 0.38).tolist() == [0, 2]  # .35 no longer pays for its verification
    assert best_chain(parents, probs, 0.7).tolist() == []
    # a branch whose first node pays little but whose sum pays more is taken: 1 (.5) -> 2 (.5) -> 3 (.5)
    parents = np.array([-1, -1, 1, 2], np.int32)
    probs = np.array([.52, .5, .5, .5], np.float32)
    assert best_chain(parents, probs, 0.1).tolist() == [1, 2, 3]
    assert best_chain(np.zeros(0, np.int32), np.zeros(0, np.float32), 0.1).tolist() == []


def test_chains_follow_the_store_and_are_model_ids(built, retriever):
    _, corpus = built
    offset = 1000  # model id of store id 0: a model whose speech ids start at 1000
    drafter = ChainDrafter(retriever, k=6, speaker=None, speech_offset=offset)
    utterance = np.array(corpus[0]["tokens"])
    history = np.concatenate([[5, 6, 7], utterance[:40] + offset])  # text ids, then speech
    [chain] = drafter.propose([history])
    tree = retriever.propose(utterance[:40], max_depth=6)
    expected = tree.tokens[best_chain(tree.parents, tree.probs, drafter.token_cost)] + offset
    assert chain == expected.tolist() and 1 <= len(chain) <= 6
    assert drafter.propose([history[:3]]) == [[]]  # the last token is text: nothing to continue
    assert drafter.propose([np.zeros(0, np.int64)]) == [[]]


def test_rows_are_independent_of_their_order_and_neighbours(built, retriever):
    _, corpus = built
    drafter = ChainDrafter(retriever, k=8, memory=RequestMemory())
    histories = [np.array(u["tokens"][:30 + i]) for i, u in enumerate(corpus[:8])]
    alone = [drafter.propose([h])[0] for h in histories]
    order = np.random.default_rng(0).permutation(len(histories))
    shuffled = drafter.propose([histories[i] for i in order])
    assert [shuffled[list(order).index(i)] for i in range(len(histories))] == alone
    assert any(alone)


def test_speaker_is_chosen_from_the_reference_speech_in_the_prompt(built, retriever):
    _, corpus = built
    speakers = by_speaker(corpus)
    propose_rows = lambda contexts, rows, depth: [retriever.propose(c, s, None, depth)  # noqa: E731
                                                  for c, s in zip(contexts, rows)]
    choose = SpeakerChoice(propose_rows, lambda: retriever.speakers, 0, retriever.vocab_size)
    assert all(choose(np.array(utts[-1][:80])) == name for name, utts in speakers.items())
    assert choose(np.array(corpus[0]["tokens"][:8])) is None  # too little speech to tell
    named = SpeakerChoice(propose_rows, lambda: retriever.speakers, 0, retriever.vocab_size,
                          speaker_tokens={"chosen": [9999, 3]})
    assert named(np.array([1, 9999, 3, 4])) == "chosen"
    assert contains(np.array([1, 2, 3]), np.array([2, 3])) and not contains(np.array([1, 2, 3]), np.array([3, 2]))


def test_request_memory_finds_each_request_again_and_stays_bounded():
    calls = []

    def choose(prompt):
        calls.append(len(prompt))
        return f"s{int(prompt[1])}"

    memory = RequestMemory(capacity=4)
    prompts = [np.array([0, i] + [7] * 20) for i in range(6)]
    assert [memory.find(np.append(p, 100), choose).speaker for p in prompts[:3]] == ["s0", "s1", "s2"]
    assert calls == [22, 22, 22]
    # later steps of the same requests, in another order, with more output: found, not chosen again
    assert memory.find(np.append(prompts[2], [100, 5, 6]), choose).speaker == "s2"
    assert memory.find(np.append(prompts[0], [100, 9]), choose).speaker == "s0"
    assert len(calls) == 3
    short = np.array([3, 4])  # a prompt shorter than the hashed head
    assert memory.find(np.append(short, 100), choose).speaker is not None
    assert memory.find(np.append(short, [100, 1]), choose).speaker == "s4"
    for p in prompts[3:]:
        memory.find(np.append(p, 100), choose)
    assert len(memory) == 4  # bounded: the least recently used went
    # no memory: every step is a first step, its speaker chosen again from the history less its last token
    assert NullMemory().find(np.append(prompts[2], [100, 5]), choose).speaker == "s2" and calls[-1] == 23
    assert len(NullMemory()) == 0


def test_a_request_that_accepts_nothing_is_sent_nothing_and_one_that_accepts_all_keeps_its_chains(built, retriever):
    store, corpus = built
    drafter = ChainDrafter(retriever, k=8, speaker=None, memory=RequestMemory())
    refused, taken = np.array(corpus[0]["tokens"][:40]), np.array(corpus[1]["tokens"][:40])
    first = drafter.propose([refused, taken])
    assert first[0] and first[1]
    for step in range(40):
        chains = drafter.propose([refused, taken])
        # the engine rejects row 0's first draft token (it samples another id) and accepts all of row 1's
        sampled = corpus[0]["tokens"][40 + step]
        refused = np.append(refused, sampled if not chains[0] or sampled != chains[0][0] else (sampled + 1) % 512)
        taken = np.append(taken, chains[1] + [corpus[1]["tokens"][40 + step]])
    assert drafter.request(refused).scale < 0.2 < 1.0 <= drafter.request(taken).scale
    assert drafter.propose([refused])[0] == []
    assert len(drafter.propose([taken])[0]) >= 1


def test_a_prompt_served_again_is_drafted_from_its_earlier_output(built, retriever):
    _, corpus = built
    drafter = ChainDrafter(retriever, k=8, speaker=None, memory=RequestMemory())
    prompt, output = np.array(corpus[2]["tokens"][:30]), np.array(corpus[3]["tokens"][:80])
    for p in range(1, len(output) + 1):  # the first request, step by step: drafted from the store
        drafter.propose([np.concatenate([prompt, output[:p]])])
    # the same prompt again (a greedy model says the same): every chain is what the earlier output said next
    for p in range(1, 70, 8):
        assert drafter.propose([np.concatenate([prompt, output[:p]])]) == [output[p:p + 8].tolist()]
    # one that parted ways with it (sampled: two ids fewer) is continued from where its last 8 ids were said
    shifted = np.concatenate([prompt, output[:20], output[22:50]])
    assert drafter.propose([shifted]) == [output[50:58].tolist()]
    other = np.concatenate([prompt[::-1], output[:40]])  # another prompt: nothing to replay
    assert not len(drafter.request(other).replay(other, 8))


def test_replays_that_are_rejected_are_cut_then_left_for_the_store(built, retriever):
    _, corpus = built
    drafter = ChainDrafter(retriever, k=8, speaker=None, memory=RequestMemory())
    prompt, output = np.array(corpus[4]["tokens"][:30]), np.array(corpus[5]["tokens"][:80])
    drafter.propose([np.concatenate([prompt, output[:1]])])  # served once: first seen after its prefill,
    drafter.propose([np.concatenate([prompt, output])])  # then near its end
    history = np.concatenate([prompt, output[:40]])
    request = drafter.request(history)
    assert replay_chain(request.replay_rate, drafter.token_cost, 8)[0] == 8  # 0.9 ** 8 = 0.43 still pays
    for _ in range(20):  # served again, sampled: the engine takes another id than the replay's first, every time
        chain = request.replay(history, 8).tolist()
        request.sent(history, chain, None)
        request.observe(np.append(history, chain[0] + 1))
    assert request.replay_rate == 9 / 30
    assert replay_chain(request.replay_rate, drafter.token_cost, 8) == (1, pytest.approx(0.2))  # 0.3 pays, 0.09 not
    tree = retriever.propose(history, max_depth=8)
    chain = best_chain(tree.parents, tree.probs * request.scale, drafter.token_cost)
    assert (tree.probs[chain] * request.scale - drafter.token_cost).sum() > 0.3 - drafter.token_cost
    assert drafter.propose([history]) == [tree.tokens[chain].tolist()]  # the store's chain is worth more now


def test_without_memory_a_rows_chain_depends_on_its_history_alone(built, retriever):
    _, corpus = built
    prompt, output = np.array(corpus[2]["tokens"][:30]), np.array(corpus[3]["tokens"][:80])
    history = np.concatenate([prompt, output[:40]])
    fresh = ChainDrafter(retriever, k=8).propose([history])
    remembering, forgetting = ChainDrafter(retriever, k=8, memory=RequestMemory()), ChainDrafter(retriever, k=8)
    for drafter in (remembering, forgetting):  # the same prompt served once before, to its end
        for p in range(1, len(output) + 1):
            drafter.propose([np.concatenate([prompt, output[:p]])])
    assert forgetting.propose([history]) == fresh != remembering.propose([history]) == [output[40:48].tolist()]


def test_per_row_speakers_over_the_service_match_in_process(built, retriever):
    store, corpus = built
    speakers = list(retriever.speakers)
    contexts = [np.array(u["tokens"][:25]) for u in corpus[:6]]
    rows = [speakers[i % len(speakers)] if i % 3 else None for i in range(len(contexts))]
    with Server(store) as server, RemoteRetriever(server.url, "store", timeout=5.0) as remote:
        trees = remote.propose_batch(contexts, rows)
        for tree, context, speaker in zip(trees, contexts, rows):
            assert tree.to_dict() == retriever.propose(context, speaker).to_dict()
        with pytest.raises(ValueError, match="2 speakers for 6 contexts"):
            remote.propose_batch(contexts, rows[:2])
        path = "/v1/stores/store/propose"
        status, body = post_json(server.url, path, {"contexts": [c.tolist() for c in contexts], "speakers": rows})
        assert status == 200 and body["trees"] == [t.to_dict() for t in trees]
        for payload, code in (({"speakers": rows[:2]}, 422), ({"speakers": rows, "speaker": speakers[0]}, 422),
                              ({"speakers": [None] * 5 + ["nobody"]}, 404)):
            status, body = post_json(server.url, path, {"contexts": [c.tolist() for c in contexts], **payload})
            assert status == code, body
        drafter = ChainDrafter(remote, k=8, step_timeout=5.0)
        local = ChainDrafter(retriever, k=8, step_timeout=5.0)
        histories = [np.array(u["tokens"][:60]) for u in corpus[:5]]
        assert drafter.propose(histories) == local.propose(histories)


def test_a_frozen_or_silent_service_costs_a_timeout_not_the_step(built):
    store, corpus = built
    history = np.array(corpus[0]["tokens"][:30])
    with Server(store) as server:
        drafter = ChainDrafter(RemoteRetriever(server.url, "store", timeout=0.05), k=8, step_timeout=0.05)
        assert drafter.propose([history])[0]
        os.kill(server.process.pid, signal.SIGSTOP)  # the service hangs: alive, accepting, never answering
        try:
            started = time.perf_counter()
            with pytest.raises(RetrieverUnavailable):
                drafter.propose([history])
            assert time.perf_counter() - started < 0.5
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        time.sleep(2.1)  # past the circuit breaker's longest back-off
        assert drafter.propose([history])[0]  # back once it answers
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)  # the kernel accepts; nobody ever answers
    try:
        started = time.perf_counter()
        with pytest.raises(RetrieverUnavailable):
            ChainDrafter(RemoteRetriever(f"http://127.0.0.1:{listener.getsockname()[1]}", "store", timeout=0.05))
        assert time.perf_counter() - started < 0.5
    finally:
        listener.close()


class SlowRetriever:
    """A retriever whose every tree takes `seconds`: a loaded machine."""

    def __init__(self, retriever, seconds):
        self.retriever, self.seconds = retriever, seconds

    def __getattr__(self, name):
        return getattr(self.retriever, name)

    def propose(self, *args):
        time.sleep(self.seconds)
        return self.retriever.propose(*args)


def test_without_a_deadline_a_loaded_machine_drafts_every_row_as_an_idle_one(built, retriever):
    _, corpus = built
    histories = [np.array(u["tokens"][:40]) for u in corpus[:4]]
    idle = ChainDrafter(retriever, k=8, speaker=None).propose(histories)
    loaded = SlowRetriever(retriever, 0.02)
    assert ChainDrafter(loaded, k=8, speaker=None, step_timeout=None).propose(histories) == idle and all(idle)
    assert ChainDrafter(loaded, k=8, speaker=None, step_timeout=0.01).propose(histories)[1:] == [[]] * 3
    pinned = make_drafter(read_options({"echospec": {"store": str(built[0]), "reproducible": True}}), 8)
    assert pinned.step_timeout is None and isinstance(pinned.memory, NullMemory)
    with pytest.raises(ValueError, match="in-process"):
        read_options({"echospec": {"store": str(built[0]), "reproducible": True, "step_timeout": 1.0}})


def test_bad_settings_are_refused(retriever):
    with pytest.raises(ValueError, match="unknown speaker"):
        ChainDrafter(retriever, speaker="nobody")
    with pytest.raises(ValueError, match="k >= 1"):
        ChainDrafter(retriever, k=0)


def test_the_proposer_weighs_sources_alike_in_process_and_over_the_service(built, retriever):
    store, corpus = built
    # each history says its first tokens again: the request's own context and the store disagree on what follows
    histories = [np.array(u["tokens"][:40] + v["tokens"][:10] + u["tokens"][:6]) for u, v in zip(corpus, corpus[12:24])]
    local = make_drafter(read_options({"echospec": {"store": str(store), "step_timeout": 5.0}}), 8)
    assert tuple(local.retriever.weights) == DRAFT_WEIGHTS
    streamed = make_drafter(read_options({"echospec": {"store": str(store), "step_timeout": 5.0,
                                                       "access": "stream"}}), 8)
    assert streamed.retriever.datastore.access == "stream" and streamed.propose(histories) == local.propose(histories)
    with pytest.raises(ValueError, match='"access" must be one of auto, random, stream, readahead'):
        read_options({"echospec": {"store": str(store), "access": "sequential"}})
    with pytest.raises(ValueError, match="echospec serve --access"):
        read_options({"echospec": {"url": "http://127.0.0.1:1", "store_name": "store", "access": "stream"}})
    plain = ChainDrafter(retriever, k=8, step_timeout=5.0)  # the retriever's own weights
    assert local.propose(histories) != plain.propose(histories)  # the weights change some chains here
    weights = ",".join(map(str, DRAFT_WEIGHTS))
    with Server(store, args=("--weights", weights)) as server:
        remote = make_drafter(read_options({"echospec": {"url": server.url, "store_name": "store", "timeout": 5.0,
                                                         "step_timeout": 5.0}}), 8)
        assert remote.propose(histories) == local.propose(histories)
    with pytest.raises(ValueError, match="echospec serve --weights"):
        read_options({"echospec": {"url": "http://127.0.0.1:1", "store_name": "store", "weights": [1, 1, 1, 1]}})
    refused = subprocess.run([ECHOSPEC, "serve", str(store), "--weights", "1,2"], capture_output=True, text=True)
    assert refused.returncode == 2 and "four non-negative numbers" in refused.stderr

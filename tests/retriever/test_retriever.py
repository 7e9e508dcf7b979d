"""Retriever: proposals follow the corpus, respect the budget, are deterministic."""

import json

import numpy as np
import pytest
from echospec.datastore import build
from echospec.retriever import SOURCES, CandidateTree, Retriever
from echospec.tools.corpus.synth_corpus import SynthConfig, generate
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def corpus():
    synth = generate(SynthConfig(n_tokens=20_000, vocab=512, n_phones=32, n_speakers=3, seed=3))
    return [{"id": synth.utterance_id(i), "speaker": synth.speaker_name(i), "tokens": synth.utterance(i).tolist()}
            for i in range(len(synth))]


@pytest.fixture(scope="module")
def store(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("retriever")
    with open(root / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps(u) + "\n" for u in corpus)
    build(root / "corpus.jsonl", root / "store", faiss=False, progress=False, vocab_size=512)
    return root / "store"


def test_propose_follows_the_corpus(store, corpus):
    r = Retriever(store)
    utt = corpus[7]["tokens"]
    tree = r.propose(np.array(utt[:30]), speaker=corpus[7]["speaker"])
    assert isinstance(tree, CandidateTree) and 0 < len(tree) <= 16
    assert tree.max_depth <= 8
    assert np.all(tree.parents < np.arange(len(tree)))
    assert np.all(np.diff(tree.depths) >= 0)
    assert tree.tokens[tree.depths == 1].size >= 1
    # the root's most probable child is a token that followed the context's last token somewhere
    stream = [t for u in corpus for t in u["tokens"] + [-1]]
    followers = {stream[i + 1] for i in range(len(stream) - 1) if stream[i] == utt[29]}
    assert set(tree.tokens[tree.depths == 1].tolist()) <= followers | set(utt[:30])


def test_propose_is_deterministic_and_bounded(store, corpus):
    r = Retriever(store, max_nodes=16, max_depth=8)
    ctx = np.array(corpus[3]["tokens"][:25])
    a, b = r.propose(ctx), r.propose(ctx)
    assert a.to_dict() == b.to_dict()
    small = r.propose(ctx, max_nodes=4, max_depth=2)
    assert len(small) <= 4 and small.max_depth <= 2
    assert np.all((small.probs > 0) & (small.probs <= 1))
    assert set(small.sources.tolist()) <= set(range(len(SOURCES)))


def test_bad_context_and_speaker(store):
    r = Retriever(store)
    with pytest.raises(ValueError, match="0..511"):
        r.propose([1, 2, 512])
    with pytest.raises(ValueError, match="unknown speaker"):
        r.propose([1, 2, 3], speaker="nobody")
    assert len(r.propose([])) == 0
    assert r.vocab_size == 512 and r.speakers == ("spk000", "spk001", "spk002")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**6), max_size=70))
def test_mask_marks_each_node_and_exactly_its_ancestors(choices):
    # any topologically ordered tree: node i's parent is one of the nodes before it, or the root
    parents = np.array([c % (i + 1) - 1 for i, c in enumerate(choices)], np.int32)
    n = len(parents)
    depths = np.zeros(n, np.int32)
    for i in range(n):
        depths[i] = 1 if parents[i] < 0 else depths[parents[i]] + 1
    tree = CandidateTree(tokens=np.arange(n, dtype=np.int64), parents=parents, depths=depths,
                         counts=np.ones(n, np.float32), probs=np.ones(n, np.float32), sources=np.zeros(n, np.uint8))
    expected = np.zeros((n, n), bool)
    for i in range(n):
        node = i
        while node >= 0:
            expected[i, node] = True
            node = parents[node]
    assert tree.mask.dtype == bool and tree.mask.shape == (n, n)
    assert (tree.mask == expected).all()


def test_propose_docstring_worked_example(tmp_path):
    """The example in `Retriever.propose`'s docstring, as written there."""
    rows = [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 9]]
    with open(tmp_path / "c.jsonl", "w") as f:
        f.writelines(json.dumps({"id": f"u{i}", "speaker": "s", "tokens": t}) + "\n" for i, t in enumerate(rows))
    build(tmp_path / "c.jsonl", tmp_path / "store", faiss=False, per_speaker=False, progress=False, vocab_size=10)
    tree = Retriever(tmp_path / "store").propose([1, 5, 6])
    paths = {tuple(int(tree.tokens[j]) for j in _path(tree, i)): round(float(tree.probs[i]), 3)
             for i in range(len(tree))}
    assert paths == {(7,): 0.667, (7, 8): 0.667, (9,): 0.333}


def _path(tree, node):
    path = []
    while node >= 0:
        path.insert(0, node)
        node = int(tree.parents[node])
    return path

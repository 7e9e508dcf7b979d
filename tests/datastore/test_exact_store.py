"""Exact store: the suffix array, memory mapping, and (hypothesis) that every proposed path really
followed the context in the corpus and never crosses an utterance or stop-id boundary."""

import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from echospec.datastore import build, open_datastore
from echospec.datastore.exact import _packed_keys, concat_segments, first_index, suffix_array
from echospec.retriever import CandidateTree, Retriever
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def brute_force_sa(stream, vocab, depth):
    sentinel = np.iinfo(stream.dtype).max

    def key(p):
        return [vocab if p - d < 0 or stream[p - d] == sentinel else int(stream[p - d]) for d in range(depth)], p

    return sorted((p for p in range(len(stream) - 1) if stream[p] != sentinel and stream[p + 1] != sentinel), key=key)


@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=20), min_size=1, max_size=15),
       st.integers(1, 9))
@settings(max_examples=60, deadline=None)
def test_suffix_array_sorts_reversed_ngrams(segments, depth):
    stream = concat_segments([np.array(s) for s in segments], 5)
    assert suffix_array(stream, 5, depth).tolist() == brute_force_sa(stream, 5, depth)


def test_large_vocabulary_uses_uint32_and_sorts(tmp_path):
    rng = np.random.default_rng(0)
    segments = [rng.integers(0, 200_000, 30) for _ in range(20)] + [np.array([199_999, 5, 199_999, 5, 7])] * 2
    stream = concat_segments(segments, 200_000)
    assert stream.dtype == np.uint32
    assert suffix_array(stream, 200_000, 4).tolist() == brute_force_sa(stream, 200_000, 4)


def sorted_reference_sa(stream, vocab, depth):
    """The suffix array by NumPy's stable lexsort of the packed keys, position last."""
    sentinel = np.iinfo(stream.dtype).max
    positions = np.flatnonzero((stream[:-1] != sentinel) & (stream[1:] != sentinel)).astype(np.int32)
    keys = _packed_keys(stream, positions, vocab, depth)
    return positions[np.lexsort((positions, *keys[::-1]))]


def repetitive_segments(rng, vocab, n_tokens):
    """Phrases said again and again, with runs of one token (silence), cut at random stop ids: buckets
    far larger than the insertion-sort size, keys tied across every word and beyond the depth."""
    phrases = [rng.integers(0, vocab, rng.integers(3, 40)) for _ in range(30)]
    silence = np.full(25, rng.integers(0, vocab))
    pieces = [phrases[i] if i < len(phrases) else silence for i in rng.integers(0, len(phrases) + 3, n_tokens // 12)]
    stream = np.concatenate(pieces)[:n_tokens]
    stream[rng.random(len(stream)) < 0.01] = rng.integers(0, vocab)  # a mis-tokenised frame now and then
    cuts = np.sort(rng.choice(len(stream), len(stream) // 60, replace=False))
    return [s for s in np.split(stream, cuts) if len(s)]


@pytest.mark.parametrize("vocab, depth", [(5, 1), (5, 9), (5, 30), (4096, 3), (4096, 4), (4096, 8), (4096, 13),
                                          (65534, 8), (200_000, 7)])
@pytest.mark.parametrize("kind", ["random", "repetitive"])
def test_suffix_sort_equals_a_sorted_reference(vocab, depth, kind):
    rng = np.random.default_rng(depth * 7 + vocab)
    if kind == "random":
        tokens = rng.integers(0, vocab, 60_000)
        segments = [s for s in np.split(tokens, np.sort(rng.choice(60_000, 500, replace=False))) if len(s)]
    else:
        segments = repetitive_segments(rng, vocab, 60_000)
    stream = concat_segments(segments, vocab)
    sa = suffix_array(stream, vocab, depth)
    assert sa.dtype == np.int32
    assert np.array_equal(sa, sorted_reference_sa(stream, vocab, depth))
    first = first_index(stream, sa, vocab)
    if len(first):
        assert np.array_equal(first, np.searchsorted(stream[sa], np.arange(vocab + 1)))


def test_suffix_sort_of_streams_without_suffixes():
    for segments in ([np.array([3])], [np.array([1]), np.array([2])]):
        assert len(suffix_array(concat_segments(segments, 5), 5, 4)) == 0


def test_store_is_memory_mapped_and_small(tmp_path):
    rng = np.random.default_rng(0)
    with open(tmp_path / "c.jsonl", "w") as f:
        f.writelines(json.dumps({"speaker": "s", "tokens": rng.integers(0, 1000, 250).tolist()}) + "\n" for _ in range(200))
    ds = build(tmp_path / "c.jsonl", tmp_path / "store", faiss=False, per_speaker=False, progress=False)
    for arr in (ds.shards[0].tokens, ds.shards[0].sa, ds.shards[0].first):
        assert isinstance(arr.base, np.memmap)  # opening maps files; nothing is read up front
    assert ds.info()["general_bytes_per_token"] <= 8.0


def segments_of(utterances, stop):
    out = []
    for tokens in utterances:
        seg = []
        for t in tokens + [stop]:
            if t == stop:
                if seg:
                    out.append(seg)
                seg = []
            else:
                seg.append(t)
    return out


def longest_match(segments, ctx, n_max):
    """Longest k <= n_max such that ctx[-k:] ends somewhere in a segment with a token after it."""
    best = 0
    for seg in segments:
        for j in range(len(seg) - 1):
            k = 0
            while k < min(n_max, len(ctx)) and j - k >= 0 and seg[j - k] == ctx[-1 - k]:
                k += 1
            best = max(best, k)
    return best


def follows(path, segments, ctx, k):
    """`path` continues an occurrence of ctx[-k:] inside one segment."""
    for seg in segments:
        for j in range(k - 1, len(seg) - len(path)):
            if seg[j - k + 1:j + 1] == ctx[len(ctx) - k:] and seg[j + 1:j + 1 + len(path)] == path:
                return True
    return False


def tree_paths(tree):
    for node in range(len(tree)):
        path, at = [], node
        while at >= 0:
            path.append(int(tree.tokens[at]))
            at = int(tree.parents[at])
        yield path[::-1]


@st.composite
def corpus_and_context(draw):
    vocab = draw(st.integers(2, 5))
    stop = vocab  # a raw id just past the speech range
    utterances = draw(st.lists(st.lists(st.integers(0, vocab), min_size=1, max_size=25), min_size=1, max_size=10))
    speakers = [draw(st.sampled_from(["a", "b"])) for _ in utterances]
    if not any(t != stop for u in utterances for t in u):
        utterances[0].append(0)
    source = draw(st.sampled_from(utterances))
    cut = draw(st.integers(0, len(source)))
    noise = draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=4))
    context = [t for t in source[:cut] if t != stop] + noise or [0]
    # utterances without speech tokens are skipped, so a speaker with only those has no store
    voiced = {s for s, u in zip(speakers, utterances) if any(t != stop for t in u)}
    return vocab, utterances, speakers, context, draw(st.sampled_from([None, *sorted(voiced)]))


@given(corpus_and_context(), st.sampled_from([1, 16]))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_exact_path_followed_the_context_in_the_corpus(case, min_support):
    vocab, utterances, speakers, context, speaker = case
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "c.jsonl"
        corpus.write_text("".join(json.dumps({"speaker": s, "tokens": u}) + "\n" for s, u in zip(speakers, utterances)))
        ds = build(corpus, Path(tmp) / "store", vocab_size=vocab, stop_ids=[vocab], n_max=4, faiss=False,
                   progress=False)
        r = Retriever(ds, prompt_lookup=False, use_faiss=False, min_support=min_support, cap=10_000,
                      max_nodes=64, max_depth=6)
        tree = r.propose(np.array(context), speaker=speaker)
        CandidateTree.from_dict(tree.to_dict())  # the checked constructor accepts what propose built
    general = segments_of(utterances, vocab)
    own = segments_of([u for s, u in zip(speakers, utterances) if s == speaker], vocab)
    k_general = longest_match(general, context, 4)
    k_own = longest_match(own, context, 4) if speaker else 0
    assert (len(tree) > 0) == (max(k_general, k_own) > 0)
    for path in tree_paths(tree):
        if min_support == 1:  # the deepest match is used: paths continue exactly that suffix
            assert follows(path, general, context, k_general) or follows(path, own, context, k_own), path
        else:  # backed off to a shorter suffix with more support, but still a real one
            assert any(follows(path, general, context, k) for k in range(1, k_general + 1)), path


def test_propose_is_deterministic_across_threads(tmp_path):
    rng = np.random.default_rng(1)
    with open(tmp_path / "c.jsonl", "w") as f:
        f.writelines(json.dumps({"speaker": f"s{i % 4}", "tokens": rng.integers(0, 50, 60).tolist()}) + "\n" for i in range(100))
    build(tmp_path / "c.jsonl", tmp_path / "store", faiss=False, progress=False)
    r = Retriever(open_datastore(tmp_path / "store"))
    contexts = [(rng.integers(0, 50, int(rng.integers(1, 40))), f"s{i % 4}" if i % 2 else None) for i in range(64)]
    serial = [r.propose(c, speaker=s).to_dict() for c, s in contexts]
    with ThreadPoolExecutor(8) as pool:
        parallel = list(pool.map(lambda cs: r.propose(cs[0], speaker=cs[1]).to_dict(), contexts * 4))
    assert parallel == serial * 4

"""The benchmark's own tools: the synthetic speech-like corpus and the plain REST reference."""

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from echospec.tools.benchmarks.support.rest_reference import SEPARATOR, RestReference, suffix_array, trie_of
from echospec.tools.corpus.synth_corpus import Corpus, SynthConfig, generate, main, write_jsonl

SMALL = SynthConfig(n_tokens=60_000, n_speakers=8, n_phrases=500, seed=3)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return generate(SMALL)


def ngram_counts(tokens: np.ndarray, n: int) -> np.ndarray:
    grams = np.lib.stride_tricks.sliding_window_view(tokens, n)
    return np.unique(grams, axis=0, return_counts=True)[1]


# --- synthetic corpus -------------------------------------------------------------------------------------


def test_same_seed_same_corpus_other_seed_other_corpus(corpus):
    again = generate(SMALL)
    assert np.array_equal(again.tokens, corpus.tokens) and np.array_equal(again.offsets, corpus.offsets)
    other = generate(SynthConfig(**{**SMALL.__dict__, "seed": 4}))
    assert not np.array_equal(other.tokens[:1000], corpus.tokens[:1000])


def test_sizes_and_ranges(corpus):
    lengths = np.diff(corpus.offsets)
    assert corpus.offsets[-1] == len(corpus.tokens) >= SMALL.n_tokens
    assert lengths.min() >= 50 and lengths.max() <= 375  # 2-15 s at 25 tokens/s
    assert corpus.tokens.min() >= 0 and corpus.tokens.max() < SMALL.vocab
    assert len(np.unique(corpus.tokens)) > SMALL.vocab // 3  # the vocabulary is really used
    assert len(np.unique(corpus.speakers)) == SMALL.n_speakers


def test_phones_span_several_frames(corpus):
    repeats = np.mean(corpus.tokens[1:] == corpus.tokens[:-1])
    assert 0.2 < repeats < 0.8


def test_speakers_have_their_own_token_preferences(corpus):
    """Two speakers' token histograms differ more than two halves of one speaker's utterances."""
    def histogram(utterances):
        counts = np.bincount(np.concatenate([corpus.utterance(i) for i in utterances]), minlength=SMALL.vocab)
        return counts / counts.sum()

    by_speaker = {s: np.flatnonzero(corpus.speakers == s) for s in np.unique(corpus.speakers)}
    a, b = sorted(by_speaker, key=lambda s: -len(by_speaker[s]))[:2]
    within = np.abs(histogram(by_speaker[a][::2]) - histogram(by_speaker[a][1::2])).sum()
    between = np.abs(histogram(by_speaker[a]) - histogram(by_speaker[b])).sum()
    assert between > 1.3 * within


def test_exact_matching_works_sometimes_and_fails_often(corpus):
    """Long n-grams recur (exact repeats) but most short contexts are not followed the same way twice."""
    repeated_16 = np.mean(ngram_counts(corpus.tokens, 16) > 1)
    repeated_4 = np.mean(ngram_counts(corpus.tokens, 4) > 1)
    assert 0.02 < repeated_16 < 0.5
    assert repeated_16 < repeated_4 < 0.9


def test_jsonl_round_trip(corpus, tmp_path):
    path = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == len(corpus)
    assert lines[5]["tokens"] == corpus.utterance(5).tolist()
    assert lines[5]["speaker"] == corpus.speaker_name(5) and lines[5]["id"] == corpus.utterance_id(5)
    assert not (tmp_path / "corpus.jsonl.tmp").exists()


def test_cli_writes_corpus_and_rejects_bad_sizes(tmp_path):
    out = tmp_path / "c.jsonl"
    ok = CliRunner().invoke(main, ["--tokens", "3000", "--vocab", "1024", "--speakers", "3", "--out", str(out)])
    assert ok.exit_code == 0, ok.output
    tokens = [t for line in out.read_text().splitlines() for t in json.loads(line)["tokens"]]
    assert len(tokens) >= 3000 and max(tokens) < 1024
    bad = CliRunner().invoke(main, ["--tokens", "10", "--out", str(out)])
    assert bad.exit_code != 0 and "10" in bad.output


# --- REST reference -----------------------------------------------------------------------------------------


def brute_occurrences(utterances, pattern):
    """(utterance, end) of every occurrence of `pattern`, end = index just after it."""
    n = len(pattern)
    return [(u, i + n) for u, tokens in enumerate(utterances) for i in range(len(tokens) - n + 1)
            if list(tokens[i : i + n]) == list(pattern)]


def test_suffix_array_sorts_by_prefix_then_position():
    text = np.random.default_rng(0).integers(0, 3, 400).astype(np.int32)
    sa = suffix_array(text, 8)
    expected = sorted(range(len(text)), key=lambda i: (list(text[i : i + 8]), i))
    # Ties (equal 8-token prefixes) are ordered by position; a shorter prefix (end of text) sorts first.
    assert sa.tolist() == expected


def test_known_example():
    utterances = [np.array([1, 2, 3, 4]), np.array([1, 2, 3, 5]), np.array([1, 2, 3, 4, 6]), np.array([7, 3, 4])]
    rest = RestReference(utterances, max_nodes=64)
    assert rest.longest_match(np.array([9, 1, 2, 3]))[0] == 3
    tree = rest.propose(np.array([9, 1, 2, 3]))
    assert tree.tokens.tolist() == [4, 5, 6] and tree.parents.tolist() == [-1, -1, 0]
    assert tree.counts.tolist() == [2, 1, 1]
    assert len(rest.propose(np.array([6, 1]))) == 0  # (6, 1) never occurs; nor does (1,) count: min_span 2
    assert len(rest.propose(np.array([3, 4, 6]))) == 0  # occurs, but at an utterance end: nothing follows


def test_node_budget_keeps_the_most_frequent_connected_nodes():
    rows = np.array([[1, 2, 3], [1, 2, 4], [1, 5, SEPARATOR], [6, 7, 8], [1, 2, 3]], np.int32)
    tree = trie_of(rows, max_nodes=3)
    assert tree.tokens.tolist() == [1, 2, 3] and tree.counts.tolist() == [4, 3, 2]
    assert tree.parents.tolist() == [-1, 0, 1]
    np.testing.assert_allclose(tree.probs, [0.8, 0.6, 0.4])


@st.composite
def corpus_and_context(draw):
    utterances = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=6))
    context = draw(st.lists(st.integers(0, 3), min_size=1, max_size=20))
    return [np.array(u) for u in utterances], np.array(context)


@settings(max_examples=150, deadline=None)
@given(corpus_and_context())
def test_longest_match_and_counts_agree_with_brute_force(case):
    utterances, context = case
    rest = RestReference(utterances, max_span=6, min_span=2, continuation=4, max_nodes=1000)
    n, lo, hi = rest.longest_match(context)
    longest = max((k for k in range(2, min(6, len(context)) + 1) if brute_occurrences(utterances, context[-k:])),
                  default=0)
    assert n == longest
    tree = rest.propose(context)
    if n == 0:
        assert len(tree) == 0
        return
    occurrences = brute_occurrences(utterances, context[-n:])
    assert hi - lo == len(occurrences)
    continuations = [tuple(utterances[u][end : end + 4]) for u, end in occurrences]
    # Every node is a prefix of a real continuation inside one utterance, with its true count.
    for i in range(len(tree)):
        path = tuple(int(t) for t in tree.tokens[np.flatnonzero(tree.mask[i])])
        assert tree.counts[i] == sum(c[: len(path)] == path for c in continuations) > 0
    assert len(tree) == len({c[:k] for c in continuations for k in range(1, len(c) + 1)})


# --- benchmark measurement logic ---------------------------------------------------------------------------


def test_oracle_accepts_the_longest_matching_path():
    from echospec.retriever.tree import CandidateTree
    from echospec.retriever.tree import matched_depth as accepted

    tree = CandidateTree.from_sequences([[5, 6, 7], [5, 6, 8, 9], [4]], max_nodes=16)
    assert accepted(tree.tokens, tree.parents, np.array([5, 6, 8, 9, 1])) == 4
    assert accepted(tree.tokens, tree.parents, np.array([5, 6, 1])) == 2
    assert accepted(tree.tokens, tree.parents, np.array([6])) == 0
    assert accepted(tree.tokens, tree.parents, np.array([5, 6])) == 2  # truth ends inside the tree
    assert accepted(np.zeros(0, np.int64), np.zeros(0, np.int32), np.array([1])) == 0
    assert tree.matched_depth([5, 6, 8, 9, 1]) == 4


def test_latency_contexts_cover_utterances_in_order():
    from echospec.tools.benchmarks.bench_retriever import latency_contexts

    held = [np.arange(50), np.arange(30)]
    for calls in (20, 60):
        contexts = latency_contexts(held, calls=calls)
        assert len(contexts) >= calls
        assert contexts == sorted(contexts) and all(1 <= pos < len(held[u]) for u, pos in contexts)


def test_task_memory_is_fitted_only_over_tasks_of_two_sizes():
    from echospec.tools.benchmarks.bench_shards import memory_fit

    two_sizes = memory_fit([[10_000_000, 300 << 20], [40_000_000, 900 << 20], [10_000_000, 310 << 20]])
    assert 20 < two_sizes["bytes_per_token"] < 22 and 100 < two_sizes["base_mb"] < 110
    # four equal shards (--latency-shards 1,4): a line through one size is noise (it gave -5.4 GB + 501 B/token)
    one_size = memory_fit([[12_400_000, 563 << 20], [12_500_000, 555 << 20], [12_420_000, 560 << 20]])
    assert one_size["base_mb"] == 0 and 46 < one_size["bytes_per_token"] < 48


def motif_corpus(path, seed: int, vocab: int, motifs: int, per_utterance: int, n: int) -> list[list[int]]:
    """`n` utterances of `per_utterance` random 6-token motifs each, written to `path` as JSONL: a small store whose
    contexts recur often enough that caps and supports bind."""
    rng = np.random.default_rng(seed)
    pieces = [rng.integers(0, vocab, 6).tolist() for _ in range(motifs)]
    utterances = [sum((pieces[i] for i in rng.integers(0, motifs, per_utterance)), []) for _ in range(n)]
    with open(path, "w") as f:
        for i, tokens in enumerate(utterances):
            f.write(json.dumps({"id": f"u{i}", "tokens": tokens}) + "\n")
    return utterances


def test_continuation_choice_replays_the_gather(tmp_path):
    """All `cap` rows near the longer suffix is Retriever.propose's own tree (prompt lookup off); spread rows differ
    only where the cap binds."""
    from echospec.datastore import build
    from echospec.retriever import Retriever
    from echospec.retriever.replay import GeneralStore
    from echospec.tools.benchmarks.bench_shards import oracle
    from echospec.tools.benchmarks.continuation_choice import Chosen, propose

    utterances = motif_corpus(tmp_path / "c.jsonl", seed=0, vocab=12, motifs=5, per_utterance=8, n=60)
    ds = build(tmp_path / "c.jsonl", tmp_path / "s", per_speaker=False, faiss=False, progress=False)
    r = Retriever(ds, prompt_lookup=False, use_faiss=False, cap=4, min_support=2)
    wide = Retriever(ds, prompt_lookup=False, use_faiss=False, cap=10_000, min_support=2)
    general, wide_general = GeneralStore(r), GeneralStore(wide)
    differs = 0
    for u in utterances[:10]:
        for pos in range(1, len(u), 7):
            ctx = np.asarray(u[:pos], np.int64)
            block, spread = propose(general, ctx, 4), propose(general, ctx, 0)
            assert block is not None and block.to_dict() == r.propose(ctx).to_dict()
            differs += block.to_dict() != spread.to_dict()
            assert propose(wide_general, ctx, 0).to_dict() == wide.propose(ctx).to_dict()  # every occurrence read
    assert differs > 0
    held = [np.asarray(u, np.int64) for u in utterances[:5]]
    assert oracle(Chosen(r, 4), held) == oracle(r, held) != oracle(Chosen(r, 1), held)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the mapped pages from Linux's smaps")
def test_bench_pages_reports_each_access_and_refuses_an_unknown_one(tmp_path):
    """Read from a cold cache, the stream maps whole only where access="stream" reads it in."""
    from echospec.tools.benchmarks.bench_pages import main as bench_pages

    out = tmp_path / "pages"
    args = ["--tokens", "2000000", "--proposals", "10", "--rounds", "1", "--out", str(out)]
    done = CliRunner().invoke(bench_pages, [*args, "--variants", "index,index-stream"])
    assert done.exit_code == 0, done.output
    summary = json.loads((out / "pages.json").read_text())["summary"]
    assert set(summary) == {"index", "index-stream"} and "| index-stream |" in done.output
    assert summary["index-stream"]["mapped_share_by_file"]["tokens.npy"] > 0.99
    assert summary["index"]["mapped_share_by_file"]["tokens.npy"] < 0.99  # 10 proposals touch a few of its 977 pages
    refused = CliRunner().invoke(bench_pages, [*args, "--variants", "index,sequential"])
    assert refused.exit_code == 2 and "choose among" in refused.output


def test_search_pages_replays_the_search_and_counts_what_a_table_spares(tmp_path):
    """The replayed search finds every range kernels.match found (measure asserts it, over 1 and 3 shards); a
    table of every occurring n-gram spares pages, one of none spares nothing."""
    from echospec.datastore import build
    from echospec.retriever import Retriever
    from echospec.tools.benchmarks.search_pages import main as search_pages
    from echospec.tools.benchmarks.search_pages import measure

    utterances = motif_corpus(tmp_path / "c.jsonl", seed=1, vocab=40, motifs=8, per_utterance=10, n=120)
    np.savez(tmp_path / "held.npz", tokens=np.concatenate(utterances[:10]), lengths=[len(u) for u in utterances[:10]])
    never = 10**9
    for shards in (1, 3):
        ds = build(tmp_path / "c.jsonl", tmp_path / f"s{shards}", per_speaker=False, faiss=False, progress=False,
                   shards=shards)
        r = Retriever(ds, prompt_lookup=False, use_faiss=False, cap=4, min_support=2)
        ctxs = [np.asarray(u[:p], np.int64) for u in utterances[:10] for p in range(2, len(u), 9)]
        result = measure(r, ctxs, (1, never))
        pages = result["search_pages"]
        assert pages[f"heavy {never}"] == pages["today"] > pages["heavy 1"] >= 0
        assert result["table_share"][never] == 0 < result["table_share"][1]
        assert result["continuation_pages"] > 0 and result["pages"]["today"] >= pages["today"]
    done = CliRunner().invoke(search_pages, ["--store", str(tmp_path / "s3"), "--held", str(tmp_path / "held.npz"),
                                             "--proposals", "20", "--heavy", "1"])
    assert done.exit_code == 0 and "| heavy 1 |" in done.output, done.output
    refused = CliRunner().invoke(search_pages, ["--store", str(tmp_path / "s3"), "--held", str(tmp_path / "held.npz"),
                                                "--heavy", "many"])
    assert refused.exit_code == 2 and "whole numbers" in refused.output

"""The sampled suffix-array index (exact.py index.npy) only narrows where a search starts: every proposal and
every count is the same with and without it, for one store and for shards, at any sampling step."""

import dataclasses
import json
import sqlite3

import numpy as np
import pytest
from echospec.datastore import build, exact, open_datastore
from echospec.retriever import Retriever, kernels


def corpus(path, rng, n_utts=400, vocab=12):
    """Few ids and many repeats: suffix ranges of thousands of entries, so the index has work to do."""
    with open(path, "w") as f:
        for i in range(n_utts):
            base = rng.integers(0, vocab, rng.integers(20, 200))
            f.write(json.dumps({"id": f"u{i}", "speaker": f"s{i % 5}", "tokens": base.tolist()}) + "\n")
    return path


def without_index(store: tuple) -> tuple:
    table = store[0].copy()
    table[:, kernels.SHARD_INDEX_ROWS] = 0
    return (table, *store[1:])


@pytest.mark.parametrize("step, shards", [(4, 1), (4, 3), (256, 1), (37, 2)])
def test_proposals_and_counts_are_the_same_with_and_without_the_index(tmp_path, monkeypatch, step, shards):
    monkeypatch.setattr(exact, "INDEX_STEP", step)
    rng = np.random.default_rng(step + shards)
    path = corpus(tmp_path / "c.jsonl", rng)
    build(path, tmp_path / "s", shards=shards, faiss=False, progress=False, workers=1, vocab_size=12)
    ds = open_datastore(tmp_path / "s", verify=True)
    assert all(len(shard.index) and shard.index_step == step for shard in ds.shards)
    r = Retriever(ds, use_faiss=False, prompt_lookup=False)
    indexed, plain = r._general, without_index(r._general)
    lines = [json.loads(line)["tokens"] for line in open(path)]
    for trial in range(400):
        if trial % 2:  # a context from the corpus (deep matches) or random ids (early misses)
            tokens = lines[rng.integers(len(lines))]
            ctx = np.asarray(tokens[:rng.integers(1, len(tokens))], np.int64)
        else:
            ctx = rng.integers(0, 12, rng.integers(1, 12)).astype(np.int64)
        for min_support in (1, 32):
            a = kernels.match(indexed, ctx, 1, ds.n_max, min_support)
            b = kernels.match(plain, ctx, 1, ds.n_max, min_support)
            assert all(np.array_equal(x, y) for x, y in zip(a[:3], b[:3])) and a[3] == b[3]
        r._general = indexed
        with_index = r.propose(ctx)
        r._general = plain
        without = r.propose(ctx)
        assert all(np.array_equal(getattr(with_index, f.name), getattr(without, f.name))
                   for f in dataclasses.fields(with_index))


def test_a_store_without_an_index_is_searched_as_before(tmp_path):
    rng = np.random.default_rng(0)
    build(corpus(tmp_path / "c.jsonl", rng), tmp_path / "s", faiss=False, progress=False, vocab_size=12)
    (tmp_path / "s" / "general" / "index.npy").unlink()  # as a store built before the index existed
    with sqlite3.connect(tmp_path / "s" / "catalog.sqlite") as db:
        db.execute("DELETE FROM files WHERE path = 'general/index.npy'")
    ds = open_datastore(tmp_path / "s")
    assert not len(ds.shards[0].index)
    r = Retriever(ds, use_faiss=False)
    assert len(r.propose(np.array([1, 2, 3]))) > 0


def test_an_index_that_does_not_fit_its_store_is_refused(tmp_path):
    rng = np.random.default_rng(1)
    build(corpus(tmp_path / "c.jsonl", rng), tmp_path / "s", faiss=False, progress=False, vocab_size=12)
    path = tmp_path / "s" / "general" / "index.npy"
    index = np.load(path)
    index[0] += 1  # the step: the keys no longer fit the suffix array (same size, so only the store sees it)
    np.save(path, index)
    with pytest.raises(exact.DamagedStoreError, match="index.npy does not fit"):
        open_datastore(tmp_path / "s").shards

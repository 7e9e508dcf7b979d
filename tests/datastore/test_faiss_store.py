"""FAISS store: continuations for contexts with no exact match; embeddings from the user or the
corpus; index type by size; bytes reported apart from the exact stores."""

import json
import struct

import numpy as np
import pytest
from echospec.datastore import DatastoreError, build, open_datastore
from echospec.datastore.faiss_store import load_embeddings
from echospec.retriever import SOURCES, Retriever

VOCAB = 100
UNSEEN = 99  # a valid speech id that never occurs in the corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("faiss") / "c.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps({"speaker": f"s{i % 2}", "tokens": rng.integers(0, UNSEEN, 40).tolist()}) + "\n" for i in range(120))
    return path


def test_faiss_answers_contexts_with_no_exact_match(tmp_path, corpus):
    ds = build(corpus, tmp_path / "store", vocab_size=VOCAB, progress=False)
    assert ds.info()["stores"][-1]["params"]["index"] == "flat"
    tree = Retriever(ds).propose(np.array([5, 17, UNSEEN]))
    assert len(tree) > 0 and set(tree.sources.tolist()) == {SOURCES.index("faiss")}
    stream = np.asarray(ds.shards[0].tokens).tolist()
    for leaf in range(len(tree)):  # every path is a real stored continuation
        path, at = [], leaf
        while at >= 0:
            path.insert(0, int(tree.tokens[at]))
            at = int(tree.parents[at])
        assert any(stream[i:i + len(path)] == path for i in range(len(stream)))
    assert len(Retriever(ds, use_faiss=False).propose(np.array([5, 17, UNSEEN]))) == 0


def test_large_stores_get_an_ivf_index_and_reopen_cheaply(tmp_path, corpus):
    ds = build(corpus, tmp_path / "store", progress=False, faiss_options={"flat_max": 100})
    faiss_row = ds.info()["stores"][-1]
    assert faiss_row["params"]["index"].startswith("ivf") and faiss_row["vectors"] > 100
    assert ds.info()["faiss_bytes"] == faiss_row["bytes"] > 0
    assert ds.info()["exact_bytes"] == sum(s["bytes"] for s in ds.info()["stores"] if s["kind"] == "exact")
    assert len(Retriever(ds).propose(np.array([3, 3, 3]), max_nodes=4)) > 0
    assert open_datastore(tmp_path / "store").faiss_store() is ds.faiss_store()  # index loaded once


def write_safetensors(path, name, array, dtype):
    if dtype == "BF16":
        raw = (array.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        raw = array.astype(np.float32).tobytes()
    header = json.dumps({name: {"dtype": dtype, "shape": list(array.shape), "data_offsets": [0, len(raw)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw)


@pytest.mark.parametrize("kind", ["npy", "F32", "BF16"])
def test_user_embeddings(tmp_path, corpus, kind):
    # a model's input embedding table: 10 text ids, then the speech ids from offset 10
    table = np.random.default_rng(1).standard_normal((10 + VOCAB, 24)).astype(np.float32)
    path = tmp_path / ("emb.npy" if kind == "npy" else "model.safetensors")
    if kind == "npy":
        np.save(path, table)
    else:
        write_safetensors(path, "model.embed_tokens.weight", table, kind)
    loaded = load_embeddings(path, VOCAB, speech_offset=10)
    assert loaded.shape == (VOCAB, 24) and np.allclose(loaded, table[10:], rtol=1e-2, atol=1e-3)
    shifted = tmp_path / "shifted.jsonl"
    shifted.write_text("".join(json.dumps({**row, "tokens": [t + 10 for t in row["tokens"]]}) + "\n"
                               for row in map(json.loads, corpus.read_text().splitlines())))
    ds = build(shifted, tmp_path / "store", embeddings=path, speech_offset=10, vocab_size=VOCAB, progress=False)
    assert ds.info()["stores"][-1]["params"]["embeddings"] == str(path)
    assert len(Retriever(ds).propose(np.array([1, 2, UNSEEN]))) > 0


def test_bad_embeddings(tmp_path, corpus):
    np.save(tmp_path / "short.npy", np.zeros((10, 4), np.float32))
    with pytest.raises(DatastoreError, match="10 rows cannot cover 100 speech ids"):
        build(corpus, tmp_path / "s", embeddings=tmp_path / "short.npy", vocab_size=VOCAB, progress=False)
    np.save(tmp_path / "ints.npy", np.zeros((VOCAB, 4), np.int64))
    with pytest.raises(DatastoreError, match="2-D float table"):
        build(corpus, tmp_path / "s", embeddings=tmp_path / "ints.npy", vocab_size=VOCAB, progress=False)
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(DatastoreError, match="not a readable .safetensors"):
        build(corpus, tmp_path / "s", embeddings=tmp_path / "bad.safetensors", vocab_size=VOCAB, progress=False)
    assert not (tmp_path / "s").exists()

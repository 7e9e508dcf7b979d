"""A damaged store is refused, never read out of bounds: the kernels check every suffix-array and
first-token entry before it indexes anything, `Retriever.propose` raises DamagedStoreError naming the
store, and the other stores of the datastore keep answering."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from echospec.datastore import DamagedStoreError, DatastoreError, build, open_datastore
from echospec.retriever import Retriever


def make_corpus(path, n_utts=60, seed=0, vocab=64):
    rng = np.random.default_rng(seed)
    utterances = [{"id": f"u{i}", "speaker": f"s{i % 3}", "tokens": rng.integers(0, vocab, 40).tolist()}
                  for i in range(n_utts)]
    path.write_text("".join(json.dumps(u) + "\n" for u in utterances))
    return path, utterances


@pytest.fixture
def store(tmp_path):
    corpus, utterances = make_corpus(tmp_path / "c.jsonl")
    build(corpus, tmp_path / "store", faiss=False, progress=False)
    return tmp_path / "store", utterances


def contexts(utterances):
    """Every prefix of every utterance (2 tokens and up): between them they reach every sa entry."""
    return [np.array(u["tokens"][:end]) for u in utterances for end in range(2, len(u["tokens"]) + 1, 3)]


def overwrite(path, every, value):
    """Overwrite entries of a stored array in place (same size, so the catalog's size check passes)."""
    arr = np.load(path, mmap_mode="r+")
    arr[::every] = value
    arr.flush()
    del arr


def proposals(retriever, utterances, speaker=None):
    return [retriever.propose(c, speaker=speaker).tokens.tolist() for c in contexts(utterances)]


def test_corrupted_suffix_array_is_refused_not_a_crash(store):
    """The issue's reproducer, in a child process: on the old kernels it died with SIGSEGV."""
    root, utterances = store
    overwrite(root / "general" / "sa.npy", 97, 2**31 - 5)
    code = f"""
import json, numpy as np
from echospec.datastore import DamagedStoreError
from echospec.retriever import Retriever
try:
    retriever = Retriever({str(root)!r})
    for u in json.loads({json.dumps(json.dumps(utterances))}):
        for end in range(2, len(u["tokens"]) + 1):
            retriever.propose(np.array(u["tokens"][:end]))
    print("answered everything")
except DamagedStoreError as e:
    print("refused:", e)
"""
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.startswith("refused: ") and "general: store is damaged" in child.stdout
    assert f"echospec info --verify {root}" in child.stdout
    with pytest.raises(DatastoreError, match="checksum mismatch"):
        open_datastore(root, verify=True)


@pytest.mark.parametrize("value", [2**31 - 5, -(2**31), -1, 10**6])
def test_damaged_speaker_store_leaves_the_others_answering(store, value):
    root, utterances = store
    retriever = Retriever(root, use_faiss=False)
    before = {s: proposals(retriever, utterances, s) for s in (None, "s1")}
    ds = open_datastore(root)
    overwrite(ds.speaker_store("s0").directory / "sa.npy", 5, value)  # a small store: no first-token table
    retriever = Retriever(root, use_faiss=False)
    with pytest.raises(DamagedStoreError, match=r"speakers/s0-[0-9a-f-]+: store is damaged"):
        proposals(retriever, utterances, "s0")
    assert {s: proposals(retriever, utterances, s) for s in (None, "s1")} == before


def test_damaged_first_token_table_is_refused(store):
    root, utterances = store
    first = root / "general" / "first.npy"
    assert np.load(first).size  # the general store keeps a first-token table
    overwrite(first, 7, 2**40)
    with pytest.raises(DamagedStoreError, match="general: store is damaged"):
        proposals(Retriever(root, use_faiss=False), utterances)


def test_random_suffix_array_damage_answers_or_refuses(store):
    """Entries replaced by random values (in and out of range): every proposal is a valid tree over
    the vocabulary or a DamagedStoreError."""
    root, utterances = store
    sa_path = root / "general" / "sa.npy"
    original = np.load(sa_path)
    rng = np.random.default_rng(1)
    outcomes = set()
    for trial in range(6):
        sa = np.load(sa_path, mmap_mode="r+")
        sa[:] = original
        where = rng.choice(len(sa), 8, replace=False)
        sa[where] = rng.integers(-(2**31), 2**31 - 1, 8) if trial % 2 else rng.integers(0, 3 * len(sa), 8)
        sa.flush()
        del sa
        retriever = Retriever(root, use_faiss=False)
        for context in contexts(utterances)[::7]:
            try:
                tree = retriever.propose(context)
            except DamagedStoreError:
                outcomes.add("refused")
                continue
            outcomes.add("answered")
            assert np.all(tree.parents < np.arange(len(tree)))
    assert outcomes == {"answered", "refused"}


@pytest.mark.parametrize("name, dtype", [("sa.npy", np.int64), ("sa.npy", np.float32), ("first.npy", np.int32)])
def test_wrong_array_types_are_refused_at_open(store, name, dtype):
    root, _ = store
    path = root / "general" / name
    arr = np.load(path)
    np.save(path, arr.astype(dtype))  # the size check may or may not notice; the type check must
    with pytest.raises(DatastoreError):
        Retriever(root, use_faiss=False)


# --- damaged files: one DatastoreError line, wherever numpy, zipfile or FAISS fail -----------------------


@pytest.fixture
def faiss_store(tmp_path):
    corpus, utterances = make_corpus(tmp_path / "c.jsonl")
    build(corpus, tmp_path / "store", progress=False)
    return tmp_path / "store", utterances


def flip(path, offset, mask=0x5A):
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["general/tokens.npy", "general/sa.npy", "general/first.npy",
                                  "faiss/embeddings.npy"])
@pytest.mark.parametrize("offset", [8, 12, 45])  # header length (numpy's tokenizer fails), a key, a value
def test_damaged_npy_header_is_one_datastore_error(faiss_store, name, offset):
    root, _ = faiss_store
    flip(root / name, offset)
    with pytest.raises(DamagedStoreError, match=rf"{name}: unreadable array, damaged or not a .npy file \([^\n]+\)$"):
        Retriever(root)


def test_faiss_table_that_does_not_fit_is_refused(faiss_store):
    root, _ = faiss_store
    table = np.load(root / "faiss" / "embeddings.npy")
    np.save(root / "faiss" / "embeddings.npy", table[:10])  # fewer rows than the vocabulary: reads past its end
    with pytest.raises(DatastoreError):  # the size check, or the shape check if the size happened to match
        Retriever(root)
    from echospec.datastore.faiss_store import FaissStore
    with pytest.raises(DamagedStoreError, match="does not fit its index or the vocabulary"):
        FaissStore(root / "faiss", {}, vocab_size=64)


def write_safetensors_header(path, header: bytes, declared=None, data=b""):
    path.write_bytes(int(len(header) if declared is None else declared).to_bytes(8, "little") + header + data)
    return path


@pytest.mark.parametrize("header, declared, data, message", [
    (b"{}", 10**12, b"", "the header declares 1000000000000 bytes, the file holds 10"),
    (json.dumps({"w": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4 * 10**12]}}).encode(),
     None, b"\0" * 64, "data_offsets [0, 4000000000000] lie outside the file's 64 data bytes"),
    (json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}}).encode(),
     None, b"\0" * 64, "shape [4, 4] does not fill its data_offsets [0, 32]"),
    (json.dumps({"w": {"dtype": "F32", "shape": "big", "data_offsets": [0, 4]}}).encode(),
     None, b"\0" * 4, "lacks an integer shape"),
    (b"[1, 2]", None, b"", "the header is not a JSON object"),
    (b"", 0, b"", "not a readable .safetensors file"),
])
def test_damaged_safetensors_reads_no_more_than_the_file_holds(tmp_path, header, declared, data, message):
    from echospec.datastore.faiss_store import load_embeddings
    path = write_safetensors_header(tmp_path / "emb.safetensors", header, declared, data)
    with pytest.raises(DatastoreError, match=re.escape(message)):
        load_embeddings(path, 64)


def test_out_of_vocabulary_ids_in_a_token_stream_are_refused(store):
    """A damaged stream id would reach the verifier, which indexes its embedding table with it."""
    root, utterances = store
    retriever = Retriever(root, use_faiss=False, prompt_lookup=False)  # maps the files: it sees the damage
    tokens = np.load(root / "general" / "tokens.npy", mmap_mode="r+")
    sentinel = np.iinfo(tokens.dtype).max
    inside = np.flatnonzero(tokens != sentinel)
    tokens[inside[::50]] = 1000  # above vocab 64, below the sentinel
    tokens.flush()
    del tokens
    refused = 0
    for context in contexts(utterances):
        try:
            tree = retriever.propose(context)
        except DamagedStoreError as e:
            assert "token stream is out of range" in str(e)
            refused += 1
            continue
        assert tree.tokens.max(initial=0) < 64
    assert refused


# --- a service with several datastores, one damaged while served ------------------------------------------


def test_serve_keeps_answering_for_the_healthy_datastore(tmp_path):
    """`echospec serve good=... bad=...`: once bad's general suffix array is overwritten (in place, so the
    service's maps see it), bad's proposals are refused with a 503 and good's keep their answers; the
    process stays up. On the old kernels it died with SIGSEGV."""
    from service_testing import Server, copy_store, make_store, post_json

    built, corpus = make_store(tmp_path / "built", n_tokens=5000, n_speakers=2)
    good, bad = copy_store(built, tmp_path / "good"), copy_store(built, tmp_path / "bad")
    contexts = [u["tokens"][:end] for u in corpus[:20] for end in (5, 12, 30)]
    expected = [Retriever(good).propose(c).to_dict() for c in contexts]
    with Server(f"good={good}", f"bad={bad}") as server:
        overwrite(bad / "general" / "sa.npy", 97, 2**31 - 5)
        statuses = set()
        for context, tree in zip(contexts, expected):
            status, answer = post_json(server.url, "/v1/stores/bad/propose", {"context": context})
            statuses.add(status)
            assert status == 200 or (status, answer["error"]["code"]) == (503, "store_damaged"), answer
            status, answer = post_json(server.url, "/v1/stores/good/propose", {"context": context})
            assert status == 200 and answer == {"tree": tree}
        assert 503 in statuses and server.process.poll() is None
        assert "Traceback" not in server.output()

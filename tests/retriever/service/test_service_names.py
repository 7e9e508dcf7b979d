"""One name rule (datastore/names.py) for the datastore, the command line and the HTTP API: a name the
service refuses is refused everywhere, never rewritten into another name."""

from __future__ import annotations

import json
import subprocess

import pytest
from service_testing import API_KEY, ECHOSPEC, VOCAB, Server, copy_store, make_store, post_json, write_jsonl

from echospec.datastore import DatastoreError, build, enroll, open_datastore
from echospec.datastore.names import check_name, is_valid_name

REFUSED = ["../../x", "/tmp/absolute", "..", "a\nb", " ann", "", ".hidden", "a/b", "a..b", "x" * 65, "ann "]
ACCEPTED = ["ann", "spk00", "espeak-en-us-m3", "A.b_c-d", "x" * 64]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("names"), n_tokens=3000, n_speakers=2)


def listing(store):
    return sorted(p.relative_to(store).as_posix() for p in store.rglob("*"))


def test_the_rule():
    assert [n for n in ACCEPTED if not is_valid_name(n)] == []
    assert [n for n in REFUSED if is_valid_name(n)] == []
    with pytest.raises(DatastoreError, match=r"speaker name 'a\\nb' must match"):
        check_name("speaker", "a\nb")


@pytest.mark.parametrize("name", REFUSED)
def test_enroll_refuses_instead_of_rewriting(built, tmp_path, name):
    store = copy_store(built[0], tmp_path / "voices")
    before = listing(store)
    corpus = write_jsonl([{"id": "u", "tokens": [1, 2, 3]}], tmp_path / "u.jsonl")
    with pytest.raises(DatastoreError, match="speaker name .* must match"):
        enroll(store, name, corpus)
    assert listing(store) == before and name not in open_datastore(store).speakers


def test_build_refuses_a_corpus_speaker_name_the_api_refuses(tmp_path):
    corpus = write_jsonl([{"id": "a", "speaker": "ann", "tokens": [1, 2, 3]},
                          {"id": "b", "speaker": "../../etc", "tokens": [4, 5, 6]}], tmp_path / "c.jsonl")
    with pytest.raises(DatastoreError, match=r"speaker name '\.\./\.\./etc' must match"):
        build(corpus, tmp_path / "store", vocab_size=VOCAB, faiss=False, progress=False)
    assert not (tmp_path / "store").exists()
    build(corpus, tmp_path / "general-only", vocab_size=VOCAB, faiss=False, per_speaker=False, progress=False)


def test_the_cli_and_the_http_api_refuse_the_same_names(built, tmp_path):
    store = copy_store(built[0], tmp_path / "voices")
    before = listing(store)
    corpus = write_jsonl([{"id": "u", "tokens": [1, 2, 3]}], tmp_path / "u.jsonl")
    for name in ("../../x", "a\nb"):  # each CLI run costs a second of imports: two of REFUSED
        done = subprocess.run([ECHOSPEC, "enroll", str(store), name, str(corpus)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 1 and done.stderr.count("\n") == 1 and "must match" in done.stderr, done.stderr
    assert listing(store) == before
    utterances = {"utterances": [{"id": "u", "tokens": [1, 2, 3]}]}
    with Server(store) as server:
        for name in ("..", "a\nb", " ann", ".hidden", "a..b", "x" * 65):
            path = "/v1/stores/voices/speakers/" + "".join(f"%{b:02X}" for b in name.encode())
            status, answer = post_json(server.url, path, utterances, api_key=API_KEY)
            assert (status, answer["error"]["code"]) == (422, "invalid_name"), (name, answer)
            assert json.dumps(name)[1:-1] in answer["error"]["message"] or name == "x" * 65
        assert post_json(server.url, "/v1/stores/voices/speakers/ann", utterances, api_key=API_KEY)[0] == 200

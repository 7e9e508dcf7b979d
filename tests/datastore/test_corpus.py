"""Corpus input: JSONL, JSONL manifest of .npy, .npz; id ranges, offsets, stop ids; bad input."""

import json

import numpy as np
import pytest
from echospec.datastore import (
    CorpusError,
    Vocabulary,
    build,
    enroll,
    open_datastore,
    read_corpus,
)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_with_extra_fields_kept_in_catalog(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [
        {"id": "a", "speaker": "ann", "tokens": [1, 2, 3], "text": "hello", "lang": "en"},
        {"id": "b", "speaker": "bob", "tokens": [3, 2, 1]},
    ])
    utts = list(read_corpus(corpus, Vocabulary()))
    assert [u.id for u in utts] == ["a", "b"] and utts[0].extra == {"text": "hello", "lang": "en"}
    assert utts[0].tokens.tolist() == [1, 2, 3] and utts[0].where == f"{corpus}:1"
    build(corpus, tmp_path / "store", faiss=False, progress=False)
    import sqlite_utils
    rows = list(sqlite_utils.Database(tmp_path / "store" / "catalog.sqlite")["utterances"].rows)
    assert json.loads(rows[0]["extra"]) == {"text": "hello", "lang": "en"} and rows[1]["speaker"] == "bob"


def test_manifest_of_npy_files_and_npz(tmp_path):
    np.save(tmp_path / "u1.npy", np.array([5, 6, 7], np.int16))
    np.save(tmp_path / "u2.npy", np.array([7, 6], np.int64))
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "u1", "speaker": "s", "path": "u1.npy"},
                                                  {"id": "u2", "speaker": "s", "path": "u2.npy"}])
    assert [u.tokens.tolist() for u in read_corpus(manifest, Vocabulary())] == [[5, 6, 7], [7, 6]]
    np.savez(tmp_path / "c.npz", tokens=np.array([1, 2, 3, 4, 5]), lengths=np.array([2, 3]),
             ids=np.array(["x", "y"]), speakers=np.array(["p", "q"]))
    utts = list(read_corpus(tmp_path / "c.npz", Vocabulary()))
    assert [(u.id, u.speaker, u.tokens.tolist()) for u in utts] == [("x", "p", [1, 2]), ("y", "q", [3, 4, 5])]


def test_offset_vocabulary_and_stop_ids(tmp_path):
    # LLaSA-like: speech ids start at 128264; 128261 ends speech and must never be stored
    corpus = write_jsonl(tmp_path / "c.jsonl", [
        {"speaker": "s", "tokens": [128264, 128265, 128266, 128261, 128270, 128271]},
    ])
    vocab = Vocabulary(speech_offset=128264, size=65536, stop_ids=(128261,))
    (utt,) = read_corpus(corpus, vocab)
    assert utt.tokens.tolist() == [0, 1, 2, -1, 6, 7]
    ds = build(corpus, tmp_path / "store", speech_offset=128264, vocab_size=65536, stop_ids=[128261],
               faiss=False, progress=False)
    assert ds.info()["tokens"] == 5 and ds.info()["vocabulary"]["stop_ids"] == [128261]
    assert ds.info()["vocabulary"]["dtype"] == "uint32"  # 65536 ids + a sentinel do not fit uint16
    stream = np.asarray(ds.shards[0].tokens).tolist()
    sentinel = ds.shards[0].sentinel
    assert stream == [sentinel, 0, 1, 2, sentinel, 6, 7, sentinel]  # the stop id split the utterance


@pytest.mark.parametrize("line, message", [
    ("{not json", "c.jsonl:2: not valid JSON"),
    ('{"speaker": "s"}', "c.jsonl:2: utterance has no 'tokens'"),
    ('{"speaker": "s", "tokens": [1, 2.5]}', "c.jsonl:2: token 2.5 is not an integer"),
    ('{"speaker": "s", "tokens": [1, "7"]}', "c.jsonl:2: token '7' is not an integer"),
    ('{"speaker": "s", "tokens": [1, true]}', "c.jsonl:2: token True is not an integer"),
    ('{"speaker": "s", "tokens": [1, -4]}', "c.jsonl:2: negative token id -4"),
    ('{"speaker": "s", "tokens": [1, 99]}', "c.jsonl:2: token id 99 is outside the speech range 0..9"),
    ('{"speaker": "s", "tokens": [[1, 2]]}', "c.jsonl:2: tokens must be a 1-D list"),
    ('{"speaker": "s", "tokens": [1, 99999999999999999999999]}', "c.jsonl:2: token id too large"),
    ('[1, 2, 3]', "c.jsonl:2: expected a JSON object"),
    ('{"tokens": [1, 2]}', "c.jsonl:2: utterance 'c:2' has no 'speaker'"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"speaker": "s", "tokens": [1, 2, 3]}\n' + line + "\n")
    with pytest.raises(CorpusError) as err:
        build(corpus, tmp_path / "store", vocab_size=10, faiss=False, progress=False)
    assert message in str(err.value)
    assert not (tmp_path / "store").exists()
    assert not list(tmp_path.glob(".store*"))  # no half-written store either


@pytest.mark.parametrize("tokens, message", [
    ([1, -4, 3], "negative token id -4"),
    ([12, 99, 1], "token id 99 is outside the speech range 10..19"),
    ([12, 5, 1], "token id 5 is below the speech range (speech_offset 10)"),
])
def test_a_build_and_an_enrollment_refuse_the_same_ids_alike(tmp_path, tokens, message):
    # one id rule: a build checks its corpus in batches, an enrollment each utterance as a batch of one
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"speaker": "s", "tokens": [11, 12]},
                                                {"speaker": "s", "tokens": tokens}])
    with pytest.raises(CorpusError, match="c.jsonl:2: " + message.replace("(", r"\(").replace(")", r"\)")):
        build(corpus, tmp_path / "store", speech_offset=10, vocab_size=10, stop_ids=[1], faiss=False, progress=False)
    build(write_jsonl(tmp_path / "ok.jsonl", [{"speaker": "s", "tokens": [11, 12, 13]}]), tmp_path / "store",
          speech_offset=10, vocab_size=10, stop_ids=[1], faiss=False, progress=False)
    with pytest.raises(CorpusError, match=message.replace("(", r"\(").replace(")", r"\)")):
        enroll(tmp_path / "store", "ann", [{"id": "x", "tokens": tokens}])


def test_missing_empty_and_unreadable_corpora(tmp_path):
    with pytest.raises(CorpusError, match="corpus file not found"):
        build(tmp_path / "nope.jsonl", tmp_path / "s", progress=False)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(CorpusError, match="corpus is empty"):
        build(tmp_path / "empty.jsonl", tmp_path / "s", progress=False)
    write_jsonl(tmp_path / "stops.jsonl", [{"speaker": "s", "tokens": [9, 9]}])
    with pytest.raises(CorpusError, match="corpus is empty"):
        build(tmp_path / "stops.jsonl", tmp_path / "s", stop_ids=[9], vocab_size=9, progress=False)
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"speaker": "s", "path": "missing.npy"}])
    with pytest.raises(CorpusError, match=r"m.jsonl:1: cannot read .*missing.npy"):
        list(read_corpus(manifest, Vocabulary()))
    np.savez(tmp_path / "bad.npz", tokens=np.arange(5), lengths=np.array([2, 2]))
    with pytest.raises(CorpusError, match="'lengths' sum to 4 but 'tokens' holds 5"):
        list(read_corpus(tmp_path / "bad.npz", Vocabulary()))
    np.savez(tmp_path / "nolen.npz", tokens=np.arange(5))
    with pytest.raises(CorpusError, match="needs arrays 'tokens' and 'lengths'"):
        list(read_corpus(tmp_path / "nolen.npz", Vocabulary()))
    assert not (tmp_path / "s").exists()


def test_no_speaker_is_fine_without_per_speaker_stores(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"tokens": [1, 2, 3]}, {"tokens": [2, 3, 4]}])
    ds = build(corpus, tmp_path / "store", per_speaker=False, faiss=False, progress=False)
    assert ds.speakers == () and open_datastore(tmp_path / "store").info()["tokens"] == 6


def test_damaged_archives_and_arrays_are_one_line_corpus_errors(tmp_path):
    (tmp_path / "fake.npz").write_bytes(b"PK\x03\x04" + b"not a zip archive" * 10)
    with pytest.raises(CorpusError, match=r"fake.npz: cannot read .npz: File is not a zip file$"):
        list(read_corpus(tmp_path / "fake.npz", Vocabulary()))
    np.save(tmp_path / "plain.npy", np.arange(4))
    (tmp_path / "plain.npy").rename(tmp_path / "plain.npz")
    with pytest.raises(CorpusError, match="a .npy file, not a .npz archive"):
        list(read_corpus(tmp_path / "plain.npz", Vocabulary()))
    np.savez(tmp_path / "good.npz", tokens=np.arange(6), lengths=np.array([3, 3]))
    data = bytearray((tmp_path / "good.npz").read_bytes())
    data[len(data) // 2:len(data) // 2 + 16] = b"\xff" * 16  # inside a member: zipfile's CRC or numpy's header
    (tmp_path / "broken.npz").write_bytes(bytes(data))
    with pytest.raises(CorpusError, match=r"broken.npz: cannot read .npz: [^\n]+$"):
        list(read_corpus(tmp_path / "broken.npz", Vocabulary()))
    np.save(tmp_path / "u.npy", np.arange(5))
    header = bytearray((tmp_path / "u.npy").read_bytes())
    header[8] ^= 0x5A  # the header length: numpy fails in its tokenizer, over several lines
    (tmp_path / "u.npy").write_bytes(bytes(header))
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"speaker": "s", "path": "u.npy"}])
    with pytest.raises(CorpusError, match=r"m.jsonl:1: cannot read .*u.npy: [^\n]+$"):
        list(read_corpus(manifest, Vocabulary()))


def test_duplicate_ids_are_refused_naming_both_lines(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "speaker": "s", "tokens": [1, 2]},
                                                {"id": "b", "speaker": "s", "tokens": [2, 3]},
                                                {"id": "a", "speaker": "s", "tokens": [3, 4]}])
    with pytest.raises(CorpusError, match=rf"c.jsonl:3: utterance id 'a' is already used at {corpus}:1"):
        build(corpus, tmp_path / "s", faiss=False, progress=False)
    first = write_jsonl(tmp_path / "b.jsonl", [{"id": "a", "speaker": "s", "tokens": [1]},
                                               {"id": "b", "speaker": "s", "tokens": [2]}])
    other = write_jsonl(tmp_path / "d.jsonl", [{"id": "b", "speaker": "t", "tokens": [5]}])
    with pytest.raises(CorpusError, match=r"d.jsonl:1: utterance id 'b' is already used at .*b.jsonl:2"):
        build([first, other], tmp_path / "s", faiss=False, progress=False)
    assert not (tmp_path / "s").exists()
    # lines without an id get "<file stem>:<line>": two files of the same name do not collide
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    rows = [{"speaker": "s", "tokens": [1, 2, 3]}]
    ds = build([write_jsonl(tmp_path / "x" / "c.jsonl", rows), write_jsonl(tmp_path / "y" / "c.jsonl", rows)],
               tmp_path / "s", faiss=False, progress=False)
    assert ds.info()["utterances"] == 2


def test_utterances_without_speech_tokens_are_skipped_with_one_warning(tmp_path, caplog):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "speaker": "s", "tokens": [1, 2]},
                                                {"id": "b", "speaker": "s", "tokens": []},
                                                {"id": "c", "speaker": "s", "tokens": [9, 9]},
                                                {"id": "d", "speaker": "s", "tokens": [3, 9, 4]}])
    with caplog.at_level("WARNING", logger="echospec.datastore.corpus"):
        ds = build(corpus, tmp_path / "s", stop_ids=[9], vocab_size=9, faiss=False, progress=False)
    assert [r.getMessage() for r in caplog.records] == [
        f"{corpus}:2: utterance has no speech tokens; skipped (and 1 more utterances like it)"]
    assert ds.info()["utterances"] == 2 and ds.info()["speakers"]["s"]["utterances"] == 2


def test_a_training_dump_keeps_only_the_speech_range_when_asked(tmp_path, caplog):
    # Spark-TTS-like: text ids below the speech range, global tokens above it, a marker and a stop id
    offset, size, stop, marker = 1000, 50, 999, 998
    rows = [{"id": "a", "speaker": "s", "tokens": [5, 6, marker, 1001, 1002, 2000, 1003, stop, 7]},
            {"id": "b", "speaker": "s", "tokens": [1004, 1005, 1006]},
            {"id": "c", "speaker": "s", "tokens": [8, 9, 2001]}]
    corpus = write_jsonl(tmp_path / "dump.jsonl", rows)
    options = dict(speech_offset=offset, vocab_size=size, stop_ids=[stop], drop_ids=[marker], faiss=False,
                   progress=False)
    with pytest.raises(CorpusError, match=r"dump.jsonl:1: token id 5 is below the speech range .*--drop-non-speech"):
        build(corpus, tmp_path / "refused", **options)
    with caplog.at_level("WARNING", logger="echospec.datastore.corpus"):
        ds = build(corpus, tmp_path / "s", drop_non_speech=True, **options)
    assert [r.getMessage() for r in caplog.records if "speech range" in r.getMessage()] == [
        f"{corpus}:1: 7 token ids outside the speech range 1000..1049 dropped from 2 utterances (this is the "
        "first; drop_non_speech)"]
    assert ds.info()["build"]["dropped_non_speech"] == {"tokens": 7, "utterances": 2}
    stream = np.asarray(ds.shards[0].tokens)
    sentinel = ds.shards[0].sentinel
    # the stop id still splits "a"; "c" kept no speech and is skipped as any such utterance is
    assert stream.tolist() == [sentinel, 1, 2, 3, sentinel, 4, 5, 6, sentinel]
    assert ds.info()["utterances"] == 2
    with pytest.raises(Exception, match="drop_non_speech needs vocab_size"):
        build(corpus, tmp_path / "t", drop_non_speech=True, faiss=False, progress=False)


def test_enrolling_into_a_drop_non_speech_store_drops_the_same_ids(tmp_path, caplog):
    offset, size, stop, marker = 1000, 50, 999, 998
    options = dict(speech_offset=offset, vocab_size=size, stop_ids=[stop], drop_ids=[marker], faiss=False,
                   progress=False)
    build(write_jsonl(tmp_path / "dump.jsonl", [{"id": "a", "speaker": "s", "tokens": [5, 1001, 1002, 2000]}]),
          tmp_path / "s", drop_non_speech=True, **options)
    build(write_jsonl(tmp_path / "clean.jsonl", [{"id": "a", "speaker": "s", "tokens": [1001, 1002]}]),
          tmp_path / "strict", **options)
    new = [{"id": "n1", "tokens": [7, 1010, marker, 1011, stop, 1012, 3000]}, {"id": "n2", "tokens": [1013, 1014]}]
    caplog.clear()
    with caplog.at_level("WARNING", logger="echospec.datastore.corpus"):
        done = enroll(tmp_path / "s", "new", new)
    assert done.dropped_non_speech == 2 and done.added == 2
    assert [r.getMessage() for r in caplog.records if "speech range" in r.getMessage()] == [
        "utterances[0]: 2 token ids outside the speech range 1000..1049 dropped from 1 utterances (this is the "
        "first; drop_non_speech)"]
    assert [seg.tolist() for seg in done.datastore.speaker_store("new").segments()] == [[10, 11], [12], [13, 14]]
    # a corpus file goes through the batch reader: the same ids dropped, counted the same way
    files = enroll(tmp_path / "s", "from-file", write_jsonl(tmp_path / "more.jsonl", new))
    assert files.dropped_non_speech == 2
    assert [seg.tolist() for seg in files.datastore.speaker_store("from-file").segments()] == [[10, 11], [12], [13, 14]]
    with pytest.raises(CorpusError, match=r"utterances\[0\]: token id 7 is below the speech range .*--drop-non-speech"):
        enroll(tmp_path / "strict", "new", new)  # a store built without the option still refuses them
    with pytest.raises(CorpusError, match="negative token id"):
        enroll(tmp_path / "s", "neg", [{"tokens": [1001, -3]}])  # negative ids stay refused


def test_cli_drop_non_speech_reports_what_it_dropped(tmp_path):
    from click.testing import CliRunner
    from echospec.tools.cli import main

    corpus = write_jsonl(tmp_path / "dump.jsonl", [{"speaker": "s", "tokens": [1, 100, 101, 300]}])
    result = CliRunner().invoke(main, ["build", str(corpus), str(tmp_path / "s"), "--speech-offset", "100",
                                       "--vocab-size", "50", "--drop-non-speech", "--no-faiss", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "dropped 2 ids outside the speech range from 1 utterances" in result.output


def test_every_format_gives_the_same_store(tmp_path):
    """JSONL, .npz and Parquet are read by different array code: the stores they give are byte-identical."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    utts = [rng.integers(0, 40, rng.integers(0, 30)).tolist() for _ in range(300)]
    utts[5] = [40, 41]  # only stop ids
    ids, speakers = [f"u{i}" for i in range(len(utts))], [f"s{i % 7}" for i in range(len(utts))]
    write_jsonl(tmp_path / "c.jsonl", [{"id": i, "speaker": s, "tokens": t} for i, s, t in zip(ids, speakers, utts)])
    np.savez(tmp_path / "c.npz", tokens=np.array([t for u in utts for t in u], np.int32),
             lengths=np.array([len(u) for u in utts]), ids=np.array(ids), speakers=np.array(speakers))
    pq.write_table(pa.table({"id": ids, "speaker": speakers, "tokens": utts}), tmp_path / "c.parquet",
                   row_group_size=64)
    stores = {}
    for name in ("c.jsonl", "c.npz", "c.parquet"):
        ds = build(tmp_path / name, tmp_path / name.replace(".", "-"), vocab_size=40, stop_ids=[40, 41], shards=3,
                   workers=1, faiss=False, progress=False)
        stores[name] = {p.relative_to(ds.root).as_posix().split("-")[0] + p.name: p.read_bytes()
                        for p in sorted(ds.root.rglob("*.npy"))}
        assert ds.info()["utterances"] == sum(any(t < 40 for t in u) for u in utts)
    assert stores["c.jsonl"] == stores["c.npz"] == stores["c.parquet"]

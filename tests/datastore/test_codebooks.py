"""Interleaved codebooks (Orpheus' 7-token SNAC frames) and marker ids in corpora: the stores record the
layout, and no source — prompt lookup, speaker, general, FAISS — proposes an id impossible at its position."""

import json

import numpy as np
import pytest

from echospec.datastore import CorpusError, DatastoreError, build, enroll, open_datastore
from echospec.retriever import SOURCES, Retriever

CODEBOOKS, CODES = 7, 64  # 7 positions a frame, a small codebook: local id = CODES * position + code
ORPHEUS_OFFSET, ORPHEUS_STOP, MARKERS = 128266, 128258, (128257, 128261, 128262)


def frames(rng, n_frames, phrases):
    """Frames drawn from a few repeated phrases (speech repeats), a code changed here and there."""
    out = []
    while len(out) < n_frames:
        phrase = phrases[rng.integers(len(phrases))]
        out.extend(f.copy() for f in phrase)
    out = np.array(out[:n_frames])
    noise = rng.random(out.shape) < 0.1
    out[noise] = rng.integers(0, CODES, noise.sum())
    return out


def orpheus_corpus(path, n_utts=60, seed=0, markers=True):
    """Utterances as an Orpheus training sequence dumps them: 128261 128257 <frames> 128258 128262."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, CODES, (int(rng.integers(3, 8)), CODEBOOKS)) for _ in range(12)]
    lines = []
    for i in range(n_utts):
        codes = frames(rng, int(rng.integers(8, 30)), phrases)
        ids = (ORPHEUS_OFFSET + CODES * np.arange(CODEBOOKS) + codes).ravel().tolist()
        tokens = [128261, 128257, *ids, ORPHEUS_STOP, 128262] if markers else ids
        lines.append(json.dumps({"id": f"u{i}", "speaker": f"s{i % 3}", "tokens": tokens}) + "\n")
    path.write_text("".join(lines))
    return path


def build_orpheus(tmp_path, codebooks=CODEBOOKS, name="store", **kwargs):
    corpus = orpheus_corpus(tmp_path / "orpheus.jsonl")
    return build(corpus, tmp_path / name, speech_offset=ORPHEUS_OFFSET, vocab_size=CODEBOOKS * CODES,
                 stop_ids=[ORPHEUS_STOP], drop_ids=MARKERS, codebooks=codebooks, progress=False,
                 faiss_options={"flat_max": 1 << 20}, **kwargs)


def violations(tree, context, codebooks=CODEBOOKS):
    """Nodes whose id is not in the codebook due at their depth after `context`, by source."""
    due = lambda depth: (context[-1] // CODES + depth) % codebooks  # noqa: E731
    bad = [SOURCES[s] for t, d, s in zip(tree.tokens, tree.depths, tree.sources) if t // CODES != due(int(d))]
    return bad


def contexts(rng, n=300):
    """Contexts from held-out utterances (same phrases, another seed), cut at every frame position."""
    phrases = [rng.integers(0, CODES, (int(rng.integers(3, 8)), CODEBOOKS)) for _ in range(12)]
    out = []
    for _ in range(n):
        codes = frames(rng, 6, phrases)
        ids = (CODES * np.arange(CODEBOOKS) + codes).ravel()
        out.append(ids[: int(rng.integers(1, len(ids) + 1))])
    return out


def test_the_catalog_records_the_layout_and_markers_are_dropped(tmp_path):
    ds = build_orpheus(tmp_path)
    vocab = ds.info()["vocabulary"]
    assert (vocab["codebooks"], vocab["drop_ids"], vocab["stop_ids"]) == (CODEBOOKS, list(MARKERS), [ORPHEUS_STOP])
    assert ds.codebooks == CODEBOOKS and ds.meta["layout_breaks"] == 0
    stream = np.asarray(ds.shards[0].tokens)
    speech = stream[stream < CODEBOOKS * CODES]
    assert speech.size == ds.info()["tokens"] and set(np.unique(speech // CODES)) == set(range(CODEBOOKS))
    with pytest.raises(CorpusError, match="below the speech range.*--drop-id"):  # without --drop-id: refused
        build(tmp_path / "orpheus.jsonl", tmp_path / "refused", speech_offset=ORPHEUS_OFFSET,
              vocab_size=CODEBOOKS * CODES, stop_ids=[ORPHEUS_STOP], progress=False)
    with pytest.raises(DatastoreError, match="codebooks must"):
        build(tmp_path / "orpheus.jsonl", tmp_path / "bad", vocab_size=100, codebooks=7, progress=False)


def test_a_lost_token_splits_the_stream_and_enrollment_keeps_the_rules(tmp_path):
    build_orpheus(tmp_path, faiss=False)
    broken = [128261, 128257] + [ORPHEUS_OFFSET + CODES * p + 3 for p in range(CODEBOOKS)] * 2
    del broken[2 + 9]  # a frame loses its third token: the stream breaks there
    (tmp_path / "more.jsonl").write_text(json.dumps({"id": "m", "tokens": broken}) + "\n")
    enroll(tmp_path / "store", "new", tmp_path / "more.jsonl")  # markers dropped as at build time
    store = open_datastore(tmp_path / "store").speaker_store("new")
    assert len(store.segments()) == 2
    ds = build(tmp_path / "more.jsonl", tmp_path / "broken", speech_offset=ORPHEUS_OFFSET,
               vocab_size=CODEBOOKS * CODES, drop_ids=MARKERS, codebooks=CODEBOOKS, per_speaker=False,
               faiss=False, progress=False)
    assert ds.meta["layout_breaks"] == 1


def test_no_source_proposes_an_id_impossible_at_its_position(tmp_path):
    ds = build_orpheus(tmp_path)
    # faiss_below > n_max: FAISS answers every context, beside the exact stores and the prompt lookup
    retriever = Retriever(ds, faiss_below=99, max_nodes=64, min_support=4)
    rng = np.random.default_rng(1)
    seen, bad = set(), []
    for context in contexts(rng):
        for speaker in (None, "s1"):
            tree = retriever.propose(context, speaker=speaker)
            seen |= {SOURCES[s] for s in tree.sources}
            bad += violations(tree, context)
    assert seen == set(SOURCES) and not bad

    # the same corpus without the layout: FAISS proposes ids at impossible positions (what the filter removes)
    flat = Retriever(build_orpheus(tmp_path, codebooks=1, name="flat"), faiss_below=99, max_nodes=64,
                     min_support=4)
    flat_bad = [source for context in contexts(np.random.default_rng(1)) for source in
                violations(flat.propose(context), context)]
    assert flat_bad and set(flat_bad) == {"faiss"}


def test_the_build_command_takes_codebooks_and_drop_ids(tmp_path):
    from click.testing import CliRunner

    from echospec.tools.cli import main

    corpus = orpheus_corpus(tmp_path / "orpheus.jsonl")
    command = ["build", str(corpus), str(tmp_path / "cli"), "--speech-offset", str(ORPHEUS_OFFSET), "--vocab-size",
               str(CODEBOOKS * CODES), "--stop-id", str(ORPHEUS_STOP), "--codebooks", str(CODEBOOKS), "--no-faiss",
               "--quiet"] + [arg for marker in MARKERS for arg in ("--drop-id", str(marker))]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.output
    vocab = open_datastore(tmp_path / "cli").info()["vocabulary"]
    assert vocab["codebooks"] == CODEBOOKS and vocab["drop_ids"] == list(MARKERS)
    shown = CliRunner().invoke(main, ["info", str(tmp_path / "cli")]).output
    assert "in 7 interleaved codebooks" in shown and "dropped ids [128257, 128261, 128262]" in shown
    refused = CliRunner().invoke(main, command[:3] + ["--vocab-size", "100", "--codebooks", "7", "--quiet"])
    assert refused.exit_code == 1 and "codebooks must" in refused.output and "Traceback" not in refused.output


def test_a_sharded_store_keeps_the_layout(tmp_path):
    one = build_orpheus(tmp_path, name="one")
    four = build_orpheus(tmp_path, name="four", shards=4, workers=1)
    assert four.codebooks == CODEBOOKS and four.meta["layout_breaks"] == one.meta["layout_breaks"]
    exact = dict(max_nodes=64, min_support=4, cap=10**6, use_faiss=False)
    r1, r4 = Retriever(one, **exact), Retriever(four, **exact)
    with_faiss = Retriever(four, faiss_below=99, max_nodes=64, min_support=4)  # FAISS neighbours over 4 shards
    bad, seen = [], set()
    for context in contexts(np.random.default_rng(2), n=100):
        for speaker in (None, "s1"):
            assert r4.propose(context, speaker=speaker).to_dict() == r1.propose(context, speaker=speaker).to_dict()
            tree = with_faiss.propose(context, speaker=speaker)
            seen |= {SOURCES[s] for s in tree.sources}
            bad += violations(tree, context)
    assert "faiss" in seen and not bad

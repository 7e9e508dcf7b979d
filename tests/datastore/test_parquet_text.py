"""Parquet text columns in every Arrow encoding a writer may choose: dictionary-encoded (pandas categoricals, and
what many writers make of a repeated string column), large_string and string_view. Issue 48: a dictionary-encoded
'speaker' column was refused ("'speaker' must be a string") though its values are strings."""

import sqlite3

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from echospec.datastore import build, open_datastore

ROWS = 90


def plain_columns():
    """id, speaker and an extra text column (some null) as plain strings, and the tokens."""
    rng = np.random.default_rng(5)
    return {"id": [f"u{i}" for i in range(ROWS)],
            "speaker": [f"s{i % 4}" for i in range(ROWS)],
            "text": [None if i % 7 == 0 else f"line {i % 5}" for i in range(ROWS)],
            "tokens": [rng.integers(0, 50, rng.integers(1, 40)).tolist() for _ in range(ROWS)]}


def encoded(columns, encoding):
    """The corpus table with every text column in `encoding`."""
    text = [name for name in columns if name != "tokens"]
    if encoding == "pandas categorical":
        frame = pa.table(columns).to_pandas()
        for name in text:
            frame[name] = frame[name].astype("category")
        return pa.Table.from_pandas(frame, preserve_index=False)
    arrays = {name: pa.array(values) for name, values in columns.items()}
    for name in text:
        arrays[name] = (arrays[name].dictionary_encode() if encoding == "dictionary"
                        else arrays[name].cast(getattr(pa, encoding)()))
    return pa.table(arrays)


def catalog_rows(root):
    """The catalog's utterance rows, the source without its directory (each corpus has a folder of its own)."""
    db = sqlite3.connect(root / "catalog.sqlite")
    try:
        rows = db.execute("select id, speaker, tokens, source, extra from utterances order by id").fetchall()
    finally:
        db.close()
    return [(uid, speaker, tokens, source.rsplit("/", 1)[1], extra) for uid, speaker, tokens, source, extra in rows]


def store_files(ds):
    """The store's arrays by place (a per-speaker store's folder by its speaker; the rest of its name varies)."""
    return {p.relative_to(ds.root).as_posix().split("-")[0] + p.name: p.read_bytes() for p in ds.root.rglob("*.npy")}


def speakers(ds):
    return {name: (row["utterances"], row["tokens"]) for name, row in ds.info()["speakers"].items()}


def built(tmp_path, name, table, shards):
    (tmp_path / name).mkdir()
    pq.write_table(table, tmp_path / name / "corpus.parquet", row_group_size=32)  # row groups read apart
    return build(tmp_path / name / "corpus.parquet", tmp_path / name / "store", shards=shards, workers=1,
                 faiss=False, progress=False)


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("encoding", ["pandas categorical", "dictionary", "large_string", "string_view"])
def test_text_columns_in_any_encoding_build_the_store_of_plain_strings(tmp_path, encoding, shards):
    columns = plain_columns()
    table = encoded(columns, encoding)
    plain = built(tmp_path, "plain", pa.table(columns), shards)
    other = built(tmp_path, "other", table, shards)
    schema = pq.read_schema(tmp_path / "other" / "corpus.parquet")
    assert all(schema.field(name).type != pa.string() for name in ("id", "speaker", "text"))  # what the reader sees
    assert store_files(other) == store_files(plain)
    assert speakers(other) == speakers(plain)
    assert catalog_rows(other.root) == catalog_rows(plain.root)
    assert ("u3", "s3") in {row[:2] for row in catalog_rows(other.root)}
    open_datastore(other.root, verify=True)


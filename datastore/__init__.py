"""echospec.datastore: offline stores of which speech-token continuations followed which contexts.

    from echospec.datastore import build, enroll, open_datastore
    ds = build("corpus.jsonl", "store_dir")          # general + per-speaker exact stores, FAISS store
    ds = build("corpus/*.parquet", "big", shards=32, ray="auto")  # general store in 32 shards, built on Ray
    enroll("store_dir", "ann", "ann_more.jsonl")      # add a speaker's utterances; general store untouched
    enroll("store_dir", "ann", [{"id": "a7", "tokens": [12, 7]}])  # ... or give them; a resent id is a no-op
    ds = open_datastore("store_dir"); ds.info()

Knows files and the catalog, nothing of models; imports no torch.
"""

from .catalog import FORMAT_VERSION
from .corpus import Utterance, Vocabulary, read_corpus
from .building import build
from .enrollment import Enrollment, enroll
from .errors import CorpusError, DamagedStoreError, DatastoreError, EnrollmentConflict
from .exact import ExactStore
from .store import N_MAX, N_MIN, Datastore, open_datastore

__all__ = ["FORMAT_VERSION", "N_MAX", "N_MIN", "CorpusError", "DamagedStoreError", "Datastore", "DatastoreError",
           "Enrollment", "EnrollmentConflict", "ExactStore", "Utterance", "Vocabulary", "build", "enroll",
           "open_datastore", "read_corpus"]

"""The one seam into the compiled proposer for scripts that replay a proposal part by part
(tools/benchmarks: continuation_choice, search_pages, bench_pages).

A replay calls the kernels a proposal runs (match, the binary searches, the gather, the tree) one at a time, to
count what each touches or to try another choice in its place, and checks it still equals `Retriever.propose`.
Only the names below may be used from outside the retriever (tests/test_layout.py holds the benchmarks to this
module): a change to one of them changes its replays with it; every other kernel stays private to kernels.py.
"""

from __future__ import annotations

import numpy as np

from .kernels import (FAISS, FIRST_ROW, GENERAL, N_SOURCES, SETTING_CAP, SETTING_MIN_SUPPORT, SETTING_N_MAX,
                      SETTING_N_MIN, SETTING_VOCAB_SIZE, SHARD_INDEX_ROWS, copy_continuation, finish, index_range,
                      match, proportional_shares, record, shard_first, shard_sa, shard_tokens, sort_rows)
from .retriever import Retriever

__all__ = ["FAISS", "FIRST_ROW", "GENERAL", "N_SOURCES", "SETTING_CAP", "SETTING_MIN_SUPPORT", "SETTING_N_MAX",
           "SETTING_N_MIN", "SETTING_VOCAB_SIZE", "copy_continuation", "finish", "general_store", "index_range",
           "match", "proportional_shares", "record", "settings", "shard_first", "shard_sa", "shard_tokens",
           "sort_rows", "without_index"]


def general_store(retriever: Retriever) -> tuple:
    """The general store as the kernels take it (retriever.kernel_store's view: shard_tokens, shard_sa, ... read
    it)."""
    return retriever._general


def settings(retriever: Retriever) -> np.ndarray:
    """The retriever's gather settings, indexed by the SETTING_* columns."""
    return retriever._settings


def without_index(retriever: Retriever) -> None:
    """Make the retriever's kernels search its general store without the sampled index (as before it existed)."""
    retriever._general[0][:, SHARD_INDEX_ROWS] = 0

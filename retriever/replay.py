"""The one seam into the compiled proposer for scripts that replay a proposal step by step
(tools/benchmarks: continuation_choice, search_pages, bench_pages).

A replay takes the steps a proposal runs on the general store one at a time, to count what each touches or to
try another choice in its place, and checks it still equals `Retriever.propose`. The steps are named here as
whole meanings: match a context (`GeneralStore.match`, a `Match`), narrow a suffix-array range by the sampled
index (`narrowed`), share the rows among shards (`shares`), gather continuations (`continuations`), build the tree
(`tree`), and a retriever without its index (`without_index`). The kernels, their column layouts and the
retriever's state stay private (tests/test_layout.py holds the benchmarks to this module).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import kernels
from .retriever import Retriever
from .tree import CandidateTree

__all__ = ["GeneralStore", "Match", "without_index"]


@dataclass(frozen=True)
class Match:
    """Where a context's suffixes occur in the general store: `los[s, t]`, `his[s, t]` bound shard s's suffix-array
    entries whose t tokens before them are the context's last t; `counts[t]` their sum over shards; `length` the
    longest suffix a proposal takes (below n_min: none)."""

    los: np.ndarray
    his: np.ndarray
    counts: np.ndarray
    length: int

    @property
    def occurrences(self) -> int:
        return int(self.counts[self.length])


class GeneralStore:
    """A retriever's general store and gather settings, as its proposals read them."""

    def __init__(self, retriever: Retriever):
        self._store, settings = retriever._general, retriever._settings
        self.n_min, self.n_max = int(settings[kernels.SETTING_N_MIN]), int(settings[kernels.SETTING_N_MAX])
        self.min_support, self.cap = int(settings[kernels.SETTING_MIN_SUPPORT]), int(settings[kernels.SETTING_CAP])
        self.vocab_size = int(settings[kernels.SETTING_VOCAB_SIZE])
        self.max_depth, self.max_nodes, self.weights = retriever.max_depth, retriever.max_nodes, retriever.weights

    @property
    def shards(self) -> int:
        return self._store[0].shape[0]

    def stream(self, shard: int) -> np.ndarray:
        return kernels.shard_tokens(self._store, shard)

    def suffix_array(self, shard: int) -> np.ndarray:
        return kernels.shard_sa(self._store, shard)

    def has_first_table(self, shard: int) -> bool:
        """Whether the shard's first-token table answers the first depth (else a binary search does)."""
        return len(kernels.shard_first(self._store, shard)) > 0

    def match(self, context: np.ndarray) -> Match:
        """Step 1: every shard's suffix-array ranges of the context's suffixes, and the length a proposal takes."""
        los, his, counts, length = kernels.match(self._store, context, self.n_min, self.n_max, self.min_support)
        return Match(los, his, counts, int(length))

    def narrowed(self, shard: int, lo: int, hi: int, depth: int, token: int, upper: bool) -> tuple[int, int]:
        """Within [lo, hi), the range the sampled index leaves a binary search for the bound (lower, or `upper`)
        of the entries whose token `depth` places left is `token`."""
        return kernels.index_range(self._store, shard, lo, hi, depth, token, upper)

    def shares(self, match: Match) -> np.ndarray:
        """Step 2: how many of the rows taken (up to `cap`) each shard gives."""
        rows = min(match.occurrences, self.cap) if match.length >= self.n_min else 0
        return kernels.proportional_shares(match.los[:, match.length], match.his[:, match.length], rows)

    def continuations(self, entries, shard: int = 0) -> np.ndarray:
        """Step 3: the continuations (`max_depth` ids, -1 after a stop) after the suffix-array `entries` of a shard,
        one row each, in the order the tree is built from."""
        stream, sa = self.stream(shard), self.suffix_array(shard)
        rows = np.full((len(entries), self.max_depth), -1, np.int64)
        for row, entry in enumerate(entries):
            kernels.copy_continuation(stream, sa[entry] + 1, self.vocab_size, rows, row)
        kernels.sort_rows(rows, 0, len(rows))
        return rows

    def tree(self, rows: np.ndarray, match: Match) -> CandidateTree:
        """Step 4: the tree of general-store `rows` gathered for `match` (no other source), as a proposal builds it."""
        stats = np.zeros((kernels.N_SOURCES, 4), np.int64)
        kernels.record(stats, kernels.GENERAL, 0, len(rows), match.length, match.occurrences)
        stats[kernels.FAISS, kernels.FIRST_ROW] = len(rows)  # where FAISS rows would start: none follow
        return CandidateTree.trusted(kernels.finish(rows, stats, self.weights, self.max_nodes))


def without_index(retriever: Retriever) -> None:
    """Make the retriever's proposals search its general store without the sampled index (as before it existed)."""
    retriever._general[0][:, kernels.SHARD_INDEX_ROWS] = 0

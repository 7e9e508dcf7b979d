"""REST's retrieval algorithm written plainly: the reference peer of the retriever benchmark.

REST (He et al., 2023, "REST: Retrieval-Based Speculative Decoding") keeps the corpus as one token array with a
suffix array over it. For a context it looks for the longest suffix of the context, from 16 tokens down to 2,
that occurs in the corpus; it takes the continuations of (at most 5000 of) its occurrences, merges their first
10 tokens into a trie counting how many continuations pass through each node, and keeps the 64 most frequent
nodes as the draft tree. This module does exactly that and nothing cleverer, so that it is easy to check:

- Utterances are joined with a separator that no query contains, so a match never spans two utterances and a
  continuation stops at its utterance's end.
- The suffix array is sorted by the first 16 tokens of each suffix (ties by position), which is all a query of
  at most 16 tokens can tell apart; prefix doubling with NumPy builds it for 10M tokens in seconds.
- The binary search runs in numba so the peer is not slowed by the interpreter; the trie is built with NumPy.

Proposals come back as `CandidateTree`s (source "general"), so the benchmark walks them like echospec's.
"""

from __future__ import annotations

from typing import Sequence

import numba
import numpy as np

from ....retriever.tree import SOURCES, CandidateTree

SEPARATOR = -1  # between utterances; smaller than every token, never in a query
_GENERAL = SOURCES.index("general")


class RestReference:
    """REST's datastore and search over a list of utterances (arrays of non-negative token ids)."""

    def __init__(
        self,
        utterances: Sequence[np.ndarray],
        max_span: int = 16,
        min_span: int = 2,
        max_matches: int = 5000,
        continuation: int = 10,
        max_nodes: int = 64,
    ) -> None:
        if not 1 <= min_span <= max_span:
            raise ValueError(f"need 1 <= min_span <= max_span, got {min_span}, {max_span}")
        self.max_span, self.min_span = max_span, min_span
        self.max_matches, self.continuation, self.max_nodes = max_matches, continuation, max_nodes
        self.text = _join(utterances, pad=continuation)
        self.suffixes = suffix_array(self.text[: len(self.text) - continuation], max_span)

    @property
    def nbytes(self) -> int:
        """Bytes the datastore holds (token array + suffix array), as REST would store them."""
        return self.text.nbytes + self.suffixes.nbytes

    def longest_match(self, context: np.ndarray) -> tuple[int, int, int]:
        """(n, lo, hi): the longest context suffix of min_span..max_span tokens that occurs, and its SA range.

        n is 0 (and lo == hi) when no suffix of min_span tokens occurs.
        """
        return _longest_match(self.text, self.suffixes, np.asarray(context, np.int32), self.max_span, self.min_span)

    def continuations(self, context: np.ndarray) -> np.ndarray:
        """int32[m, continuation]: what followed the longest match, padded with SEPARATOR at utterance ends."""
        n, lo, hi = self.longest_match(context)
        starts = self.suffixes[lo : min(hi, lo + self.max_matches)].astype(np.int64) + n
        rows = self.text[starts[:, None] + np.arange(self.continuation)]
        ended = np.cumsum(rows == SEPARATOR, axis=1) > 0
        rows[ended] = SEPARATOR
        return rows

    def propose(self, context: np.ndarray) -> CandidateTree:
        """The draft tree: the max_nodes most frequent trie nodes over the longest match's continuations."""
        return trie_of(self.continuations(context), self.max_nodes)


def _join(utterances: Sequence[np.ndarray], pad: int) -> np.ndarray:
    """One int32 array: every utterance followed by a separator, plus `pad` separators at the end."""
    parts = []
    for utterance in utterances:
        utterance = np.asarray(utterance)
        if len(utterance) and utterance.min() < 0:
            raise ValueError("token ids must be non-negative")
        parts += [utterance.astype(np.int32), np.array([SEPARATOR], np.int32)]
    parts.append(np.full(pad, SEPARATOR, np.int32))
    return np.concatenate(parts)


def suffix_array(text: np.ndarray, depth: int) -> np.ndarray:
    """int32 positions of `text` sorted by their first `depth` tokens (ties by position), by prefix doubling."""
    n = len(text)
    rank = np.unique(text, return_inverse=True)[1].astype(np.int64) + 1  # 0 is "past the end"
    span = 1
    while span < depth:
        following = np.zeros(n, np.int64)
        following[: max(n - span, 0)] = rank[span:]
        rank = np.unique(rank * (n + 2) + following, return_inverse=True)[1].astype(np.int64) + 1
        span *= 2
    return np.argsort(rank, kind="stable").astype(np.int32)


@numba.njit(cache=True, nogil=True)
def _compare(text, start, query, n):
    """-1, 0, 1: the first n tokens of the suffix at `start` against query[-n:] (text ends with separators)."""
    offset = len(query) - n
    for j in range(n):
        a = text[start + j]
        b = query[offset + j]
        if a != b:
            return -1 if a < b else 1
    return 0


@numba.njit(cache=True, nogil=True)
def _bound(text, suffixes, query, n, upper):
    """First SA index whose suffix is >= (upper=False) or > (upper=True) the last n query tokens."""
    lo, hi = 0, len(suffixes)
    while lo < hi:
        mid = (lo + hi) // 2
        c = _compare(text, suffixes[mid], query, n)
        if c < 0 or (upper and c == 0):
            lo = mid + 1
        else:
            hi = mid
    return lo


@numba.njit(cache=True, nogil=True)
def _longest_match(text, suffixes, query, max_span, min_span):
    for n in range(min(max_span, len(query)), min_span - 1, -1):
        lo = _bound(text, suffixes, query, n, False)
        hi = _bound(text, suffixes, query, n, True)
        if hi > lo:
            return n, lo, hi
    return 0, 0, 0


def trie_of(rows: np.ndarray, max_nodes: int) -> CandidateTree:
    """Merge continuation rows (SEPARATOR-padded) into a trie; keep the max_nodes most frequent nodes.

    A node's count is the number of rows through it and never exceeds its parent's, so ranking by count
    (ties: shallower first, then smaller token path) keeps a connected tree.
    """
    m, width = rows.shape
    if m == 0 or max_nodes <= 0:
        return CandidateTree.empty()
    base = int(rows.max()) + 2
    parent_of_row = np.full(m, -1, np.int64)  # each row's node at the previous depth (-1 = root)
    nodes_token, nodes_parent, nodes_depth, nodes_count = [], [], [], []
    n_nodes = 0
    for depth in range(width):
        alive = rows[:, depth] != SEPARATOR  # rows that ended stay ended (continuations() pads them)
        if not alive.any():
            break
        key = (parent_of_row[alive] + 1) * base + rows[alive, depth]
        unique, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
        nodes_token.append(unique % base)
        nodes_parent.append(unique // base - 1)
        nodes_depth.append(np.full(len(unique), depth + 1))
        nodes_count.append(counts)
        parent_of_row[alive] = n_nodes + inverse
        n_nodes += len(unique)
    if n_nodes == 0:
        return CandidateTree.empty()
    token, parent = np.concatenate(nodes_token), np.concatenate(nodes_parent)
    depth, count = np.concatenate(nodes_depth), np.concatenate(nodes_count)
    # Ids are assigned depth by depth in (parent, token) order, so they break ties by path order.
    keep = np.lexsort((np.arange(len(token)), depth, -count))[:max_nodes]
    keep = keep[np.lexsort((keep, depth[keep]))]  # topological: by depth, then id
    new_id = np.full(len(token), -1, np.int64)
    new_id[keep] = np.arange(len(keep))
    parents = np.where(parent[keep] >= 0, new_id[np.maximum(parent[keep], 0)], -1)
    return CandidateTree(
        tokens=token[keep].astype(np.int64),
        parents=parents.astype(np.int32),
        depths=depth[keep].astype(np.int32),
        counts=count[keep].astype(np.float32),
        probs=(count[keep] / m).astype(np.float32),
        sources=np.full(len(keep), _GENERAL, np.uint8),
    )

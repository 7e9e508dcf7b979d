"""CandidateTree: the proposer's output and the verifier's input.

A tree of candidate continuations of a context. The root is the context's last token (not stored);
nodes are stored in topological order (every parent before its children), so a verifier can feed
`tokens` as one block with `mask` as the tree-attention mask and `depths` as position offsets.
Everything is a NumPy array; nothing here knows about torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

import numpy as np
from numba import njit

SOURCES = ("prompt", "speaker", "general", "faiss")
"""Where a node came from: `sources[i]` indexes this tuple."""

MAX_DEPTH = 8
"""How deep a proposed tree goes unless asked otherwise: the one default of the retriever, the decoder and the
CLI (retriever.py's tuning notes: 6 and 12 accepted no more)."""

MAX_NODES = 16
"""How many nodes a proposal keeps when its caller sets no budget (the retrieval paper verifies 16 candidates):
the service's answers and the vLLM drafter's trees, from which it sends one branch. A decoder sets its own budget
on every call: `echospec.decoder.NODES` (8) by default, what one of its steps verifies fastest on a CPU."""

DTYPES = {"tokens": np.int64, "parents": np.int32, "depths": np.int32, "counts": np.float32, "probs": np.float32,
          "sources": np.uint8}
"""Each field's dtype (the kernels' build_tree writes the same ones)."""
FIELDS = tuple(DTYPES)


@njit(cache=True, nogil=True)
def ancestor_mask(parents):
    """bool[N, N] of a topologically ordered tree: row i is its parent's row plus i itself. Compiled: the
    decoder builds it every step, and a Python loop over rows cost 16 us at 16 nodes and 90 us at 64."""
    n = parents.shape[0]
    mask = np.zeros((n, n), dtype=np.bool_)
    for i in range(n):
        if parents[i] >= 0:
            mask[i, :i] = mask[parents[i], :i]
        mask[i, i] = True
    return mask


@njit(cache=True, nogil=True)
def tree_is_valid(parents, depths, sources, n_sources):
    """What CandidateTree promises, in one pass: parents come first (-1 = the root), each depth is its
    parent's + 1, sources index SOURCES."""
    for i in range(parents.shape[0]):
        parent = parents[i]
        if parent < -1 or parent >= i or sources[i] >= n_sources:
            return False
        if depths[i] != (1 if parent < 0 else depths[parent] + 1):
            return False
    return True


@njit(cache=True, nogil=True)
def _gather(keep, tokens, parents, depths, counts, probs, sources):
    """The fields of nodes `keep` (distinct) in index order, parents re-indexed; a parent not kept
    becomes the root."""
    keep = np.sort(keep)
    index = np.full(tokens.shape[0], -1, np.int32)
    for new, old in enumerate(keep):
        index[old] = new
    kept_parents = np.empty(keep.shape[0], np.int32)
    for new, old in enumerate(keep):
        kept_parents[new] = -1 if parents[old] < 0 else index[parents[old]]
    return tokens[keep], kept_parents, depths[keep], counts[keep], probs[keep], sources[keep]


@njit(cache=True, nogil=True)
def _prune_order(probs, depths, parents):
    """Sorted by (-probability, depth, index), keeping a node only once its parent is kept."""
    by_depth = np.argsort(depths, kind="mergesort")
    order = by_depth[np.argsort(-probs[by_depth], kind="mergesort")]
    taken = np.zeros(parents.shape[0], np.bool_)
    kept = np.empty_like(order)
    n = 0
    for i in order:
        if parents[i] < 0 or taken[parents[i]]:
            taken[i] = True
            kept[n] = i
            n += 1
    return kept[:n]


def matched_path(tokens: np.ndarray, parents: np.ndarray, sequence) -> list[int]:
    """Node indices of the longest root path of the tree (`tokens`, `parents`) equal to a prefix of
    `sequence`: what an exact verifier would accept if `sequence` is what the target says next."""
    path, node = [], -1
    for token in sequence:
        hit = np.flatnonzero((parents == node) & (tokens == token))
        if not len(hit):
            break
        node = int(hit[0])
        path.append(node)
    return path


def matched_depth(tokens: np.ndarray, parents: np.ndarray, sequence) -> int:
    """Length of matched_path: how many tokens of `sequence` an exact verifier would accept."""
    return len(matched_path(tokens, parents, sequence))


@dataclass(frozen=True, eq=False)
class CandidateTree:
    tokens: np.ndarray  # int64[N]   store-local speech ids
    parents: np.ndarray  # int32[N]  index of the parent node, -1 = child of the root
    depths: np.ndarray  # int32[N]   1 for the root's children
    counts: np.ndarray  # float32[N] support: weighted number of stored continuations through the node
    probs: np.ndarray  # float32[N]  estimated probability that the path root..node is right
    sources: np.ndarray  # uint8[N]  index into SOURCES

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in FIELDS[1:]:
            if len(getattr(self, name)) != n:
                raise ValueError(f"CandidateTree.{name} has {len(getattr(self, name))} entries, tokens has {n}")
        if n and np.any(self.parents >= np.arange(n)):
            raise ValueError("CandidateTree nodes must come after their parents")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if len(self) else 0

    @cached_property
    def mask(self) -> np.ndarray:
        """bool[N, N]: mask[i, j] is True when node j is node i or one of its ancestors."""
        return ancestor_mask(self.parents)

    def matched_depth(self, sequence) -> int:
        """How many tokens of `sequence` the tree proposes in order (its longest matching root path)."""
        return matched_depth(self.tokens, self.parents, sequence)

    def subtree(self, keep) -> "CandidateTree":
        """The nodes `keep` (each with its parent kept), re-indexed in topological order. Compiled: the
        decoder cuts a tree every step, and the dict-and-loop version cost ~20 us at 64 nodes."""
        keep = np.asarray(keep, np.int64)  # distinct node indices
        return CandidateTree.trusted(_gather(keep, self.tokens, self.parents, self.depths, self.counts,
                                             self.probs, self.sources))

    def prune_order(self) -> np.ndarray:
        """Nodes by decreasing probability, every node after its parent: keeping any prefix keeps a tree (a
        budget of N nodes keeps the first N). A node more probable than its parent, which the retriever never
        proposes, is dropped."""
        return _prune_order(self.probs, self.depths, self.parents)

    def children(self, node: int) -> np.ndarray:
        """Indices of `node`'s children (node -1 is the root)."""
        return np.flatnonzero(self.parents == node)

    @classmethod
    def trusted(cls, arrays) -> "CandidateTree":
        """A tree from arrays in field order that are valid by construction (the retriever's kernels),
        skipping `__post_init__`'s checks: they are a fifth of a proposal's ~20 us. Property tests hold
        the kernels to the invariants."""
        tree = object.__new__(cls)
        for name, value in zip(FIELDS, arrays):
            object.__setattr__(tree, name, value)
        return tree

    @classmethod
    def empty(cls) -> "CandidateTree":
        return cls(**{name: np.zeros(0, dtype) for name, dtype in DTYPES.items()})

    @classmethod
    def from_sequences(
        cls,
        sequences: Iterable[Sequence[int]],
        weights: Sequence[float] | None = None,
        sources: Sequence[int] | None = None,
        max_nodes: int = MAX_NODES,
        max_depth: int = MAX_DEPTH,
    ) -> "CandidateTree":
        """Merge continuations into a trie and keep the `max_nodes` most probable nodes.

        A node's probability is the weight of the continuations through it over the total weight.
        It never exceeds its parent's, so keeping the best nodes (ties: shallower first, then first
        seen) always keeps a connected tree.
        """
        sequences = [list(s)[:max_depth] for s in sequences]
        weights = [1.0] * len(sequences) if weights is None else list(weights)
        sources = [SOURCES.index("general")] * len(sequences) if sources is None else list(sources)
        trie: dict[tuple[int, ...], list] = {}  # prefix -> [count, source, first_seen]
        total = 0.0
        for seq, weight, source in zip(sequences, weights, sources):
            if not seq or weight <= 0:
                continue
            total += weight
            for depth in range(1, len(seq) + 1):
                entry = trie.setdefault(tuple(int(t) for t in seq[:depth]), [0.0, int(source), len(trie)])
                entry[0] += weight
        if not trie or max_nodes <= 0:
            return cls.empty()
        ranked = sorted(trie.items(), key=lambda kv: (-kv[1][0], len(kv[0]), kv[1][2]))[:max_nodes]
        ranked.sort(key=lambda kv: (len(kv[0]), -kv[1][0], kv[1][2]))  # topological: by depth
        index = {prefix: i for i, (prefix, _) in enumerate(ranked)}
        return cls.from_dict({"tokens": [p[-1] for p, _ in ranked],
                              "parents": [index.get(p[:-1], -1) for p, _ in ranked],
                              "depths": [len(p) for p, _ in ranked], "counts": [e[0] for _, e in ranked],
                              "probs": [e[0] / total for _, e in ranked], "sources": [e[1] for _, e in ranked]})

    def to_dict(self) -> dict:
        return {name: getattr(self, name).tolist() for name in FIELDS}

    @classmethod
    def from_dict(cls, data: dict) -> "CandidateTree":
        return cls(**{name: np.asarray(data[name], dtype) for name, dtype in DTYPES.items()})

    def draw(self) -> str:
        """The tree as indented text, one node a line: token, count, probability, source."""
        lines = []

        def walk(node: int, indent: str) -> None:
            for child in self.children(node):
                lines.append(
                    f"{indent}{self.tokens[child]}  (count {self.counts[child]:g}, "
                    f"p {self.probs[child]:.2f}, {SOURCES[self.sources[child]]})"
                )
                walk(child, indent + "  ")

        walk(-1, "")
        return "\n".join(lines) if lines else "(empty tree)"

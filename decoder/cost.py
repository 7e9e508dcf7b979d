"""Verify cost: what a forward over a tree costs against its size, and which nodes a smaller budget keeps.

Verifying N nodes costs one forward over 1 + N tokens. On a GPU that is nearly the price of one token;
on a CPU it jumps at N = 1 (a 2-row matrix multiply costs about twice a 1-row one) and then grows
slowly. `CostCurve` is that curve as benchmarks report it; `prune_order` ranks a tree's nodes so that any
prefix of the ranking is a tree (a budget of N keeps the first N).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from numba import njit

from ..retriever.tree import CandidateTree

CURVE_SIZES = (0, 1, 2, 4, 8, 16, 32, 64)  # the tree sizes a verify-cost curve is measured at


@dataclass
class CostCurve:
    """Seconds of one verify forward with `sizes[i]` tree nodes (plus the root) with `context` tokens
    cached. What benchmarks report; an adaptive budget measures whole steps instead."""

    sizes: list[int]
    seconds: list[float]
    context: int = 0

    def time(self, nodes) -> np.ndarray:
        """Seconds of a forward verifying `nodes` (interpolated between the sizes measured)."""
        return np.interp(nodes, self.sizes, self.seconds)

    def relative(self) -> list[float]:
        return [s / self.seconds[0] for s in self.seconds]

    def to_dict(self) -> dict:
        return asdict(self) | {"relative": self.relative()}


def prune_order(tree: CandidateTree) -> np.ndarray:
    """Nodes by decreasing probability, every node after its parent: keeping any prefix keeps a tree.
    (A node more probable than its parent, which the retriever never proposes, is dropped.)"""
    return _prune_order(tree.probs, tree.depths, tree.parents)


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

"""A verified tree and the rows its policy reads: each quantity computed once, for all 1 + N positions at once, on
the logits' device, and copied to the host as the few numbers the walk reads (N + 1 tokens, not N + 1 vocabularies).

A chain (vLLM's drafts) is a tree with one child per node: the vLLM plugin builds one and walks it with the same
policies (`vllm_acceptance`), handing in its own distributions instead of a sampler's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np
import torch

from .sampling import NodeState, Positions, draw, draw_rows


def tree_layout(tokens: list[int], parents: np.ndarray):
    """(depths int64[1 + N], paths int64[1 + N, D], order, bounds) of a topologically ordered tree: each row's
    depth (0: the root's row), its tokens from depth 1 down to it (-1 after), and every node's children at once
    (node indices by parent, in index order; parent p's are order[bounds[p + 1]:bounds[p + 2]]). One pass over the
    nodes in plain Python: at a tree's size (tens of nodes) it costs less than the ~20 NumPy operations it replaced,
    and the acceptance rules must not load numba (vLLM loads them at start)."""
    parent_list = parents.tolist()
    depths, rows = [0], [[]]
    for token, parent in zip(tokens, parent_list):
        rows.append(rows[parent + 1] + [token])
        depths.append(len(rows[-1]))
    paths = np.full((len(rows), max(depths)), -1, np.int64)
    for row, path in enumerate(rows):
        paths[row, :len(path)] = path
    order = np.argsort(parents, kind="stable")
    bounds = np.searchsorted(parents[order], np.arange(-1, len(tokens) + 1))
    return np.asarray(depths, np.int64), paths, order, bounds


@dataclass
class VerifiedTree:
    """What the verifier hands a policy: one logits row per position (row 0 = the root) and the tree's shape."""

    logits: torch.Tensor  # float[1 + N, V], on the model's device
    tokens: Sequence[int]  # model ids of the N nodes
    parents: Sequence[int]  # each node's parent index, -1 = the root; parents come before their children
    root: NodeState  # the sampler's view at the root

    def __post_init__(self):
        self.tokens = [int(t) for t in self.tokens]
        self.parents = np.asarray(self.parents, np.int64).reshape(-1)
        n = len(self.tokens)
        if len(self.parents) != n or len(self.logits) != n + 1:
            raise ValueError(f"a tree of {n} tokens needs {n} parents and {n + 1} logits rows, "
                             f"got {len(self.parents)} and {len(self.logits)}")
        if n and np.any(self.parents >= np.arange(n)):
            raise ValueError("a verified tree's nodes must come after their parents")
        self.depths, self._paths, self._order, self._bounds = tree_layout(self.tokens, self.parents)

    def children(self, node: int) -> list[int]:
        """The child node indices of `node` (-1 = the root), in index order."""
        return self._order[self._bounds[node + 1]:self._bounds[node + 2]].tolist()

    @cached_property
    def positions(self) -> Positions:
        """Each row's path below the root, as the sampler's batched pass reads it."""
        return Positions(self.root, self._paths, self.depths, self.logits.device)

    def generated_at(self, path: list[int]) -> list[int]:
        """The output before the position after `path`: the root's generated tokens and the path's."""
        return list(self.root.generated) + [self.tokens[i] for i in path]


class Rows:
    """What a policy reads at a verified tree's rows. Each quantity is computed for all 1 + N rows in one pass on
    the logits' device the first time a rule asks for it, then read row by row by the walk.

    `sampler` gives the distributions (`q`); the vLLM plugin passes its own `q` and `scores` instead. Draws come
    from `generator` (a CPU generator, whatever the device: seeded runs repeat on CPU and CUDA alike), one uniform
    per draw, in the order the walk makes them, so a step that emits k tokens by the sampler's draws uses the k
    uniforms autoregressive sampling would have used.
    """

    def __init__(self, tree: VerifiedTree, generator: torch.Generator, sampler=None,
                 q: torch.Tensor | None = None, scores: torch.Tensor | None = None):
        if sampler is not None and q is not None:
            raise ValueError("Rows takes a sampler or the distributions q, not both")
        self.tree, self.generator, self.sampler = tree, generator, sampler
        if q is not None:
            self.__dict__["q"] = q
        if scores is not None:
            self.__dict__["scores"] = scores
        self._peeked = None  # the generator's state before `draws` looked ahead

    @cached_property
    def q(self) -> torch.Tensor:
        """float[1 + N, V]: the sampler's distribution at every row."""
        if self.sampler is None:
            raise ValueError("this policy has no sampler: its rule reads no distribution")
        return self.sampler.distributions(self.tree.logits, self.tree.positions)

    @cached_property
    def scores(self) -> torch.Tensor:
        """float[1 + N, V]: the logits with the ids blocked at each row (a minimum length's stops) at -inf."""
        return self.tree.positions.mask(self.tree.logits.float())

    @cached_property
    def argmax(self) -> list[int]:
        """Each row's most likely id (ties: the lowest), taken on the device: 1 + N integers come back."""
        return self.scores.argmax(-1).tolist()

    @cached_property
    def draws(self) -> list[int]:
        """The sampler's draw at every row, each from the uniform of its depth: the walk visits one row per depth,
        so row r's draw is the one made there if the walk gets there. Call `done` when the walk ends."""
        depth = int(self.tree.depths.max(initial=0))
        self._peeked = self.generator.get_state()
        uniforms = torch.rand(depth + 1, generator=self.generator, dtype=torch.float64)
        at_rows = uniforms[torch.from_numpy(self.tree.depths)].to(self.q.device)
        return draw_rows(self.q, at_rows).tolist()

    def done(self, visited: int) -> None:
        """The walk decided at `visited` rows: the generator moves on by that many of the uniforms `draws` took."""
        if self._peeked is not None:
            self.generator.set_state(self._peeked)
            torch.rand(visited, generator=self.generator, dtype=torch.float64)
            self._peeked = None

    def draw(self, row: int) -> int:
        """A draw from row `row`'s distribution now, from the next uniform."""
        return draw(self.q[row], self.generator)

    def q_at(self, row: int) -> torch.Tensor:
        """Row `row`'s distribution on the host, for the rules that work on the whole of it."""
        return self.q[row].cpu()

    @cached_property
    def child_standing(self) -> tuple[list[int], list[float], list[float]]:
        """(rank, share, score) of every node's token among its parent row's scores: how many ids score higher
        there, the probability they hold under softmax(scores), and its own score (-inf: blocked)."""
        tree = self.tree
        if not tree.tokens:
            return [], [], []
        parent_rows = self.scores[torch.from_numpy(tree.parents + 1).to(self.scores.device)]
        own = parent_rows.gather(1, torch.tensor(tree.tokens, device=parent_rows.device)[:, None])
        higher = parent_rows > own
        share = (torch.softmax(parent_rows, dim=-1) * higher).sum(-1)
        return higher.sum(-1).tolist(), share.tolist(), own[:, 0].tolist()

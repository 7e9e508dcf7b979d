"""Cost-aware node budget: how many tree nodes to verify this step to maximise expected tokens per second.

Verifying N nodes costs one forward over 1 + N tokens. On a GPU that is nearly the price of one token;
on a CPU it grows quickly. `CostCurve` is the attached model's measured forward time against tree size;
`NodeBudget` combines it with the tree's path probabilities, calibrated by the acceptance seen so far.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..retriever.tree import CandidateTree

CURVE_SIZES = (0, 1, 2, 4, 8, 16, 32, 64)


@dataclass
class CostCurve:
    """Median seconds of one verify forward with `sizes[i]` tree nodes (plus the root)."""

    sizes: list[int]
    seconds: list[float]

    def time(self, nodes) -> np.ndarray:
        return np.interp(nodes, self.sizes, self.seconds)

    def relative(self) -> list[float]:
        return [s / self.seconds[0] for s in self.seconds]

    def to_dict(self) -> dict:
        return asdict(self) | {"relative": self.relative()}


def prune_order(tree: CandidateTree) -> list[int]:
    """Nodes by decreasing probability, every node after its parent: keeping any prefix keeps a tree."""
    ranked = sorted(range(len(tree)), key=lambda i: (-float(tree.probs[i]), int(tree.depths[i]), i))
    taken: set[int] = set()
    order = []
    for i in ranked:
        if tree.parents[i] < 0 or int(tree.parents[i]) in taken:
            taken.add(i)
            order.append(i)
    return order


class NodeBudget:
    """Chooses each step's node count n maximising (1 + c * S(n)) / (t(n) + t_propose).

    S(n) is the summed path probability of the tree's n most probable nodes (the expected accepted
    length if the probabilities were calibrated); c calibrates them: accepted over predicted length,
    decayed so it follows the current utterance, starting from an optimistic prior so trees are tried.
    t(n) is the curve's forward time, scaled by what whole steps have actually cost against it, apart
    for steps with and without a tree: the curve is measured once, at the first prompt's length, and
    leaves out the tree mask, the policy's walk and the cache compaction, while a tree step's forward
    grows faster with the context than a one-token step's does.
    """

    def __init__(self, curve: CostCurve, max_nodes: int, prior: float = 1.0, prior_weight: float = 2.0,
                 decay: float = 0.9, cost_decay: float = 0.95, calibrate_costs: bool = True):
        self.curve, self.max_nodes, self.decay, self.cost_decay = curve, max_nodes, decay, cost_decay
        self.calibrate_costs = calibrate_costs  # False: the curve is authoritative (given by the caller)
        self.accepted, self.predicted = prior * prior_weight, prior_weight
        self._step_cost = {False: [0.0, 0.0], True: [0.0, 0.0]}  # tree step? -> decayed [measured, curve] seconds

    @property
    def calibration(self) -> float:
        return self.accepted / self.predicted

    def choose(self, tree: CandidateTree, order: list[int], propose_seconds: float) -> int:
        if not order:
            return 0
        mass = np.concatenate([[0.0], np.cumsum(tree.probs[order[: self.max_nodes]])])
        nodes = np.arange(len(mass))
        rate = (1.0 + self.calibration * mass) / (self.step_time(nodes) + propose_seconds)
        return int(np.argmax(rate))

    def step_time(self, nodes) -> np.ndarray:
        """Expected seconds of a step verifying `nodes` tree nodes (the curve, scaled by the steps seen)."""
        nodes = np.asarray(nodes)
        return self.curve.time(nodes) * np.where(nodes > 0, self._scale(True), self._scale(False))

    def observe_step(self, nodes: int, seconds: float) -> None:
        """A step verifying `nodes` tree nodes took `seconds` from the forward to the compaction."""
        if not self.calibrate_costs:
            return
        measured, expected = self._step_cost[nodes > 0]
        self._step_cost[nodes > 0] = [self.cost_decay * measured + seconds,
                                      self.cost_decay * expected + float(self.curve.time(nodes))]

    def _scale(self, tree: bool) -> float:
        measured, expected = self._step_cost[tree]
        if not expected:  # a kind of step not seen yet is taken to be off the curve as much as the other
            measured, expected = self._step_cost[not tree]  # (else unseen one-token steps look dear)
        return measured / expected if expected else 1.0

    def observe(self, predicted: float, accepted: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.predicted = self.decay * self.predicted + predicted

"""Node budgets: how many of a proposed tree's nodes a decode step verifies.

Verifying N nodes costs one forward over 1 + N tokens. On a GPU that is nearly the price of one token;
on a CPU it grows quickly. A session has one budget, with three calls: `wants_tree()` (ask the retriever
at all this step?), `fit(tree, ...)` (the part of the tree to verify) and `observe(...)` (what the step
cost and accepted). `FixedBudget` keeps the N most probable nodes. `AutoBudget` (max_nodes="auto") keeps
what maximises expected tokens per second: `CostCurve` is the attached model's measured forward time
against tree size, and `NodeBudget` combines it with the tree's path probabilities, calibrated by the
acceptance seen so far.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from ..retriever.tree import CandidateTree

CURVE_SIZES = (0, 1, 2, 4, 8, 16, 32, 64)
AUTO_MAX_NODES = 64
MAX_IDLE_STEPS = 4  # while trees do not pay, ask the retriever at least every 5th step
EXPLORE_EVERY, EXPLORE_NODES = 4, 8  # relaxed policies: verify every 4th declined tree (8 nodes)


def node_cap(max_nodes: int | str) -> int:
    """The most tree nodes a step may verify under `max_nodes` (an int, or "auto")."""
    return AUTO_MAX_NODES if max_nodes == "auto" else int(max_nodes)


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


class FixedBudget:
    """Verify the `cap` most probable nodes of every tree."""

    curve = None  # no cost model

    def __init__(self, cap: int):
        self.cap = cap

    def start(self, *_) -> None:
        pass

    def wants_tree(self) -> bool:
        return True

    def fit(self, tree: CandidateTree, propose_seconds: float, position: int) -> CandidateTree:
        return tree if len(tree) <= self.cap else tree.subtree(prune_order(tree)[: self.cap])

    def observe(self, position: int, nodes: int, accepted: int, seconds: float, generated: list[int],
                finished: bool) -> None:
        pass


class AutoBudget:
    """max_nodes="auto": each step verifies the prefix of the tree that maximises expected tokens per second.

    Its `NodeBudget` learns from every proposed tree, verified or not, how its path probabilities relate
    to what is accepted (`observe` scores a tree against the tokens that followed it), and from every step
    what a forward really costs. A tree it declines whole makes it skip the retriever for 1, 3, ... up to
    MAX_IDLE_STEPS steps, so a retriever that never pays costs almost nothing. The cost curve is measured
    once per model and the calibration is shared by sessions with the same retriever and policy kind.
    """

    cap = AUTO_MAX_NODES

    def __init__(self, exact: bool, speech_offset: int, curve: CostCurve | None = None):
        self.exact, self.offset, self.curve = exact, speech_offset, curve
        self.nodes: NodeBudget | None = None  # set by start(); until then trees are only cut to `cap`
        self._shadow: deque = deque()  # [position, tree, predicted, accepted or None] awaiting a score
        self._idle = self._skip = 0  # steps to skip the retriever while trees do not pay
        self._declined = 0

    def start(self, model, retriever, policy_kind: type, measure: Callable[[], CostCurve]) -> None:
        """Take the model's cost curve (measured by `measure` on first use) and the shared calibration."""
        measured = self.curve is None  # a curve the caller gives is taken as it is, never rescaled
        if measured:
            self.curve = _CURVES.get(model) or measure()
            _CURVES[model] = self.curve
        try:
            budgets = _BUDGETS.setdefault(retriever, {})
        except TypeError:  # a retriever that cannot be weakly referenced keeps its calibration per session
            budgets = {}
        self.nodes = budgets.get(policy_kind)
        if self.nodes is None or self.nodes.curve is not self.curve:
            self.nodes = budgets[policy_kind] = NodeBudget(self.curve, AUTO_MAX_NODES, calibrate_costs=measured)

    def wants_tree(self) -> bool:
        if self._skip:
            self._skip -= 1
            return False
        return True

    def fit(self, tree: CandidateTree, propose_seconds: float, position: int) -> CandidateTree:
        """The part of `tree` worth verifying at output position `position` (maybe none of it)."""
        if self.nodes is None or not len(tree):
            return tree if len(tree) <= self.cap else tree.subtree(prune_order(tree)[: self.cap])
        order = prune_order(tree)
        self._shadow.append([position, tree, float(tree.probs[order].sum()), None])
        chosen = self.nodes.choose(tree, order, propose_seconds)
        if not chosen and not self.exact:
            # a relaxed policy's acceptance shows only on verified trees (see _score)
            self._declined += 1
            chosen = 0 if self._declined % EXPLORE_EVERY else min(len(tree), EXPLORE_NODES)
        self._idle = 0 if chosen else min(2 * self._idle + 1, MAX_IDLE_STEPS)
        self._skip = self._idle
        return tree if len(tree) <= chosen else tree.subtree(order[:chosen])

    def observe(self, position: int, nodes: int, accepted: int, seconds: float, generated: list[int],
                finished: bool) -> None:
        """A step from output position `position` verified `nodes` nodes, accepted `accepted` of them and
        took `seconds` from the forward to the compaction; `generated` is the output so far."""
        if self.nodes is None:
            return
        self.nodes.observe_step(nodes, seconds)
        if nodes and self._shadow and self._shadow[-1][0] == position:
            self._shadow[-1][3] = accepted  # verified: a relaxed policy may accept more than the output shows
        self._score(generated, finished)

    def _score(self, generated: list[int], finished: bool) -> None:
        """Score proposed trees against the tokens that actually followed.

        For the exact policies this is the length the tree would have had accepted, verified or not. A
        relaxed policy accepts drafts the output would not have matched, so only its verified trees are
        scored (a declined tree's match with sampled output undercounts it), and every few declined trees
        one is verified anyway so the estimate keeps up. A tree is scored as soon as the output leaves it
        (usually the next step), or reaches its leaves.
        """
        while self._shadow:
            start, tree, predicted, accepted = self._shadow[0]
            continuation = generated[start:]
            depth = tree.matched_depth(np.asarray(continuation) - self.offset)
            if depth == len(continuation) and depth < tree.max_depth and not finished:
                return
            self._shadow.popleft()
            if accepted is not None or self.exact:
                self.nodes.observe(predicted, max(depth, accepted or 0))


_CURVES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its measured CostCurve
_BUDGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # retriever -> {policy class: NodeBudget}

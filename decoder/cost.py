"""Node budgets: how many of a proposed tree's nodes a decode step verifies.

Verifying N nodes costs one forward over 1 + N tokens. On a GPU that is nearly the price of one token;
on a CPU it jumps at N = 1 (a 2-row matrix multiply costs about twice a 1-row one) and then grows
slowly. A session has one budget, with three calls: `wants_tree()` (ask the retriever at all this
step?), `fit(tree, ...)` (the part of the tree to verify) and `observe(...)` (what the step cost and
accepted). `FixedBudget` keeps the N most probable nodes. `AutoBudget` (max_nodes="auto", the default)
keeps what maximises expected tokens per second, and nothing (a plain one-token step) when no part of
the tree pays: `NodeBudget` is its model, `StepCosts` (what a step verifying n nodes costs: the
model's measured `CostCurve` plus what the step's other work costs now) times `Acceptance` (how
often a node with a given probability and depth is accepted, learned from the trees seen).
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable, NamedTuple

import numpy as np
from numba import njit

from ..retriever.tree import CandidateTree

CURVE_SIZES = (0, 1, 2, 4, 8, 16, 32, 64)
AUTO_MAX_NODES = 64
CURVE_CONTEXT_STEP = 256  # the curve is also timed this many cached tokens later, for how its shape changes
MARGIN = 0.02  # a tree must promise 2% more tokens per second than a plain step: estimates err, plain steps do not
TIE = 0.02  # of trees within 2% of the best rate, the smallest: the cost of a larger tree is the less certain
EXPLORE_EVERY, EXPLORE_NODES = 4, 8  # relaxed policies: verify every 4th declined tree (8 nodes at least)
MAX_SKIP = 32  # while asking the retriever does not pay, ask at least every 33rd step
WINDOW = 32  # recent steps the cost terms are medians over
SIZE_SEEN = 8  # a tree size's own median counts once 8 recent steps had it (on a GPU a new shape's first
# forwards can take 10x longer: three of them once priced 8-node trees at 48 ms a step)
OBSERVE_EVERY = 8  # steps taken in at a time, once the first 32 trees have been scored one step at a time
SE_PRIOR = 14  # an unseen cell's standard error is that of 16 nodes (prior weight 2 + 14): shrunk, not zeroed
CONTEXT_BIN = 16  # step costs are worked out afresh each step, or when the context moves this far


def node_cap(max_nodes: int | str) -> int:
    """The most tree nodes a step may verify under `max_nodes` (an int, or "auto")."""
    return AUTO_MAX_NODES if max_nodes == "auto" else int(max_nodes)


@dataclass(frozen=True)
class StepRecord:
    """What one decode step did, as a budget sees it."""

    position: int  # output position of the step's first new token
    context: int  # tokens in the cache before the step
    nodes: int  # tree nodes verified
    accepted: int  # tree nodes accepted
    forward_seconds: float  # the verify forward (logits on the host)
    walk_seconds: float  # the policy's walk: its work per token emitted
    seconds: float  # the whole step, forward to compaction (the proposal not included)


@dataclass
class CostCurve:
    """Seconds of one verify forward with `sizes[i]` tree nodes (plus the root) with `context` tokens
    cached, and (`longer`) with `step` more: a tree's rows each attend to the whole context, so its
    forward grows with the context faster than a one-token step's. No `longer`: taken as flat."""

    sizes: list[int]
    seconds: list[float]
    context: int = 0
    longer: list[float] | None = None
    step: int = 0

    def time(self, nodes, context: int | None = None) -> np.ndarray:
        """Seconds of a forward verifying `nodes`: the one-token step's time at `context` times the
        curve's shape there, both interpolated linearly in the context between the two measured."""
        shape = np.interp(nodes, self.sizes, self.seconds) / self.seconds[0]
        if self.longer is None or context is None:
            return self.seconds[0] * shape
        w = min(max((context - self.context) / self.step, 0.0), 4.0)  # extrapolated up to 4 steps further
        longer = np.interp(nodes, self.sizes, self.longer) / self.longer[0]
        plain = self.seconds[0] + w * (self.longer[0] - self.seconds[0])
        return plain * (shape + w * (longer - shape))

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


@njit(cache=True, nogil=True)
def _matched_path(tokens, parents, sequence):
    """Nodes of the longest root path whose tokens are a prefix of `sequence` (compiled: every step scores
    a tree, and a NumPy scan per level cost ~30 us)."""
    path = np.empty(min(sequence.shape[0], tokens.shape[0]), np.int64)
    node, depth = -1, 0
    for token in sequence[: path.shape[0]]:
        found = -1
        for i in range(tokens.shape[0]):
            if parents[i] == node and tokens[i] == token:
                found = i
                break
        if found < 0:
            break
        path[depth] = found
        depth += 1
        node = found
    return path[:depth]


def matched_path(tree: CandidateTree, sequence) -> np.ndarray:
    """The nodes of the longest root path of `tree` whose tokens are a prefix of `sequence`."""
    return _matched_path(tree.tokens, tree.parents, np.asarray(sequence, np.int64))


# The auto budget runs on every decode step, beside a forward of a few milliseconds on a small model: as
# NumPy calls its choice cost ~40 ops (~100 us on a busy CPU, 5% of a step); compiled, one call each.

@njit(cache=True, nogil=True)
def _cells(probs, depths, prob_edges, depth_edges):
    cells = np.empty(probs.shape[0], np.int64)
    columns = depth_edges.shape[0] + 1
    for i in range(probs.shape[0]):
        cells[i] = (np.searchsorted(prob_edges, probs[i], side="right") * columns
                    + np.searchsorted(depth_edges, depths[i], side="right"))
    return cells


@njit(cache=True, nogil=True)
def _best(order, cells, chance, forward, extra, per_token, base, sizes, max_nodes, tie):
    """(node count with the highest expected tokens per second, that rate over a plain step's, a plain
    step's seconds): counts
    are the curve's sizes below n and n itself, the tree's `order`-prefix of n nodes. A step emitting
    1 + m tokens (m: the expected accepted length) takes forward + per_token * (1 + m) + extra."""
    n = min(order.shape[0], max_nodes)
    plain = 1.0 / (forward[0] + per_token + base)
    counts = np.zeros(sizes.shape[0] + 1, np.int64)
    rates = np.zeros(sizes.shape[0] + 1)
    mass, m, size = 0.0, 0, 0
    for k in range(n):
        mass += chance[cells[order[k]]]
        count = k + 1
        while size < sizes.shape[0] and sizes[size] < count:
            size += 1
        if count == n or (size < sizes.shape[0] and sizes[size] == count):
            counts[m] = count
            rates[m] = (1.0 + mass) / (forward[count] + per_token * (1.0 + mass) + base + extra[count])
            m += 1
    if m == 0:
        return 0, 1.0, 1.0 / plain
    top = rates[:m].max()
    for i in range(m):  # the smallest count within TIE of the best: larger trees' costs are the less certain
        if rates[i] >= top * (1.0 - tie):
            return counts[i], rates[i] / plain, 1.0 / plain
    return 0, 1.0, 1.0 / plain


@njit(cache=True, nogil=True)
def _choose(probs, depths, parents, chance, prob_edges, depth_edges, forward, extra, per_token, base, sizes,
            max_nodes, tie):
    """_prune_order, _cells and _best in one call: (order, cells, best count, its rate over a plain step's,
    a plain step's seconds)."""
    order = _prune_order(probs, depths, parents)
    cells = _cells(probs, depths, prob_edges, depth_edges)
    count, ratio, plain = _best(order, cells, chance, forward, extra, per_token, base, sizes, max_nodes, tie)
    return order, cells, count, ratio, plain


@njit(cache=True, nogil=True)
def _score(tokens, parents, cells, continuation, depth, finished, accepted, seen, hits, centres):
    """Score one proposal against the output that followed it: (-1.0, 0) while the output may still run
    along it (it reached no leaf and did not leave the tree), else (the summed centres of its nodes'
    cells, the nodes counted accepted) after counting them into `seen` and `hits`. `accepted` >= 0
    caps the accepted path (a relaxed policy's verified acceptance), -1: the matched path (exact)."""
    path = _matched_path(tokens, parents, continuation)
    if path.shape[0] == continuation.shape[0] and continuation.shape[0] < depth and not finished:
        return -1.0, 0
    if accepted >= 0:
        path = path[:accepted]
    return _learn(cells, path, seen, hits, centres), path.shape[0]


@njit(cache=True, nogil=True)
def _learn(cells, path, seen, hits, centres):
    """Count each node of a scored tree as seen, the ones on `path` as accepted; return the summed
    centres of their cells (what their probabilities predicted)."""
    predicted = 0.0
    for c in cells:
        seen[c] += 1.0
        predicted += centres[c]
    for i in path:
        hits[cells[i]] += 1.0
    return predicted


class Acceptance:
    """How often a tree node is accepted, by the retriever's probability for it and its depth.

    A tree's expected accepted length is the sum over its nodes of the chance that the node is on the
    accepted path, so a table of those chances by (probability, depth) cell prices any prefix of any
    tree. The retriever's probabilities are counts from the corpus: lossless sampling accepts about
    what they say at depth 1 and far less deeper down (on the sample, depth-4 nodes of probability
    0.035 were accepted 0.2% of the time), greedy decoding more than they say. A cell's estimate is
    shrunk towards its probability times the calibration seen over all cells (accepted nodes over
    their summed probabilities), with the weight of `prior_weight` nodes, so a cell seen rarely
    follows the rest; each cell keeps at most `memory` nodes' weight, so it follows a drifting target.
    """

    PROB_EDGES = np.array([0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9])
    DEPTH_EDGES = np.array([2, 3, 5])  # depth 1, 2, 3-4, 5 and deeper
    CENTRES = (np.concatenate([[0.0], PROB_EDGES]) + np.concatenate([PROB_EDGES, [1.0]])) / 2

    def __init__(self, prior_weight: float = 2.0, memory: float = 4000.0):
        self.shape = (len(self.CENTRES), len(self.DEPTH_EDGES) + 1)
        self.seen, self.hits = np.zeros(np.prod(self.shape)), np.zeros(np.prod(self.shape))  # flat, per cell
        self.prior_weight, self.memory = prior_weight, memory
        self.total = [prior_weight, prior_weight]  # [accepted, predicted], calibration 1 at first
        self._centres = np.repeat(self.CENTRES, self.shape[1])
        self._table: np.ndarray | None = None
        self._learned = 0

    @property
    def calibration(self) -> float:
        return float(self.total[0] / self.total[1])

    def cells(self, probs: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """Each node's cell, as one index into the flattened table."""
        return _cells(probs, depths, self.PROB_EDGES, self.DEPTH_EDGES)

    @property
    def table(self) -> np.ndarray:
        """The chance of acceptance of each (probability, depth) cell, flattened (a cautious estimate)."""
        if self._table is None:
            prior = self.prior_weight * self.calibration * self._centres
            weight = self.seen + self.prior_weight
            mean = np.minimum((self.hits + prior) / weight, 1.0)
            # one standard error below the mean: the nodes a larger tree adds sit in cells seen less (deep,
            # unlikely; for relaxed policies, seen only where verified), and choosing by the mean there
            # made trees grow past what paid (Filtered: 2.64 tokens per forward at 1.17x, 8 nodes 2.30 at 1.32x)
            self._table = np.maximum(mean - np.sqrt(mean * (1.0 - mean) / (weight + SE_PRIOR)), 0.0)
        return self._table

    def expected(self, probs: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """The chance each node is accepted."""
        return self.table[self.cells(probs, depths)]

    def learn(self, probs: np.ndarray, depths: np.ndarray, accepted: np.ndarray) -> None:
        """Nodes with these probabilities and depths were (`accepted`) or were not on the accepted path."""
        self.learn_path(self.cells(probs, depths), np.flatnonzero(accepted))

    def learn_path(self, cells: np.ndarray, path: np.ndarray) -> None:
        """The nodes of cells `cells` were seen, those at indices `path` accepted."""
        self.learned(_learn(cells, np.asarray(path, np.int64), self.seen, self.hits, self._centres), len(path))

    def learned(self, predicted: float, accepted: int) -> None:
        """`seen` and `hits` have been counted into (by `_learn`): nodes whose cells' centres sum to
        `predicted`, `accepted` of them accepted."""
        self.total[0] += accepted
        self.total[1] += predicted
        self._learned += 1
        if self._learned % 64 == 0:  # forget slowly: keep at most `memory` nodes' weight per cell
            full = self.seen > self.memory
            self.hits[full] *= self.memory / self.seen[full]
            self.seen[full] = self.memory
            if self.total[1] > self.memory:
                self.total = [self.total[0] * self.memory / self.total[1], self.memory]
        self._table = None


class StepCosts:
    """What a decode step costs: its forward, its work per token emitted, and what else it does.

    step seconds = forward(n, context) * ratio + per_token * (1 + accepted) + base + extra(n)

    The curve gives the forward's shape (what n nodes cost against one token, at this context) and
    `ratio` what forwards cost now against it (another process on the cores, a warm or cold cache): the
    median over recent steps. `per_token` is the policy's walk per token emitted (the sampler's draw):
    autoregressive decoding pays it for every token too, so it is no tree's fault, but it is large (with
    RAS sampling on the sample model, a sixth of a step) and a tree step pays it for each token it
    emits. `base` is what a plain step takes beyond those (emitting, bookkeeping, the curve's error
    there), and `extra(n)` what a tree step of n nodes takes beyond a plain step's base: the median of
    recent steps of about that size (sizes binned to the curve's), and where a size has not been seen,
    a line through those medians. The curve is timed back to back; in decoding each forward runs after
    the retriever and the walk have been through the caches, and on the sample a fixed 8-node budget's
    steps cost 1.12-1.24x its 4-node budget's where the curve said 1.06x: `extra` learns that from the
    steps themselves. Medians over a window, not running means: one slow step (a page fault, a
    neighbour's burst) moves them little, and nothing from the first steps stays. A curve the caller
    gives is taken as it is (no scaling, no other work).
    """

    RATIO, WALK = range(2)  # rows of the ring buffer of recent steps

    def __init__(self, curve: CostCurve, calibrate: bool = True, max_nodes: int = AUTO_MAX_NODES):
        self.curve, self.calibrate = curve, calibrate
        self._nodes = np.arange(max_nodes + 1)
        self._bins = np.searchsorted(_SIZES, self._nodes)  # each node count's curve size (at or above it)
        self.ratio, self.per_token, self.base = 1.0, 0.0, 0.0
        self.extra = np.zeros(max_nodes + 1)
        self._recent = np.zeros((2, WINDOW))  # forward / curve and walk per token of recent steps
        self._steps = 0
        self._residuals = np.zeros((2, 4 * WINDOW))  # (nodes, seconds the forward and walk do not explain)
        self._residual_steps = 0
        self._forward = (None, None)  # (context bin, the curve's seconds for 0..max_nodes nodes there)

    def forward_time(self, context: int | None) -> np.ndarray:
        """Expected forward seconds for 0..max_nodes nodes at about `context` cached tokens (per CONTEXT_BIN)."""
        key = _context_bin(context)
        if self._forward[0] != key or self._forward[1] is None:
            self._forward = (key, self.curve.time(self._nodes, None if key is None else key * CONTEXT_BIN))
        return self._forward[1] * self.ratio

    def step_time(self, nodes, context: int | None = None, tokens=1.0) -> np.ndarray:
        """Expected seconds of a step verifying `nodes` nodes and emitting `tokens` tokens."""
        return self.forward_time(context)[nodes] + self.per_token * np.asarray(tokens) + self.base + self.extra[nodes]

    def observe(self, steps: list[StepRecord]) -> None:
        """Recent steps (a few at a time: the medians are worked out once per call)."""
        if not self.calibrate or not steps:
            return
        curves = []
        for step in steps:
            curve = self.forward_time(step.context)[step.nodes] / self.ratio
            curves.append(curve)
            slot = self._steps % WINDOW
            self._recent[self.RATIO, slot] = step.forward_seconds / curve
            self._recent[self.WALK, slot] = step.walk_seconds / (step.accepted + 1)
            self._steps += 1
        filled = min(self._steps, WINDOW)
        self.ratio, self.per_token = np.median(self._recent[:, :filled], axis=1)
        for step, curve in zip(steps, curves):
            slot = self._residual_steps % self._residuals.shape[1]
            self._residuals[:, slot] = (step.nodes, step.seconds - curve * self.ratio
                                        - self.per_token * (step.accepted + 1))
            self._residual_steps += 1
        filled = min(self._residual_steps, self._residuals.shape[1])
        self.base, x0, x1, centres, medians, counts = _residual_model(self._residuals[:, :filled], _SIZES, SIZE_SEEN)
        seen = counts[self._bins] >= SIZE_SEEN
        self.extra = np.where(seen, medians[self._bins] + x1 * (self._nodes - centres[self._bins]),
                              x0 + x1 * self._nodes)
        self.extra[0] = 0.0


@njit(cache=True, nogil=True)
def _residual_model(residuals, sizes, min_count):
    """What recent steps took beyond their forward and walk: (base, x0, x1, centres, medians, counts):
    base the plain steps' median; per curve size (the tree sizes at or below it), the median size and the
    median beyond base of its steps, and their count; x0 + x1 * n a line through the medians of sizes
    seen at least `min_count` times, weighted by count (x1 = 0 and x0 their median while fewer than two are)."""
    nodes, seconds = residuals[0], residuals[1]
    plain = nodes == 0
    base = np.median(seconds[plain]) if plain.any() else 0.0
    bins = np.searchsorted(sizes, nodes)
    centres, medians, counts = np.zeros(sizes.shape[0]), np.zeros(sizes.shape[0]), np.zeros(sizes.shape[0])
    for b in range(1, sizes.shape[0]):
        members = (bins == b) & ~plain
        counts[b] = members.sum()
        if counts[b]:
            centres[b], medians[b] = np.median(nodes[members]), np.median(seconds[members]) - base
    fit = counts >= min_count
    if not fit.any():
        tree = ~plain
        return base, (np.median(seconds[tree]) - base) if tree.any() else 0.0, 0.0, centres, medians, counts
    x, y, w = centres[fit], medians[fit], counts[fit]
    x_mean, y_mean = (w * x).sum() / w.sum(), (w * y).sum() / w.sum()
    slope = 0.0
    if fit.sum() >= 2:
        slope = max((w * (x - x_mean) * (y - y_mean)).sum() / max((w * (x - x_mean) ** 2).sum(), 1e-12), 0.0)
    return base, y_mean - slope * x_mean, slope, centres, medians, counts


class NodeBudget:
    """Chooses each step's node count: the n among CURVE_SIZES (and the whole tree) maximising
    (1 + expected accepted length of the n most probable nodes) / (expected step time with n nodes),
    or 0 unless that beats a plain step by MARGIN. The retriever's time is spent by then, so it does
    not count here (`AutoBudget.wants_tree` weighs it)."""

    def __init__(self, curve: CostCurve, max_nodes: int = AUTO_MAX_NODES, calibrate_costs: bool = True,
                 costs: StepCosts | None = None):
        self.max_nodes = max_nodes
        self.costs = costs or StepCosts(curve, calibrate_costs, max_nodes)
        self.acceptance = Acceptance()
        self.ask_gain = 0.25  # running mean over retriever calls of gain / (1 + gain); hopeful at first
        self.ask_seconds: float | None = None  # running mean of a retriever call's time

    def asking_pays(self, gain: float, propose_seconds: float, plain_seconds: float) -> bool:
        """Fold in one retriever call (its tree's gain, its time); do the calls save more than they cost?
        A step with gain g saves about g / (1 + g) of a plain step's time."""
        self.ask_gain = 0.8 * self.ask_gain + 0.2 * gain / (1.0 + gain)
        self.ask_seconds = (propose_seconds if self.ask_seconds is None
                            else 0.9 * self.ask_seconds + 0.1 * propose_seconds)
        return self.ask_gain * plain_seconds > self.ask_seconds

    @property
    def curve(self) -> CostCurve:
        return self.costs.curve

    def choose(self, tree: CandidateTree, context: int | None = None) -> Choice:
        """The tree's prune order and cells, the node count with the highest expected rate and its gain over a
        plain step, in one compiled call."""
        costs, acceptance = self.costs, self.acceptance
        order, cells, nodes, ratio, plain = _choose(
            tree.probs, tree.depths, tree.parents, acceptance.table, acceptance.PROB_EDGES, acceptance.DEPTH_EDGES,
            costs.forward_time(context), costs.extra, costs.per_token, costs.base, _SIZES, self.max_nodes, TIE)
        return Choice(order, cells, int(nodes), float(ratio) - 1.0, float(plain))


class Choice(NamedTuple):
    order: np.ndarray  # the tree's nodes, most probable first, every node after its parent
    cells: np.ndarray  # each node's acceptance cell
    nodes: int  # the count (an `order` prefix) with the highest expected tokens per second
    gain: float  # its rate over a plain step's, minus 1
    plain_seconds: float  # a plain step's expected time

    @property
    def pays(self) -> bool:
        """Whether the tree beats a plain step by MARGIN."""
        return self.nodes > 0 and self.gain > MARGIN


_SIZES = np.array(CURVE_SIZES, np.int64)


def _context_bin(context: int | None) -> int | None:
    return None if context is None else context // CONTEXT_BIN


class FixedBudget:
    """Verify the `cap` most probable nodes of every tree."""

    curve = None  # no cost model

    def __init__(self, cap: int):
        self.cap = cap

    def start(self, *_) -> None:
        pass

    def wants_tree(self) -> bool:
        return True

    def fit(self, tree: CandidateTree, propose_seconds: float, position: int, context: int) -> CandidateTree:
        return tree if len(tree) <= self.cap else tree.subtree(prune_order(tree)[: self.cap])

    def observe(self, step: StepRecord, generated: list[int], finished: bool) -> None:
        pass

    def summary(self) -> None:
        return None


@dataclass
class _Proposal:
    """A proposed tree awaiting its score: scored once the output leaves it or passes its leaves."""

    position: int  # output position of the tree's root's first child
    tree: CandidateTree  # exact policies: the whole proposal; relaxed: the verified part (their only evidence)
    cells: np.ndarray  # its nodes' acceptance cells
    depth: int  # its deepest node's depth
    accepted: int | None = None  # verified: nodes the policy accepted


class AutoBudget:
    """max_nodes="auto": each step verifies the prefix of the tree that maximises expected tokens per second.

    Acceptance is learned per (probability, depth) cell. For the exact policies every proposed tree is
    scored, verified or not, against the tokens that followed it: what they accept is exactly the
    longest tree path the output continues, so a declined tree teaches as much as a verified one.
    Relaxed policies accept drafts the output would not have matched, so only their verified trees
    are scored, and every EXPLORE_EVERY-th declined tree is verified anyway (EXPLORE_NODES nodes) so
    the estimate keeps up. Asking the retriever costs its time: while the trees asked for promise less
    than that (a running mean of their expected gain), it is asked on every 2nd, 4th, up to
    (MAX_SKIP + 1)th step only. The cost curve is measured once per model; the costs and acceptance
    learned are shared by sessions with the same retriever and policy kind.
    """

    cap = AUTO_MAX_NODES

    def __init__(self, exact: bool, speech_offset: int, curve: CostCurve | None = None):
        self.exact, self.offset, self.curve = exact, speech_offset, curve
        self.nodes: NodeBudget | None = None  # set by start(); until then trees are only cut to `cap`
        self._pending: deque[_Proposal] = deque()
        self._steps: list[StepRecord] = []
        self._skip = self._backoff = self._declined = 0

    def start(self, model, retriever, policy_kind: type, speaker, measure: Callable[[], CostCurve]) -> None:
        """Take the model's cost curve (measured by `measure` on first use) and the shared model: step costs
        per retriever and policy kind; acceptance apart for speakers' stores and the general store, whose
        counts run differently (one speaker's table each learned too slowly: a speaker has few utterances)."""
        measured = self.curve is None  # a curve the caller gives is taken as it is, never rescaled
        if measured:
            self.curve = _CURVES.get(model) or measure()
            _CURVES[model] = self.curve
        try:
            budgets = _BUDGETS.setdefault(retriever, {})
        except TypeError:  # a retriever that cannot be weakly referenced keeps its model per session
            budgets = {}
        key = (policy_kind, speaker is not None)
        self.nodes = budgets.get(key)
        if self.nodes is None or self.nodes.curve is not self.curve:
            costs = budgets.get(policy_kind)
            if costs is None or costs.curve is not self.curve:
                costs = budgets[policy_kind] = StepCosts(self.curve, measured, AUTO_MAX_NODES)
            self.nodes = budgets[key] = NodeBudget(self.curve, AUTO_MAX_NODES, costs=costs)

    def wants_tree(self) -> bool:
        if self._skip:
            self._skip -= 1
            return False
        return True

    def fit(self, tree: CandidateTree, propose_seconds: float, position: int, context: int) -> CandidateTree:
        """The part of `tree` worth verifying at output position `position` with `context` cached tokens."""
        if self.nodes is None or not len(tree):
            return tree if len(tree) <= self.cap else tree.subtree(prune_order(tree)[: self.cap])
        order, cells, chosen, gain, plain_seconds = choice = self.nodes.choose(tree, context)
        if not choice.pays:
            self._declined += 1
            if not self.exact and self._declined % EXPLORE_EVERY == 0:
                chosen, gain = max(chosen, min(len(order), EXPLORE_NODES)), 0.0
            else:
                chosen, gain = 0, 0.0
        kept = tree if chosen >= len(tree) else tree.subtree(order[:chosen])
        if self.exact:
            self._pending.append(_Proposal(position, tree, cells, int(tree.depths[-1])))
        elif chosen:
            kept_cells = cells if kept is tree else cells[np.sort(order[:chosen])]
            self._pending.append(_Proposal(position, kept, kept_cells, int(kept.depths[-1])))
        if self.nodes.asking_pays(gain, propose_seconds, plain_seconds):
            self._backoff = 0
        else:  # skip the retriever for 1, 3, 7, then MAX_SKIP steps
            self._backoff = self._skip = min(2 * self._backoff + 1, MAX_SKIP)
        return kept

    def observe(self, step: StepRecord, generated: list[int], finished: bool) -> None:
        """What a step did and cost; `generated` is the output so far. Taken in every OBSERVE_EVERY steps
        (and at the end): one pass over several steps keeps its code and data in cache, where a pass
        after each forward ran cold, at ~50 us a step."""
        if self.nodes is None:
            return
        if step.nodes and self._pending and self._pending[-1].position == step.position:
            self._pending[-1].accepted = step.accepted
        self._steps.append(step)
        if len(self._steps) >= OBSERVE_EVERY or finished or self.nodes.acceptance._learned < 32:
            self.nodes.costs.observe(self._steps)
            self._steps = []
            self._score(generated, finished)

    def summary(self) -> dict | None:
        """What the model holds (for reports): cost terms in microseconds, acceptance by cell."""
        if self.nodes is None:
            return None
        costs, acceptance = self.nodes.costs, self.nodes.acceptance
        sizes = list(CURVE_SIZES)
        return {"forward_ratio": float(costs.ratio), "per_token_us": 1e6 * float(costs.per_token),
                "base_us": 1e6 * costs.base, "extra_us": {n: 1e6 * float(costs.extra[n]) for n in sizes},
                "calibration": acceptance.calibration, "ask_gain": self.nodes.ask_gain,
                "ask_us": 1e6 * (self.nodes.ask_seconds or 0.0),
                "acceptance": np.round(acceptance.table.reshape(acceptance.shape), 4).tolist()}

    def _score(self, generated: list[int], finished: bool) -> None:
        """Teach the acceptance table every proposal the output has left (or passed the leaves of)."""
        acceptance = self.nodes.acceptance
        while self._pending:
            proposal = self._pending[0]
            continuation = np.array(generated[proposal.position:proposal.position + proposal.depth], np.int64)
            # a relaxed policy: what it accepted, not what the output matched later
            cap = -1 if self.exact else (proposal.accepted or 0)
            predicted, accepted = _score(proposal.tree.tokens, proposal.tree.parents, proposal.cells,
                                         continuation - self.offset, proposal.depth, finished, cap,
                                         acceptance.seen, acceptance.hits, acceptance._centres)
            if predicted < 0:
                return
            self._pending.popleft()
            acceptance.learned(predicted, accepted)


_CURVES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its measured CostCurve
_BUDGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""retriever -> {policy class: its StepCosts, (policy class, speaker store?): its NodeBudget (sharing those costs)}"""

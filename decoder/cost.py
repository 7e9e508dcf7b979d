"""Node budgets: how many of a proposed tree's nodes a decode step verifies.

Verifying N nodes costs one forward over 1 + N tokens. On a GPU that is nearly the price of one token;
on a CPU it jumps at N = 1 (a 2-row matrix multiply costs about twice a 1-row one) and then grows
slowly, and a step also pays for the retriever's call, the mask, the policy's walk over the tree and
the cache compaction, which no forward-time curve shows. A session's budget has two calls:
`nodes()` (this step's cap; 0: do not ask the retriever) and `observe(tokens, seconds)` (what the
whole step emitted and took). `FixedBudget` keeps the N most probable nodes of every tree.
`AutoBudget` (max_nodes="auto", the default) measures instead of predicting: `ArmRates` runs the
caps in ARMS in blocks of steps, keeps each one's tokens per second of wall-clock and how sure that
is, and runs the fastest, trying the others as often as they might be faster.
"""

from __future__ import annotations

import math
import random
import threading
import weakref
from dataclasses import asdict, dataclass

import numpy as np
from numba import njit

from ..retriever.tree import CandidateTree

CURVE_SIZES = (0, 1, 2, 4, 8, 16, 32, 64)  # the tree sizes a verify-cost curve is measured at

ARMS = (0, 4, 8, 16, 32, 64)
"""The caps "auto" chooses among; 0 is the plain step (the retriever is not asked). No 1 or 2: where the
forward is flat to 4 nodes (bfloat16, a GPU) 4 costs what they do and accepts more; where it jumps at 1
(float32 on a CPU: 1.2-2x a plain step) they ran slower than plain steps on the sample where 8 ran 9%
faster, and trying them only cost lossless sampling time."""
FIRST_ARM = 8  # tried first: a middle cap
BLOCK = 8  # steps in a row under one cap: the unit a cap is chosen and measured by
TRIES = 2  # blocks counted for every cap before its rate counts (after a warm-up block: a cap's first
# block, the first steps of a process, ran at 0.4x its rate)
HALF_LIFE = 1024  # blocks after which a block's weight in its cap's rate has halved: rates follow drift
DECAY = 0.5 ** (1 / HALF_LIFE)
BLOCK_CV = 0.1  # the least spread assumed of a block's tokens per second: a rate is never certain (plain
# steps emit one token each and their blocks vary by ~5%; 0.25 kept trees tried in 7% of lossless sampling steps)
RECHECK = 128  # blocks after which a cap in the running runs again, however slow it looked: a cap measured only
# at the start (a cold process: the first cap once read 25% slow and was never run again) or before the target
# or machine changed. 4x as many for a cap not CLOSE to the fastest tree cap, and where plain steps lead, where
# rechecks are the only way trees run (Thompson draws among trees within a few % of plain steps ran them in
# 28% of lossless sampling's steps and cost 2.6% against a control; rechecks every 128 blocks, 1-2%)
CLOSE = 0.8  # a cap within 20% of the fastest one's weighed rate is close to it
MARGIN = 0.04  # a tree cap must look 4% faster than plain steps: plain steps cost nothing to get wrong (the
# retriever is not asked), and within 5% of the fastest cap is close enough
STAY = 0.02  # the cap that ran last is drawn 2% higher: a switch costs a warm-up block's slowdown
OUTLIER = 4.0  # a step over 4x its block's median step counts as 4x: a GC pause, a preempted process, or a new
# shape's first forwards on a GPU (three of those once priced a whole cap at 48 ms a step)


def node_cap(max_nodes: int | str) -> int:
    """The most tree nodes a step may verify under `max_nodes` (an int, or "auto")."""
    return ARMS[-1] if max_nodes == "auto" else int(max_nodes)


@dataclass
class CostCurve:
    """Seconds of one verify forward with `sizes[i]` tree nodes (plus the root) with `context` tokens
    cached. What benchmarks report; the auto budget measures whole steps instead."""

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


class FixedBudget:
    """Verify the `cap` most probable nodes of every tree."""

    def __init__(self, cap: int):
        self.cap = cap

    def nodes(self) -> int:
        return self.cap

    def observe(self, tokens: int, seconds: float) -> None:
        pass

    def summary(self) -> None:
        return None


class ArmRates:
    """Tokens per second of wall-clock under each cap in `arms`, and which cap the next steps run.

    Caps run in blocks of BLOCK steps; a block's rate is its tokens over its seconds (retriever calls,
    forward, walk and compaction: the speed-up users see, whatever the model, machine, policy or store).
    Each cap's rate is the ratio of its counted blocks' discounted sums (weights halving every HALF_LIFE
    blocks), with a standard error from the blocks' spread. A block right after another cap's is a warm-up
    and not counted (`_close_block`). Each block runs the plain step (cap 0) or one of the caps next to the
    fastest tree cap so far (one size smaller, the same, one larger): one not yet counted TRIES times, or
    not run for RECHECK blocks (4x as many unless within 20% of a tree cap that is the fastest), else the
    plain step if it is the fastest, else the one whose rate, drawn from a normal around its estimate with
    that standard error, is highest (Thompson sampling). The plain step's rate counts MARGIN higher, in
    choosing the fastest and in the draw, and the cap that ran last STAY higher in the draw. The first cap
    is measured again once the caps next to it have been: its first blocks ran in a cold process.

    So caps are compared over the same stretch of utterances and load, a clearly slower cap is seldom
    run again, and near-equal ones share the blocks in long runs. Rate against tree cap rises to one peak
    (more nodes accept more, at a rising cost), so looking next to the fastest finds the best without
    running caps far from it; the plain step and the best tree cap are always in the running, so neither
    locks the other out after an unlucky start (the plain step's rate is no guide to trees': on the sample
    1-2 nodes ran slower than plain steps where 8 ran 9% faster); rechecks notice a changed target or
    machine. Shared by the sessions of one model, retriever and policy kind (thread-safe), so what one
    utterance measured the next one uses.
    """

    def __init__(self, arms=ARMS, first: int = FIRST_ARM, seed: int = 0):
        self.arms = tuple(arms)
        # per cap, discounted sums over its counted blocks (t tokens, s seconds): weight, t, s, t², ts, s².
        # Plain Python floats: a block's bookkeeping in NumPy cost ~200 us here, 1% of a small model's time
        self._sums = [[0.0] * 6 for _ in self.arms]
        self.blocks = [0] * len(self.arms)  # blocks run per cap, all time
        self._counted = [0] * len(self.arms)  # blocks counted in each cap's rate
        self._count = 0  # blocks run, all caps
        self._last = [0] * len(self.arms)  # the block count when each cap last ran
        # the order untried caps run in: `first`, then the others from the plain step up
        self._order = [self.arms.index(first)] + [i for i, cap in enumerate(self.arms) if cap != first]
        self._cold = True  # the first cap has not been measured again yet
        self._best = self._best_tree = self._order[0]
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._arm, self._tokens, self._seconds = self._best, 0, []  # the block running, and its steps so far
        self._previous: int | None = None  # the cap of the block before it
        self._held: tuple[int, float, float] | None = None  # a tree block (cap, t, s) not yet counted
        self._charge = 0.0  # a tree warm-up's seconds after plain steps, beyond its cap's rate

    def choose(self) -> int:
        """The index (into `arms`) of the cap the next step runs."""
        return self._arm

    def record(self, arm: int, tokens: int, seconds: float) -> None:
        """A step under cap `arms[arm]` emitted `tokens` tokens in `seconds`; the block ends after BLOCK."""
        with self._lock:
            if arm != self._arm:  # chosen before its block ended (a session in another thread): left out
                return
            self._tokens += tokens
            self._seconds.append(seconds)
            if len(self._seconds) == BLOCK:
                steps = sorted(self._seconds)
                cap = OUTLIER * (steps[(BLOCK - 1) // 2] + steps[BLOCK // 2]) / 2
                warm_up = self._close_block(arm, self._tokens, sum(min(step, cap) for step in steps))
                self._arm, self._tokens, self._seconds = arm if warm_up else self._next_block(), 0, []

    def _close_block(self, arm: int, t: float, s: float) -> bool:
        """Count a finished block; True if it was a warm-up, and the same cap runs the next block.

        A cap's steps right after another cap's run slower than among themselves (the sample's CPU: plain
        steps after tree steps 4-14%, a tree cap after another cap 6-15% in a full bench run; a burst of any
        other work does it, even a busy loop; and a process's, a shape's first forwards). Counted, that
        favours whichever cap runs longest, so a block right after another cap's, or the first, is a
        warm-up: not counted. The seconds of a plain warm-up after trees beyond the plain rate are charged
        to the tree block before it (held until then), and a tree warm-up's after plain steps beyond its
        own rate to its next block: going between plain steps and trees is part of what trees cost."""
        previous, self._previous = self._previous, arm
        plain = self.arms[arm] == 0
        self.blocks[arm] += 1
        self._count += 1
        self._last[arm] = self._count
        weight, tokens, seconds = self._sums[arm][:3]
        extra = s - t * seconds / tokens if weight > 0.0 else 0.0  # beyond this cap's rate
        if self._held is not None:  # the block before was a counted tree block
            held, held_t, held_s = self._held
            self._held = None
            self._add(held, held_t, held_s + (extra if plain else 0.0))
        if previous != arm:
            self._charge = extra if not plain and previous is not None and self.arms[previous] == 0 else 0.0
            return True
        self._counted[arm] += 1
        if plain:
            self._add(arm, t, s)
        else:
            self._held, self._charge = (arm, t, s + self._charge), 0.0
        return False

    def _add(self, arm: int, t: float, s: float) -> None:
        for sums in self._sums:
            sums[:] = [x * DECAY for x in sums]
        self._sums[arm] = [a + b for a, b in zip(self._sums[arm], (1.0, t, s, t * t, t * s, s * s))]

    def _next_block(self) -> int:
        estimates = [self._estimate(i) for i in range(len(self.arms))]  # (rate, standard error) per cap
        weighed = [rate * self._handicap(i) for i, (rate, _) in enumerate(estimates)]
        tried = [i for i, n in enumerate(self._counted) if n >= TRIES]
        if tried:
            self._best = max(tried, key=weighed.__getitem__)
        trees = [i for i in tried if self.arms[i] > 0]
        if trees:
            self._best_tree = max(trees, key=lambda i: estimates[i][0])
        near = [i for i in self._order if i in (self._best_tree - 1, self._best_tree, self._best_tree + 1, 0)]
        untried = [i for i in near if self._counted[i] < TRIES]
        if not untried and self._cold:  # measure the first cap again, now that the process is warm
            self._cold, first = False, self._order[0]
            self._sums[first], self._counted[first] = [0.0] * 6, 0
            untried = [first] if first in near else []
        if untried:
            return untried[0]
        tree_fastest, top = self.arms[self._best] > 0, weighed[self._best]
        stale = [i for i in near if self._count - self._last[i]
                 > (RECHECK if tree_fastest and weighed[i] > CLOSE * top else 4 * RECHECK)]
        if stale:
            return stale[0]
        if not tree_fastest:  # plain steps lead: trees run only in rechecks
            return self._best
        return max(near, key=lambda i: self._random.gauss(*estimates[i]) * self._handicap(i)
                   * (1.0 + STAY if i == self._previous else 1.0))

    def _handicap(self, arm: int) -> float:
        """What a cap's rate is weighed with: the plain step's raised by MARGIN."""
        return 1.0 + MARGIN if self.arms[arm] == 0 else 1.0

    def _estimate(self, arm: int) -> tuple[float, float]:
        """Cap `arms[arm]`'s rate and its standard error (the ratio estimator's, from its blocks' spread)."""
        w, t, s, tt, ts, ss = self._sums[arm]
        if w <= 0.0 or s <= 0.0:
            return 0.0, 0.0
        rate = t / s
        spread = max((tt - 2 * rate * ts + rate * rate * ss) / w, (BLOCK_CV * t / w) ** 2)
        return rate, math.sqrt(spread / w) / (s / w)

    def summary(self) -> dict:
        """Each cap's rate, standard error and steps run (for reports), and the fastest."""
        tried = [n >= TRIES for n in self._counted]
        estimates = [self._estimate(i) if ok else (None, None) for i, ok in enumerate(tried)]
        return {"rates": {str(cap): estimates[i][0] for i, cap in enumerate(self.arms)},
                "errors": {str(cap): estimates[i][1] for i, cap in enumerate(self.arms)},
                "steps": {str(cap): BLOCK * self.blocks[i] for i, cap in enumerate(self.arms)},
                "fastest": self.arms[self._best]}


class AutoBudget:
    """max_nodes="auto": each step runs the cap `ArmRates` chooses and reports what it emitted and took.

    The rates are shared per (model, retriever, policy kind, speaker's store or the general store): their
    acceptance differs, so their best caps do. A retriever that cannot be weakly referenced keeps
    its rates per session."""

    def __init__(self, model, retriever, policy_kind: type, speaker):
        key = (policy_kind, speaker is not None)
        try:
            shared = _RATES.setdefault(model, weakref.WeakKeyDictionary()).setdefault(retriever, {})
        except TypeError:
            shared = {}
        if key not in shared:
            shared[key] = ArmRates()
        self.rates = shared[key]
        self._arm: int | None = None

    def nodes(self) -> int:
        self._arm = self.rates.choose()
        return self.rates.arms[self._arm]

    def observe(self, tokens: int, seconds: float) -> None:
        if self._arm is not None:
            self.rates.record(self._arm, tokens, seconds)
            self._arm = None

    def summary(self) -> dict:
        return self.rates.summary()


_RATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> retriever -> {(policy class, speaker's store?): ArmRates}"""

"""Node budgets: how many of a proposed tree's nodes a decode step verifies.

Verifying N nodes costs one forward over 1 + N tokens. On a GPU that is nearly the price of one token;
on a CPU it jumps at N = 1 (a 2-row matrix multiply costs about twice a 1-row one) and then grows
slowly, and a step also pays for the retriever's call, the mask, the policy's walk over the tree and
the cache compaction, which no forward-time curve shows. A session's budget has three calls:
`nodes(position)` (the cap of a step `position` tokens into the utterance; 0: do not ask the retriever),
`observe(tokens, seconds)` (what the whole step emitted and took) and `finish()` (the utterance ended).
`FixedBudget` keeps the N most probable nodes of every tree.
`AutoBudget` (max_nodes="auto", the default) measures instead of predicting: each utterance (a stint)
runs one of the caps in ARMS from its first step to its last, `ArmRates` keeps each cap's tokens per second of
wall-clock over its stints and how sure that is, and the next utterances run the fastest, trying the others as
often as they might be faster. Under a lossless policy, whose tokens do not depend on the tree, each utterance
also says how many steps the caps next to the fastest would have taken over one window of its tokens, so those
caps are compared on the same tokens instead of on utterances that differ in how predictable they are.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
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
STINT = 512  # the most steps a stint runs: an utterance's steps, or STINT of them in a longer one. Caps change only
# between stints: on the sample's CPU a cap's steps right after another cap's ran 6-18% slower for 8-24 steps, and
# choosing a cap per block of 8 steps made 4.4% fewer tokens a second than fixed 4 where it ran 4 in 84% of its
# steps (for three of five policies, utterances it switched in ran 2-7% slower, paired, than those it did not)
TRIES = 2  # stints counted for every cap before its rate counts
SETTLE = 5 * TRIES  # stints before "auto" first chooses by its rates: TRIES each of the first cap, the plain
# step, one size smaller and one larger, then of the first cap again (its first ran in a cold process)
HALF_LIFE = 256  # stints after which a stint's weight in its cap's rate has halved: rates follow drift
DECAY = 0.5 ** (1 / HALF_LIFE)
STINT_CV = 0.1  # the least spread assumed of a tree stint's tokens per second: a rate is never certain (on the
# sample stints of one cap vary 26-41%)
RECHECK = 32  # stints after which a cap in the running runs again, however slow it looked: a cap measured only at
# the start (a cold process: the first cap once read 25% slow and was never run again) or before the target or
# machine changed. Twice as many for a cap not CLOSE to the fastest tree cap, and where plain steps lead, where
# rechecks are the only way trees run (Thompson draws among trees within a few % of plain steps ran them in 28% of
# lossless sampling's steps and cost 2.6% against a control)
CLOSE = 0.8  # a cap within 20% of the fastest one's weighed rate is close to it
MARGIN = 0.04  # a tree cap must look 4% faster than plain steps: plain steps cost nothing to get wrong (the
# retriever is not asked), and within 5% of the fastest cap is close enough
WINDOW = 32  # tokens of a lossless utterance over which the caps next to the fastest are compared step for step
COUNT_SHARE = 0.01  # the most of the stints' time that counting windows may take: replaying a cap costs a
# retriever call per step it would take (on the sample 0.07 ms beside a 2.3 ms step: about 1% of an utterance for
# the two or three caps compared; far more with a slow retriever, which then counts fewer windows)
MIN_WINDOWS = 4  # windows counted for a tree cap before its rate is its seconds per step times its steps per token
STEP_CV = 0.02  # the least spread assumed of a stint's seconds per step (on the sample 3-7% at one cap)
OUTLIER = 4.0  # a step over 4x its stint's median step counts as 4x: a GC pause, a preempted process, or a new
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

    def nodes(self, position: int = 0) -> int:
        return self.cap

    def observe(self, tokens: int, seconds: float) -> None:
        pass

    def finish(self) -> None:
        pass

    def summary(self) -> None:
        return None


class Ratio:
    """A ratio estimator: sum(y) / sum(x) over records weighed by recency, and its standard error from the
    records' spread (at least `cv` of the ratio per record)."""

    def __init__(self):
        self.sums = [0.0] * 6  # weight, x, y, x², xy, y²

    @property
    def weight(self) -> float:
        return self.sums[0]

    def add(self, x: float, y: float) -> None:
        self.sums = [a + b for a, b in zip(self.sums, (1.0, x, y, x * x, x * y, y * y))]

    def decay(self) -> None:
        self.sums = [a * DECAY for a in self.sums]

    def estimate(self, cv: float) -> tuple[float, float]:
        w, x, y, xx, xy, yy = self.sums
        if w <= 0.0 or x <= 0.0:
            return 0.0, 0.0
        ratio = y / x
        spread = max((yy - 2 * ratio * xy + ratio * ratio * xx) / w, (cv * y / w) ** 2)
        return ratio, math.sqrt(spread / w) / (x / w)


class ArmRates:
    """Tokens per second of wall-clock under each cap in `arms`, and which cap the next stint runs.

    A stint is one utterance's steps under one cap (STINT of them at most); its rate is its tokens over its
    seconds (retriever calls, forward, walk and compaction: the speed-up users see, whatever the model, machine,
    policy or store). Each cap's rate is the ratio of its stints' discounted sums (weights halving every
    HALF_LIFE stints), with a standard error from the stints' spread. Under a lossless policy a tree cap's rate
    is instead its stints' seconds per step times its steps per token over the windows counted for it: every
    utterance counts, in one window of its tokens, the steps of the tree caps next to the fastest (`compared`),
    so those caps are compared on the same tokens, and only seconds per step, which vary far less between
    utterances than tokens per step (on the sample 3-7% against 8-24%), come from the stints each cap ran.
    Each stint runs the plain step (cap 0) or one of the caps next to the fastest tree cap so far (one size
    smaller, the same, one larger): one not yet counted TRIES times, or not run for RECHECK stints (twice as
    many unless within 20% of a tree cap that is the fastest), else the plain step if it is the fastest, else
    the one whose rate, drawn from a normal around its estimate with that standard error, is highest (Thompson
    sampling). The plain step's rate counts MARGIN higher, in choosing the fastest and in the draw. The first
    cap is measured again once the caps next to it have been: its first stints ran in a cold process.

    Caps change only between utterances, where a prefill runs anyway: within one, a change slows the steps after
    it, and counted or not, that slowdown made short blocks of steps cost more than choosing among caps saved.
    A clearly slower cap is seldom run again, and near-equal ones share the stints in long runs. Rate against
    tree cap rises to one peak (more nodes accept more, at a rising cost), so looking next to the fastest finds
    the best without running caps far from it; the plain step and the best tree cap are always in the running,
    so neither locks the other out after an unlucky start (the plain step's rate is no guide to trees': on the
    sample 1-2 nodes ran slower than plain steps where 8 ran 9% faster); rechecks notice a changed target or
    machine. Shared by the sessions of one model, retriever and policy kind (thread-safe: concurrent sessions
    run their own stints), so what one utterance measured the next one uses.
    """

    def __init__(self, arms=ARMS, first: int = FIRST_ARM, seed: int = 0):
        self.arms = tuple(arms)
        self._rate = [Ratio() for _ in self.arms]  # per cap over its stints: tokens (y) per second (x)
        self._step_time = [Ratio() for _ in self.arms]  # per cap over its stints: seconds (y) per step (x)
        self._step_count = [Ratio() for _ in self.arms]  # per tree cap over windows: steps (y) per token (x)
        self.steps = [0] * len(self.arms)  # steps recorded per cap, all time
        self._counted = [0] * len(self.arms)  # stints counted in each cap's rate
        self._started = 0  # stints started, all caps
        self._last = [0] * len(self.arms)  # `_started` when each cap's last stint started
        # the order untried caps run in: `first`, then the others from the plain step up
        self._order = [self.arms.index(first)] + [i for i, cap in enumerate(self.arms) if cap != first]
        self._cold = True  # the first cap has not been measured again yet
        self._best = self._best_tree = self._order[0]
        self._random = random.Random(seed)
        self._allowance = 0.0  # seconds that counting windows may still take: COUNT_SHARE of the stints' time
        self._lock = threading.Lock()

    def choose(self) -> int:
        """The index (into `arms`) of the cap the next stint runs."""
        with self._lock:
            arm = self._next_stint()
            self._started += 1
            self._last[arm] = self._started
            return arm

    def compared(self) -> list[int]:
        """The tree caps (indices) whose steps a lossless stint should count over a window of its tokens: those
        next to the fastest tree cap, while counting has taken under COUNT_SHARE of the stints' time (none else)."""
        with self._lock:
            if self._allowance < 0.0:
                return []
            return [i for i in (self._best_tree - 1, self._best_tree, self._best_tree + 1)
                    if 0 <= i < len(self.arms) and self.arms[i] > 0]

    def record(self, arm: int, tokens: int, seconds: list[float], window: dict[int, int] | None = None,
               window_tokens: int = 0, counting_seconds: float = 0.0) -> None:
        """A stint under cap `arms[arm]` emitted `tokens` tokens in steps that took `seconds`; under a lossless
        policy `window` gives, for caps (by index) in `compared()`, the steps each takes to emit the same
        `window_tokens` tokens of it, which took `counting_seconds` to count."""
        if not seconds:
            return
        cap = OUTLIER * statistics.median(seconds)
        clipped = sum(min(step, cap) for step in seconds)
        with self._lock:
            self._allowance += COUNT_SHARE * sum(seconds) - counting_seconds
            self.steps[arm] += len(seconds)
            self._counted[arm] += 1
            for ratio in (*self._rate, *self._step_time, *self._step_count):
                ratio.decay()
            self._rate[arm].add(clipped, float(tokens))
            self._step_time[arm].add(float(len(seconds)), clipped)
            for other, steps in (window or {}).items():
                self._step_count[other].add(float(window_tokens), float(steps))

    def _next_stint(self) -> int:
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
            self._rate[first], self._step_time[first], self._counted[first] = Ratio(), Ratio(), 0
            untried = [first] if first in near else []
        if untried:
            return untried[0]
        tree_fastest, top = self.arms[self._best] > 0, weighed[self._best]
        stale = [i for i in near if self._started - self._last[i]
                 > (RECHECK if tree_fastest and weighed[i] > CLOSE * top else 2 * RECHECK)]
        if stale:
            return stale[0]
        if not tree_fastest:  # plain steps lead: trees run only in rechecks
            return self._best
        return max(near, key=lambda i: self._random.gauss(*estimates[i]) * self._handicap(i))

    def _handicap(self, arm: int) -> float:
        """What a cap's rate is weighed with: the plain step's raised by MARGIN."""
        return 1.0 + MARGIN if self.arms[arm] == 0 else 1.0

    def _estimate(self, arm: int) -> tuple[float, float]:
        """Cap `arms[arm]`'s rate and its standard error: one over its stints' seconds per step for the plain step
        (one token a step), else its stints' tokens per second, or under a lossless policy, once MIN_WINDOWS windows
        counted it, one over (seconds per step x steps per token)."""
        seconds, seconds_error = self._step_time[arm].estimate(STEP_CV)
        if not seconds:
            return 0.0, 0.0
        if self.arms[arm] == 0:
            return 1.0 / seconds, seconds_error / seconds ** 2
        if self._step_count[arm].weight < MIN_WINDOWS:
            return self._rate[arm].estimate(STINT_CV)
        steps, steps_error = self._step_count[arm].estimate(0.0)
        rate = 1.0 / (seconds * steps)
        return rate, rate * math.hypot(seconds_error / seconds, steps_error / steps)

    def summary(self) -> dict:
        """Each cap's rate, standard error and steps run (for reports), and the fastest."""
        with self._lock:
            tried = [n >= TRIES for n in self._counted]
            estimates = [self._estimate(i) if ok else (None, None) for i, ok in enumerate(tried)]
            return {"rates": {str(cap): estimates[i][0] for i, cap in enumerate(self.arms)},
                    "errors": {str(cap): estimates[i][1] for i, cap in enumerate(self.arms)},
                    "steps": {str(cap): self.steps[i] for i, cap in enumerate(self.arms)},
                    "fastest": self.arms[self._best]}


class AutoBudget:
    """max_nodes="auto": each utterance runs, as one stint, the cap `ArmRates` chooses at its first step (a
    new one after STINT steps), and its tokens and step times count when it ends (`finish`).

    `count_steps(cap, start, stop)`, given for a lossless policy, says how many steps cap `cap` takes to emit
    the session's tokens `start:stop` (None: it could not tell); a stint then counts one window of WINDOW
    tokens, starting at one of its steps, for the caps `ArmRates.compared()` names (its own cap's steps are
    those it ran).
    The rates are shared per (model, retriever, policy kind, speaker's store or the general store): their
    acceptance differs, so their best caps do. A retriever that cannot be weakly referenced keeps
    its rates per session."""

    def __init__(self, model, retriever, policy_kind: type, speaker, count_steps=None):
        key = (policy_kind, speaker is not None)
        try:
            shared = _RATES.setdefault(model, weakref.WeakKeyDictionary()).setdefault(retriever, {})
        except TypeError:
            shared = {}
        if key not in shared:
            shared[key] = ArmRates()
        self.rates = shared[key]
        # weakly: a session holds its budget, and its KV cache should go when the session does
        self._count_steps = None if count_steps is None else weakref.WeakMethod(count_steps)
        self._arm: int | None = None
        self._tokens, self._seconds, self._starts = 0, [], []

    def nodes(self, position: int = 0) -> int:
        """This step's cap; `position`: how many tokens the session has generated."""
        if self._arm is None or len(self._seconds) >= STINT:
            self.finish()
            self._arm = self.rates.choose()
        self._starts.append(position)
        return self.rates.arms[self._arm]

    def observe(self, tokens: int, seconds: float) -> None:
        if self._arm is not None:
            self._tokens += tokens
            self._seconds.append(seconds)

    def finish(self) -> None:
        """The utterance (or a STINT of it) ended: its stint counts."""
        if self._arm is not None:
            began = time.perf_counter()
            window, tokens = self._window()
            self.rates.record(self._arm, self._tokens, self._seconds, window, tokens, time.perf_counter() - began)
        self._arm, self._tokens, self._seconds, self._starts = None, 0, [], []

    def _window(self) -> tuple[dict[int, int], int]:
        """Steps per compared cap over one window of this stint's tokens, and its tokens (none without
        `count_steps`)."""
        count_steps = self._count_steps and self._count_steps()
        compared = self.rates.compared() if count_steps is not None and self._seconds else []
        if not compared:
            return {}, 0
        starts = self._starts[: len(self._seconds)]
        start, stop = pick_window(starts, starts[0] + self._tokens, _WINDOWS)
        window = {arm: (steps_within(starts, start, stop) if arm == self._arm
                        else count_steps(self.rates.arms[arm], start, stop)) for arm in compared}
        if None in window.values():  # the retriever failed or was slow: no window this time
            return {}, 0
        return window, stop - start

    def summary(self) -> dict:
        return self.rates.summary()


def pick_window(starts: list[int], end: int, draw: random.Random) -> tuple[int, int]:
    """A window of WINDOW tokens (fewer if the stint is shorter) starting at one of the steps `starts` of a
    stint that ends at token `end`: (start, stop)."""
    start = draw.choice([s for s in starts if s + WINDOW <= end] or starts[:1])
    return start, min(start + WINDOW, end)


def steps_within(starts: list[int], start: int, stop: int) -> int:
    """How many of the steps `starts` start in tokens `start:stop`: a stint's own steps over a window."""
    return sum(start <= s < stop for s in starts)


_WINDOWS = random.Random(0)  # where each stint's window starts


_RATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> retriever -> {(policy class, speaker's store?): ArmRates}"""

"""Node budgets: how many of a proposed tree's nodes each decode step verifies.

A session asks its budget three things (`NodeBudget`): `cap(position)`, the most nodes this step may verify
(0: a plain step, the retriever is not asked); `observe(tokens, seconds)`, what the step emitted and took;
`finish()`, the utterance ended. Two budgets ship:

- `FixedBudget(cap)`: every step verifies the `cap` most probable nodes. The default, `FixedBudget(NODES)`:
  a session's tokens then depend only on its model, store, inputs, policy and seed.
- `AdaptiveBudget(rates)`: each utterance runs the cap that `rates` (a `CapRates`) measured fastest in
  tokens per second of wall-clock, and re-checks the others now and then. The rates learn from the
  utterances of every session given them: share one `CapRates` between the sessions of one model, store and
  policy on purpose. The choice depends on timings, so under a relaxed policy, whose tokens depend on the
  tree, the tokens do too; under a lossless one they do not (only the speed does).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Protocol

NODES = 8
"""The default cap: on the shipped sample (CPU, float32) the fastest fixed cap for every policy within 3%. A
session passes its cap with every proposal, so the retriever's own default (retriever.tree.MAX_NODES, 16: what a
proposal keeps when its caller sets no budget) never applies to a decoder."""

CAPS = (8, 0, 4)
"""The caps an adaptive budget compares, in the order first tried: a middle tree, plain steps (trees that do
not pay cost time and emit nothing more), a small tree."""
TRIES = 2  # utterances each cap runs before the fastest is chosen
RECENT = 16  # a cap's rate: its tokens over its seconds in its last RECENT utterances, so that it follows drift
RECHECK = 32  # every RECHECK-th utterance runs the cap not run for longest: a slow start is not final, and a
# recheck costs at most 1/RECHECK of the time (RECENT 16 and RECHECK 32 did 1-4% better than 8 and 16 on the
# replays in docs/auto_budget.md)


class NodeBudget(Protocol):
    """What a session asks of its node budget."""

    def cap(self, position: int) -> int:
        """The most tree nodes the step `position` tokens into the utterance may verify (0: no retriever call)."""

    def observe(self, tokens: int, seconds: float) -> None:
        """The step emitted `tokens` tokens and took `seconds` (retriever call, forward, walk, compaction)."""

    def finish(self) -> None:
        """The utterance ended."""


class FixedBudget:
    """Verify the `cap` most probable nodes of every tree."""

    def __init__(self, cap: int = NODES):
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
            raise ValueError(f"a node cap is a non-negative int, got {cap!r}")
        self.nodes = cap

    def cap(self, position: int) -> int:
        return self.nodes

    def observe(self, tokens: int, seconds: float) -> None:
        pass

    def finish(self) -> None:
        pass


class CapRates:
    """Tokens per second of wall-clock under each cap in `caps`, and the cap the next utterance runs.

    Each cap runs TRIES utterances first (in the order of `caps`); then the fastest runs, except every
    RECHECK-th utterance, which runs the cap that has waited longest. A cap's rate is its tokens over its
    seconds in its last RECENT utterances. Thread-safe: sessions decoding at once may share one.
    """

    def __init__(self, caps=CAPS):
        self.caps = tuple(caps)
        self._recent = {cap: deque(maxlen=RECENT) for cap in self.caps}  # (tokens, seconds) per utterance
        self._runs = {cap: 0 for cap in self.caps}  # utterances run under each cap
        self._last = {cap: 0 for cap in self.caps}  # the number of the utterance each cap last ran
        self._started = 0
        self._lock = threading.Lock()

    def choose(self) -> int:
        """The cap the next utterance runs."""
        with self._lock:
            self._started += 1
            untried = [cap for cap in self.caps if self._runs[cap] < TRIES]
            if untried:
                cap = untried[0]
            else:
                cap = self._fastest()
                if self._started % RECHECK == 0:
                    cap = min((c for c in self.caps if c != cap), key=self._last.__getitem__)
            self._runs[cap] += 1
            self._last[cap] = self._started
            return cap

    def record(self, cap: int, tokens: int, seconds: float) -> None:
        """An utterance under `cap` emitted `tokens` tokens in steps that took `seconds` in all."""
        if seconds > 0:
            with self._lock:
                self._recent[cap].append((tokens, seconds))

    def rate(self, cap: int) -> float | None:
        """Tokens per second under `cap` over its recent utterances (None before any)."""
        recent = self._recent[cap]
        return sum(t for t, _ in recent) / sum(s for _, s in recent) if recent else None

    def _fastest(self) -> int:
        return max((cap for cap in self.caps if self._recent[cap]), key=self.rate, default=self.caps[0])

    def summary(self) -> dict:
        """Each cap's rate and utterances run (for reports), and the fastest."""
        with self._lock:
            return {"rates": {str(cap): self.rate(cap) for cap in self.caps},
                    "utterances": {str(cap): self._runs[cap] for cap in self.caps}, "fastest": self._fastest()}


class AdaptiveBudget:
    """One utterance's budget: the cap `rates` chooses at its first step, for all its steps; its tokens and
    seconds go to `rates` when it finishes. Make one per session; share the `rates`."""

    def __init__(self, rates: CapRates | None = None):
        self.rates = rates if rates is not None else CapRates()
        self.nodes: int | None = None
        self._tokens, self._seconds = 0, 0.0

    def cap(self, position: int) -> int:
        if self.nodes is None:
            self.nodes = self.rates.choose()
        return self.nodes

    def observe(self, tokens: int, seconds: float) -> None:
        self._tokens += tokens
        self._seconds += seconds

    def finish(self) -> None:
        if self.nodes is not None:
            self.rates.record(self.nodes, self._tokens, self._seconds)
        self.nodes, self._tokens, self._seconds = None, 0, 0.0

    def summary(self) -> dict:
        return self.rates.summary()

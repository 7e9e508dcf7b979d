"""The verify-cost curve the bench reports: what a forward over a tree costs against its size on this machine.

Verifying N nodes costs one forward over 1 + N tokens. On a GPU that is nearly the price of one token; on a CPU it
jumps at N = 1 (a 2-row matrix multiply costs about twice a 1-row one) and then grows slowly. An adaptive node
budget measures whole steps instead (echospec.decoder.budget); this curve is what benchmarks report.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ...retriever.tree import CandidateTree

CURVE_SIZES = (0, 1, 2, 4, 8, 16, 32, 64)  # the tree sizes a verify-cost curve is measured at


@dataclass
class CostCurve:
    """Seconds of one verify forward with `sizes[i]` tree nodes (plus the root) with `context` tokens
    cached."""

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


@torch.no_grad()
def session_cost_curve(session, sizes=CURVE_SIZES, repeats: int = 5) -> CostCurve:
    """Forward time of a verify step against tree size, on a prefilled `SpeculativeSession`'s live cache (cropped
    back after each).

    Sizes are timed round-robin after a warm-up round, in a fresh order each round: a size timed
    right after the largest one runs slower (measured: the one-token step by 10-20%), and a fixed
    order put that on the one-token step every round. The shape is the median over rounds of each
    round's times relative to its own one-token step, so load that comes and goes between rounds
    (another process on the cores) cancels; taking each size's median time instead put a 1-node tree
    at 5x a plain step on a loaded 2-core machine. The shape is made non-decreasing (more tokens never
    cost less) and scaled by the one-token step's median time.
    """
    sizes = sorted({0, *(s for s in sizes if session.cached + s < session.max_positions)})
    forwards, forward_seconds = session.stats.target_forwards, session.stats.forward_seconds
    chains = [CandidateTree.from_sequences([[0] * n], max_nodes=n, max_depth=n) for n in sizes]
    orders = np.random.default_rng(0)
    rounds = [_time_chains(session, chains, orders) for _ in range(repeats + 1)]  # the first warms up
    session.stats.target_forwards, session.stats.forward_seconds = forwards, forward_seconds  # not the utterance's
    return CostCurve(sizes, _typical_curve(rounds[1:]), context=session.cached)


def _time_chains(session, chains: list[CandidateTree], orders: np.random.Generator) -> np.ndarray:
    times = np.zeros(len(chains))
    for i in orders.permutation(len(chains)).tolist():
        start = time.perf_counter()
        session.verify(chains[i])
        times[i] = time.perf_counter() - start
        session.cache.crop(-(len(chains[i]) + 1))
    return times


def _typical_curve(rounds: list[np.ndarray]) -> list[float]:
    """Median over rounds of each round's times relative to its one-token step, made non-decreasing,
    times the one-token step's median."""
    rounds = np.array(rounds)
    shape = np.maximum.accumulate(np.median(rounds / rounds[:, :1], axis=0))
    return [float(s) for s in shape * np.median(rounds[:, 0])]

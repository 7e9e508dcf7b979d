"""Quality measures for relaxed acceptance: log-mel distortion and bootstrap confidence intervals
(of quality changes, and of the speed-up).

Relaxed policies trade fidelity to the target's distribution for speed; these measures say how much,
against autoregressive sampling with the same sampler, over many utterances.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"

    def to_dict(self, estimate: str = "mean") -> dict:
        """{estimate: the point estimate, "ci95": [low, high]}; `estimate` names what it is (a mean, a median)."""
        return {estimate: self.mean, "ci95": [self.low, self.high]}


def bootstrap_ci(values, resamples: int = 2000, seed: int = 0) -> Interval:
    """Mean with a 95% percentile-bootstrap interval, resampling utterances."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return Interval(float("nan"), float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return Interval(float(values.mean()), float(low), float(high))


def relative_difference_ci(values, baseline, resamples: int = 2000, seed: int = 0) -> Interval:
    """(mean(values) - mean(baseline)) / |mean(baseline)| with a 95% paired bootstrap interval.

    `values[i]` and `baseline[i]` come from the same utterance, so resampling utterances keeps pairs
    together and the interval reflects the policy, not which sentences happened to be drawn.
    """
    def change(values, baseline):
        base = baseline.mean(axis=-1)
        return (values.mean(axis=-1) - base) / np.abs(base)

    return _paired_bootstrap(change, values, baseline, resamples, seed)


def difference_ci(values, baseline, resamples: int = 2000, seed: int = 0) -> Interval:
    """mean(values - baseline) (a score's change in its own units: WER, SIM, MOS) with a 95% paired bootstrap
    interval, resampling utterance pairs."""
    return _paired_bootstrap(lambda values, baseline: (values - baseline).mean(axis=-1), values, baseline,
                             resamples, seed)


def ratio_of_medians_ci(baseline, values, resamples: int = 2000, seed: int = 0) -> Interval:
    """median(baseline) / median(values) (the bench's speed-up from times per token) with a 95% paired
    bootstrap interval: utterance i of both lists is the same prompt, resampled together."""
    return _paired_bootstrap(lambda values, baseline: np.median(baseline, axis=-1) / np.median(values, axis=-1),
                             values, baseline, resamples, seed)


def median_ratio_ci(baseline, values, resamples: int = 2000, seed: int = 0) -> Interval:
    """The median over utterances of baseline[i] / values[i] (each utterance's own speed-up: the prompt, its
    length and the machine's state at that moment cancel) with a 95% paired bootstrap interval."""
    return _paired_bootstrap(lambda values, baseline: np.median(baseline / values, axis=-1),
                             values, baseline, resamples, seed)


def _paired_bootstrap(statistic, values, baseline, resamples: int, seed: int) -> Interval:
    """`statistic(values, baseline)` (over the last axis) with a 95% percentile-bootstrap interval,
    resampling utterance pairs; NaN when the lists are empty or of different lengths."""
    values, baseline = np.asarray(values, np.float64), np.asarray(baseline, np.float64)
    if len(values) == 0 or len(values) != len(baseline):
        return Interval(float("nan"), float("nan"), float("nan"))
    picks = np.random.default_rng(seed).integers(0, len(values), size=(resamples, len(values)))
    low, high = np.percentile(statistic(values[picks], baseline[picks]), [2.5, 97.5])
    return Interval(float(statistic(values, baseline)), float(low), float(high))


@njit(cache=True)
def dtw_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Dynamic-time-warping distance between two frame sequences, per step of the warping path.

    Euclidean frame distance; dividing by the path length keeps long and short utterances comparable.
    """
    n, m = a.shape[0], b.shape[0]
    if n == 0 or m == 0:
        return np.inf
    cost = np.full((n + 1, m + 1), np.inf)
    steps = np.zeros((n + 1, m + 1))
    cost[0, 0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            d = np.sqrt(np.sum((a[i - 1] - b[j - 1]) ** 2))
            best, length = cost[i - 1, j - 1], steps[i - 1, j - 1]
            if cost[i - 1, j] < best:
                best, length = cost[i - 1, j], steps[i - 1, j]
            if cost[i, j - 1] < best:
                best, length = cost[i, j - 1], steps[i, j - 1]
            cost[i, j] = best + d
            steps[i, j] = length + 1
    return cost[n, m] / steps[n, m]

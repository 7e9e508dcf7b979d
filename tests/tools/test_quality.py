"""The benchmark's quality measures."""

import numpy as np
import pytest

from echospec.tools.bench.quality import (
    bootstrap_ci,
    dtw_distance,
    median_ratio_ci,
    ratio_of_medians_ci,
    relative_difference_ci,
)


def test_dtw_ignores_timing_but_not_content():
    rng = np.random.default_rng(0)
    frames = rng.normal(size=(30, 8))
    stretched = np.repeat(frames, 2, axis=0)  # the same sounds, twice as slow
    assert dtw_distance(frames, frames) == 0.0
    assert dtw_distance(frames, stretched) == pytest.approx(0.0)
    other = rng.normal(size=(30, 8))
    assert dtw_distance(frames, other) > 1.0
    assert dtw_distance(frames, frames[:0]) == np.inf


def test_bootstrap_interval_brackets_the_mean_and_shrinks_with_data():
    rng = np.random.default_rng(1)
    small, large = rng.normal(5, 1, 20), rng.normal(5, 1, 2000)
    a, b = bootstrap_ci(small), bootstrap_ci(large)
    assert a.low < a.mean < a.high and b.low < b.mean < b.high
    assert (b.high - b.low) < (a.high - a.low) / 5
    assert b.low < 5 < b.high


def test_relative_difference_is_paired_by_utterance():
    rng = np.random.default_rng(2)
    baseline = rng.normal(-2, 1, 100)  # utterances differ a lot; the policy's effect is a steady -10%
    values = baseline * 1.1
    change = relative_difference_ci(values, baseline)
    assert change.mean == pytest.approx(-0.1, abs=1e-9)
    assert change.low < change.mean < change.high and change.high - change.low < 0.05
    assert np.isnan(relative_difference_ci([1.0], [1.0, 2.0]).mean)


def test_speedup_interval_is_paired_by_utterance():
    # utterance lengths vary 10x, so unpaired resampling would swing the medians far more than the 2% the
    # system saves on every utterance
    baseline = np.random.default_rng(0).uniform(1.0, 10.0, 100)
    speedup = ratio_of_medians_ci(baseline, baseline / 1.02 * np.random.default_rng(1).normal(1.0, 0.01, 100))
    assert speedup.low < speedup.mean < speedup.high and 1.0 < speedup.low and speedup.high < 1.05
    assert ratio_of_medians_ci(baseline, baseline).to_dict() == {"mean": 1.0, "ci95": [1.0, 1.0]}
    assert np.isnan(ratio_of_medians_ci([1.0], [1.0, 2.0]).mean)


def test_paired_speedup_resolves_what_the_ratio_of_medians_blurs():
    # each utterance's level (its length, the machine's state of the moment) varies 10x and is shared by both
    # systems; each measurement has 10% noise of its own; the system is 2% faster
    rng = np.random.default_rng(0)
    level = rng.uniform(1.0, 10.0, 120)
    baseline, system = level * rng.lognormal(0, 0.1, 120), level * rng.lognormal(0, 0.1, 120) / 1.02
    paired, medians = median_ratio_ci(baseline, system), ratio_of_medians_ci(baseline, system)
    assert paired.low < 1.02 < paired.high and paired.high - paired.low < (medians.high - medians.low) / 2
    assert median_ratio_ci(baseline, baseline).to_dict() == {"mean": 1.0, "ci95": [1.0, 1.0]}

"""The bench's resolution check: a damaged copy of the baseline that the table's WER must see."""

import numpy as np

from echospec.decoder import SpeechVocab
from echospec.tools.bench.audio import DAMAGE_FRACTION, damage, resolution_check, resolution_lines

SPEECH = SpeechVocab(10, 64, (74,))


def test_damage_replaces_a_tenth_of_the_speech_tokens_the_same_way_every_time():
    rng = np.random.default_rng(0)
    rows = [{"prompt": f"p{i}", "round": 0, "tokens": [*rng.integers(10, 74, 400).tolist(), 74]} for i in range(3)]
    first, again = damage(rows, SPEECH), damage(rows, SPEECH)
    assert first == again
    for row, hurt in zip(rows, first):
        changed = np.asarray(row["tokens"]) != np.asarray(hurt["tokens"])
        assert 0.05 < changed.mean() < DAMAGE_FRACTION + 0.03
        assert hurt["tokens"][-1] == 74 and all(10 <= t < 74 for t in hurt["tokens"][:-1])  # the stop stays


def test_damage_stays_inside_each_token_s_codebook():
    books = SpeechVocab(0, 40, (40,), codebooks=4)
    rows = [{"prompt": "p", "round": 0, "tokens": list(range(40)) * 20}]
    hurt = damage(rows, books, fraction=1.0)[0]["tokens"]
    assert [t // 10 for t in hurt] == [t // 10 for t in rows[0]["tokens"]]


def report(damaged_wer, n=40):
    rng = np.random.default_rng(1)
    base = [{"prompt": f"p{i}", "round": 0, "wer": float(w)} for i, w in enumerate(rng.uniform(0.1, 0.4, n))]
    return {"systems": {"ar-sampling": {"baseline": "ar-sampling"},
                        "exact-sampling/speaker": {"baseline": "ar-sampling", "identical_to_baseline": 1.0,
                                                   "wer_change": {"mean": 0.0, "ci95": [0.0, 0.0]}}},
            "utterances": {"ar-sampling": base},
            "damaged": {"ar-sampling/damaged": [r | {"wer": r["wer"] + d} for r, d in
                                                zip(base, damaged_wer(rng, n))]}}


def test_a_table_that_sees_the_damage_says_how_much_and_one_that_does_not_says_so():
    seen = report(lambda rng, n: rng.uniform(0.1, 0.3, n))
    seen["resolution"] = resolution_check(seen)
    check = seen["resolution"]["ar-sampling"]
    assert check["resolves"] and check["wer_change"]["ci95"][0] > 0
    assert check["exact_wer_change"] == {"exact-sampling/speaker": 0.0}
    seen_text = " ".join(" ".join(resolution_lines(seen)).split())
    assert "the table sees a loss of words" in seen_text and "exact-sampling/speaker +0.0" in seen_text
    assert max(map(len, resolution_lines(seen))) <= 100

    blind = report(lambda rng, n: rng.normal(0, 0.1, n))
    blind["resolution"] = resolution_check(blind)
    assert not blind["resolution"]["ar-sampling"]["resolves"]
    assert "cannot see a loss of words" in " ".join(" ".join(resolution_lines(blind)).split())

"""The vLLM side-by-side benchmark's offline parts, which need no vLLM: the prompt pool that never repeats a
(speaker, text) prompt, the relaxed systems' request options, the scores on audio, and the replay of greedy outputs
through echospec's chain drafter (first time and again)."""

from __future__ import annotations

import json

import pytest

from echospec.datastore import build
from echospec.decoder import Tolerance
from echospec.decoder.registry import default
from echospec.tools.bench.harness import RelaxedSettings
from echospec.tools.benchmarks.support.vllm_quality import score_on_audio
from echospec.tools.benchmarks.vllm_side_by_side import (main, prompt_pool, relaxed_rules, replay_drafters,
                                                         steps_taken, summarise, table)
from echospec.tools.corpus import SAMPLE_CORPUS, SAMPLE_MODEL_DIR, SAMPLE_PROMPTS, SAMPLE_TOKENIZER
from echospec.tools.corpus.tts_prompt import TTSMeta, encode_prompt


def test_the_prompt_pool_never_repeats_a_speaker_and_text():
    rows = [json.loads(line) for line in open(SAMPLE_PROMPTS)]
    meta = TTSMeta.load(SAMPLE_MODEL_DIR)
    pool = list(prompt_pool(rows, meta.speakers))
    pairs = [(p["speaker"], p["text"]) for p in pool]
    assert len(pairs) == len(set(pairs)) > len(rows)
    assert {p["text"] for p in pool} == {r["text"] for r in rows}  # held-out texts only


def test_relaxed_systems_ask_for_the_policy_defaults_unless_a_knob_is_given():
    defaults = relaxed_rules(RelaxedSettings())  # the registry's chain defaults, not the classes' (the tree's)
    assert defaults["echospec-filtered"]["tau"] == default("filtered", "chain")
    assert defaults["echospec-tolerance"] == {"policy": "tolerance", "beta": default("tolerance", "chain")}
    assert default("tolerance", "chain") != Tolerance().beta
    assert defaults["echospec-pcg"] == {"policy": "pcg", "threshold": default("pcg", "chain")}
    given = relaxed_rules(RelaxedSettings(tau=7, beta=0.0, similarity=0.5))
    assert (given["echospec-filtered"]["tau"], given["echospec-tolerance"]["beta"]) == (7, 0.0)
    assert given["echospec-similarity"]["threshold"] == given["echospec-pcg"]["threshold"] == 0.5


def test_a_relaxed_system_may_set_one_knob_of_its_own():
    rules = relaxed_rules(RelaxedSettings(beta=0.3), ["none", "echospec-tolerance", "echospec-tolerance/beta=0.1",
                                                      "echospec-filtered/tau=20", "echospec-pcg/threshold=0.5"])
    assert list(rules) == ["echospec-tolerance", "echospec-tolerance/beta=0.1", "echospec-filtered/tau=20",
                           "echospec-pcg/threshold=0.5"]
    assert (rules["echospec-tolerance"]["beta"], rules["echospec-tolerance/beta=0.1"]["beta"]) == (0.3, 0.1)
    assert rules["echospec-filtered/tau=20"]["tau"] == 20 and rules["echospec-pcg/threshold=0.5"]["threshold"] == 0.5
    with pytest.raises(ValueError, match="unknown option"):
        relaxed_rules(RelaxedSettings(), ["echospec-tolerance/tau=3"])
    with pytest.raises(ValueError, match="key=number"):
        relaxed_rules(RelaxedSettings(), ["echospec-tolerance/beta=lots"])


@pytest.mark.parametrize("systems, says", [("none,echospec-bogus", "unknown echospec-bogus"),
                                           ("none,echospec-tolerance/tau=3", "unknown option"),
                                           ("none,echospec-filtered/tau=lots", "key=number")])
def test_a_bad_system_is_refused_before_anything_is_built(tmp_path, systems, says):
    from click.testing import CliRunner

    result = CliRunner().invoke(main, ["--systems", systems, "--out", str(tmp_path)])
    assert result.exit_code == 2 and says in result.output
    assert not (tmp_path / "voices").exists()


def test_sampling_cells_are_scored_on_audio_against_no_speculation_in_their_cell(tmp_path):
    pytest.importorskip("pocketsphinx", reason="the quality extra")
    meta = TTSMeta.load(SAMPLE_MODEL_DIR)
    rows = [json.loads(line) for line in open(SAMPLE_PROMPTS)]
    cells = {p["id"]: p for p in list(prompt_pool(rows, meta.speakers))[:2]}
    ids = list(cells)
    reference = [[meta.speech_offset + t for t in cells[i]["reference"][:60]] for i in ids]
    garbled = [list(reversed(tokens)) for tokens in reference]  # another output of the same length

    def record(system, tokens):
        return {"k": 8, "batch": 1, "mode": "sampling", "system": system, "round": 0, "ids": ids, "tokens": tokens,
                "prompts": [[0]] * 2, "seconds": 1.0, "spec": {}}
    records = [record("none", reference), record("echospec-tolerance", reference),
               record("echospec-filtered/tau=20", garbled)]
    summary = summarise(records)
    floor = score_on_audio(records, cells, meta, SAMPLE_TOKENIZER, tmp_path, summary)
    audio = {row["system"]: row["audio"] for row in summary}
    assert audio["none"]["sim_change"] is None  # the baseline itself
    assert audio["echospec-tolerance"]["mos_change"]["mean"] == 0.0  # the same tokens, the same scores
    assert audio["echospec-filtered/tau=20"]["mos_change"]["mean"] != 0.0
    assert floor["mos"]["utterances"] == 2
    assert len(list((tmp_path / "audio" / "k8-b1-echospec-filtered-tau=20").glob("*.wav"))) == 2
    assert "MOS change" in table(summary)


def test_steps_taken_counts_one_step_per_draft_plus_its_accepted_tokens():
    assert steps_taken([1] * 10, lambda p: 0) == 10
    assert steps_taken([1] * 10, lambda p: 8) == 2  # the first token, then 1 + 8 in one step
    assert steps_taken([1] * 10, lambda p: 3) == 4  # positions 0, 1, 5, 9


def test_a_prompt_served_again_is_replayed_from_its_earlier_output(tmp_path):
    meta = TTSMeta.load(SAMPLE_MODEL_DIR)
    store = tmp_path / "voices"
    build(SAMPLE_CORPUS, store, faiss=False, progress=False)
    corpus = [json.loads(line) for line in open(SAMPLE_CORPUS)][:6]
    # the corpus' own utterances stand for greedy outputs (the store holds them: the first pass accepts a lot too)
    runs = [(encode_prompt(meta, u["text"], u["speaker"]), [meta.speech_offset + t for t in u["tokens"]])
            for u in corpus]
    result = replay_drafters(store, meta, runs, k=8)
    assert 1.0 < result["chain"] <= result["tree"] and result["chain"] < result["chain, again"]
    assert result["chain, again"] > 7.0  # 9 at most with k = 8
    assert ("suffix" in result) == ("suffix, again" in result)

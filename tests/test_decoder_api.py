"""The Hugging Face hooks, bad input, failing retrievers, the auto node budget and the real Retriever."""

import json
import time
import warnings

import numpy as np
import pytest
import torch
from decoder_testing import PromptLookup, Raising, Scripted, Slow, Wrong, tiny_model

from echospec.decoder import (HF_CUSTOM_GENERATE_DIR, ArmRates, AutoBudget, DecoderInputError, ExactGreedy,
                              SpeechVocab, UnsupportedModelError, generate, hf_generate)
from echospec.decoder.cost import ARMS, STINT, TRIES, WINDOW, prune_order
from echospec.retriever import CandidateTree

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "sdpa", VOCAB, seed=1)


def prompt(n=8, seed=0):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, n=24):
    return generate(model, None, input_ids=ids, max_new_tokens=n, speech=SpeechVocab(0, VOCAB)).tokens


def test_hf_custom_generate_callable_and_folder(model):
    ids = prompt()
    common = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20, pad_token_id=0)
    reference = model.generate(ids, **common)
    assert torch.equal(model.generate(ids, custom_generate=hf_generate, retriever=PromptLookup(), **common), reference)
    folder = model.generate(ids, custom_generate=HF_CUSTOM_GENERATE_DIR, trust_remote_code=True,
                            retriever=PromptLookup(), **common)
    assert torch.equal(folder, reference)
    embeds = model.get_input_embeddings()(ids)
    del common["attention_mask"]
    assert torch.equal(model.generate(inputs_embeds=embeds, custom_generate=hf_generate, retriever=PromptLookup(),
                                      **common), model.generate(inputs_embeds=embeds, **common))


def test_hf_custom_generate_sampling_is_seeded(model):
    ids = prompt()
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, top_k=8, temperature=0.8, max_new_tokens=16,
                  pad_token_id=0, custom_generate=hf_generate, retriever=PromptLookup())
    a, b = model.generate(ids, seed=3, **kwargs), model.generate(ids, seed=3, **kwargs)
    assert torch.equal(a, b) and a.shape == (1, 8 + 16)


class OutOfRange:
    def propose(self, context, **kwargs):
        return CandidateTree.from_sequences([[VOCAB + 5]])


class NotATree:
    def propose(self, context, **kwargs):
        return [1, 2, 3]


def test_bad_input_is_refused_clearly(model):
    with pytest.raises(DecoderInputError, match="batch size 1"):
        generate(model, None, input_ids=torch.zeros(2, 4, dtype=torch.long), max_new_tokens=3)
    with pytest.raises(DecoderInputError, match="exactly one"):
        generate(model, None, max_new_tokens=3)
    with pytest.raises(DecoderInputError, match="empty"):
        generate(model, None, input_ids=torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3)
    with pytest.raises(DecoderInputError, match="positions"):
        generate(model, None, input_ids=torch.zeros(1, 128, dtype=torch.long), max_new_tokens=3)
    with pytest.raises(DecoderInputError, match="outside the store's vocabulary"):
        generate(model, OutOfRange(), input_ids=prompt(), speech=SpeechVocab(0, VOCAB), max_new_tokens=5)
    with pytest.raises(DecoderInputError, match="not a CandidateTree"):
        generate(model, NotATree(), input_ids=prompt(), max_new_tokens=5)
    with pytest.raises(DecoderInputError, match="do not cover the speech ids"):
        generate(model, None, input_ids=prompt(), speech=SpeechVocab(10, VOCAB), max_new_tokens=5)
    with pytest.raises(DecoderInputError, match="padded"):
        ids = prompt()
        mask = torch.ones_like(ids)
        mask[0, 0] = 0
        model.generate(ids, attention_mask=mask, custom_generate=hf_generate, max_new_tokens=3, pad_token_id=0)
    with pytest.raises(DecoderInputError, match="max_nodes"):
        generate(model, None, input_ids=prompt(), max_nodes=-1)


def test_unsupported_models_are_refused():
    flash = tiny_model("llama", "sdpa", VOCAB)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedModelError, match="flash"):
        generate(flash, None, input_ids=prompt(), max_new_tokens=3)
    with pytest.raises(UnsupportedModelError, match="not a decoder-only causal LM"):
        generate(tiny_model("llama", "sdpa", VOCAB).model, None, input_ids=prompt(), max_new_tokens=3)
    with pytest.raises(UnsupportedModelError, match="PreTrainedModel"):
        generate(torch.nn.Linear(2, 2), None, input_ids=prompt(), max_new_tokens=3)
    from transformers import Qwen2Config, Qwen2ForCausalLM
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                           sliding_window=8, max_window_layers=0, attn_implementation="sdpa"))
    with pytest.raises(UnsupportedModelError, match="full-attention"):
        generate(sliding, None, input_ids=prompt(), max_new_tokens=3)


def test_failing_or_slow_retriever_only_costs_speed(model):
    ids = prompt(seed=2)
    reference = greedy(model, ids)
    with pytest.warns(UserWarning, match="retriever failed"):
        broken = generate(model, Raising(), input_ids=ids, max_new_tokens=24, max_nodes=16)
    assert broken.tokens == reference and broken.stats.retriever_errors == len(broken.stats.accepted_lengths) > 0
    slow = generate(model, Slow(), input_ids=ids, max_new_tokens=24, retriever_timeout=0.001)
    assert slow.tokens == reference and slow.stats.retriever_timeouts > 0 and max(slow.stats.node_budgets) == 0


def test_stats_and_streamer(model):
    ids = prompt(seed=4)
    reference = greedy(model, ids, 30)
    received = []

    class Streamer:
        def put(self, tokens):
            received.extend(tokens)

    result = generate(model, Scripted(reference, 8, VOCAB), input_ids=ids, max_new_tokens=30, streamer=Streamer(),
                      token_rate=50.0)
    stats = result.stats.to_dict()
    assert received == result.tokens == reference
    assert stats["target_forwards"] == 1 + len(stats["accepted_lengths"])
    assert stats["tokens_per_forward"] == pytest.approx(30 / stats["target_forwards"])
    assert stats["lm_rtf"] == pytest.approx(stats["wall_seconds"] / (30 / 50.0))
    assert 0 <= stats["propose_share"] < 1 and stats["time_per_token"] > 0


def test_prune_order_keeps_a_tree_even_when_a_child_outranks_its_parent():
    tree = CandidateTree(tokens=np.arange(3), parents=np.array([-1, 0, -1], np.int32), depths=np.array([1, 2, 1], np.int32),
                         counts=np.ones(3, np.float32), probs=np.array([0.2, 0.9, 0.5], np.float32),
                         sources=np.zeros(3, np.uint8))
    assert prune_order(tree).tolist() == [2, 0]  # node 1 comes before its parent would: dropped
    usual = CandidateTree.from_sequences([[1, 2, 3], [1, 4], [5]], [3, 1, 1])
    order = prune_order(usual).tolist()
    assert sorted(order) == list(range(len(usual)))
    assert all(usual.parents[i] < 0 or order.index(int(usual.parents[i])) < order.index(i) for i in order)


def greedy_store(model, folder, prompts):
    """A real Retriever over a store of the model's greedy continuations of `prompts` (speaker "spk"),
    and the corpus it was built from."""
    from echospec.datastore import build
    from echospec.retriever import Retriever

    corpus = [{"id": f"u{i}", "speaker": "spk", "tokens": ids[0].tolist() + greedy(model, ids, 40)}
              for i, ids in enumerate(prompts)]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(u) + "\n" for u in corpus))
    build(folder / "corpus.jsonl", folder / "store", faiss=False, progress=False, vocab_size=VOCAB)
    return Retriever(folder / "store"), corpus


def test_with_the_real_retriever(model, tmp_path):
    prompts = [prompt(6, seed) for seed in range(12)]
    retriever, corpus = greedy_store(model, tmp_path, prompts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = generate(model, retriever, input_ids=prompts[3], speaker="spk", max_new_tokens=40, max_nodes=16,
                          speech=SpeechVocab(0, VOCAB))
    assert result.tokens == corpus[3]["tokens"][6:]
    assert result.stats.tokens_per_forward > 2 and result.stats.retriever_errors == 0


def run_arms(rates: ArmRates, speed: dict, utterances: int, steps: int = 40, noise: float = 0.0,
             spread: float = 0.0, stall: int | None = None, slow_first: float = 1.0, seed: int = 0) -> list[int]:
    """Decode `utterances` utterances of `steps` one-token steps, each under the cap `rates` chooses at its
    start, at `speed[cap]` tokens a second times lognormal factors: per step of spread `noise`, per utterance
    of spread `spread` (prompts differ); returns the caps run, step by step. Step number `stall` takes 1000x
    longer (a GC pause, a preempted process); the first utterance `slow_first` times longer (a cold process)."""
    rng = np.random.default_rng(seed)
    caps = []
    for utterance in range(utterances):
        arm = rates.choose()
        cap = rates.arms[arm]
        factor = rng.lognormal(0.0, spread) * (slow_first if utterance == 0 else 1.0)
        seconds = [(1000 if len(caps) + i == stall else 1) * factor * f / speed[cap]
                   for i, f in enumerate(rng.lognormal(0.0, noise, steps))]
        rates.record(arm, steps, seconds)
        caps += [cap] * steps
    return caps


CPU = {0: 100, 4: 130, 8: 150, 16: 140, 32: 120, 64: 100}  # tokens per second under each cap
GPU = {0: 100, 4: 150, 8: 200, 16: 250, 32: 300, 64: 280}  # bigger trees nearly free
USELESS = {0: 100, 4: 95, 8: 90, 16: 80, 32: 70, 64: 60}  # no tree pays


def test_auto_runs_the_fastest_cap():
    # caps next to the fastest and plain steps are tried; caps beyond them run only while a noisy start
    # puts the fastest elsewhere. Steps vary 50%, utterances 30% (stints on the sample: 26-41%), so caps 7%
    # apart (GPU: 32 and 64 nodes) take a few hundred utterances to tell apart
    for speed, best, never in ((CPU, 8, {32, 64}), (GPU, 32, set()), (USELESS, 0, {32, 64})):
        rates = ArmRates()
        caps = run_arms(rates, speed, 800, noise=0.5, spread=0.3)
        late = caps[16000:]
        assert caps[:40] == [8] * 40 and sum(c in never for c in caps) < 0.01 * len(caps), speed
        assert not never & set(late), speed
        assert late.count(best) / len(late) > 0.8 and rates.summary()["fastest"] == best, speed
        # what exploring costs late in the run (measured: 1.7% CPU, 3.9% GPU, 0.4% USELESS)
        assert sum(speed[best] / speed[c] for c in late) / len(late) < 1.05, speed


def test_auto_shares_near_equal_caps_and_shrugs_off_outliers():
    near = {0: 100, 4: 149, 8: 150, 16: 120, 32: 110, 64: 100}  # 4 and 8 within noise of each other
    late = run_arms(ArmRates(), near, 400, noise=0.5, spread=0.3)[8000:]
    assert late.count(4) + late.count(8) > 0.9 * len(late)
    assert min(late.count(4), late.count(8)) > 0.1 * len(late)  # neither is sure to be faster
    # a step 1000x slower than the others (a GC pause, a preempted process) counts as 4x its stint's median
    rates = ArmRates()
    arm = rates.choose()
    for _ in range(TRIES):
        rates.record(arm, 40, [0.01] * 39 + [10.0])
    assert rates.summary()["rates"][str(ARMS[arm])] == pytest.approx(40 / (39 * 0.01 + 4 * 0.01))


def test_auto_follows_a_changed_target():
    rates = ArmRates()
    run_arms(rates, USELESS, 100, noise=0.3)
    assert run_arms(rates, GPU, 1000, noise=0.3, seed=1)[-4000:].count(32) > 0.8 * 4000
    assert ArmRates().arms == ARMS and ARMS[0] == 0


def test_auto_recovers_a_tree_cap_after_an_unlucky_start():
    # 8 the fastest, but its first utterance (a cold process) ran 2x slower, so plain steps lead at first and
    # their neighbour, 4 nodes, is no faster than they are ...
    valley = {0: 100, 4: 100, 8: 125, 16: 115, 32: 100, 64: 90}
    # ... or 8 a little faster than 4, its first utterance 1.5x slower. The first cap is measured again once
    # the caps next to it have been
    close = {0: 80, 4: 140, 8: 150, 16: 120, 32: 110, 64: 100}
    for speed, slow in ((valley, 2.0), (close, 1.5)):
        caps = run_arms(ArmRates(), speed, 300, slow_first=slow)
        assert caps[:40] == [8] * 40, speed
        assert caps[1000:4000].count(8) > 0.8 * 3000 and caps[8000:].count(8) > 0.8 * 4000, speed


def test_auto_prefers_plain_steps_to_a_tree_that_barely_pays():
    # trees 1% faster: within MARGIN, so plain steps (which cost nothing to get wrong)
    late = run_arms(ArmRates(), {0: 100, 4: 101, 8: 100, 16: 95, 32: 90, 64: 80}, 400, noise=0.3, spread=0.3)[8000:]
    assert late.count(0) > 0.85 * len(late)


def test_auto_runs_trees_only_in_rechecks_where_plain_steps_lead():
    # trees 1-2% slower, steps that vary 100%: Thompson draws alone keep trees in a share of the steps
    speed = {0: 100, 4: 99, 8: 98, 16: 95, 32: 90, 64: 80}
    shares = []
    for seed in (1, 2, 3):
        late = run_arms(ArmRates(seed=seed), speed, 400, noise=1.0, spread=0.3, seed=seed)[8000:]
        shares.append(1 - late.count(0) / len(late))
    assert sum(shares) / len(shares) < 0.1, shares


def test_auto_changes_caps_only_between_stints(model):
    # two sessions decoding at once share one ArmRates: each holds its cap for its whole utterance (or STINT
    # steps of a longer one), and both utterances count
    retriever = Wrong(VOCAB)
    budgets = [AutoBudget(model, retriever, ExactGreedy, None) for _ in range(2)]
    assert budgets[0].rates is budgets[1].rates
    caps = [[], []]
    for step in range(2 * STINT + 10):
        for budget, run in zip(budgets, caps):
            run.append(budget.nodes())
            budget.observe(1 + (run[-1] > 0), 0.001)
    for run in caps:
        assert all(run[i] == run[i - 1] for i in range(1, len(run)) if i % STINT), run
    for budget in budgets:
        budget.finish()
    assert sum(budgets[0].summary()["steps"].values()) == 2 * (2 * STINT + 10)


def test_auto_budget_end_to_end(model):
    ids = prompt(seed=5)
    reference = greedy(model, ids, 40)
    right = generate(model, Scripted(reference, 8, VOCAB, depth=6), input_ids=ids, max_new_tokens=40)
    assert right.tokens == reference and right.stats.tokens_per_forward > 2
    assert max(right.stats.node_budgets) <= 8  # the first cap tried: FIRST_ARM
    # the cap every decode step ran (the prefill asks no budget)
    assert right.stats.node_caps == [8] * (right.stats.target_forwards - 1)


def test_auto_budget_stops_asking_a_retriever_that_never_pays():
    model = tiny_model("llama", "sdpa", VOCAB, seed=1)
    calls = []

    class Counting(Wrong):  # slow as well as wrong: on this tiny model a tree forward costs what a plain one does
        def propose(self, *args, **kwargs):
            calls.append(1)
            time.sleep(0.002)
            return super().propose(*args, **kwargs)

    retriever, results, counting = Counting(VOCAB), [], 0
    for seed in range(24):
        ids, before = prompt(seed=seed), len(calls)
        results.append(generate(model, retriever, input_ids=ids, max_new_tokens=40, speech=SpeechVocab(0, VOCAB)))
        assert results[-1].tokens == greedy(model, ids, 40)
        counting += len(calls) - before - sum(cap > 0 for cap in results[-1].stats.node_caps)  # cap 0: not asked
    # trees that are never accepted cost time and emit nothing more: once the caps next to the first have
    # been tried (2 utterances each, the first cap again), plain steps only
    assert all(set(r.stats.node_caps) == {0} for r in results[-8:]) and results[-1].stats.budget["fastest"] == 0
    # counting windows asks it too, but only while that takes under COUNT_SHARE of the time: here one window in
    # 24 utterances, the first (4 and 16 nodes, a call per step they would take; 8 ran, its steps are known)
    assert WINDOW < counting <= 2 * WINDOW


def test_count_steps_replays_a_lossless_policy_exactly(model, tmp_path):
    # a lossless policy's tokens do not depend on the tree, so the steps a cap would take over them can be
    # counted after the fact from retriever calls alone: exactly the steps a session pinned to that cap takes
    from echospec.decoder import ExactSampling, SpeculativeSession

    prompts = [prompt(6, seed) for seed in range(8)]
    (retriever, _), speech = greedy_store(model, tmp_path, prompts), SpeechVocab(0, VOCAB)
    for make_policy in (ExactGreedy, lambda: ExactSampling(seed=3)):
        for ids in (prompts[2], prompt(6, seed=99)):  # one the store holds, one it does not
            sessions = {}
            for cap in (1, 4, 16):
                session = sessions[cap] = SpeculativeSession(model, retriever, make_policy(), speech=speech,
                                                             speaker="spk", max_new_tokens=40, max_nodes=cap)
                session.prefill(input_ids=ids)
                while not session.finished:
                    session.step()
            reference = sessions[4]
            for cap, session in sessions.items():
                assert session.generated == reference.generated
                assert reference.count_steps(cap, 1, len(reference.generated)) == len(session.stats.node_budgets)
            # a window starting at one of its steps: the steps that start inside it
            starts = np.cumsum([1] + [n + 1 for n in sessions[1].stats.accepted_lengths])
            assert reference.count_steps(1, int(starts[3]), 30) == sum(starts[3] <= s < 30 for s in starts)
    broken = SpeculativeSession(model, Raising(), ExactGreedy(), speech=speech, max_new_tokens=8, max_nodes=4)
    broken.prefill(input_ids=prompts[0])
    with pytest.warns(UserWarning, match="retriever failed"):
        while not broken.finished:
            broken.step()
    assert broken.count_steps(4, 1, 8) is None  # no count from a retriever that fails


def run_windows(rates: ArmRates, caps: dict, utterances: int, spread: float, noise: float, windows: bool,
                seed: int = 0) -> list[int]:
    """Decode `utterances` utterances of 300 tokens under the caps `rates` chooses, each cap a pair (tokens per
    step, seconds per step); an utterance's drafts are right `spread`-lognormally more or less often (prompts
    differ) and its steps take `noise`-lognormally longer or shorter. With `windows`, every utterance counts
    32 of its tokens under the caps `rates.compared()` names; returns the cap of each utterance."""
    rng, chosen = np.random.default_rng(seed), []
    for _ in range(utterances):
        ease, slow = rng.lognormal(0.0, spread), rng.lognormal(0.0, noise)
        per_step = {cap: 1 + (tokens - 1) * ease if cap else 1.0 for cap, (tokens, _) in caps.items()}
        arm = rates.choose()
        cap = rates.arms[arm]
        steps = round(300 / per_step[cap])
        counted = {i: 32 / per_step[rates.arms[i]] for i in rates.compared()} if windows else None
        rates.record(arm, 300, [caps[cap][1] * slow] * steps, counted, 32)
        chosen.append(cap)
    return chosen


def test_auto_compares_a_lossless_policys_caps_on_the_same_tokens():
    # greedy on the sample at 1 thread: 4 nodes 6% faster than 8, utterances' tokens per step spread 25%
    # (measured 18-24%), their seconds per step 4% (3-7%). Rated on whole utterances, 4 and 8 take more
    # utterances to tell apart than a run has; counted on the same tokens, only seconds per step differ
    caps = {0: (1.0, 1.7e-3), 4: (2.25, 2.3e-3), 8: (2.5, 2.7e-3), 16: (2.7, 3.1e-3), 32: (2.9, 3.8e-3),
            64: (3.1, 5.1e-3)}
    shares = {}
    for windows in (False, True):
        late = [c for seed in range(6) for c in run_windows(ArmRates(seed=seed), caps, 120, 0.25, 0.04, windows,
                                                             seed)[40:]]
        shares[windows] = late.count(4) / len(late)
    assert shares[True] > 0.85 and shares[True] > shares[False] + 0.1, shares


def test_steps_do_not_read_the_models_device_or_dtype(model, monkeypatch):
    # each read walks the model's parameters (~10 us on a CPU); the session reads them once, when it is made
    from echospec.decoder import SpeculativeSession

    ids = prompt(seed=3)
    reference = greedy(model, ids)
    session = SpeculativeSession(model, PromptLookup(), ExactGreedy(), speech=SpeechVocab(0, VOCAB),
                                 max_new_tokens=24, max_nodes=8)
    reads = []
    for name in ("device", "dtype"):
        value = getattr(model, name)
        monkeypatch.setattr(type(model), name, property(lambda self, name=name, value=value:
                                                        reads.append(name) or value))
    session.prefill(input_ids=ids)
    while not session.finished:
        session.step()
    assert reads == []
    assert session.generated == reference and session.stats.tokens_per_forward > 1

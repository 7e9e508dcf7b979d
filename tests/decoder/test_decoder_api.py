"""The Hugging Face hooks, bad input, failing retrievers, node budgets and the real Retriever."""

import json
import time
import warnings

import numpy as np
import pytest
import torch
from decoder_testing import PromptLookup, Raising, Scripted, Slow, Wrong, tiny_model

from echospec.decoder import (HF_CUSTOM_GENERATE_DIR, NODES, AdaptiveBudget, CapRates, DecoderInputError, ExactGreedy,
                              Filtered, FixedBudget, SpeechVocab, UnsupportedModelError, generate, hf_generate)
from echospec.decoder.budget import RECHECK, TRIES
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
    # 16 new tokens, or fewer ending at the eos (which Hugging Face's own sampling draws within 16 tokens about a
    # third of the time on this model)
    assert torch.equal(a, b) and (a.shape == (1, 8 + 16) or int(a[0, -1]) == model.generation_config.eos_token_id)


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
    with pytest.raises(DecoderInputError, match="AdaptiveBudget"):
        generate(model, None, input_ids=prompt(), max_nodes="auto")
    with pytest.raises(DecoderInputError, match="not both"):
        generate(model, None, input_ids=prompt(), max_nodes=4, budget=FixedBudget(4))


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
    # a relaxed policy's tokens depend on the tree: a late one is used, so that they do not depend on timings
    relaxed = generate(model, Slow(), Filtered(tau=4, seed=0), input_ids=ids, max_new_tokens=24,
                       retriever_timeout=0.001)
    assert relaxed.stats.retriever_timeouts == 0 and max(relaxed.stats.node_budgets) > 0


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
    assert tree.prune_order().tolist() == [2, 0]  # node 1 comes before its parent would: dropped
    usual = CandidateTree.from_sequences([[1, 2, 3], [1, 4], [5]], [3, 1, 1])
    order = usual.prune_order().tolist()
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


def run_rates(rates: CapRates, speed: dict, utterances: int, steps: int = 40, spread: float = 0.0,
              seed: int = 0) -> list[int]:
    """Decode `utterances` utterances of `steps` one-token steps, each under the cap `rates` chooses at its start,
    at `speed[cap]` tokens a second times a lognormal factor of spread `spread` per utterance (prompts differ);
    returns the cap of each utterance."""
    rng, caps = np.random.default_rng(seed), []
    for _ in range(utterances):
        cap = rates.choose()
        rates.record(cap, steps, steps * rng.lognormal(0.0, spread) / speed[cap])
        caps.append(cap)
    return caps


CPU = {0: 100, 4: 130, 8: 150}  # tokens per second under each cap
SMALL = {0: 100, 4: 120, 8: 110}  # a small tree pays best
USELESS = {0: 100, 4: 95, 8: 90}  # no tree pays


def test_adaptive_budget_runs_the_fastest_cap_and_rechecks_the_others():
    for speed, best in ((CPU, 8), (SMALL, 4), (USELESS, 0)):
        rates = CapRates()
        caps = run_rates(rates, speed, 320, spread=0.05)
        assert caps[:3 * TRIES] == [8, 8, 0, 0, 4, 4], speed  # each cap tried, the middle tree first
        late = caps[3 * TRIES:]
        assert rates.summary()["fastest"] == best and late.count(best) > 0.9 * len(late), speed
        assert all(cap != best for i, cap in enumerate(caps, 1) if i % RECHECK == 0 and i > 3 * TRIES), speed


def test_adaptive_budget_follows_its_cap_slowing_down():
    rates = CapRates()
    run_rates(rates, CPU, 100)
    assert run_rates(rates, {0: 100, 4: 130, 8: 90}, 100)[-80:].count(4) > 0.9 * 80  # its recent rates count


def test_adaptive_budget_holds_its_cap_for_the_utterance_and_shares_its_rates():
    # two sessions decoding at once share one CapRates: each holds its cap for its whole utterance, and both
    # utterances count
    rates = CapRates()
    budgets = [AdaptiveBudget(rates) for _ in range(2)]
    caps = [[], []]
    for position in range(600):
        for budget, run in zip(budgets, caps):
            run.append(budget.cap(position))
            budget.observe(1 + (run[-1] > 0), 0.001)
    assert [set(run) for run in caps] == [{8}, {8}]
    for budget in budgets:
        budget.finish()
    assert rates.summary()["utterances"] == {"8": 2, "0": 0, "4": 0}
    assert rates.rate(8) == pytest.approx(2 / 0.001)


def test_the_default_budget_is_a_fixed_cap(model):
    ids = prompt(seed=5)
    reference = greedy(model, ids, 40)
    right = generate(model, Scripted(reference, 8, VOCAB, depth=6), input_ids=ids, max_new_tokens=40)
    assert right.tokens == reference and right.stats.tokens_per_forward > 2
    # the cap every decode step ran (the prefill asks no budget), whatever ran before
    assert right.stats.node_caps == [NODES] * (right.stats.target_forwards - 1) and right.stats.budget is None


def test_adaptive_budget_stops_asking_a_retriever_that_never_pays():
    model = tiny_model("llama", "sdpa", VOCAB, seed=1)
    calls = []

    class Counting(Wrong):  # slow as well as wrong: on this tiny model a tree forward costs what a plain one does
        def propose(self, *args, **kwargs):
            calls.append(1)
            time.sleep(0.002)
            return super().propose(*args, **kwargs)

    retriever, rates, results = Counting(VOCAB), CapRates(), []
    for seed in range(20):
        ids = prompt(seed=seed)
        results.append(generate(model, retriever, input_ids=ids, max_new_tokens=40, speech=SpeechVocab(0, VOCAB),
                                budget=AdaptiveBudget(rates)))
        assert results[-1].tokens == greedy(model, ids, 40)
        assert len(calls) == sum(cap > 0 for r in results for cap in r.stats.node_caps)  # cap 0: not asked
    # trees that are never accepted cost time and emit nothing more: once each cap has been tried, plain steps
    # but for a recheck
    late = [set(r.stats.node_caps) for r in results[3 * TRIES:]]
    assert late.count({0}) >= len(late) - 1 and results[-1].stats.budget["fastest"] == 0


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


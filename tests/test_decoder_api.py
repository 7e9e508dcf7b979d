"""The Hugging Face hooks, bad input, failing retrievers, the cost-aware budget and the real Retriever."""

import json
import warnings

import numpy as np
import pytest
import torch
from decoder_testing import PromptLookup, Raising, Scripted, Slow, Wrong, tiny_model

from echospec.decoder import (HF_CUSTOM_GENERATE_DIR, CostCurve, DecoderInputError, NodeBudget,
                              SpeechVocab, UnsupportedModelError, generate, hf_generate)
from echospec.decoder.cost import Acceptance, StepCosts, StepRecord, prune_order
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
        broken = generate(model, Raising(), input_ids=ids, max_new_tokens=24)
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


def test_budget_follows_the_cost_curve_and_acceptance():
    tree = CandidateTree.from_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 7], [8, 9]], [6, 1, 1], max_nodes=16, max_depth=8)
    order = prune_order(tree)
    gpu = NodeBudget(CostCurve([0, 1, 64], [1.0, 1.01, 1.1]), 64)
    cpu = NodeBudget(CostCurve([0, 1, 2, 4, 8, 64], [1.0, 1.3, 1.6, 2.2, 3.4, 20.0]), 64)
    assert gpu.choose(tree).pays and gpu.choose(tree).nodes >= len(tree) - 1  # (the last node adds less than TIE)
    assert cpu.choose(tree).pays and 0 < cpu.choose(tree).nodes < gpu.choose(tree).nodes
    assert cpu.choose(tree).order.tolist() == order.tolist()
    for _ in range(30):  # trees that never pay: the budget drops to nothing
        cpu.acceptance.learn(tree.probs, tree.depths, np.zeros(len(tree), bool))
    assert not cpu.choose(tree).pays


def test_budget_prices_the_jump_at_one_node():
    # this CPU's shape: one node costs almost what eight do, so one likely node is not worth a tree
    # forward while eight of them are
    budget = NodeBudget(CostCurve([0, 1, 8, 64], [1.0, 1.6, 1.65, 3.0]), 64)
    one = CandidateTree.from_sequences([[5], [6]], [1, 1], max_nodes=1)  # one node, probability 0.5
    chain = CandidateTree.from_sequences([[5, 6, 7, 8, 9, 10, 11, 12], [13]], [1, 1], max_nodes=8)
    assert not budget.choose(one).pays
    choice = budget.choose(chain)
    assert choice.pays and choice.nodes == 8 and choice.gain > 0.5


def test_acceptance_is_learned_per_probability_and_depth():
    acceptance = Acceptance(prior_weight=2.0)
    probs, depths = np.array([0.6, 0.6, 0.6]), np.array([1, 2, 6])
    assert (acceptance.expected(probs, depths) < 0.6).all()  # cautious while a cell is unseen
    for _ in range(50):  # shallow nodes accepted, deep ones never
        acceptance.learn(probs, depths, np.array([True, True, False]))
    shallow, second, deep = acceptance.expected(probs, depths)
    assert shallow > 0.9 and second > 0.9 and deep < 0.05
    # accepted more than the probabilities said: cells not seen yet follow that calibration
    assert acceptance.calibration > 1
    unseen = np.array([0.8]), np.array([3])
    assert acceptance.expected(*unseen)[0] > Acceptance().expected(*unseen)[0]


def test_prune_order_keeps_a_tree_even_when_a_child_outranks_its_parent():
    tree = CandidateTree(tokens=np.arange(3), parents=np.array([-1, 0, -1], np.int32), depths=np.array([1, 2, 1], np.int32),
                         counts=np.ones(3, np.float32), probs=np.array([0.2, 0.9, 0.5], np.float32),
                         sources=np.zeros(3, np.uint8))
    assert prune_order(tree).tolist() == [2, 0]  # node 1 comes before its parent would: dropped
    usual = CandidateTree.from_sequences([[1, 2, 3], [1, 4], [5]], [3, 1, 1])
    order = prune_order(usual).tolist()
    assert sorted(order) == list(range(len(usual)))
    assert all(usual.parents[i] < 0 or order.index(int(usual.parents[i])) < order.index(i) for i in order)


def test_auto_budget_end_to_end(model):
    ids = prompt(seed=5)
    reference = greedy(model, ids, 40)
    right = generate(model, Scripted(reference, 8, VOCAB, depth=6), input_ids=ids, max_new_tokens=40, max_nodes="auto")
    assert right.tokens == reference and right.stats.tokens_per_forward > 2
    assert right.stats.cost_curve["sizes"][0] == 0 and len(right.stats.cost_curve["seconds"]) > 3
    cpu_like = CostCurve([0, 1, 2, 4, 8, 16, 32, 64], [1e-3 * (1 + 0.2 * n) for n in (0, 1, 2, 4, 8, 16, 32, 64)])
    wrong = generate(model, Wrong(VOCAB), input_ids=ids, max_new_tokens=40, max_nodes="auto", cost_curve=cpu_like)
    assert wrong.tokens == reference and wrong.stats.node_budgets[-10:] == [0] * 10


def test_with_the_real_retriever(model, tmp_path):
    from echospec.datastore import build
    from echospec.retriever import Retriever

    prompts = [prompt(6, seed) for seed in range(12)]
    corpus = [{"id": f"u{i}", "speaker": "spk", "tokens": ids[0].tolist() + greedy(model, ids, 40)}
              for i, ids in enumerate(prompts)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(u) + "\n" for u in corpus))
    build(tmp_path / "corpus.jsonl", tmp_path / "store", faiss=False, progress=False, vocab_size=VOCAB)
    retriever = Retriever(tmp_path / "store")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = generate(model, retriever, input_ids=prompts[3], speaker="spk", max_new_tokens=40, max_nodes=16,
                          speech=SpeechVocab(0, VOCAB))
    assert result.tokens == corpus[3]["tokens"][6:]
    assert result.stats.tokens_per_forward > 2 and result.stats.retriever_errors == 0


def test_step_costs_separate_forward_per_token_and_tree_work():
    curve = CostCurve([0, 1, 2, 4, 8], [1e-3 * (1 + 0.2 * n) for n in (0, 1, 2, 4, 8)])
    costs = StepCosts(curve, max_nodes=8)
    for i in range(9):  # forwards run at half the curve's time (one of them 100x slower)
        slow = 100 if i == 3 else 1
        # plain steps: a walk of 0.1 ms per token and 0.02 ms of other work
        costs.observe([StepRecord(i, 10, 0, 0, 0.5e-3 * slow, 1e-4, 0.5e-3 * slow + 1.2e-4)])
        for n in (2, 8):  # tree steps emit 3 tokens and do 0.05 ms + 0.01 ms a node more
            forward = 0.5 * float(curve.time(n))
            costs.observe([StepRecord(i, 10, n, 2, forward, 3e-4, forward + 3e-4 + 2e-5 + 5e-5 + 1e-5 * n)])
    assert costs.ratio == pytest.approx(0.5) and costs.per_token == pytest.approx(1e-4)
    assert costs.base == pytest.approx(2e-5) and costs.extra[[0, 2, 8]] == pytest.approx([0.0, 7e-5, 1.3e-4])
    # size 4 not seen: the line through the sizes seen
    assert costs.step_time(4, tokens=3) == pytest.approx(0.5 * 1.8e-3 + 3e-4 + 2e-5 + 9e-5)
    budget = NodeBudget(curve, max_nodes=8)
    budget.costs = costs
    tree = CandidateTree.from_sequences([[1, 2, 3], [4, 5]], max_nodes=8)
    for _ in range(30):  # nothing is ever accepted: no tree pays
        budget.acceptance.learn(tree.probs, tree.depths, np.zeros(len(tree), bool))
    assert not budget.choose(tree).pays


def test_cost_curve_shape_follows_the_context():
    # one token: 1.0 s at 100 cached tokens, 2.0 s at 356; 8 nodes: 2x a token at 100, 3x at 356
    curve = CostCurve([0, 8], [1.0, 2.0], context=100, longer=[2.0, 6.0], step=256)
    assert curve.time([0, 8], context=228).tolist() == pytest.approx([1.5, 1.5 * 2.5])
    assert curve.time([0, 8], context=50).tolist() == pytest.approx([1.0, 2.0])  # never below the measured
    assert curve.time([0, 8]).tolist() == [1.0, 2.0]  # no context: the curve as measured


def test_auto_budget_stops_asking_a_retriever_that_never_pays(model):
    ids = prompt(seed=5)
    calls = []

    class Counting(Wrong):
        def propose(self, *args, **kwargs):
            calls.append(1)
            return super().propose(*args, **kwargs)

    cpu_like = CostCurve([0, 1, 2, 4, 8, 16, 32, 64], [1e-3 * (1 + 0.2 * n) for n in (0, 1, 2, 4, 8, 16, 32, 64)])
    result = generate(model, Counting(VOCAB), input_ids=ids, max_new_tokens=100, min_new_tokens=100,
                      max_nodes="auto", cost_curve=cpu_like)
    assert result.tokens == greedy(model, ids, 100)
    assert len(calls) < len(result.stats.node_budgets) / 4 and set(result.stats.node_budgets[10:]) == {0}


def test_auto_budget_keeps_verifying_a_few_trees_for_relaxed_policies():
    # A relaxed policy's acceptance shows only on verified trees, so declined ones are not scored for it and
    # every EXPLORE_EVERY-th declined tree is verified anyway (EXPLORE_NODES nodes); exact policies never explore.
    from echospec.decoder import AutoBudget
    from echospec.decoder.cost import EXPLORE_EVERY, EXPLORE_NODES

    class Store:  # a retriever stand-in: the budget only keys its shared model by it
        pass

    cpu_like = CostCurve([0, 1, 2, 4, 8, 16, 32, 64], [1e-3 * (1 + 0.2 * n) for n in (0, 1, 2, 4, 8, 16, 32, 64)])
    tree = CandidateTree.from_sequences([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], max_nodes=16)
    sizes = {}
    for exact in (False, True):
        budget = AutoBudget(exact, speech_offset=0, curve=cpu_like)
        budget.start(None, Store(), type(exact), None, measure=None)
        for _ in range(50):  # nothing is ever accepted: no tree pays
            budget.nodes.acceptance.learn(tree.probs, tree.depths, np.zeros(len(tree), bool))
        sizes[exact] = [len(budget.fit(tree, 1e-5, position, context=10)) for position in range(8 * EXPLORE_EVERY)]
    assert set(sizes[True]) == {0}
    assert set(sizes[False]) == {0, EXPLORE_NODES} and sizes[False].count(EXPLORE_NODES) == 8

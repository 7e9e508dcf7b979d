"""Sampling policies: RAS as CosyVoice does it; ExactSampling and Tolerance(0) keep AR's distribution; relaxed rules."""

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from decoder_testing import chi_square_p, tiny_model

from echospec.decoder import (RAS, ExactGreedy, ExactSampling, Filtered, GroupRejection, NodeState, Sampler,
                              SimilarityGroups, SpeechVocab, Tolerance, VerifiedTree, generate)
from echospec.retriever import CandidateTree

VOCAB = 16


def state(history=(), n_generated=None, stops=(), allow_stop=True):
    history = list(history)
    return NodeState(history, len(history) if n_generated is None else n_generated, tuple(stops),
                     () if allow_stop else tuple(stops))


def test_ras_distribution_is_cosyvoices_rule():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.2, 0.1])
    logits = probs.log()
    ras = RAS(top_p=0.8, top_k=25, win_size=10, tau_r=0.1)
    # nucleus: 0.5, 0.2, 0.15 (running sums before them 0, .5, .7 are < .8; .85 is not)
    fresh = ras.distribution(logits, state([0, 4]))
    assert torch.allclose(fresh, torch.tensor([0, 0.5, 0.15, 0.2, 0]) / 0.85, atol=1e-6)
    # token 1 was generated within the window: drawing it means drawing again from the full softmax without it
    repeated = ras.distribution(logits, state([1, 4]))
    without_1 = torch.tensor([0.05, 0, 0.15, 0.2, 0.1]) / 0.5
    expected = torch.tensor([0, 0, 0.15, 0.2, 0]) / 0.85 + (0.5 / 0.85) * without_1
    assert torch.allclose(repeated, expected, atol=1e-6)
    # the window holds only generated tokens, not the prompt's
    assert torch.allclose(ras.distribution(logits, state([1, 4], n_generated=1)), fresh, atol=1e-6)
    top2 = torch.tensor([0, 0.5, 0, 0.2, 0]) / 0.7
    assert torch.allclose(RAS(top_k=2).distribution(logits, state()), top2, atol=1e-6)


@pytest.mark.parametrize("allow_stop", [True, False])
def test_ras_draws_follow_its_distribution(allow_stop):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(0)) * 2
    stop = int(logits.argsort(descending=True)[1])
    st = state([3, 5, 0, 3], stops=(stop,), allow_stop=allow_stop)  # the most likely token (0) repeats
    ras, generator = RAS(top_p=0.7, top_k=5, win_size=3, tau_r=0.3), torch.Generator().manual_seed(1)
    draws = Counter(ras.sample(logits, st, generator) for _ in range(4000))
    expected = ras.distribution(logits, st).double().numpy() * 4000
    assert chi_square_p(np.array([draws[i] for i in range(12)], float), expected) > 1e-3
    assert (draws[stop] > 0) == allow_stop


def exact_joint(model, prompt, sampler, steps, stop):
    """P(first `steps` tokens) by full forwards, sequences ending early at the stop token."""
    table = {}

    def walk(prefix, p):
        if p < 1e-9:
            return
        if len(prefix) == steps or (prefix and prefix[-1] == stop):
            table[tuple(prefix)] = table.get(tuple(prefix), 0.0) + p
            return
        with torch.no_grad():
            logits = model(torch.tensor([prompt + prefix])).logits[0, -1]
        st = state(prompt + prefix, len(prefix), (stop,), len(prefix) >= 1)
        for token, q in enumerate(sampler.distribution(logits, st).tolist()):
            walk(prefix + [token], p * q)

    walk([], 1.0)
    return table


class AllPairs:
    """A constructed tree: every pair over a few tokens the model likes (right and wrong paths)."""

    def __init__(self, tokens):
        self.tree = CandidateTree.from_sequences([list(p) for p in itertools.product(tokens, repeat=2)],
                                                 max_nodes=24, max_depth=2)

    def propose(self, context, speaker=None, max_nodes=None, max_depth=None):
        return self.tree


SAMPLERS = {
    "sampler": lambda: Sampler(temperature=0.9, top_k=6),
    "ras": lambda: RAS(top_p=0.8, top_k=25, win_size=10, tau_r=0.1),
}


@pytest.mark.parametrize("kind", ["exact-sampler", "exact-ras", "tolerance0-sampler", "tolerance0-ras"])
def test_speculative_sampling_keeps_the_autoregressive_distribution(kind):
    model = tiny_model("llama", "sdpa", VOCAB, seed=3, sharpen=6.0)
    sampler = SAMPLERS[kind.split("-")[1]]()
    policy = ExactSampling(sampler) if kind.startswith("exact") else Tolerance(sampler, beta=0.0)
    prompt, stop, steps, draws = [3, 9, 4, 1, 12], 5, 3, 500
    joint = exact_joint(model, prompt, sampler, steps, stop)
    with torch.no_grad():
        likely = model(torch.tensor([prompt])).logits[0, -1].topk(4).indices.tolist()
    retriever, speech = AllPairs(likely), SpeechVocab(0, VOCAB, (stop,))
    counts, accepted = Counter(), 0
    for seed in range(draws):
        result = generate(model, retriever, input_ids=prompt, policy=policy, speech=speech, seed=seed,
                          max_new_tokens=steps, min_new_tokens=1, max_nodes=24)
        counts[tuple(result.tokens)] += 1
        accepted += sum(result.stats.accepted_lengths)
    cells = sorted(joint)
    assert set(counts) <= set(cells)
    p = chi_square_p(np.array([counts[c] for c in cells], float), np.array([joint[c] for c in cells]) * draws)
    assert p > 1e-3, p
    assert accepted > draws / 4  # the trees were actually used


def verified(logits, sequences, history=(), stops=()):
    tree = CandidateTree.from_sequences(sequences, max_nodes=32, max_depth=4)
    tokens = tree.tokens.tolist()
    rows = torch.stack([logits] * (len(tree) + 1))
    return VerifiedTree(rows, tokens, tree.parents, state(history, stops=stops)), tokens


def test_filtered_honours_tau_and_the_repetition_rule():
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0, -1.0, -2.0])  # ranking 1 > 2 > 3 > 0 > 4 > 5
    tree, tokens = verified(logits, [[2], [1]])
    path, _ = Filtered(tau=1).walk(tree)
    assert [tokens[i] for i in path] == [1]
    tree, tokens = verified(logits, [[2], [3]])
    assert Filtered(tau=1).walk(tree)[0] == []
    assert [tokens[i] for i in Filtered(tau=2).walk(tree)[0]] == [2]
    assert [tokens[i] for i in Filtered(tau=3).walk(tree)[0]] == [2]  # both pass: the target's likelier wins
    tree, tokens = verified(logits, [[1]], history=[1, 0, 0])
    assert Filtered(tau=6).walk(tree)[0] == []  # 1 was generated within the window: a retrieved loop is cut


def test_tolerance_beta_bounds():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    tree, tokens = verified(logits, [[3], [2]])
    assert len(Tolerance(beta=1.0, seed=0).walk(tree)[0]) == 1  # accepts any draft
    policy, n = Tolerance(beta=0.0, seed=1), 4000
    emitted = Counter()
    for _ in range(n):
        path, bonus = policy.walk(tree)
        emitted[tokens[path[0]] if path else bonus] += 1
    q = torch.softmax(logits, 0).double().numpy()
    assert chi_square_p(np.array([emitted[i] for i in range(4)], float), q * n) > 1e-3


def test_similarity_groups_accept_within_the_group_only():
    embeddings = torch.eye(6)
    embeddings[3] = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 1.0])  # token 3 ~ token 5 (cosine 0.995)
    logits = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 9.0])
    greedy_sampler = Sampler(top_k=1)  # always samples token 5
    tree, tokens = verified(logits, [[3], [4]])
    groups = lambda threshold: SimilarityGroups(greedy_sampler, threshold=threshold, embeddings=embeddings)  # noqa: E731
    assert [tokens[i] for i in groups(0.9).walk(tree)[0]] == [3]
    assert groups(0.999).walk(tree)[0] == []
    assert groups(0.9).walk(verified(logits, [[4]])[0]) == ([], 5)


def test_relaxed_policies_accept_at_least_as_much_as_exact_ones():
    generator = torch.Generator().manual_seed(0)
    embeddings = torch.randn(VOCAB, 8, generator=generator)
    policies = {"exact": ExactSampling(Sampler(), seed=0), "greedy": ExactGreedy(),
                "filtered": Filtered(tau=4, sampler=Sampler(), win_size=1, tau_r=1.0, seed=0),
                "tolerance": Tolerance(Sampler(), beta=0.3, seed=0),
                "similarity": SimilarityGroups(Sampler(), threshold=0.5, embeddings=embeddings, seed=0),
                "pcg": GroupRejection(Sampler(), threshold=0.5, embeddings=embeddings, seed=0)}
    accepted = Counter()
    for _ in range(300):
        logits = torch.randn(VOCAB, generator=generator) * 2
        sequences = torch.randint(0, VOCAB, (4, 3), generator=generator).tolist()
        tree, _ = verified(logits, sequences)
        for name, policy in policies.items():
            accepted[name] += len(policy.walk(tree)[0])
    for relaxed in ("filtered", "tolerance", "similarity", "pcg"):
        assert accepted[relaxed] > accepted["exact"], accepted


@pytest.mark.parametrize("name", ["filtered", "tolerance", "similarity"])
def test_relaxed_policies_decide_the_end_of_speech_exactly(name):
    # the stop token (5) has probability 0.3; every draft would pass each relaxed rule, even over the stop
    probs = torch.tensor([0.2, 0.2, 0.1, 0.1, 0.1, 0.3])
    embeddings = torch.ones(6, 4)  # every token in every token's similarity group, the stop's included
    policy = {"filtered": Filtered(tau=6, sampler=Sampler(), seed=0),
              "tolerance": Tolerance(Sampler(), beta=1.0, seed=0),
              "similarity": SimilarityGroups(Sampler(), threshold=0.5, embeddings=embeddings, seed=0)}[name]
    tree, _ = verified(probs.log(), [[0], [1]], stops=(5,))
    n = 2000
    stopped = sum(policy.walk(tree) == ([], 5) for _ in range(n))
    assert abs(stopped / n - 0.3) < 0.05, stopped / n  # sd 0.01: the target's own stop probability


@pytest.mark.parametrize("name", ["filtered", "tolerance", "similarity", "pcg"])
def test_relaxed_policies_without_a_tree_draw_what_autoregressive_sampling_draws(name):
    # a plain step (no retriever, or "auto" choosing 0 nodes) emits, and costs, what autoregressive sampling does
    model = tiny_model("llama", "sdpa", VOCAB, seed=3, sharpen=2.0)
    sampler, speech = SAMPLERS["ras"](), SpeechVocab(0, VOCAB, (5,))
    policy = {"filtered": Filtered(tau=4, sampler=sampler), "tolerance": Tolerance(sampler, beta=0.3),
              "similarity": SimilarityGroups(sampler, threshold=0.5),
              "pcg": GroupRejection(sampler, threshold=0.5)}[name]
    for seed in range(5):
        options = dict(input_ids=[3, 9, 4, 1, 12], speech=speech, seed=seed, max_new_tokens=30)
        reference = generate(model, None, policy=ExactSampling(sampler), **options)
        assert generate(model, None, policy=policy, **options).tokens == reference.tokens, seed

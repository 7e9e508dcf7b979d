"""One rule engine: the Hugging Face tree walk and the vLLM plugin's draft chains (a chain is a tree with one child
per node) emit the same tokens from the same distributions and seed, for every policy."""

import pytest
import torch

from echospec.decoder import (RAS, ExactGreedy, ExactSampling, Filtered, GroupRejection, NodeState, Sampler,
                              SimilarityGroups, Tolerance, VerifiedTree)
from echospec.decoder.vllm_acceptance import chain_tokens
from echospec.decoder.verified import Rows
from echospec.retriever import CandidateTree

VOCAB, STOP = 24, 23
EMBEDDINGS = torch.randn(VOCAB, 6, generator=torch.Generator().manual_seed(7))
POLICIES = {
    "exact-greedy": lambda seed: ExactGreedy(),
    "exact-sampling": lambda seed: ExactSampling(Sampler(), seed=seed),
    "filtered": lambda seed: Filtered(RAS(), tau=6, seed=seed),
    "tolerance": lambda seed: Tolerance(beta=0.3, seed=seed),
    "similarity": lambda seed: SimilarityGroups(threshold=0.2, embeddings=EMBEDDINGS, seed=seed),
    "pcg": lambda seed: GroupRejection(threshold=0.2, embeddings=EMBEDDINGS, seed=seed),
}


def chain_case(seed: int):
    """(logits of a chain's 1 + n positions, its drafts: mostly each position's likeliest id, root state)."""
    generator = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 7, (1,), generator=generator))
    logits = torch.randn(n + 1, VOCAB, generator=generator) * 3
    drafts = logits[:-1].argmax(-1)
    noise = torch.randint(0, VOCAB - 1, (n,), generator=generator)
    drafts = torch.where(torch.rand(n, generator=generator) < 0.3, noise, drafts).tolist()
    history = torch.randint(0, VOCAB - 1, (12,), generator=generator).tolist()
    return logits, drafts, NodeState(history, 8, (STOP,), (STOP,), 10)  # the stop blocked for two positions


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_tree_walk_and_vllm_chain_emit_the_same_tokens(name):
    accepted = 0
    for seed in range(40):
        logits, drafts, root = chain_case(seed)
        # the Hugging Face path: the chain as a retriever's tree, verified as the session verifies it
        tree = CandidateTree.from_sequences([drafts], max_nodes=len(drafts), max_depth=len(drafts))
        verified = VerifiedTree(logits, tree.tokens.tolist(), tree.parents, root)
        tree_policy = POLICIES[name](seed)
        sampler = tree_policy.sampler
        path, bonus = tree_policy.walk(verified)
        by_tree = [verified.tokens[i] for i in path] + ([] if bonus is None else [bonus])
        # the vLLM path: the same distributions, handed in, along the chain
        rows = Rows(verified, torch.Generator(), sampler)
        q = rows.q if sampler is not None else torch.softmax(rows.scores, -1)
        by_chain = chain_tokens(POLICIES[name](seed), rows.scores, q, drafts, root)
        assert by_chain == by_tree, (name, seed)
        accepted += len(path)
    assert accepted > 10  # the drafts were taken, not only rejected


@pytest.mark.parametrize("sampler", [Sampler(temperature=0.8, top_k=6, top_p=0.9, repetition_penalty=1.5,
                                             repetition_window=5), RAS(top_p=0.7, top_k=5, win_size=4, tau_r=0.3)])
def test_the_batched_pass_gives_each_node_the_distribution_of_its_own_position(sampler):
    generator = torch.Generator().manual_seed(3)
    sequences = torch.randint(0, 6, (6, 4), generator=generator).tolist()  # few ids: paths repeat them
    tree = CandidateTree.from_sequences(sequences, max_nodes=20, max_depth=4)
    logits = torch.randn(len(tree) + 1, VOCAB, generator=generator) * 2
    history = [1, 2, 3, 1, 4]
    root = NodeState(history, 3, (STOP,), (STOP,), 5)  # the stop blocked for two generated tokens
    verified = VerifiedTree(logits, tree.tokens.tolist(), tree.parents, root)
    batched = Rows(verified, generator, sampler).q
    for row in range(len(tree) + 1):
        path = [] if row == 0 else [int(t) for t in verified.positions.paths[row] if t >= 0]
        own = NodeState(history + path, 3 + len(path), (STOP,), (STOP,) if 3 + len(path) < 5 else ())
        assert torch.allclose(batched[row], sampler.distribution(logits[row], own), atol=1e-6), row

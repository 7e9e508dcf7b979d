"""PCG done exactly (GroupRejection): the group emitted at a position is distributed as the target's overlap-aware
group distribution p_G, whatever is drafted; a stop is emitted with the target's own probability."""

from collections import Counter

import numpy as np
import pytest
import torch
from decoder_testing import chi_square_p

from echospec.decoder import GroupRejection, NodeState, Sampler
from echospec.decoder.policies import TokenGroups, group_distribution, group_rejection

VOCAB, THRESHOLD = 12, 0.5


def embeddings() -> torch.Tensor:
    return torch.randn(VOCAB, 3, generator=torch.Generator().manual_seed(4))


def p_group_by_definition(q: torch.Tensor, table: torch.Tensor, threshold: float) -> np.ndarray:
    """p_G(c) = sum over u with cos(u, c) >= threshold of q(u) / #{c': cos(u, c') >= threshold}, in float64."""
    unit = torch.nn.functional.normalize(table.double(), dim=-1)
    near = (unit @ unit.T >= threshold) | torch.eye(len(table), dtype=torch.bool)
    return (near.double() @ (q.double() / near.sum(1))).numpy()


def test_groups_overlap_and_p_g_sums_to_one():
    table = embeddings()
    q = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 2, 0)
    groups = TokenGroups(lambda ids: table[ids], THRESHOLD)
    sizes = [len(m) for m in groups.members(range(VOCAB), VOCAB)]
    assert min(sizes) >= 1 and max(sizes) > 2  # every token in its own group; groups overlap
    p_group = p_group_by_definition(q, table, THRESHOLD)
    assert abs(p_group.sum() - 1) < 1e-6 and not np.allclose(p_group, q.double().numpy())
    assert np.allclose(group_distribution(q, groups)[0].double().numpy(), p_group, atol=1e-6)


@pytest.mark.parametrize("children", [[7], [7, 2, 10]])
def test_emitted_groups_follow_the_targets_group_distribution(children):
    table = embeddings()
    q = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 2, 0)
    groups = TokenGroups(lambda ids: table[ids], THRESHOLD)
    generator = torch.Generator().manual_seed(0)
    n, emitted, accepted = 6000, Counter(), 0
    for _ in range(n):
        pick, token, group = group_rejection(q, children, (), groups, generator)
        assert token in groups.members([group], VOCAB)[0].tolist()  # the token stands in for its group
        assert pick is None or children[pick] == token
        emitted[group] += 1
        accepted += pick is not None
    expected = p_group_by_definition(q, table, THRESHOLD) * n
    # chi-square over 12 cells at 6000 draws: a wrong rule (say, drafts accepted with min(1, q(x)/...) on tokens,
    # or the residual not updated between children) moves cells by far more than the test's p > 1e-3 allows
    p = chi_square_p(np.array([emitted[c] for c in range(VOCAB)], float), expected)
    assert p > 1e-3, (p, emitted, expected)
    # more than the exact rule accepts (q of the drafted tokens): the groups relax it
    assert accepted / n > float(q[children].sum()) + 0.05, accepted / n


def test_singleton_groups_make_it_exact_sampling():
    table = torch.eye(VOCAB)  # no two tokens alike: every group is one token
    q = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)), 0)
    groups, generator = TokenGroups(lambda ids: table[ids], THRESHOLD), torch.Generator().manual_seed(0)
    n = 6000
    tokens = Counter(group_rejection(q, [3, 5], (), groups, generator)[1] for _ in range(n))
    assert chi_square_p(np.array([tokens[t] for t in range(VOCAB)], float), q.double().numpy() * n) > 1e-3


def test_the_policy_decides_the_end_of_speech_exactly():
    table = torch.ones(6, 4)  # every token in every group, the stop's included
    probs = torch.tensor([0.2, 0.2, 0.1, 0.1, 0.1, 0.3])
    policy = GroupRejection(Sampler(), threshold=0.5, embeddings=table, seed=0)
    state = NodeState([], 0, (5,))
    n = 2000
    outcomes = [policy.choose(probs.log(), [0, 5], state) for _ in range(n)]
    stopped = sum(token == 5 for _, token in outcomes)
    assert abs(stopped / n - 0.3) < 0.05, stopped / n  # sd 0.01: the target's own stop probability
    assert all(pick in (None, 0) for pick, _ in outcomes)  # a drafted stop is never accepted over the rule
    assert all(pick == 0 for pick, token in outcomes if token != 5)  # one group: the draft always stands in

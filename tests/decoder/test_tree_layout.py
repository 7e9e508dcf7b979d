"""The host-side layout a verified tree hands its sampler (depths, paths, children, each row's recent tokens) against
a plain per-node reference, and the row draw's guard against ids of probability 0."""

import numpy as np
import torch

from echospec.decoder.sampling import NodeState, draw_rows
from echospec.decoder.verified import VerifiedTree


def random_tree(rng, n):
    parents = [-1 if i == 0 or rng.random() < 0.3 else int(rng.integers(0, i)) for i in range(n)]
    return rng.integers(0, 50, n).tolist(), parents


def reference_path(tokens, parents, node):
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def test_layout_matches_a_per_node_walk():
    rng = np.random.default_rng(0)
    for n in [0, 1, 2, 5, 16, 40]:
        tokens, parents = random_tree(rng, n)
        history = rng.integers(0, 50, 7).tolist()
        tree = VerifiedTree(torch.zeros(n + 1, 50), tokens, parents, NodeState(history, 4))
        for node in range(-1, n):
            assert tree.children(node) == [i for i in range(n) if parents[i] == node]
        paths = [[]] + [reference_path(tokens, parents, i) for i in range(n)]
        assert tree.depths.tolist() == [len(p) for p in paths]
        for window in [None, 3, 10]:
            ids, valid = tree.positions.tails(history, window)
            for row, path in enumerate(paths):
                want = (history + path)[-window:] if window else history + path
                got = ids[row][valid[row]].tolist()
                assert got == want
                assert set(ids[row].tolist()) == set(want)  # the padding repeats a token of the row's own


def test_a_uniform_next_to_one_never_draws_an_id_of_probability_zero():
    q = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0], [1e-30, 0.0, 0.0, 0.0, 0.0]])
    top = torch.tensor([1 - 2 ** -53, 1 - 2 ** -53], dtype=torch.float64)
    assert draw_rows(q, top).tolist() == [2, 0]
    assert draw_rows(q, torch.zeros(2, dtype=torch.float64)).tolist() == [1, 0]

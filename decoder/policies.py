"""Acceptance policies: walk a verified tree from the root and decide which path to keep and the bonus token.

Every policy answers the same question at each visited position — given the target's logits there and the
draft children, which child (if any) to follow, or which token to emit instead as the step's bonus token.
The exact policies emit exactly what autoregressive decoding would; the relaxed ones accept more drafts
and say what they trade for it. The relaxed ones still decide the end of speech exactly: a stop token is
emitted with the sampler's own probability and no draft is accepted over it. (Without that, accepting
drafts over a likely stop made Filtered's utterances on the shipped sample 13% longer than autoregressive
sampling's, which the log-mel distortion measured as a loss of quality.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .sampling import RAS, NodeState, Sampler, make_generator, mask_blocked


@dataclass
class VerifiedTree:
    """What the verifier hands a policy: one logits row per position (row 0 = the root) and the tree's shape."""

    logits: torch.Tensor  # float[1 + N, V]
    tokens: list[int]  # model ids of the N nodes
    children: list[list[int]]  # children[node + 1]: child node indices of `node` (-1 = root)
    state_at: Callable[[list[int]], NodeState]  # sampler state after root + the nodes on `path`


class Policy:
    """One acceptance rule. Subclasses implement `choose` and declare `exact`; `walk` is shared.

    `exact = True`: the policy emits exactly the tokens autoregressive decoding would (for a sampler, with
    the same draws), whatever the tree. `exact = False`: relaxed, its tokens depend on the tree. No default:
    a policy that does not say cannot be taken for lossless by mistake. Constructors take the sampler (if
    any) as their one positional argument and every other option by keyword.
    """

    exact: bool

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not isinstance(getattr(cls, "exact", None), bool):
            raise TypeError(f"{cls.__name__} must declare `exact = True` (it emits exactly what autoregressive "
                            f"decoding would, whatever the tree) or `exact = False` (relaxed)")

    def __init__(self, *, seed: int | torch.Generator | None = None):
        self.generator = make_generator(seed)

    def reseed(self, seed: int | torch.Generator) -> None:
        self.generator = make_generator(seed)

    def bind(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Called once per session with the target's token-embedding lookup (only SimilarityGroups uses it)."""

    def choose(self, logits: torch.Tensor, child_tokens: list[int], state: NodeState) -> tuple[int | None, int]:
        """(index into child_tokens to follow, or None; the token emitted at this position)."""
        raise NotImplementedError

    def walk(self, tree: VerifiedTree) -> tuple[list[int], int | None]:
        """(accepted node indices root-to-leaf, bonus token or None when the path ends with a stop token)."""
        path: list[int] = []
        node = -1
        while True:
            state = tree.state_at(path)
            kids = tree.children[node + 1]
            pick, token = self.choose(tree.logits[node + 1], [tree.tokens[k] for k in kids], state)
            if pick is None:
                return path, token
            node = kids[pick]
            path.append(node)
            if token in state.stop_ids:
                return path, None


def _match(child_tokens: Sequence[int], token: int) -> int | None:
    return child_tokens.index(token) if token in child_tokens else None


def _sampler(policy: str, sampler, default):
    """The sampler a policy was given (its one positional argument), or `default`."""
    if sampler is None:
        return default
    if not callable(getattr(sampler, "sample", None)):
        raise TypeError(f"{policy}'s positional argument is its sampler (Sampler() or RAS()), got {sampler!r}; "
                        f"pass its other options by keyword")
    return sampler


class ExactGreedy(Policy):
    """Lossless greedy: the output is token for token `model.generate(do_sample=False)`'s."""

    exact = True

    def choose(self, logits, child_tokens, state):
        token = int(torch.argmax(mask_blocked(logits, state)))
        return _match(child_tokens, token), token


class ExactSampling(Policy):
    """Lossless sampling: at each node draw the token the sampler would draw there; follow the child with it.

    Drafts are deterministic, so following the drawn token is rejection sampling with acceptance q(x):
    the output is distributed exactly as autoregressive sampling with `sampler` (Sampler or RAS).
    """

    exact = True

    def __init__(self, sampler: Sampler | RAS | None = None, *, seed: int | torch.Generator | None = None):
        super().__init__(seed=seed)
        self.sampler = _sampler("ExactSampling", sampler, Sampler())

    def choose(self, logits, child_tokens, state):
        token = self.sampler.sample(logits, state, self.generator)
        return _match(child_tokens, token), token


class Filtered(Policy):
    """The retrieval paper's filtered acceptance (relaxed).

    A draft token is accepted when the target ranks it within its top `tau` and it passes the RAS
    repetition rule (it occurs fewer than `win_size * tau_r` times in the last `win_size` generated
    tokens — cuts retrieved loops). Among passing children the target's most likely wins; otherwise the
    bonus token is drawn by `sampler`. Trades: the output is no longer distributed as the target's
    sampler — any of the top-`tau` tokens may be emitted regardless of its probability.
    """

    exact = False

    def __init__(self, sampler: Sampler | RAS | None = None, *, tau: int = 512, win_size: int = 10,
                 tau_r: float = 0.1, seed: int | torch.Generator | None = None):
        super().__init__(seed=seed)
        if tau < 1:
            raise ValueError(f"Filtered needs tau >= 1, got {tau}")
        self.tau, self.win_size, self.tau_r = tau, win_size, tau_r
        self.sampler = _sampler("Filtered", sampler, RAS())

    def _passes(self, scores: torch.Tensor, token: int, state: NodeState) -> bool:
        rank = int((scores > scores[token]).sum())
        repeats = list(state.generated[-self.win_size:]).count(token)
        return rank < self.tau and bool(torch.isfinite(scores[token])) and repeats < self.win_size * self.tau_r

    def choose(self, logits, child_tokens, state):
        token = self.sampler.sample(logits, state, self.generator)  # the bonus token, unless a draft passes
        if not child_tokens or token in state.stop_ids:  # the end of speech is decided exactly
            return None, token
        scores = mask_blocked(logits.float(), state)
        passing = [i for i, t in enumerate(child_tokens) if self._passes(scores, t, state)]
        if passing:
            best = max(passing, key=lambda i: float(scores[child_tokens[i]]))
            return best, child_tokens[best]
        return None, token


class Tolerance(Policy):
    """SSD's tolerance rule for deterministic drafts (relaxed): accept draft x when r < q(x) + beta, r ~ U(0, 1).

    Children are tried most likely first; a rejected child's mass is removed from q and q renormalised
    (recursive rejection sampling), and the bonus token is drawn from what is left. With beta = 0 this
    is exact sampling; beta > 0 trades distribution fidelity for acceptance (beta = 1 accepts every draft).
    """

    exact = False

    def __init__(self, sampler: Sampler | RAS | None = None, *, beta: float = 0.1,
                 seed: int | torch.Generator | None = None):
        super().__init__(seed=seed)
        if beta < 0:
            raise ValueError(f"Tolerance needs beta >= 0, got {beta}")
        self.beta = beta
        self.sampler = _sampler("Tolerance", sampler, Sampler())

    def choose(self, logits, child_tokens, state):
        if not child_tokens:  # q itself, drawn as autoregressive sampling draws it, at its cost
            return None, self.sampler.sample(logits, state, self.generator)
        q = self.sampler.distribution(logits, state).clone()
        stops = list(state.stop_ids)
        if stops:  # the end of speech is decided exactly; the rule then runs on q without the stop tokens
            p_stop = float(q[stops].sum())
            if p_stop > 0 and float(torch.rand(1, generator=self.generator)) < p_stop:
                return None, stops[int(torch.multinomial(q[stops], 1, generator=self.generator))]
            q[stops] = 0.0
            q = q / q.sum()
        for i in sorted(range(len(child_tokens)), key=lambda i: -float(q[child_tokens[i]])):
            token = child_tokens[i]
            if float(torch.rand(1, generator=self.generator)) < float(q[token]) + self.beta:
                return i, token
            q[token] = 0.0
            q = q / q.sum()
        return None, int(torch.multinomial(q, 1, generator=self.generator))


class SimilarityGroups(Policy):
    """PCG's coarse-grained acceptance (relaxed): accept a child whose similarity group holds the sampled token.

    A token's group is every token whose target embedding (the LM head's row, unless `embeddings` is
    given) has cosine similarity >= `threshold` with it; groups overlap. The target samples a token
    with `sampler`; the child with that token wins, else the most similar child in the token's group.
    Trades: an accepted child may differ from the sampled token, only within its acoustic neighbourhood.
    """

    exact = False

    def __init__(self, sampler: Sampler | RAS | None = None, *, threshold: float = 0.9,
                 embeddings: torch.Tensor | None = None, seed: int | torch.Generator | None = None):
        super().__init__(seed=seed)
        self.threshold = threshold
        self.sampler = _sampler("SimilarityGroups", sampler, Sampler())
        self.embed = None if embeddings is None else (lambda ids: embeddings[ids])
        self._own_embeddings = embeddings is not None

    def bind(self, embed):
        if not self._own_embeddings:
            self.embed = embed

    def choose(self, logits, child_tokens, state):
        token = self.sampler.sample(logits, state, self.generator)
        if not child_tokens or token in child_tokens or token in state.stop_ids:  # a stop has no substitute
            return _match(child_tokens, token), token
        if self.embed is None:
            raise ValueError("SimilarityGroups needs embeddings: pass them, or use it via generate/SpeculativeSession")
        vectors = torch.nn.functional.normalize(self.embed(torch.tensor(child_tokens + [token])).float(), dim=-1)
        similarity = vectors[:-1] @ vectors[-1]
        best = int(torch.argmax(similarity))
        if float(similarity[best]) >= self.threshold:
            return best, child_tokens[best]
        return None, token

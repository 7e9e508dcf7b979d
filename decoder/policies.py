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

import math
from typing import Callable, Sequence

import torch

from . import registry
from .sampling import RAS, NodeState, Sampler, make_generator
from .verified import Rows, VerifiedTree

__all__ = ["ExactGreedy", "ExactSampling", "Filtered", "GroupRejection", "Policy", "Rows", "SimilarityGroups",
           "TokenGroups", "Tolerance", "VerifiedTree"]


class Policy:
    """One acceptance rule. Subclasses implement `decide` and declare `exact`; `walk` is shared.

    `exact = True`: the policy emits exactly the tokens autoregressive decoding would (for a sampler, with
    the same draws), whatever the tree. `exact = False`: relaxed, its tokens depend on the tree. No default:
    a policy that does not say cannot be taken for lossless by mistake. Constructors take the sampler (if
    any) as their one positional argument and every other option by keyword.
    """

    exact: bool
    sampler: Sampler | RAS | None = None

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

    def decide(self, rows: Rows, node: int, child_tokens: list[int], path: list[int]) -> tuple[int | None, int]:
        """At `node`'s row (-1: the root), reached by `path`: (index into child_tokens to follow, or None; the
        token emitted there). `rows` holds the step's batched quantities; read only the rows you need."""
        raise NotImplementedError

    def walk(self, tree: VerifiedTree, rows: Rows | None = None) -> tuple[list[int], int | None]:
        """(accepted node indices root-to-leaf, bonus token or None when the path ends with a stop token). `rows`:
        the tree's distributions when given (vLLM's), else this policy's sampler's, in one pass."""
        rows = rows if rows is not None else Rows(tree, self.generator, self.sampler)
        path: list[int] = []
        node = -1
        while True:
            kids = tree.children(node)
            pick, token = self.decide(rows, node, [tree.tokens[k] for k in kids], path)
            if pick is None:
                rows.done(len(path) + 1)
                return path, token
            node = kids[pick]
            path.append(node)
            if token in tree.root.stop_ids:
                rows.done(len(path))
                return path, None

    def choose(self, logits: torch.Tensor, child_tokens: list[int], state: NodeState) -> tuple[int | None, int]:
        """The rule at one position: (index into child_tokens to follow, or None; the token emitted there), with
        `logits` there and `state` the sampler's view (the root of a tree of `child_tokens`)."""
        tree = VerifiedTree(logits[None].expand(len(child_tokens) + 1, -1), child_tokens, [-1] * len(child_tokens),
                            state)
        rows = Rows(tree, self.generator, self.sampler)
        decided = self.decide(rows, -1, list(child_tokens), [])
        rows.done(1)
        return decided


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


# ---- The rules, each written once: the tree walk below calls them per node with its children, and the vLLM
# plugin (vllm_acceptance) per chain position with its one draft. A rule's options and their defaults are the
# policy classes'. ----


def filtered_choice(token: int, child_tokens: Sequence[int], child_above: Sequence[float],
                    child_scores: Sequence[float], generated: Sequence[int], stop_ids: Sequence[int], tau: float,
                    win_size: int, tau_r: float) -> tuple[int | None, int]:
    """Filtered's rule at one position: (index into child_tokens accepted or None, token emitted). `token` is the
    sampler's draw there, emitted unless a draft passes; each draft's standing (what the target ranks above it: a
    count of ids for `tau` >= 1, their share of the probability for `tau` < 1, blocked ids at -inf) and score
    there; `generated` the output before this position. A draft passes when less than `tau` ranks above it, it is
    not blocked, and it occurs fewer than win_size * tau_r times in the last `win_size` generated tokens; the
    likeliest passing draft wins. A drawn stop token is emitted: the end of speech is decided exactly. The share
    means the same on any vocabulary, where a count of ids does not."""
    if not child_tokens or token in stop_ids:
        return None, token
    recent = list(generated[-win_size:]) if win_size else []
    passing = [i for i, draft in enumerate(child_tokens) if child_above[i] < tau and child_scores[i] > -math.inf
               and recent.count(draft) < win_size * tau_r]
    if passing:
        best = max(passing, key=lambda i: child_scores[i])
        return best, child_tokens[best]
    return None, token


def tolerance_choice(q: torch.Tensor, child_tokens: Sequence[int], stop_ids: Sequence[int], beta: float,
                     generator) -> tuple[int | None, int]:
    """Tolerance's rule at one position with at least one draft: (index accepted or None, token emitted), q the
    sampler's distribution. The end of speech is decided exactly first; then drafts, likeliest first, are accepted
    when r < q(x) + beta, r ~ U(0, 1), a rejected draft's mass leaving q (recursive rejection sampling); the
    token emitted otherwise is drawn from what is left."""
    stop, q = decide_stop(q, stop_ids, generator)
    if stop is not None:
        return None, stop
    q = q.clone()
    child_q = q[list(child_tokens)].tolist()
    for i in sorted(range(len(child_tokens)), key=lambda i: -child_q[i]):
        token = child_tokens[i]
        if float(torch.rand(1, generator=generator)) < float(q[token]) + beta:
            return i, token
        q[token] = 0.0
        q = q / q.sum()
    return None, int(torch.multinomial(q, 1, generator=generator))


def decide_stop(q: torch.Tensor, stop_ids: Sequence[int], generator) -> tuple[int | None, torch.Tensor]:
    """The end of speech, decided exactly: a stop token drawn with its own probability under q, else None
    and q without the stop tokens, renormalised (the relaxed rule then runs on that)."""
    stops = list(stop_ids)
    if not stops:
        return None, q
    p_stop = float(q[stops].sum())
    if p_stop > 0 and float(torch.rand(1, generator=generator)) < p_stop:
        return stops[int(torch.multinomial(q[stops], 1, generator=generator))], q
    q = q.clone()
    q[stops] = 0.0
    return None, q / q.sum()


class TokenGroups:
    """Overlapping acoustic-similarity groups over a vocabulary, one group per token: token c's group is every
    token whose embedding has cosine similarity >= `threshold` with c's (c itself always included). Cosine is
    symmetric, so u is in c's group exactly when c is in u's: u belongs to len(group(u)) groups.

    `embed` maps ids to embedding rows (the target's LM head, or given embeddings). The first rule that needs the
    groups finds them all at once, as (group, member) pairs sorted by group, kept on the host where the rules
    run: a vocabulary-by-vocabulary cosine pass in row blocks of at most 2**25 cosines, so that PCG's group
    distribution is then one gather and one scatter over the pairs, not a Python loop over the support.
    """

    BLOCK = 2 ** 25  # cosines a block of rows computes at once (128 MB of float32)

    def __init__(self, embed: Callable[[torch.Tensor], torch.Tensor], threshold: float):
        self.embed, self.threshold = embed, threshold
        self._pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # group, member, bounds

    def similarity(self, ids: Sequence[int], token: int) -> torch.Tensor:
        """Cosine similarity of each of `ids` with `token`."""
        vectors = torch.nn.functional.normalize(self.embed(torch.tensor([*ids, token])).float().cpu(), dim=-1)
        return vectors[:-1] @ vectors[-1]

    def pairs(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(group, member, bounds): every pair with cos >= threshold, sorted by group then member; group c's
        members are member[bounds[c]:bounds[c + 1]] (so bounds.diff() is each token's group size)."""
        if self._pairs is None or len(self._pairs[2]) != vocab_size + 1:
            unit = torch.nn.functional.normalize(self.embed(torch.arange(vocab_size)).float().cpu(), dim=-1)
            rows = max(1, self.BLOCK // vocab_size)
            found = []
            for start in range(0, vocab_size, rows):
                near = unit[start:start + rows] @ unit.T >= self.threshold
                near[torch.arange(len(near)), torch.arange(start, start + len(near))] = True
                group, member = torch.nonzero(near, as_tuple=True)  # row-major: sorted by group, then member
                found.append((group + start, member))
            group, member = (torch.cat(parts) for parts in zip(*found))
            sizes = torch.bincount(group, minlength=vocab_size)
            self._pairs = group, member, torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
        return self._pairs

    def members(self, tokens: Sequence[int], vocab_size: int) -> list[torch.Tensor]:
        """The ids in each token's group, ascending."""
        _, member, bounds = self.pairs(vocab_size)
        return [member[bounds[t]:bounds[t + 1]] for t in tokens]


def similarity_choice(token: int, child_tokens: Sequence[int], stop_ids: Sequence[int],
                      groups: TokenGroups) -> tuple[int | None, int]:
    """SimilarityGroups' rule at one position with at least one draft: (index accepted or None, token emitted),
    `token` the sampler's draw there. The draft equal to it wins, else the draft most similar to it if that one
    is in its group; a drawn stop has no substitute."""
    if token in child_tokens or token in stop_ids:
        return _match(child_tokens, token), token
    similarity = groups.similarity(child_tokens, token)
    best = int(torch.argmax(similarity))
    if float(similarity[best]) >= groups.threshold:
        return best, child_tokens[best]
    return None, token


def group_distribution(q: torch.Tensor, groups: TokenGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """PCG's overlap-aware group distribution: each token's probability split evenly over the groups that hold
    it, p_G(c) = sum over u in group(c) of q(u) / (groups holding u). Returns (p_G, those counts for every token).
    It sums to 1 because u is in exactly len(group(u)) groups (symmetry)."""
    group, member, bounds = groups.pairs(len(q))
    counts = bounds.diff().to(q.dtype)
    return torch.zeros_like(q).index_add_(0, group, (q / counts)[member]), counts


def group_rejection(q: torch.Tensor, child_tokens: Sequence[int], stop_ids: Sequence[int], groups: TokenGroups,
                    generator) -> tuple[int | None, int, int | None]:
    """PCG's rule at one position: (index into child_tokens accepted or None, token emitted, its group or None
    for a stop). Rejection sampling on the group variable, so the group is distributed exactly as p_G.

    A deterministic draft x stands for its groups with q_G = x's mass split evenly over them; a group c is drawn
    from q_G and x accepted with min(1, p(c) / q_G(c)), p the target's group distribution (p_G at first); on
    rejection p becomes the normalised residual max(0, p - q_G) and the next child is tried (recursive rejection).
    When none is accepted, a group is drawn from the residual and a token from it with weights q(u) / (groups
    holding u), its share of that group. Stop tokens are decided first, exactly, and never accepted as drafts.
    """
    stop, q = decide_stop(q, stop_ids, generator)
    if stop is not None:
        return None, stop, None
    _, member, bounds = groups.pairs(len(q))
    p_group, counts = group_distribution(q, groups)
    residual = p_group.clone()  # unnormalised: the target is residual / residual.sum()
    child_q = q[list(child_tokens)].tolist()
    for i in sorted(range(len(child_tokens)), key=lambda i: -child_q[i]):
        token = child_tokens[i]
        if token in stop_ids:
            continue
        own = member[bounds[token]:bounds[token + 1]]
        group = int(own[torch.randint(len(own), (1,), generator=generator)])  # c ~ q_G: uniform over x's groups
        total = float(residual.sum())
        if float(torch.rand(1, generator=generator)) * total < float(residual[group]) * len(own):
            return i, token, group
        residual[own] -= total / len(own)
        residual.clamp_(min=0.0)
    if float(residual.sum()) <= 0:  # only rounding empties it: the last child's q_G matched p exactly
        residual = p_group
    group = int(torch.multinomial(residual, 1, generator=generator))
    inside = member[bounds[group]:bounds[group + 1]]
    weights = q[inside] / counts[inside]
    return None, int(inside[torch.multinomial(weights, 1, generator=generator)]), group


class ExactGreedy(Policy):
    """Lossless greedy: the output is token for token `model.generate(do_sample=False)`'s."""

    exact = True

    def decide(self, rows, node, child_tokens, path):
        token = rows.argmax[node + 1]
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

    def decide(self, rows, node, child_tokens, path):
        token = rows.draws[node + 1]
        return _match(child_tokens, token), token


class Filtered(Policy):
    """The retrieval paper's filtered acceptance (relaxed).

    A draft token is accepted when the target ranks it within its top `tau` and it passes the RAS
    repetition rule (it occurs fewer than `win_size * tau_r` times in the last `win_size` generated
    tokens — cuts retrieved loops). Among passing children the target's most likely wins; otherwise the
    bonus token is drawn by `sampler`. Trades: the output is no longer distributed as the target's
    sampler — any of the top-`tau` tokens may be emitted regardless of its probability.

    Default tau = 160 (the registry's): on the sample the paired rule refused every setting, and 160 (0.16 of its
    1024 speech ids; the paper used 512 of CosyVoice 2's 6561) moved the log-likelihood least of those swept,
    +3.3% [1.5, 5.1] at 1.38x; the share form tau = 0.99 moved it +5.8%, 0.9 +9.3% (mode-seeking;
    docs/results.md). A count means something else on every vocabulary, a share does not: sweep it on yours
    (`echospec bench --sweep tau=...`).
    """

    exact = False

    def __init__(self, sampler: Sampler | RAS | None = None, *, tau: float = registry.default("filtered"),
                 win_size: int = 10, tau_r: float = 0.1, seed: int | torch.Generator | None = None):
        super().__init__(seed=seed)
        if not tau > 0:
            raise ValueError(f"Filtered needs tau > 0 (a count of ids, or below 1 a share of the probability), "
                             f"got {tau}")
        self.tau, self.win_size, self.tau_r = tau, win_size, tau_r
        self.sampler = _sampler("Filtered", sampler, RAS())

    def decide(self, rows, node, child_tokens, path):
        token = rows.draws[node + 1]  # the bonus token, unless a draft passes
        if not child_tokens:
            return None, token
        ranks, shares, scores = rows.child_standing
        above = shares if self.tau < 1 else ranks
        kids = rows.tree.children(node)
        return filtered_choice(token, child_tokens, [above[k] for k in kids], [scores[k] for k in kids],
                               rows.tree.generated_at(path), rows.tree.root.stop_ids, self.tau, self.win_size,
                               self.tau_r)


class Tolerance(Policy):
    """SSD's tolerance rule for deterministic drafts (relaxed): accept draft x when r < q(x) + beta, r ~ U(0, 1).

    Children are tried most likely first; a rejected child's mass is removed from q and q renormalised
    (recursive rejection sampling), and the bonus token is drawn from what is left. With beta = 0 this
    is exact sampling; beta > 0 trades distribution fidelity for acceptance (beta = 1 accepts every draft).

    Default beta = 0.2 (the registry's; 0.1 on vLLM chains): the fastest beta swept on the sample whose
    log-likelihood change stayed within 5% (1.27x, -1.5% [-3.5, 0.4]); 0.4 ran 1.41x at +5.4% [3.7, 7.1]. The
    paired rule refused every setting there (docs/results.md).
    """

    exact = False

    def __init__(self, sampler: Sampler | RAS | None = None, *, beta: float = registry.default("tolerance"),
                 seed: int | torch.Generator | None = None):
        super().__init__(seed=seed)
        if beta < 0:
            raise ValueError(f"Tolerance needs beta >= 0, got {beta}")
        self.beta = beta
        self.sampler = _sampler("Tolerance", sampler, Sampler())

    def decide(self, rows, node, child_tokens, path):
        if not child_tokens:  # q itself, drawn as autoregressive sampling draws it, at its cost
            return None, rows.draw(node + 1)
        return tolerance_choice(rows.q_at(node + 1), child_tokens, rows.tree.root.stop_ids, self.beta,
                                self.generator)


class SimilarityGroups(Policy):
    """PCG's coarse-grained acceptance, simplified (relaxed): accept a child whose similarity group holds the
    sampled token.

    A token's group is every token whose target embedding (the LM head's row, unless `embeddings` is
    given) has cosine similarity >= `threshold` with it; groups overlap (TokenGroups). The target samples a token
    with `sampler`; the child with that token wins, else the most similar child in the token's group.
    Trades: an accepted child may differ from the sampled token, only within its acoustic neighbourhood; the
    groups emitted are not distributed as the target's (GroupRejection's are).

    Default threshold = 0.6 (the registry's): on the sample a group is then 2.1 of 1024 ids on average (132 at
    0.1), 1.09x at log-likelihood +3.0% [1.6, 4.5]; 0.3 and 0.1 moved it by more than 5% (docs/results.md). A
    threshold is a cosine on one model's embeddings: measure the group sizes on yours before carrying it over.
    """

    exact = False

    def __init__(self, sampler: Sampler | RAS | None = None, *, threshold: float = registry.default("similarity"),
                 embeddings: torch.Tensor | None = None, seed: int | torch.Generator | None = None):
        super().__init__(seed=seed)
        self.threshold = threshold
        self.sampler = _sampler(type(self).__name__, sampler, Sampler())
        self.groups = None if embeddings is None else TokenGroups(lambda ids: embeddings[ids], threshold)
        self._own_embeddings = embeddings is not None

    def bind(self, embed):
        if not self._own_embeddings:
            self.groups = None if embed is None else TokenGroups(embed, self.threshold)

    def _groups(self) -> TokenGroups:
        if self.groups is None:
            raise ValueError(f"{type(self).__name__} needs embeddings: pass them, or use it via "
                             f"generate/SpeculativeSession")
        return self.groups

    def decide(self, rows, node, child_tokens, path):
        token = rows.draws[node + 1]
        if not child_tokens:
            return None, token
        return similarity_choice(token, child_tokens, rows.tree.root.stop_ids, self._groups())


class GroupRejection(SimilarityGroups):
    """PCG done exactly (relaxed at the token level, exact at the group level): rejection sampling on the
    overlapping acoustic-similarity groups (SimilarityGroups' groups, `threshold`), so the sequence of groups
    emitted is distributed exactly as the target's overlap-aware group distribution p_G (`group_rejection`).

    Trades: an accepted draft stands in for a group the target would have chosen with the same probability, so
    tokens within a group are interchangeable; with threshold above every off-diagonal cosine each group is one
    token and this is exact sampling. The end of speech is decided exactly. Where a step has no draft it draws
    the sampler's own token, as autoregressive sampling does.

    It shares SimilarityGroups' threshold. On the sample's CPU, with its groups as pairs (TokenGroups), it ran
    1.10x autoregressive sampling at 0.6 and 1.27x at 0.3 (40 prompts; before, 0.79x and 0.94x): about 2 tokens
    per forward, each tree forward costing 1.2-1.4 steps (docs/acceptance_profile.md). On a GPU, measure it.
    """

    exact = False

    def decide(self, rows, node, child_tokens, path):
        if not child_tokens:
            return None, rows.draw(node + 1)
        pick, token, _ = group_rejection(rows.q_at(node + 1), child_tokens, rows.tree.root.stop_ids,
                                         self._groups(), self.generator)
        return pick, token

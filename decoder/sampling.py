"""Token samplers: the target's sampling rule at one position, as a distribution and as a seeded draw.

A sampler is what autoregressive decoding would do at a position. Lossless policies call `sample` at every
tree node (so speculative output is distributed exactly like autoregressive output with the same sampler);
`distribution` gives the same rule as probabilities for the residual and relaxed rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass
class NodeState:
    """What a sampler may look at besides the logits: the tokens before this position (model ids)."""

    history: Sequence[int]  # prompt ids (when the prompt was ids) + generated ids, oldest first
    n_generated: int  # how many of `history`'s last tokens were generated (CosyVoice's `decoded_tokens`)
    stop_ids: tuple[int, ...] = ()
    allow_stop: bool = True  # False while fewer than min_new_tokens have been generated

    @property
    def generated(self) -> Sequence[int]:
        return self.history[len(self.history) - self.n_generated :]


def make_generator(seed: int | torch.Generator | None) -> torch.Generator:
    """A generator from a seed; None draws the seed from torch's global RNG (so torch.manual_seed governs it)."""
    if isinstance(seed, torch.Generator):
        return seed
    generator = torch.Generator()
    generator.manual_seed(int(torch.randint(0, 2**62, (1,))) if seed is None else int(seed))
    return generator


def mask_stops(scores: torch.Tensor, state: NodeState) -> torch.Tensor:
    """Hugging Face's min-new-tokens rule: stop tokens get -inf until they are allowed."""
    if state.allow_stop or not state.stop_ids:
        return scores
    scores = scores.clone()
    scores[..., list(state.stop_ids)] = -float("inf")
    return scores


class Sampler:
    """Hugging Face's multinomial sampling: repetition penalty, min-new-tokens, temperature, top-k, top-p, min-p.

    Uses transformers' own logits processors in `generate`'s order, so the distribution is the one
    `model.generate(do_sample=True, ...)` samples from.
    """

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0):
        self.params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           repetition_penalty=repetition_penalty)
        penalties = LogitsProcessorList()
        if repetition_penalty != 1.0:
            penalties.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
        warpers = LogitsProcessorList()
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
        if min_p:
            warpers.append(MinPLogitsWarper(min_p))
        self.penalties, self.warpers = penalties, warpers

    def __repr__(self) -> str:
        return f"Sampler({', '.join(f'{k}={v}' for k, v in self.params.items())})"

    def scores(self, logits: torch.Tensor, state: NodeState) -> torch.Tensor:
        scores = logits.float()[None]
        if len(self.penalties) and len(state.history):
            scores = self.penalties(torch.tensor([list(state.history)], device=scores.device), scores)
        scores = mask_stops(scores, state)
        return self.warpers(None, scores)[0] if len(self.warpers) else scores[0]

    def distribution(self, logits: torch.Tensor, state: NodeState) -> torch.Tensor:
        return torch.softmax(self.scores(logits, state), dim=-1)

    def sample(self, logits: torch.Tensor, state: NodeState, generator: torch.Generator) -> int:
        return int(torch.multinomial(self.distribution(logits, state), 1, generator=generator))


class RAS:
    """CosyVoice's repetition-aware sampling (from VALL-E 2), with CosyVoice 2's min-length rule.

    Draw from the nucleus (the most probable tokens, in stable descending order, taken while their
    running sum is below `top_p` and there are fewer than `top_k`); if the drawn token occurs at least
    `win_size * tau_r` times among the last `win_size` generated tokens, draw again from the full
    softmax instead. While stopping is not yet allowed, a drawn stop token is thrown away and the
    whole draw repeated (CosyVoice 2 gives up after 100 tries).
    """

    max_trials = 100

    def __init__(self, top_p: float = 0.8, top_k: int = 25, win_size: int = 10, tau_r: float = 0.1):
        self.top_p, self.top_k, self.win_size, self.tau_r = top_p, top_k, win_size, tau_r

    def __repr__(self) -> str:
        return f"RAS(top_p={self.top_p}, top_k={self.top_k}, win_size={self.win_size}, tau_r={self.tau_r})"

    def _nucleus(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, probabilities) of the nucleus, probabilities not renormalised (multinomial does that)."""
        values, ids = probs.sort(descending=True, stable=True)
        head = values[: self.top_k]
        # the running sum before each token, accumulated in the same order as CosyVoice's loop; compared in
        # float32 like the tensor comparison it replaces (a Python loop over 25 floats beats 4 tensor ops)
        top_p = float(np.float32(self.top_p))
        keep = 1 if 0.0 < top_p else 0
        for before in torch.cumsum(head, 0)[:-1].tolist():
            if before >= top_p:
                break
            keep += 1
        keep = max(keep, 1)
        return ids[:keep], head[:keep]

    def _repeats(self, token: int, state: NodeState) -> bool:
        return list(state.generated[-self.win_size:]).count(token) >= self.win_size * self.tau_r

    def _repeated(self, ids: torch.Tensor, state: NodeState) -> torch.Tensor:
        return torch.tensor([self._repeats(token, state) for token in ids.tolist()], dtype=torch.bool)

    def _draw(self, probs: torch.Tensor, state: NodeState, generator: torch.Generator) -> int:
        ids, head = self._nucleus(probs)
        token = int(ids[torch.multinomial(head, 1, replacement=True, generator=generator)])
        if self._repeats(token, state):
            token = int(torch.multinomial(probs, 1, replacement=True, generator=generator))
        return token

    def sample(self, logits: torch.Tensor, state: NodeState, generator: torch.Generator) -> int:
        probs = torch.softmax(logits.float(), dim=-1)
        for _ in range(self.max_trials + 1):
            token = self._draw(probs, state, generator)
            if state.allow_stop or token not in state.stop_ids:
                return token
        raise RuntimeError(f"RAS drew a stop token {self.max_trials + 1} times while stopping was not allowed")

    def distribution(self, logits: torch.Tensor, state: NodeState) -> torch.Tensor:
        probs = torch.softmax(logits.float(), dim=-1)
        ids, head = self._nucleus(probs)
        nucleus = head / head.sum()
        repeated = self._repeated(ids, state)
        dist = probs * nucleus[repeated].sum()
        dist[ids[~repeated]] += nucleus[~repeated]
        if not state.allow_stop and state.stop_ids:
            dist[list(state.stop_ids)] = 0.0
            dist = dist / dist.sum()
        return dist

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
    blocked: tuple[int, ...] = ()  # ids that may not be emitted here: the stop ids a minimum length masks

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


def mask_blocked(scores: torch.Tensor, state: NodeState) -> torch.Tensor:
    """The minimum-length rule of Hugging Face and of CosyVoice: blocked ids get -inf."""
    if not state.blocked:
        return scores
    scores = scores.clone()
    scores[..., list(state.blocked)] = -float("inf")
    return scores


class Sampler:
    """Hugging Face's multinomial sampling: repetition penalty, min-new-tokens, temperature, top-k, top-p, min-p.

    Uses transformers' own logits processors in `generate`'s order, so the distribution is the one
    `model.generate(do_sample=True, ...)` samples from. `repetition_window` limits the penalty to the last
    that many tokens of the prompt and output (OuteTTS 1.0 patches Hugging Face's penalty so; None: all).
    """

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, repetition_window: int | None = None):
        self.params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           repetition_penalty=repetition_penalty, repetition_window=repetition_window)
        self.repetition_window = repetition_window
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
            window = state.history if self.repetition_window is None else state.history[-self.repetition_window:]
            scores = self.penalties(torch.tensor([list(window)], device=scores.device), scores)
        scores = mask_blocked(scores, state)
        return self.warpers(None, scores)[0] if len(self.warpers) else scores[0]

    def distribution(self, logits: torch.Tensor, state: NodeState) -> torch.Tensor:
        return torch.softmax(self.scores(logits, state), dim=-1)

    def sample(self, logits: torch.Tensor, state: NodeState, generator: torch.Generator) -> int:
        return int(torch.multinomial(self.distribution(logits, state), 1, generator=generator))


class RAS:
    """CosyVoice's repetition-aware sampling (from VALL-E 2), as FunAudioLLM/CosyVoice cosyvoice/utils/common.py
    (`ras_sampling`, `nucleus_sampling`) and cosyvoice/llm/llm.py (`sampling_ids`) do it now.

    Blocked ids (the minimum length's stop ids) are masked first. Draw from the nucleus: the most probable
    tokens, in stable descending order, taken while their running sum is below `top_p` and there are fewer
    than `top_k`. If the drawn token occurs at least `win_size * tau_r` times among the last `win_size`
    generated tokens, draw again from the full softmax without that token. (Before upstream's "fix ras",
    the second draw could return the repeated token; before "simply code", a stop token drawn too early
    was thrown away and the whole draw repeated instead of masked.)
    """

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

    @staticmethod
    def _probs(logits: torch.Tensor, state: NodeState) -> torch.Tensor:
        return torch.softmax(mask_blocked(logits.float(), state), dim=-1)

    def sample(self, logits: torch.Tensor, state: NodeState, generator: torch.Generator) -> int:
        probs = self._probs(logits, state)
        ids, head = self._nucleus(probs)
        token = int(ids[torch.multinomial(head, 1, replacement=True, generator=generator)])
        if self._repeats(token, state):
            rest = probs.clone()
            rest[token] = 0.0
            if float(rest.sum()) > 0:  # (upstream's softmax of nothing but -inf would fail here)
                token = int(torch.multinomial(rest, 1, replacement=True, generator=generator))
        return token

    def distribution(self, logits: torch.Tensor, state: NodeState) -> torch.Tensor:
        probs = self._probs(logits, state)
        ids, head = self._nucleus(probs)
        nucleus = head / head.sum()
        dist = torch.zeros_like(probs)
        for token, weight in zip(ids.tolist(), nucleus.tolist()):
            rest = 1.0 - float(probs[token])
            if self._repeats(token, state) and rest > 0:
                dist += (weight / rest) * probs
                dist[token] -= (weight / rest) * probs[token]
            else:
                dist[token] += weight
        return dist

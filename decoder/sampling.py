"""Token samplers: the target's sampling rule at every position of a step, as distributions and as seeded draws.

A sampler is what autoregressive decoding would do at a position. `distributions` computes it for all of a step's
positions (the root and every tree node, each with its own history) in one batched pass on the logits' device; the
lossless policies draw from those rows (so speculative output is distributed exactly like autoregressive output with
the same sampler) and the residual and relaxed rules read them as probabilities. `distribution` and `sample` are the
same rule at one position.
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
    blocked: tuple[int, ...] = ()  # ids that may not be emitted: the stop ids a minimum length masks
    blocked_below: int | None = None  # `blocked` holds while fewer than this many are generated (None: always)

    @property
    def generated(self) -> Sequence[int]:
        return self.history[len(self.history) - self.n_generated :]


@dataclass
class Positions:
    """A step's positions as a sampler sees them: the root's state and, for each row, the path below the root
    (row 0 is the root itself, with an empty path). The layout is a few host integers; what the rows' scores
    need of it goes to `device` in one copy."""

    root: NodeState
    paths: np.ndarray  # int64[R, D]: row r's tokens from depth 1 to its own depth, -1 after it
    depths: np.ndarray  # int64[R]
    device: torch.device | str | None = None

    @classmethod
    def of(cls, state: NodeState, device=None) -> Positions:
        """One position: `state` itself."""
        return cls(state, np.empty((1, 0), np.int64), np.zeros(1, np.int64), device)

    def tails(self, history: Sequence[int], length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids long[R, L], valid bool[R, L]) on `device`: each row's last `length` tokens (None: all) of
        `history` followed by its path, where `valid`; elsewhere the row's last token again (padding that adds
        no new id)."""
        prefix = np.asarray(history[-length:] if length else history, np.int64).reshape(-1)
        ids, valid = row_tails(prefix, self.paths, self.depths, length or 0)
        return torch.from_numpy(ids).to(self.device), torch.from_numpy(valid).to(self.device)

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """The minimum-length rule of Hugging Face and of CosyVoice, at every row: blocked ids get -inf."""
        root = self.root
        if not root.blocked or (root.blocked_below is not None and root.n_generated >= root.blocked_below):
            return scores  # past the minimum length (most steps): nothing to mask
        blocked = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
        blocked[list(root.blocked)] = True
        if root.blocked_below is not None:
            rows = torch.from_numpy(root.n_generated + self.depths < root.blocked_below).to(scores.device)
            blocked = rows[:, None] & blocked
        return scores.masked_fill(blocked, -float("inf"))


def row_tails(prefix: np.ndarray, paths: np.ndarray, depths: np.ndarray, length: int):
    """Positions.tails on the host, in NumPy (in torch it was a dozen small device operations a step): row r's
    last `length` (0: all) tokens of prefix + its path, left-aligned, padded with its last token."""
    full = np.concatenate([np.broadcast_to(prefix, (len(depths), len(prefix))), paths], 1)
    width = full.shape[1] if length == 0 else min(length, full.shape[1])
    end = len(prefix) + depths
    take = np.minimum(end, width)
    column = np.arange(width)
    at = (end - take)[:, None] + np.minimum(column, take[:, None] - 1)  # past `take`: the row's last token again
    ids = np.where(at >= 0, np.take_along_axis(full, np.maximum(at, 0), 1), 0) if width else full[:, :0]
    return np.ascontiguousarray(ids, np.int64), column < take[:, None]


def make_generator(seed: int | torch.Generator | None) -> torch.Generator:
    """A generator from a seed; None draws the seed from torch's global RNG (so torch.manual_seed governs it)."""
    if isinstance(seed, torch.Generator):
        return seed
    generator = torch.Generator()
    generator.manual_seed(int(torch.randint(0, 2**62, (1,))) if seed is None else int(seed))
    return generator


def draw_rows(q: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One id per row of `q` (float[R, V], rows summing to about 1) by inverting its running sum at that row's
    uniform in [0, 1), on q's device. Never an id of probability 0: in float64 u * total < total for every u < 1
    (total * 2**-53 is at least half an ulp of total), and the first running sum above a point below the total is
    one where the sum rose."""
    cdf = q.double().cumsum(-1)
    return torch.searchsorted(cdf, uniforms.to(cdf)[:, None] * cdf[:, -1:], right=True)[:, 0]


def draw(q: torch.Tensor, generator: torch.Generator) -> int:
    """One id from the distribution `q` (float[V], any device) with the next uniform of `generator` (a CPU one)."""
    return int(draw_rows(q[None], torch.rand(1, generator=generator, dtype=torch.float64))[0])


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

    def scores(self, logits: torch.Tensor, positions: Positions) -> torch.Tensor:
        """float[R, V]: every row's logits after the penalty (over its own history), the mask and the warpers."""
        scores = logits.float()
        if len(self.penalties):
            ids, valid = positions.tails(positions.root.history, self.repetition_window)
            if ids.shape[1]:  # (Hugging Face penalises each id once, however often it occurs: padding is harmless)
                scores = torch.where(valid.any(-1, keepdim=True), self.penalties(ids, scores), scores)
        scores = positions.mask(scores)
        return self.warpers(None, scores) if len(self.warpers) else scores

    def distributions(self, logits: torch.Tensor, positions: Positions) -> torch.Tensor:
        return torch.softmax(self.scores(logits, positions), dim=-1)

    def distribution(self, logits: torch.Tensor, state: NodeState) -> torch.Tensor:
        return self.distributions(logits[None], Positions.of(state, logits.device))[0]

    def sample(self, logits: torch.Tensor, state: NodeState, generator: torch.Generator) -> int:
        return draw(self.distribution(logits, state), generator)


class RAS:
    """CosyVoice's repetition-aware sampling (from VALL-E 2), as FunAudioLLM/CosyVoice cosyvoice/utils/common.py
    (`ras_sampling`, `nucleus_sampling`) and cosyvoice/llm/llm.py (`sampling_ids`) do it now.

    Blocked ids (the minimum length's stop ids) are masked first. Draw from the nucleus: the most probable
    tokens, in stable descending order, taken while their running sum is below `top_p` and there are fewer
    than `top_k`. If the drawn token occurs at least `win_size * tau_r` times among the last `win_size`
    generated tokens, draw again from the full softmax without that token. (Before upstream's "fix ras",
    the second draw could return the repeated token; before "simply code", a stop token drawn too early
    was thrown away and the whole draw repeated instead of masked.) `distributions` gives the two draws'
    outcome as one distribution per row, which one uniform then draws from.
    """

    def __init__(self, top_p: float = 0.8, top_k: int = 25, win_size: int = 10, tau_r: float = 0.1):
        self.top_p, self.top_k, self.win_size, self.tau_r = top_p, top_k, win_size, tau_r

    def __repr__(self) -> str:
        return f"RAS(top_p={self.top_p}, top_k={self.top_k}, win_size={self.win_size}, tau_r={self.tau_r})"

    def distributions(self, logits: torch.Tensor, positions: Positions) -> torch.Tensor:
        probs = torch.softmax(positions.mask(logits.float()), dim=-1)
        # the top_k in descending order, equal probabilities by ascending id as CosyVoice's stable sort has them
        # (topk, not a sort of the whole vocabulary: on a CPU the sort cost a step more than the rest of the pass)
        head, ids = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
        if bool((head[:, 1:] == head[:, :-1]).any()):  # ties (rare): their order is topk's, not CosyVoice's
            order = torch.sort(ids, dim=-1).indices  # ids ascending, then stably by descending probability
            head, ids = head.gather(1, order), ids.gather(1, order)
            order = head.sort(dim=-1, descending=True, stable=True).indices
            head, ids = head.gather(1, order), ids.gather(1, order)
        # the nucleus: tokens while the running sum before them (accumulated in CosyVoice's order, compared in
        # float32 as its tensor comparison is) is below top_p, at least one
        before = torch.cumsum(head, -1)[:, :-1]
        keep = 1 + (before < float(np.float32(self.top_p))).sum(-1, keepdim=True)
        weight = head * (torch.arange(head.shape[-1], device=head.device) < keep)
        weight = weight / weight.sum(-1, keepdim=True)
        # a drawn token that repeats in its row's window is drawn again from the softmax without it
        recent, valid = positions.tails(positions.root.generated, self.win_size or None)
        counts = torch.zeros_like(probs).scatter_add_(1, recent, valid.to(probs.dtype))
        rest = 1.0 - head
        redrawn = (counts.gather(1, ids) >= self.win_size * self.tau_r) & (rest > 0)
        again = torch.where(redrawn, weight / rest.clamp(min=1e-30), 0.0)
        dist = again.sum(-1, keepdim=True) * probs
        dist.scatter_add_(1, ids, torch.where(redrawn, -again * head, weight))
        return dist.clamp(min=0.0)

    def distribution(self, logits: torch.Tensor, state: NodeState) -> torch.Tensor:
        return self.distributions(logits[None], Positions.of(state, logits.device))[0]

    def sample(self, logits: torch.Tensor, state: NodeState, generator: torch.Generator) -> int:
        return draw(self.distribution(logits, state), generator)

"""How likely the target finds what was generated: the quality measure every policy can be held to."""

from __future__ import annotations

from typing import Sequence

import torch


@torch.inference_mode()
def mean_log_likelihood(model, input_ids: Sequence[int], generated: Sequence[int]) -> float:
    """The target's mean log-probability per token of `generated` following the prompt `input_ids`.

    Raw model probabilities (temperature 1, no truncation), so every sampler is scored on one scale.
    """
    if not generated:
        return float("nan")
    ids = torch.tensor([list(input_ids) + list(generated)], device=model.device)
    logits = model(ids).logits[0, len(input_ids) - 1 : -1].float()
    targets = torch.tensor(list(generated), device=logits.device)[:, None]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets).mean().item()

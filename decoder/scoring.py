"""How likely the target finds what was generated: the quality measure every policy can be held to."""

from __future__ import annotations

from typing import Sequence

import torch


@torch.inference_mode()
def mean_log_likelihood(model, generated: Sequence[int], *, input_ids: Sequence[int] | None = None,
                        inputs_embeds=None, head=None, speech_embedding=None) -> float:
    """The target's mean log-probability per token of `generated` following the prompt (`input_ids` or
    `inputs_embeds`), for a model with its own `head` and `speech_embedding` as for a causal LM.

    Raw model probabilities (temperature 1, no truncation), so every sampler is scored on one scale.
    """
    if not generated:
        return float("nan")
    device = model.device
    if head is None and inputs_embeds is None and speech_embedding is None:
        ids = torch.tensor([list(input_ids) + list(generated)], device=device)
        logits = model(ids).logits[0, len(input_ids) - 1 : -1].float()
    else:
        prompt = (model.get_input_embeddings()(torch.tensor([list(input_ids)], device=device))
                  if inputs_embeds is None else torch.as_tensor(inputs_embeds, device=device).reshape(
                      1, -1, model.config.hidden_size).to(model.dtype))
        fed = torch.tensor([list(generated[:-1])], dtype=torch.long, device=device)
        table = speech_embedding if speech_embedding is not None else model.get_input_embeddings()
        new = table[fed] if isinstance(table, torch.Tensor) else table(fed)
        embeds = torch.cat([prompt, new.to(prompt.dtype)], dim=1)
        if head is None:
            logits = model(inputs_embeds=embeds).logits
        else:
            logits = head(model.base_model(inputs_embeds=embeds).last_hidden_state)
        logits = logits[0, prompt.shape[1] - 1:].float()
    targets = torch.tensor(list(generated), device=logits.device)[:, None]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets).mean().item()

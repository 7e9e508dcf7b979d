"""Telling rounding from bugs: where a lossless system's output left its baseline's, and by how much the
system's logits there differed from a plain one-token forward's."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class LogitsRecord:
    """What `record_logits` keeps: the rows, and the seconds spent copying them, which the bench takes off the
    decode's time (a copy per emitted token cost lossless systems 0.5% of their speed on the sample)."""

    rows: list = field(default_factory=list)
    seconds: float = 0.0


def record_logits(policy) -> LogitsRecord:
    """Make `policy` keep the logits row behind each token it emits (one `decide` call per emitted token,
    in order: the prefill's row first) in the record returned."""
    record = LogitsRecord()
    decide = policy.decide

    def recording(rows, node, child_tokens, path):
        start = time.perf_counter()
        record.rows.append(rows.tree.logits[node + 1].detach().float().cpu())
        record.seconds += time.perf_counter() - start
        return decide(rows, node, child_tokens, path)

    policy.decide = recording  # an instance attribute: Policy.walk's self.decide finds it first
    return record


def first_divergence(tokens: list[int], baseline: list[int]) -> int | None:
    """The first position where `tokens` and `baseline` differ (None when identical)."""
    for position, (a, b) in enumerate(zip(tokens, baseline)):
        if a != b:
            return position
    return None if len(tokens) == len(baseline) else min(len(tokens), len(baseline))


def plain_logits(model, prompt_ids: list[int], tokens: list[int], position: int):
    """The logits a plain one-token-at-a-time decode computes for output `position` after `tokens`:
    the prompt in one forward, then one forward per token, as autoregressive decoding runs."""
    import torch

    from ...decoder import compat

    device = model.device
    cache = {compat.cache_argument(model): compat.new_cache(model.config)}
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt_ids], device=device), **cache, use_cache=True,
                    logits_to_keep=1)
        for offset, token in enumerate(tokens[:position]):
            out = model(input_ids=torch.tensor([[token]], device=device),
                        position_ids=torch.tensor([[len(prompt_ids) + offset]], device=device),
                        **cache, use_cache=True)
    return out.logits[0, -1].float().cpu()


def divergence(model, prompt_ids, tokens, baseline, rows) -> dict | None:
    """For a lossless system's output `tokens` (with `rows`, its recorded logits) against `baseline`: None
    when identical, else the first divergent position, both tokens there, the largest |logit difference|
    at it between the system's row and a plain one-token forward's, and the plain row's gap between its two
    largest logits (a near-tie flips on rounding). The logit figures are None where they cannot be had
    (no rows, no model: a prompt of embeddings or a model with its own head)."""
    position = first_divergence(tokens, baseline)
    if position is None:
        return None
    found = {"position": position,
             "system_token": tokens[position] if position < len(tokens) else None,
             "baseline_token": baseline[position] if position < len(baseline) else None,
             "max_logit_difference": None, "top2_gap": None}
    if model is None or rows is None or position >= len(rows):
        return found
    plain = plain_logits(model, prompt_ids, tokens, position)
    top = plain.topk(2).values
    return found | {"max_logit_difference": float((rows[position] - plain).abs().max()),
                    "top2_gap": float(top[0] - top[1])}

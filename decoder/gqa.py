"""`grouped_query_attention()`: a tree forward on a CPU attends with SDPA's own grouped-query support.

Most speech LMs share each key/value head among several query heads (CosyVoice 2's Qwen2.5-0.5B: 14 query
heads, 2 key/value heads; LLaSA's Llama-3.2-1B: 32 and 8). With a mask and more than one query token, which
every tree forward has, transformers' "sdpa" attention first copies the whole KV cache once per query head
of a group (`repeat_kv`), because CUDA's fast SDPA kernels take no mask with `enable_gqa`; one-token steps and
the prefill skip the copy. torch's CPU kernels take both, and its `TRANSFORMERS_SDPA_FORCE_GQA` switch says
so: on the project's CPU the tree forward then ran 5-7% faster on the sample (3 query heads per key/value head)
and 2-4% on a CosyVoice 2-shaped model in bfloat16 with 400 tokens cached, with the same logits to the bit.
The switch is read on every attention call, so a session sets it only around its tree forwards, and only
where `copies_grouped_heads` (a CPU model): a GPU keeps transformers' choice. While it is set, sdpa models
on other threads of the process attend the same way.
"""

from __future__ import annotations

import contextlib
import os
import threading

SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"
_lock = threading.Lock()
_holders = 0  # tree forwards inside the context now (sessions on several threads)
_saved: str | None = None  # the switch's value before the first of them


def copies_grouped_heads(model) -> bool:
    """True if a tree forward of `model` would copy its KV cache per query head (sdpa, grouped heads, CPU)."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    groups = getattr(config, "num_key_value_heads", None) or heads
    return (model.device.type == "cpu" and config._attn_implementation == "sdpa"
            and heads is not None and groups < heads)


@contextlib.contextmanager
def grouped_query_attention():
    """Within: transformers' sdpa attention passes grouped key/value heads to torch as they are."""
    global _holders, _saved
    with _lock:
        if _holders == 0:
            _saved = os.environ.get(SWITCH)
            os.environ[SWITCH] = "1"
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                if _saved is None:
                    os.environ.pop(SWITCH, None)
                else:
                    os.environ[SWITCH] = _saved

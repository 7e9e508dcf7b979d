"""`grouped_query_attention()`: a tree forward on a CPU attends with SDPA's own grouped-query support.

Most speech LMs share each key/value head among several query heads (CosyVoice 2's Qwen2.5-0.5B: 14 query
heads, 2 key/value heads; LLaSA's Llama-3.2-1B: 32 and 8). With a mask and more than one query token, which
every tree forward has, transformers' "sdpa" attention first copies the whole KV cache once per query head
of a group (`repeat_kv`), because CUDA's fast SDPA kernels take no mask with `enable_gqa`; one-token steps and
the prefill skip the copy. torch's CPU kernels take both, and transformers' switch TRANSFORMERS_SDPA_FORCE_GQA
says so, with the same logits to the bit: on the project's CPU decoding with trees ran 3-4% faster on the
sample (3 query heads per key/value head; `python -m echospec.tools.benchmarks.grouped_heads`), and a CosyVoice
2-shaped model's tree forwards cost 2-3% less (`cost_curves --variants repeat-kv`). The switch is read on
every attention call, so a session sets it only around its tree forwards, and only where
`copies_grouped_heads`: a GPU keeps transformers' choice, and so does a process that set the switch itself
(=0 keeps the copies). While it is set, sdpa models on other threads of the process attend the same way.
"""

from __future__ import annotations

import contextlib
import os
import threading

from .compat import sdpa_reads_gqa_switch

SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"
_lock = threading.Lock()
_holders = 0  # tree forwards inside the context now (sessions on several threads)


def copies_grouped_heads(model) -> bool:
    """True if a tree forward of `model` would copy its KV cache per query head (sdpa attention, grouped
    key/value heads, a CPU) and the process has not set transformers' switch itself; False on a transformers
    that never reads the switch (4.51), where tree forwards copy as before."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    groups = getattr(config, "num_key_value_heads", None) or heads
    with _lock:
        set_by_user = _holders == 0 and SWITCH in os.environ
    return (model.device.type == "cpu" and config._attn_implementation == "sdpa"
            and heads is not None and groups < heads and not set_by_user and sdpa_reads_gqa_switch())


@contextlib.contextmanager
def grouped_query_attention():
    """Within: transformers' sdpa attention passes grouped key/value heads to torch as they are."""
    global _holders
    with _lock:
        if _holders == 0:
            os.environ[SWITCH] = "1"
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                os.environ.pop(SWITCH, None)

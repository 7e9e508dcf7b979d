"""The transformers releases echospec runs on: 4.51 (CosyVoice 2/3 pin 4.51.3, OuteTTS 4.52.3) to the current one.

What changed between them and is used here, each with the one call that hides it:

- the forward keyword for the KV cache: `past_key_values` up to 4.x, `cache` in 5.x (`cache_argument`);
- DynamicCache's constructor: 4.56+ takes the model's config and builds one layer per decoder layer, 4.51
  takes none (`new_cache`);
- a cache's tensors: 4.56+ keeps a list of layers (`cache.layers`, each `.keys` / `.values`), 4.51 two lists
  (`cache.key_cache`, `cache.value_cache`) (`layer_tensors`, `keeps_every_token`);
- which layers slide: 4.56+ configs list `layer_types`, 4.51 configs say `use_sliding_window` /
  `sliding_window` (`layer_types`);
- SDPA's grouped-query switch (TRANSFORMERS_SDPA_FORCE_GQA): read by newer releases only, 4.51 always
  copies grouped key/value heads (`sdpa_reads_gqa_switch`);
- `from_pretrained`'s dtype keyword: `dtype` in 5.x, `torch_dtype` in 4.x, where an unknown `dtype` lands in the
  config as a torch.dtype and saving or printing it fails (`Object of type dtype is not JSON serializable`)
  (`load_causal_lm`).

`DynamicCache.crop`, `get_seq_length`, 4D additive attention masks with explicit `position_ids`,
`logits_to_keep` and the logits processors behave alike on all of them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator

import torch
from transformers import DynamicCache

try:  # 4.56+: a cache is a list of layers
    from transformers.cache_utils import DynamicLayer
except ImportError:  # 4.51-4.55
    DynamicLayer = None


def load_causal_lm(path, dtype=None, **options):
    """`AutoModelForCausalLM.from_pretrained(path, **options)` in `dtype` (a torch.dtype; None: the checkpoint's
    default), in eval mode, on any supported transformers."""
    import transformers
    from transformers import AutoModelForCausalLM

    if dtype is not None:
        options["dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"] = dtype
    return AutoModelForCausalLM.from_pretrained(path, **options).eval()


def cache_argument(model) -> str:
    """The keyword `model`'s forward takes its KV cache by: `cache` (transformers 5) or `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def new_cache(config) -> DynamicCache:
    """An empty DynamicCache for a model with `config`."""
    if "config" in inspect.signature(DynamicCache.__init__).parameters:
        return DynamicCache(config=config)
    return DynamicCache()


def output_cache(outputs):
    """The KV cache a forward returned (`outputs.cache` in transformers 5, `outputs.past_key_values` before)."""
    return outputs.cache if hasattr(outputs, "cache") else outputs.past_key_values


def layer_tensors(cache) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each filled layer's (keys, values), [batch, heads, tokens, head_dim], to be written in place."""
    if hasattr(cache, "layers"):
        pairs = ((layer.keys, layer.values) for layer in cache.layers if layer.is_initialized)
    else:
        pairs = zip(cache.key_cache, cache.value_cache)
    for keys, values in pairs:
        if isinstance(keys, torch.Tensor) and keys.numel():
            yield keys, values


def keeps_every_token(cache) -> bool:
    """True if every layer of `cache` keeps every token (no sliding window, no quantisation, no offloading):
    what gathering accepted nodes into place and cropping the rest needs."""
    if hasattr(cache, "layers"):
        return DynamicLayer is not None and all(type(layer) is DynamicLayer for layer in cache.layers)
    return type(cache) is DynamicCache


def layer_types(config) -> list[str]:
    """The config's attention kind per layer ("full_attention", "sliding_attention", ...)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    slides = getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if slides else "full_attention"]


@functools.cache
def sdpa_reads_gqa_switch() -> bool:
    """True if this transformers' SDPA attention reads TRANSFORMERS_SDPA_FORCE_GQA (4.51 never does)."""
    from transformers.integrations import sdpa_attention

    decide = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    return decide is not None and "TRANSFORMERS_SDPA_FORCE_GQA" in inspect.getsource(decide)

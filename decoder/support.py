"""Which models echospec can verify a tree with: `check_model`."""

from __future__ import annotations

from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from . import compat
from .errors import UnsupportedModelError

ALLOWED_ATTENTION = ("eager", "sdpa")


def check_model(model, head=None) -> None:
    """Raise UnsupportedModelError unless `model` can verify a tree.

    It must be a decoder-only causal LM whose attention takes a 4D additive mask; with a `head` (the model's
    own speech head, applied to the final hidden states) its bare backbone (e.g. `Qwen2Model`) will do too.
    """
    if not isinstance(model, PreTrainedModel):
        raise UnsupportedModelError(f"echospec needs a transformers PreTrainedModel, got {type(model).__name__}")
    config = model.config
    name = type(model).__name__
    causal_lm = name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) or name.endswith("ForCausalLM")
    backbone = head is not None and model.base_model is model and config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if config.is_encoder_decoder or not getattr(config, "is_causal", True) or not (causal_lm or backbone):
        hint = "" if head is not None else " (a bare backbone needs the model's own head: pass head=...)"
        raise UnsupportedModelError(f"{name} is not a decoder-only causal LM{hint}")
    attention = config._attn_implementation
    if attention not in ALLOWED_ATTENTION:
        raise UnsupportedModelError(
            f"attention implementation {attention!r} cannot take a tree-attention mask; load the model with "
            f"attn_implementation='sdpa' or 'eager' (flash and flex attention are not supported)"
        )
    layer_types = compat.layer_types(config)
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(f"only full-attention layers are supported, got {sorted(set(layer_types))}")

"""echospec.decoder: verify a retriever's CandidateTree with a Hugging Face causal LM in one forward, and accept.

Batch size 1 only. Attention implementations: "sdpa" and "eager" (flash/flex attention are refused).
Needs the decoder extra (torch, transformers); the core install (datastores, retriever) does not.

The names below are imported on first use, not here: the acceptance rules (`policies`, `sampling`) need torch
and transformers only, so vLLM's plugin (`vllm_acceptance`) can load them where numba must not be loaded yet.
"""

from importlib import import_module

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as missing:
    if missing.name not in ("torch", "transformers"):
        raise
    raise ImportError(f"echospec.decoder needs {missing.name}, which is not installed: install the decoder extra: "
                      f"pip install -e '.[decoder]' in a checkout", name=missing.name) from None

_LAZY = {
    "NODES": ".budget", "AdaptiveBudget": ".budget", "CapRates": ".budget", "FixedBudget": ".budget",
    "NodeBudget": ".budget",
    "DecoderInputError": ".errors", "UnsupportedModelError": ".errors",
    "HF_CUSTOM_GENERATE_DIR": ".generate", "GenerationResult": ".generate", "generate": ".generate",
    "hf_generate": ".generate", "stream": ".generate",
    "prepack": ".prepack",
    "ExactGreedy": ".policies", "ExactSampling": ".policies", "Filtered": ".policies", "GroupRejection": ".policies",
    "Policy": ".policies", "SimilarityGroups": ".policies", "Tolerance": ".policies", "VerifiedTree": ".policies",
    "RAS": ".sampling", "NodeState": ".sampling", "Sampler": ".sampling",
    "SpeculativeSession": ".session", "GenerationStats": ".stats", "check_model": ".support",
    "SpeechVocab": ".vocab",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value

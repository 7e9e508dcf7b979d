"""echospec.decoder: verify a retriever's CandidateTree with a Hugging Face causal LM in one forward, and accept.

Batch size 1 only. Attention implementations: "sdpa" and "eager" (flash/flex attention are refused).
Needs the decoder extra (torch, transformers); the core install (datastores, retriever) does not.

The names below are imported on first use, not here (torch and transformers are only looked for; where one is
missing, the first use says which extra to install): the acceptance rules (`policies`, `sampling`) need torch and
transformers only, so vLLM's plugin (`vllm_acceptance`) can load them where numba must not be loaded yet; the
registry of policies (`registry`) needs neither.
"""

from importlib import import_module
from importlib.util import find_spec

# looked for, not imported; a missing one is named when a name below is first used, so the registry of policies
# (`registry`: plain Python) still loads on the core install, where the CLI reads its names and knobs
MISSING = next((name for name in ("torch", "transformers") if find_spec(name) is None), None)

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
    if MISSING:
        raise ImportError(f"echospec.decoder needs {MISSING}, which is not installed: install the decoder extra: "
                          f"pip install -e '.[decoder]' in a checkout", name=MISSING)
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value

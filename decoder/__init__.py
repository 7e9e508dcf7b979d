"""echospec.decoder: verify a retriever's CandidateTree with a Hugging Face causal LM in one forward, and accept.

Batch size 1 only. Attention implementations: "sdpa" and "eager" (flash/flex attention are refused).
Needs the decoder extra (torch, transformers); the core install (datastores, retriever) does not.
"""

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as missing:
    if missing.name not in ("torch", "transformers"):
        raise
    raise ImportError(f"echospec.decoder needs {missing.name}, which is not installed: install the decoder extra: "
                      f"pip install -e '.[decoder]' in a checkout", name=missing.name) from None

from .budget import NODES, AdaptiveBudget, CapRates, FixedBudget, NodeBudget
from .errors import DecoderInputError, UnsupportedModelError
from .generate import HF_CUSTOM_GENERATE_DIR, GenerationResult, generate, hf_generate, stream
from .prepack import prepack
from .policies import ExactGreedy, ExactSampling, Filtered, Policy, SimilarityGroups, Tolerance, VerifiedTree
from .sampling import RAS, NodeState, Sampler
from .session import SpeculativeSession
from .stats import GenerationStats
from .support import check_model
from .vocab import SpeechVocab

__all__ = [
    "generate", "stream", "hf_generate", "HF_CUSTOM_GENERATE_DIR", "GenerationResult", "GenerationStats",
    "SpeculativeSession", "check_model", "prepack",
    "Policy", "ExactGreedy", "ExactSampling", "Filtered", "Tolerance", "SimilarityGroups", "VerifiedTree",
    "Sampler", "RAS", "NodeState", "SpeechVocab",
    "NodeBudget", "FixedBudget", "AdaptiveBudget", "CapRates", "NODES",
    "DecoderInputError", "UnsupportedModelError",
]

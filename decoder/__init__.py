"""echospec.decoder: verify a retriever's CandidateTree with a Hugging Face causal LM in one forward, and accept.

Batch size 1 only. Attention implementations: "sdpa" and "eager" (flash/flex attention are refused).
"""

from .cost import ArmRates, AutoBudget, CostCurve, FixedBudget
from .errors import DecoderInputError, UnsupportedModelError
from .generate import HF_CUSTOM_GENERATE_DIR, GenerationResult, generate, hf_generate, stream
from .prepack import prepack
from .policies import ExactGreedy, ExactSampling, Filtered, Policy, SimilarityGroups, Tolerance, VerifiedTree
from .sampling import RAS, NodeState, Sampler
from .session import GenerationStats, SpeculativeSession, check_model
from .vocab import SpeechVocab

__all__ = [
    "generate", "stream", "hf_generate", "HF_CUSTOM_GENERATE_DIR", "GenerationResult", "GenerationStats",
    "SpeculativeSession", "check_model", "prepack",
    "Policy", "ExactGreedy", "ExactSampling", "Filtered", "Tolerance", "SimilarityGroups", "VerifiedTree",
    "Sampler", "RAS", "NodeState", "SpeechVocab", "CostCurve", "ArmRates", "AutoBudget", "FixedBudget",
    "DecoderInputError", "UnsupportedModelError",
]

"""echospec.retriever.engines: echospec as the drafter of inference engines that verify one chain per request
(vLLM), not a tree. Imports no torch and no engine.

    proposer.EchospecProposer   vLLM's `custom_class` proposer (configured as
                                echospec.retriever.vllm_proposer.EchospecProposer, which re-exports it)
    chains.ChainDrafter         a chain per row: the tree's most promising branch, as long as it pays
    speakers.SpeakerChoice      the speaker store a prompt asks for
    memory.RequestMemory        what the drafter keeps of each request between steps (NullMemory: nothing)
"""

from .chains import DRAFT_WEIGHTS, TOKEN_COST, ChainDrafter
from .memory import NullMemory, Request, RequestMemory
from .proposer import EchospecProposer
from .speakers import SpeakerChoice

__all__ = ["DRAFT_WEIGHTS", "TOKEN_COST", "ChainDrafter", "EchospecProposer", "NullMemory", "Request",
           "RequestMemory", "SpeakerChoice"]

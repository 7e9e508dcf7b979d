"""The path users' vLLM configs name ("model": "echospec.retriever.vllm_proposer.EchospecProposer"); the proposer
lives in echospec.retriever.engines.proposer."""

from .engines.proposer import EchospecProposer

__all__ = ["EchospecProposer"]

"""echospec.retriever: turns a context into a CandidateTree of NumPy arrays. Imports no torch."""

from .tree import SOURCES, CandidateTree

__all__ = ["SOURCES", "CandidateTree"]

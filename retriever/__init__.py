"""echospec.retriever: turns a context into a CandidateTree of NumPy arrays. Imports no torch.

    from echospec.retriever import Retriever
    r = Retriever("store_dir")
    tree = r.propose(context, speaker="ann")   # context: prompt speech tokens + output so far
"""

from .retriever import DEFAULT_WEIGHTS, Retriever
from .tree import SOURCES, CandidateTree

__all__ = ["DEFAULT_WEIGHTS", "SOURCES", "CandidateTree", "Retriever"]

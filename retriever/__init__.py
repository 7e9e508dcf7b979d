"""echospec.retriever: turns a context into a CandidateTree of NumPy arrays. Imports no torch.

    from echospec.retriever import Retriever
    r = Retriever("store_dir")
    tree = r.propose(context, speaker="ann")   # context: prompt speech tokens + output so far

`echospec.retriever.tree` (the CandidateTree contract the decoder imports) needs only numpy and numba,
so the package's other names are imported on first use, not here. The rooms beside this core (docs/layout.md):
`client` (RemoteRetriever and the wire format), `service` (echospec serve), `engines` (the vLLM proposer and
its chain drafter).
"""

from importlib import import_module

_LAZY = {
    "CandidateTree": ".tree", "SOURCES": ".tree",
    "Retriever": ".retriever", "DEFAULT_WEIGHTS": ".retriever",
    "RemoteRetriever": ".client", "RetrieverUnavailable": ".client",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value

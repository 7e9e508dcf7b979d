"""echospec.retriever.client: the HTTP client of an `echospec serve` service (`RemoteRetriever`) and the propose
wire format it shares with the service (`wire`). Needs httptools, no web framework."""

from .remote import RemoteRetriever, RetrieverUnavailable

__all__ = ["RemoteRetriever", "RetrieverUnavailable"]

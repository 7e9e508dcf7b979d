"""The documented import path of `RemoteRetriever` (from echospec.retriever.remote import RemoteRetriever); the
client lives in echospec.retriever.client."""

from .client.remote import RemoteRetriever, RetrieverUnavailable

__all__ = ["RemoteRetriever", "RetrieverUnavailable"]

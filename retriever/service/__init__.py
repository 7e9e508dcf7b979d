"""The datastore service: many TTS workers share datastores over HTTP.

    echospec serve store_dir [NAME=other_dir ...] --port 8750           # or serve(...) below

Endpoints (JSON unless noted; every error is JSON `{"error": {"status", "code", "message"}}`):
  POST /v1/stores/{store}/propose            one context or a batch: JSON, or the binary form of wire.py
  GET  /v1/stores                            every store with its stats and speakers
  GET  /v1/stores/{store}                    one store
  POST /v1/stores/{store}/speakers/{speaker} enroll: append (or replace) a speaker's utterances; API key
  GET  /healthz                              liveness and the stores served
  GET  /metrics                              Prometheus text format

Propose requests are answered on the event loop from the store's current `Snapshot` (a `Retriever`
over a memory-mapped datastore: a few microseconds a call, so no thread hop). An enrollment runs in a
worker thread under the store's write lock: `datastore.enroll` writes and fsyncs the new store and
commits the catalog, a fresh `Snapshot` is opened and warmed, and only then is it swapped in (one
reference assignment) and the request acknowledged. Proposals keep using the old snapshot meanwhile.
Writes made by other processes (`echospec enroll`, another service on the same directory) are picked up
the same way within `reload_interval` seconds: the catalog's mtime and size are polled.

One module per concern:
  requests.py   what a request may be: routes, names, content types, body limits, bodies, options, errors
  stores.py     the served datastores, their snapshots and the catalog polling
  metrics.py    the Prometheus metrics
  app.py        `Service`, the ASGI app (propose on a plain ASGI path, the rest FastAPI)
  asgi.py       the plain path's ASGI helpers: headers, the body under its limit, the responses
  start.py      `serve`: the write key, the HTTP protocol, the open-file limit, uvicorn
  fast_http.py  the fast HTTP path: uvicorn's httptools protocol answering each request in one write and
                binary proposals inline; used only under the uvicorn version it was written for
  read_guard.py slow or oversized requests: the read timeout and the head size limit, on either HTTP path

Imports the datastore and the retriever; nothing else in the retriever imports this package, so a
retriever-only install needs no web framework.
"""

from importlib import import_module

from .app import API_KEY_ENV, Service
from .metrics import Metrics
from .requests import EnrollRequest, Limits, ProposeRequest, ServiceError
from .start import is_loopback, read_api_key, serve
from .stores import Snapshot, StoreHandle, parse_store_arg

_FAST_HTTP = ("ServiceHttpProtocol", "OneWriteHttpToolsProtocol", "INLINE_BODY_LIMIT")

__all__ = ["API_KEY_ENV", "EnrollRequest", "Limits", "Metrics", "ProposeRequest", "Service", "ServiceError",
           "Snapshot", "StoreHandle", "is_loopback", "parse_store_arg", "read_api_key", "serve", *_FAST_HTTP]


def __getattr__(name: str):
    """fast_http's names on first use: importing it fails under a uvicorn it was not written for."""
    if name not in _FAST_HTTP:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(".fast_http", __name__), name)

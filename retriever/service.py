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

The propose route bypasses FastAPI's routing and dependency machinery (it is the hot path; on this
project's 2-core machine a FastAPI route answered about 30% fewer requests/s than a plain ASGI callable
on the same uvicorn); the rest of the API is an ordinary FastAPI app.
Body-size limits, write authentication and metrics wrap both, in `Service.__call__`. `serve` runs it on
uvicorn with `ServiceHttpProtocol`: each answer's head and body leave in one write, and a binary propose
is answered inline in the HTTP parser's callbacks (`Service.answer_binary_propose`), without uvicorn's
per-request task and ASGI calls.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import re
import tempfile
import threading
import time
from bisect import bisect_left
from collections import defaultdict
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import parse_qsl

import httptools
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from ..datastore import DatastoreError, enroll, open_datastore
from ..datastore.catalog import CATALOG
from . import Retriever
from .wire import BINARY, WireError, decode_contexts, encode_trees

log = logging.getLogger("echospec.service")

API_KEY_ENV = "ECHOSPEC_API_KEY"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""Store and speaker names: no slash, no leading dot, no `..`, at most 64 characters."""
MAX_ID_LENGTH = 256
MAX_PARSED_QUERIES = 4096  # distinct propose query strings whose parse is kept
_BINARY = BINARY.encode()
INLINE_PROPOSE = re.compile(rb"/v1/stores/([A-Za-z0-9][A-Za-z0-9_.-]{0,63})/propose")  # raw path, a valid name
INLINE_BODY_LIMIT = 64 << 10  # uvicorn's read high-water mark: larger bodies take its flow-controlled path


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; anything past a limit is a 413 or a 422, never a slow answer."""

    max_body_bytes: int = 8 << 20
    max_batch: int = 256  # contexts per propose request
    max_context: int = 1 << 16  # tokens per context
    max_nodes: int = 1024  # node budget per tree
    max_depth: int = 64
    max_utterances: int = 10_000  # per enrollment


class ServiceError(Exception):
    """An error meant for the client: becomes a JSON response with `status`."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def valid_name(name: str) -> bool:
    return bool(NAME.fullmatch(name)) and ".." not in name


# ---------------------------------------------------------------------------------------------------
# Stores and their snapshots


@dataclass(frozen=True)
class Snapshot:
    """One consistent view of a datastore: its retriever and what validation needs to know about it."""

    retriever: Retriever
    info: dict
    vocab_size: int
    speakers: frozenset[str]
    speech_offset: int
    stop_ids: frozenset[int]
    catalog_stamp: tuple[int, int]  # the catalog's (mtime_ns, size) just before it was read

    @classmethod
    def open(cls, path: Path, retriever_options: dict) -> "Snapshot":
        try:
            stamp = catalog_stamp(path)  # taken first: a write racing with this open shows up as a change later
        except FileNotFoundError:
            open_datastore(path)  # raises DatastoreError with the reason (no directory, interrupted build)
            raise
        ds = open_datastore(path)
        # Map every speaker store now: an enrollment deletes a replaced store's directory once its
        # catalog commit is done, and this snapshot may still answer for that speaker until the swap.
        for speaker in ds.speakers:
            ds.speaker_store(speaker)
        retriever = Retriever(ds, **retriever_options)
        retriever.propose(np.zeros(1, np.int64))  # compile/load the kernels before the first request
        return cls(retriever, _jsonable(ds.info()), int(retriever.vocab_size), frozenset(ds.speakers),
                   ds.speech_offset, frozenset(ds.stop_ids), stamp)


def catalog_stamp(path: Path) -> tuple[int, int]:
    stat = (path / CATALOG).stat()
    return stat.st_mtime_ns, stat.st_size


class StoreHandle:
    """A served datastore: its current snapshot (swapped whole) and a lock serialising its writes."""

    def __init__(self, name: str, path: Path, retriever_options: dict):
        self.name, self.path, self.retriever_options = name, path, retriever_options
        self.snapshot = Snapshot.open(path, retriever_options)
        self.write_lock = threading.Lock()  # held by the worker thread, so a dropped client cannot free it

    def enroll(self, speaker: str, utterances: list[dict], replace: bool) -> Snapshot:
        """Write, commit, reopen, swap: returns the new snapshot once it is the one being served."""
        with self.write_lock, tempfile.TemporaryDirectory(prefix="echospec-enroll-") as tmp:
            corpus = Path(tmp) / "utterances.jsonl"
            with open(corpus, "w") as f:
                for utt in utterances:
                    f.write(json.dumps({"id": utt["id"], "speaker": speaker, "tokens": utt["tokens"]}) + "\n")
            try:
                enroll(self.path, speaker, corpus, replace=replace)
            except DatastoreError as e:  # CorpusError included; the checks below make this rare
                raise ServiceError(422, "enroll_rejected", str(e).replace(str(corpus), "request")) from None
            self.snapshot = snapshot = Snapshot.open(self.path, self.retriever_options)
            return snapshot

    def reload_if_changed(self) -> bool:
        """Swap in a fresh snapshot when another process (`echospec enroll`, a second service) changed
        the catalog. Returns whether it did."""
        with self.write_lock:
            if catalog_stamp(self.path) == self.snapshot.catalog_stamp:
                return False
            self.snapshot = Snapshot.open(self.path, self.retriever_options)
            return True


def parse_store_arg(arg: str) -> tuple[str, Path]:
    """`NAME=PATH` or `PATH` (the name is then the directory's name)."""
    name, sep, path = arg.partition("=")
    if not sep:
        name, path = Path(arg).resolve().name, arg
    if not valid_name(name):
        raise ValueError(f"store name {name!r} must match {NAME.pattern} (give NAME=PATH to choose one)")
    return name, Path(path)


# ---------------------------------------------------------------------------------------------------
# Metrics

LATENCY_BUCKETS = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """The service's Prometheus metrics, in a registry of its own (one per Service).

    Requests, latency, errors and proposal counts are tallied in plain dicts and turned into metric
    families only when scraped: prometheus_client's own metrics take a lock per update, and a proposal
    made five updates. Every tally is written and read on the event loop (the /metrics route is async),
    so needs no lock."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, status)
        self.latency: dict[str, list[float]] = {}  # endpoint: a count per bucket, then the sum
        self.errors: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, code)
        self.contexts: dict[str, int] = defaultdict(int)  # store
        self.nodes: dict[str, int] = defaultdict(int)  # store
        self.enrollments: dict[str, int] = defaultdict(int)  # store
        gauges = (("tokens", "Tokens in the general store"), ("utterances", "Utterances in the general store"),
                  ("speakers", "Enrolled speakers"), ("exact_bytes", "Bytes of all exact stores"),
                  ("faiss_bytes", "Bytes of the FAISS store"))
        self.store = {field: Gauge(f"echospec_store_{field}", help_, ["store"], registry=self.registry)
                      for field, help_ in gauges}
        self.registry.register(self)  # collect() below

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests[endpoint, str(status)] += 1
        counts = self.latency.get(endpoint)
        if counts is None:
            counts = self.latency[endpoint] = [0] * (len(LATENCY_BUCKETS) + 1) + [0.0]
        counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        counts[-1] += seconds

    def set_store(self, name: str, info: dict) -> None:
        values = {**info, "speakers": len(info.get("speakers", {}))}
        for field, gauge in self.store.items():
            gauge.labels(name).set(values.get(field) or 0)

    def collect(self):
        """The tallies as metric families (prometheus_client's Collector protocol)."""
        yield _counter("echospec_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                       self.requests)
        latency = HistogramMetricFamily("echospec_request_seconds",
                                        "Request latency, request read to answer written", labels=["endpoint"])
        bounds = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]
        for endpoint, counts in self.latency.items():
            latency.add_metric([endpoint], list(zip(bounds, accumulate(counts[:-1]))), counts[-1])
        yield latency
        yield _counter("echospec_errors", "Error responses by endpoint and error code", ["endpoint", "code"],
                       self.errors)
        yield _counter("echospec_proposed_contexts", "Contexts answered by propose", ["store"], self.contexts)
        yield _counter("echospec_proposed_nodes", "Tree nodes returned by propose", ["store"], self.nodes)
        yield _counter("echospec_enrollments", "Acknowledged enrollments", ["store"], self.enrollments)


def _counter(name: str, help_: str, labels: list[str], tally: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_, labels=labels)
    for key, value in tally.items():
        family.add_metric(key if isinstance(key, tuple) else (key,), value)
    return family


# ---------------------------------------------------------------------------------------------------
# Request bodies (JSON)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ProposeRequest(_Strict):
    """JSON propose: exactly one of `context` (answer `{"tree": ...}`) or `contexts` (`{"trees": [...]}`)."""

    context: list[int] | None = None
    contexts: list[list[int]] | None = None
    speaker: str | None = None
    max_nodes: int | None = None
    max_depth: int | None = None


class Utterance(_Strict):
    id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    tokens: list[int] = Field(min_length=1)


class EnrollRequest(_Strict):
    """Utterances in raw model ids, exactly as a corpus line has them; `replace` drops the old ones."""

    utterances: list[Utterance] = Field(min_length=1)
    replace: bool = False


# ---------------------------------------------------------------------------------------------------
# The service


ROUTES = (  # (endpoint label, pattern): labels keep the metrics' cardinality bounded
    ("propose", re.compile(r"/v1/stores/([^/]+)/propose")),
    ("enroll", re.compile(r"/v1/stores/[^/]+/speakers/[^/]+")),
    ("store", re.compile(r"/v1/stores/[^/]+")),
    ("stores", re.compile(r"/v1/stores")),
    ("health", re.compile(r"/healthz")),
    ("metrics", re.compile(r"/metrics")),
)


class Service:
    """The ASGI application. `stores` maps names to datastore directories, opened here (and warmed)."""

    def __init__(self, stores: dict[str, str | Path], api_key: str | None = None, limits: Limits = Limits(),
                 retriever_options: dict | None = None, reload_interval: float | None = 1.0):
        for name in stores:
            if not valid_name(name):
                raise ValueError(f"store name {name!r} must match {NAME.pattern}")
        paths = [Path(p).resolve() for p in stores.values()]
        if len(set(paths)) != len(paths):
            raise ValueError("the same datastore directory is served under two names")
        self.limits, self.reload_interval = limits, reload_interval
        self.api_key = api_key.encode() if api_key else None
        self.metrics = Metrics()
        self._parsed_queries: dict[bytes, dict] = {}
        self.stores = {name: StoreHandle(name, path, dict(retriever_options or {}))
                       for name, path in zip(stores, paths, strict=True)}
        for name, handle in self.stores.items():
            self.metrics.set_store(name, handle.snapshot.info)
        self.api = self._build_api()

    # -- ASGI entry point: limits, authentication, metrics; propose; everything else to FastAPI --

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.api(scope, receive, send)
        started = time.perf_counter()
        endpoint, match = _route(scope["path"])
        status = None  # until a response starts

        async def send_tracked(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if scope["method"] not in ("GET", "HEAD") and endpoint not in ("propose", "other"):
                self._authenticate(scope)
            body = await _read_body(scope, receive, self.limits.max_body_bytes)
            if endpoint == "propose" and scope["method"] == "POST":
                await self._propose(match.group(1), scope, body, send_tracked)
            else:
                await self.api(scope, _replay(body, receive), send_tracked)
        except ServiceError as e:
            self.metrics.errors[endpoint, e.code] += 1
            await _send_error(send_tracked, e)
        except _ClientGone:
            status = 499
        except Exception:
            log.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            self.metrics.errors[endpoint, "internal"] += 1
            if status is None:
                await _send_error(send_tracked, _internal_error())
        finally:
            self.metrics.observe(endpoint, status or 500, time.perf_counter() - started)

    def _authenticate(self, scope) -> None:
        if self.api_key is None:
            raise ServiceError(403, "writes_disabled",
                               f"this service has no API key configured (set {API_KEY_ENV} or --api-key-file)")
        header = _header(scope, b"authorization")
        if header is None:
            raise ServiceError(401, "unauthenticated", "writes need 'Authorization: Bearer <API key>'")
        scheme, _, key = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
            raise ServiceError(403, "forbidden", "wrong API key")

    # -- propose --

    async def _propose(self, store: str, scope, body: bytes, send) -> None:
        content_type = (_header(scope, b"content-type") or b"").split(b";")[0].strip()
        await _send(send, 200, self.answer_propose(store, scope["query_string"], content_type, body), content_type
                    if content_type == _BINARY else b"application/json")

    def answer_propose(self, store: str, query: bytes, content_type: bytes, body: bytes) -> bytes:
        """The body of a 200 answer to a propose request; raises ServiceError for anything else."""
        snapshot = self._store(store).snapshot  # read once: an enrollment may swap it meanwhile
        if content_type == _BINARY:
            try:
                contexts = decode_contexts(body, self.limits.max_batch)
            except WireError as e:
                raise ServiceError(400, "bad_body", str(e)) from None
            options = self._query_options(query)
            single = False
        elif content_type in (b"application/json", b""):
            contexts, options, single = self._json_propose(body)
        else:
            given = content_type.decode(errors="replace")
            raise ServiceError(415, "unsupported_media_type",
                               f"propose takes application/json or {BINARY}, not {given!r}")
        speaker, max_nodes, max_depth = self._check_options(snapshot, **options)
        trees = self._propose_all(snapshot, contexts, speaker, max_nodes, max_depth)
        self.metrics.contexts[store] += len(trees)
        self.metrics.nodes[store] += sum(len(t) for t in trees)
        if content_type == _BINARY:
            return encode_trees(trees)
        payload = {"tree": trees[0].to_dict()} if single else {"trees": [t.to_dict() for t in trees]}
        return json.dumps(payload, separators=(",", ":")).encode()

    def answer_binary_propose(self, store: str, query: bytes, body: bytes, started: float) -> tuple[int, bytes, bytes]:
        """(status, content type, body) of a binary propose answered synchronously, as `__call__` would
        (metrics included); for `ServiceHttpProtocol`'s inline path."""
        status, content_type = 200, _BINARY
        try:
            answer = self.answer_propose(store, query, _BINARY, body)
        except ServiceError as e:
            self.metrics.errors["propose", e.code] += 1
            status, content_type, answer = e.status, b"application/json", _error_json(e)
        except Exception:
            log.exception("unexpected error answering a binary propose for store %r", store)
            self.metrics.errors["propose", "internal"] += 1
            status, content_type, answer = 500, b"application/json", _error_json(_internal_error())
        self.metrics.observe("propose", status, time.perf_counter() - started)
        return status, content_type, answer

    def _json_propose(self, body: bytes) -> tuple[list[np.ndarray], dict, bool]:
        try:
            request = ProposeRequest.model_validate_json(body)
        except ValidationError as e:
            raise _validation_error(e.errors()) from None
        if (request.context is None) == (request.contexts is None):
            raise ServiceError(422, "invalid_request", "give exactly one of 'context' and 'contexts'")
        single = request.context is not None
        raw = [request.context] if single else request.contexts
        if len(raw) > self.limits.max_batch:
            raise ServiceError(422, "batch_too_large", f"{len(raw)} contexts, the limit is {self.limits.max_batch}")
        try:
            contexts = [np.array(c, np.int64) if c else np.zeros(0, np.int64) for c in raw]
        except OverflowError:
            raise ServiceError(422, "id_out_of_range", "a context id does not fit in 64 bits") from None
        options = dict(speaker=request.speaker, max_nodes=request.max_nodes, max_depth=request.max_depth)
        return contexts, options, single

    def _query_options(self, query: bytes) -> dict:
        """The binary propose's options, parsed once per distinct query string: workers send the same
        few (one per speaker and budget) over and over."""
        options = self._parsed_queries.get(query)
        if options is None:
            options = _parse_query(query)  # raises for a bad one: nothing is kept
            if len(self._parsed_queries) < MAX_PARSED_QUERIES:
                self._parsed_queries[query] = options
        return options

    def _check_options(self, snapshot: Snapshot, speaker=None, max_nodes=None, max_depth=None):
        if speaker is not None:
            if not valid_name(speaker):
                raise ServiceError(422, "invalid_name", f"speaker name must match {NAME.pattern}")
            if speaker not in snapshot.speakers:
                raise ServiceError(404, "unknown_speaker", f"no speaker {speaker!r} in this store")
        for key, value, limit in (("max_nodes", max_nodes, self.limits.max_nodes),
                                  ("max_depth", max_depth, self.limits.max_depth)):
            if value is not None and not 0 <= value <= limit:
                raise ServiceError(422, "out_of_range", f"{key} must be in 0..{limit}, got {value}")
        return speaker, max_nodes, max_depth

    def _propose_all(self, snapshot: Snapshot, contexts: Sequence[np.ndarray], speaker, max_nodes, max_depth):
        trees = []
        for i, context in enumerate(contexts):
            if len(context) > self.limits.max_context:
                raise ServiceError(422, "context_too_long", f"context {i} has {len(context)} tokens, "
                                                            f"the limit is {self.limits.max_context}")
            try:  # the retriever checks ids against its vocabulary (compiled) and raises ValueError
                trees.append(snapshot.retriever.propose(context, speaker=speaker, max_nodes=max_nodes,
                                                        max_depth=max_depth))
            except ValueError as e:
                raise ServiceError(422, "id_out_of_range", f"context {i}: {e}") from None
        return trees

    def _store(self, name: str) -> StoreHandle:
        handle = self.stores.get(name)
        if handle is None:
            if not valid_name(name):
                raise ServiceError(422, "invalid_name", f"store name must match {NAME.pattern}")
            raise ServiceError(404, "unknown_store", f"no store {name!r}; this service has {sorted(self.stores)}")
        return handle

    # -- everything else: FastAPI --

    async def _watch_catalogs(self) -> None:
        """Pick up writes made outside this service, every `reload_interval` seconds."""
        while True:
            await asyncio.sleep(self.reload_interval)
            for name, handle in self.stores.items():
                try:
                    if await run_in_threadpool(handle.reload_if_changed):
                        log.info("store %s changed on disk; now serving the new snapshot", name)
                        self.metrics.set_store(name, handle.snapshot.info)
                except (DatastoreError, OSError) as e:  # e.g. mid-rebuild: keep serving the old snapshot
                    log.warning("store %s changed on disk but cannot be reopened yet: %s", name, e)

    @asynccontextmanager
    async def _lifespan(self, _app):
        watcher = asyncio.create_task(self._watch_catalogs()) if self.reload_interval else None
        yield
        if watcher:
            watcher.cancel()

    def _build_api(self) -> FastAPI:
        api = FastAPI(title="echospec datastore service", version="1", lifespan=self._lifespan)
        api.add_exception_handler(ServiceError, self._error_response)
        api.add_exception_handler(RequestValidationError, lambda request, e: self._error_response(
            request, _validation_error(e.errors())))
        api.add_exception_handler(StarletteHTTPException, lambda request, e: self._error_response(
            request, ServiceError(e.status_code, "http_error", str(e.detail))))

        @api.get("/healthz")
        def health() -> dict:
            """Liveness: the service answers and has these stores open (pid: which process answered)."""
            return {"status": "ok", "stores": sorted(self.stores), "pid": os.getpid()}

        @api.get("/v1/stores")
        def list_stores() -> dict:
            """Every store: vocabulary, sizes, speakers with their utterance and token counts."""
            return {"stores": [self._describe(h) for h in self.stores.values()]}

        @api.get("/v1/stores/{store}")
        def get_store(store: str) -> dict:
            """One store, as in /v1/stores."""
            return self._describe(self._store(store))

        @api.post("/v1/stores/{store}/speakers/{speaker}")
        async def enroll_speaker(store: str, speaker: str, request: EnrollRequest) -> dict:
            """Append (or with `replace`, replace) a speaker's utterances. Acknowledged once the new store
            and catalog are on disk and proposals are answered from them."""
            return await self._enroll(store, speaker, request)

        @api.get("/metrics")
        async def metrics() -> Response:  # async: on the event loop, where the tallies are written
            """Prometheus text format."""
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        return api

    def _error_response(self, request: Request, error: ServiceError) -> JSONResponse:
        self.metrics.errors[_route(request.url.path)[0], error.code] += 1
        return JSONResponse(_error_body(error), status_code=error.status)

    def _describe(self, handle: StoreHandle) -> dict:
        info = handle.snapshot.info
        keep = ("vocabulary", "n_min", "n_max", "utterances", "tokens", "speakers", "exact_bytes", "faiss_bytes",
                "created_at", "updated_at")
        return {"name": handle.name, **{k: info[k] for k in keep if k in info}}

    async def _enroll(self, store: str, speaker: str, request: EnrollRequest) -> dict:
        handle = self._store(store)
        if not valid_name(speaker):
            raise ServiceError(422, "invalid_name", f"speaker name must match {NAME.pattern}")
        self._check_utterances(request.utterances, handle.snapshot)
        utterances = [u.model_dump() for u in request.utterances]
        snapshot = await run_in_threadpool(handle.enroll, speaker, utterances, request.replace)
        self.metrics.enrollments[store] += 1
        self.metrics.set_store(store, snapshot.info)
        return {"store": store, "speaker": speaker, "replace": request.replace,
                "enrolled": len(utterances), **snapshot.info["speakers"][speaker]}

    def _check_utterances(self, utterances: list[Utterance], snapshot: Snapshot) -> None:
        if len(utterances) > self.limits.max_utterances:
            raise ServiceError(422, "too_many_utterances",
                               f"{len(utterances)} utterances, the limit is {self.limits.max_utterances}")
        lo, hi = snapshot.speech_offset, snapshot.speech_offset + snapshot.vocab_size
        for i, utt in enumerate(utterances):
            tokens = np.array(utt.tokens, np.int64)  # strict validation already made these ints
            outside = (tokens < lo) | (tokens >= hi)
            if outside.any():
                bad = tokens[outside]
                bad = bad[~np.isin(bad, list(snapshot.stop_ids))] if snapshot.stop_ids else bad
                if bad.size:
                    raise ServiceError(422, "id_out_of_range", f"utterances[{i}] holds raw id {int(bad[0])}; "
                                                               f"speech ids are {lo}..{hi - 1} (raw model ids)")


# ---------------------------------------------------------------------------------------------------
# ASGI helpers


class _ClientGone(Exception):
    pass


def _route(path: str):
    for endpoint, pattern in ROUTES:
        match = pattern.fullmatch(path)
        if match:
            return endpoint, match
    return "other", None


def _parse_query(query: bytes) -> dict[str, Any]:
    options: dict[str, Any] = {}
    text = query.decode("latin-1")
    for key, value in parse_qsl(text, keep_blank_values=True) if text else ():
        if key == "speaker":
            options[key] = value
        elif key in ("max_nodes", "max_depth"):
            if not (value.isascii() and value.isdigit()) or len(value) > 9:
                raise ServiceError(422, "invalid_request", f"{key} must be an integer >= 0, got {value!r}")
            options[key] = int(value)
        else:
            raise ServiceError(422, "invalid_request", f"unknown query parameter {key!r}")
    return options


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def _read_body(scope, receive, limit: int) -> bytes:
    length = _header(scope, b"content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise ServiceError(413, "body_too_large", f"request body over {limit} bytes")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ServiceError(413, "body_too_large", f"request body over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """A `receive` that hands the already-read body to the inner app, then defers to the real one."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


async def _send(send, status: int, body: bytes, content_type: bytes, extra_headers=()) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send, error: ServiceError) -> None:
    # After a 413 the rest of the body is still in the socket: close rather than parse it as a request.
    extra = [(b"connection", b"close")] if error.status == 413 else []
    await _send(send, error.status, _error_json(error), b"application/json", extra)


def _internal_error() -> ServiceError:
    return ServiceError(500, "internal", "internal error (see the service log)")


def _error_json(error: ServiceError) -> bytes:
    return json.dumps(_error_body(error)).encode()


def _error_body(error: ServiceError) -> dict:
    return {"error": {"status": error.status, "code": error.code, "message": error.message}}


def _validation_error(errors: list[dict]) -> ServiceError:
    if any(e.get("type") == "json_invalid" for e in errors):
        return ServiceError(400, "bad_json", "the body is not valid JSON")
    parts = [f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
             for e in errors[:5]]
    return ServiceError(422, "invalid_request", "; ".join(parts))


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


# ---------------------------------------------------------------------------------------------------
# Running it


class OneWriteHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, writing each response's head and body in one `transport.write`.

    uvicorn writes the head when the app sends `http.response.start` and the body when it sends
    `http.response.body`: two send syscalls and two TCP segments per response, and the client often
    wakes up and reads twice. Joined, a propose costs one syscall less on each end (measured with
    tools/bench_service.py). Everything else, parsing, keep-alive, flow control, pipelining, is uvicorn's."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app) -> None:
        # uvicorn builds the cycle itself (in on_headers_complete); this is the one hook that sees every
        # cycle, pipelined ones included, before its app runs. _OneWriteCycle adds no state of its own.
        cycle.__class__ = _OneWriteCycle
        super()._start_asgi_task(cycle, app)


class ServiceHttpProtocol(OneWriteHttpToolsProtocol):
    """OneWriteHttpToolsProtocol that answers binary proposals inline, in the parser's callbacks.

    uvicorn runs every request as an asyncio task through a request-response cycle and the ASGI
    calls: about 24 us of CPU a request on this project's 2-core machine, against 12 us answering in
    `on_message_complete` (measured with a fixed answer), and a propose's own work is ~40 us. So a
    request that is a binary propose (POST .../propose, Content-Type application/x-echospec, a
    Content-Length of at most INLINE_BODY_LIMIT, no Expect or Transfer-Encoding header, nothing else
    in flight on the connection, the client reading its answers) is answered by
    `Service.answer_binary_propose` when its body is in, head and body in one write. Everything else, JSON proposals included, takes uvicorn's path."""

    _inline: tuple[str, bytes, float, list[bytes]] | None = None  # (store, query, started, body parts)

    def on_headers_complete(self) -> None:
        self._inline = self._inline_propose()
        if self._inline is None:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._inline is None:
            return super().on_body(body)
        self._inline[3].append(body)

    def on_message_complete(self) -> None:
        if self._inline is None:
            return super().on_message_complete()
        (store, query, started, parts), self._inline = self._inline, None
        status, content_type, body = self.app.answer_binary_propose(store, query, b"".join(parts), started)
        keep_alive = self.parser.should_keep_alive()
        head = [STATUS_LINE[status], *(b"%s: %s\r\n" % header for header in self.server_state.default_headers),
                b"content-type: %s\r\ncontent-length: %d\r\n" % (content_type, len(body)),
                b"" if keep_alive else b"connection: close\r\n", b"\r\n", body]
        self.transport.write(b"".join(head))
        self.server_state.total_requests += 1
        if not keep_alive:
            self.transport.close()
        else:  # as uvicorn's on_response_complete: close the connection if it then idles too long
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def _inline_propose(self) -> tuple[str, bytes, float, list[bytes]] | None:
        """(store, query, started, []) when the request whose headers just ended can be answered inline."""
        if not hasattr(self.app, "answer_binary_propose") or self.parser.get_method() != b"POST" \
                or self.expect_100_continue:
            return None
        if self.cycle is not None and not self.cycle.response_complete:
            return None  # an earlier request on this connection is still being answered: keep the order
        if self.flow.write_paused:
            return None  # the client is not reading its answers: uvicorn's path waits, and stops reading
        url = httptools.parse_url(self.url)
        match = INLINE_PROPOSE.fullmatch(url.path)
        if match is None:
            return None
        length = None
        for name, value in self.headers:
            if name == b"content-type":
                if value.split(b";")[0].strip() != _BINARY:
                    return None
            elif name == b"content-length":
                length = value
            elif name in (b"transfer-encoding", b"upgrade"):
                return None
        if length is None or not length.isdigit() \
                or int(length) > min(INLINE_BODY_LIMIT, self.app.limits.max_body_bytes):
            return None  # uvicorn's path reads it with flow control, or refuses it (413)
        return match.group(1).decode("ascii"), url.query or b"", time.perf_counter(), []


class _OneWriteCycle(RequestResponseCycle):
    """Holds the head written for `http.response.start` and writes it with the next body message.

    The head leaves alone only when no body write follows it: after a HEAD request (when the body
    message is sent) or when the connection closes. An app failing between its start and body
    messages gets its connection closed without the head, where uvicorn would send the head first:
    the client sees an incomplete answer either way."""

    _held: _HeldWrites | None = None

    async def send(self, message) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            self.transport = held = _HeldWrites(self.transport)
            try:
                await super().send(message)
            finally:
                self.transport, self._held = held.transport, held
            return
        held, self._held = self._held, None
        if held is None:
            return await super().send(message)
        self.transport = held  # the body joins the head
        try:
            await super().send(message)
        finally:
            self.transport = held.transport
            held.flush()


class _HeldWrites:
    """Stands in for a transport in `_OneWriteCycle.send`: keeps what is written until `flush`."""

    def __init__(self, transport):
        self.transport, self.parts = transport, []

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def flush(self) -> None:
        if self.parts:
            self.transport.write(b"".join(self.parts))
            self.parts = []

    def close(self) -> None:  # a `connection: close` answer: send it, then close
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()


def read_api_key(api_key_file: str | Path | None = None) -> str | None:
    """The write key: the file's first line when a file is given, else $ECHOSPEC_API_KEY, else None."""
    if api_key_file is not None:
        key = Path(api_key_file).read_text().strip()
        if not key:
            raise ValueError(f"{api_key_file}: empty API key file")
        return key
    return os.environ.get(API_KEY_ENV) or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(stores: Sequence[str], host: str = "127.0.0.1", port: int = 8750, api_key_file: str | None = None,
          limits: Limits = Limits(), retriever_options: dict | None = None, reload_interval: float | None = 1.0,
          log_level: str = "warning") -> None:
    """Open `stores` (`PATH` or `NAME=PATH`) and serve them until interrupted."""
    import uvicorn

    named = dict(parse_store_arg(s) for s in stores)
    if len(named) != len(stores):
        raise ValueError("two stores share a name; give NAME=PATH")
    api_key = read_api_key(api_key_file)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_loopback(host):
        log.warning("listening on %s: proposals and store listings are readable by anyone who can reach it", host)
    if api_key is None:
        log.warning("no API key (%s or --api-key-file): enrollment is disabled", API_KEY_ENV)
    service = Service(named, api_key, limits, retriever_options, reload_interval)
    uvicorn.run(service, host=host, port=port, log_level=log_level, access_log=False, server_header=False,
                timeout_keep_alive=75, limit_concurrency=1024, http=ServiceHttpProtocol,
                proxy_headers=False)  # no proxy in front: X-Forwarded-* would only cost time

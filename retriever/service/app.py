"""The service's ASGI application, `Service` (start.py's `serve` runs it on uvicorn; asgi.py holds the plain
path's ASGI helpers).

The propose route bypasses FastAPI's routing and dependency machinery (it is the hot path; on this
project's 2-core machine a FastAPI route answered about 30% fewer requests/s than a plain ASGI callable
on the same uvicorn); the rest of the API is an ordinary FastAPI app. Body-size limits, write
authentication and metrics wrap both, in `Service.__call__`."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Sequence

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...datastore import DatastoreError
from ...datastore.names import check_name
from ..client.wire import WireError, decode_contexts, encode_trees
from .metrics import Metrics
from .requests import (BINARY_TYPE, BODY_TYPES, JSON_TYPE, EnrollRequest, Limits, ProposeRequest, ServiceError,
                       Utterance, body_type, check_request_name, int64_ids, internal_error, merge_options,
                       parse_query, route, validation_error)
from . import asgi
from .stores import Snapshot, StoreHandle

log = logging.getLogger("echospec.service")

API_KEY_ENV = "ECHOSPEC_API_KEY"
MAX_PARSED_QUERIES = 4096  # distinct propose query strings whose parse is kept


class Service:
    """The ASGI application. `stores` maps names to datastore directories, opened here (and warmed) with
    open_datastore's `access`; one found damaged is answered 503 `store_damaged` while the others are served,
    or with `strict` raises."""

    def __init__(self, stores: dict[str, str | Path], api_key: str | None = None, limits: Limits = Limits(),
                 retriever_options: dict | None = None, reload_interval: float | None = 1.0, docs: bool = False,
                 strict: bool = False, access: str = "auto"):
        for name in stores:
            check_name("store", name)
        paths = [Path(p).resolve() for p in stores.values()]
        if len(set(paths)) != len(paths):
            raise ValueError("the same datastore directory is served under two names")
        self.limits, self.reload_interval = limits, reload_interval
        self.api_key = api_key.encode() if api_key else None
        self.metrics = Metrics()
        self._parsed_queries: dict[bytes, dict] = {}
        self._damaged: set[str] = set()  # damaged-store messages already logged
        self.stores = {name: StoreHandle(name, path, dict(retriever_options or {}), strict, access)
                       for name, path in zip(stores, paths, strict=True)}
        for name, handle in self.stores.items():
            if handle.snapshot is None:
                log.error("store %s is damaged; answering 503 for it, serving the others: %s", name, handle.damage)
            else:
                self.metrics.set_store(name, handle.snapshot.info)
        self.api = self._build_api(docs)

    # -- ASGI entry point: limits, authentication, metrics; propose; everything else to FastAPI --

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.api(scope, receive, send)
        started = time.perf_counter()
        endpoint, match = route(scope["path"])
        status = None  # until a response starts

        async def send_tracked(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if scope["method"] not in ("GET", "HEAD") and endpoint not in ("propose", "other"):
                self._authenticate(scope)
            posted = scope["method"] == "POST" and endpoint in BODY_TYPES
            kind = body_type(endpoint, asgi.header(scope, b"content-type")) if posted else None
            body = await asgi.read_body(scope, receive, self.limits.max_body_bytes)
            if endpoint == "propose" and posted:
                await asgi.send_body(send_tracked, 200,
                                     self.answer_propose(match.group(1), scope["query_string"], kind, body), kind)
            else:
                await self.api(scope, asgi.replay_body(body, receive), send_tracked)
        except asgi.ClientGone:
            status = 499
        except Exception as e:
            error = self._failed(endpoint, e, f"{scope['method']} {scope['path']}")
            if status is None:
                await asgi.send_error(send_tracked, error)
        finally:
            self.metrics.observe(endpoint, status or 500, time.perf_counter() - started)

    def _failed(self, endpoint: str, error: Exception, what: str) -> ServiceError:
        """The error to answer for `error`, counted in the metrics; one that is not a ServiceError is
        logged with its traceback and answered as a 500. Every error answer passes here."""
        if not isinstance(error, ServiceError):
            log.error("unexpected error answering %s", what, exc_info=error)
            error = internal_error()
        self.metrics.errors[endpoint, error.code] += 1
        return error

    def _authenticate(self, scope) -> None:
        if self.api_key is None:
            raise ServiceError(403, "writes_disabled",
                               f"this service has no API key configured (set {API_KEY_ENV} or --api-key-file)")
        header = asgi.header(scope, b"authorization")
        if header is None:
            raise ServiceError(401, "unauthenticated", "writes need 'Authorization: Bearer <API key>'")
        scheme, _, key = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
            raise ServiceError(403, "forbidden", "wrong API key")

    # -- propose --

    def answer_propose(self, store: str, query: bytes, body_type: bytes, body: bytes) -> bytes:
        """The body of a 200 answer to a propose request whose body is `body_type` (BINARY_TYPE or
        JSON_TYPE, and so is the answer); raises ServiceError for anything else."""
        snapshot = self._store(store).current()  # read once: an enrollment may swap it meanwhile
        if body_type == BINARY_TYPE:
            try:
                contexts = decode_contexts(body, self.limits.max_batch)
            except WireError as e:
                raise ServiceError(400, "bad_body", str(e)) from None
            options = self._query_options(query)
            single = False
        else:
            contexts, options, single = self._json_propose(body)
            options = merge_options(options, self._query_options(query))
        speakers, max_nodes, max_depth = self._check_options(snapshot, len(contexts), **options)
        trees = self._propose_all(snapshot, contexts, speakers, max_nodes, max_depth)
        self.metrics.contexts[store] += len(trees)
        self.metrics.nodes[store] += sum(len(t) for t in trees)
        if body_type == BINARY_TYPE:
            return encode_trees(trees)
        payload = {"tree": trees[0].to_dict()} if single else {"trees": [t.to_dict() for t in trees]}
        return json.dumps(payload, separators=(",", ":")).encode()

    def answer_binary_propose(self, store: str, query: bytes, body: bytes, started: float) -> tuple[int, bytes, bytes]:
        """(status, content type, body) of a binary propose answered synchronously, as `__call__` would
        (metrics included); for fast_http's inline path."""
        try:
            status, content_type, answer = 200, BINARY_TYPE, self.answer_propose(store, query, BINARY_TYPE, body)
        except Exception as e:
            error = self._failed("propose", e, f"a binary propose for store {store!r}")
            status, content_type, answer = error.status, JSON_TYPE, error.json()
        self.metrics.observe("propose", status, time.perf_counter() - started)
        return status, content_type, answer

    def _json_propose(self, body: bytes) -> tuple[list[np.ndarray], dict, bool]:
        try:
            request = ProposeRequest.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e.errors()) from None
        if (request.context is None) == (request.contexts is None):
            raise ServiceError(422, "invalid_request", "give exactly one of 'context' and 'contexts'")
        single = request.context is not None
        raw = [request.context] if single else request.contexts
        if len(raw) > self.limits.max_batch:
            raise ServiceError(422, "batch_too_large", f"{len(raw)} contexts, the limit is {self.limits.max_batch}")
        contexts = [int64_ids(c, f"context {i}") for i, c in enumerate(raw)]
        options = dict(speaker=request.speaker, speakers=request.speakers, max_nodes=request.max_nodes,
                       max_depth=request.max_depth)
        return contexts, options, single

    def _query_options(self, query: bytes) -> dict:
        """The binary propose's options, parsed once per distinct query string: workers send the same
        few (one per speaker and budget) over and over."""
        options = self._parsed_queries.get(query)
        if options is None:
            options = parse_query(query)  # raises for a bad one: nothing is kept
            if len(self._parsed_queries) < MAX_PARSED_QUERIES:
                self._parsed_queries[query] = options
        return options

    def _check_options(self, snapshot: Snapshot, n_contexts: int, speaker=None, speakers=None, max_nodes=None,
                       max_depth=None):
        """(a speaker per context, max_nodes, max_depth) of valid options; ServiceError otherwise."""
        if speaker is not None and speakers is not None:
            raise ServiceError(422, "invalid_request", "give 'speaker' or 'speakers', not both")
        if speakers is not None and len(speakers) != n_contexts:
            raise ServiceError(422, "invalid_request", f"{len(speakers)} speakers for {n_contexts} contexts")
        speakers = [speaker] * n_contexts if speakers is None else speakers
        for name in set(speakers) - {None}:
            check_request_name("speaker", name)
            if name not in snapshot.speakers:
                raise ServiceError(404, "unknown_speaker", f"no speaker {name!r} in this store")
        for key, value, limit in (("max_nodes", max_nodes, self.limits.max_nodes),
                                  ("max_depth", max_depth, self.limits.max_depth)):
            if value is not None and not 0 <= value <= limit:
                raise ServiceError(422, "out_of_range", f"{key} must be in 0..{limit}, got {value}")
        return speakers, max_nodes, max_depth

    def _propose_all(self, snapshot: Snapshot, contexts: Sequence[np.ndarray], speakers, max_nodes, max_depth):
        trees = []
        for i, (context, speaker) in enumerate(zip(contexts, speakers)):
            if len(context) > self.limits.max_context:
                raise ServiceError(422, "context_too_long", f"context {i} has {len(context)} tokens, "
                                                            f"the limit is {self.limits.max_context}")
            try:  # the retriever checks ids against its vocabulary (compiled) and raises ValueError
                trees.append(snapshot.retriever.propose(context, speaker=speaker, max_nodes=max_nodes,
                                                        max_depth=max_depth))
            except ValueError as e:
                raise ServiceError(422, "id_out_of_range", f"context {i}: {e}") from None
            except DatastoreError as e:  # DamagedStoreError: this store's files are corrupt; the others answer
                if str(e) not in self._damaged:
                    self._damaged.add(str(e))
                    log.error("%s", e)
                raise ServiceError(503, "store_damaged", str(e)) from None
        return trees

    def _store(self, name: str) -> StoreHandle:
        handle = self.stores.get(name)
        if handle is None:
            check_request_name("store", name)
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

    def _build_api(self, docs: bool) -> FastAPI:
        """`docs`: serve /docs, /redoc and /openapi.json (FastAPI's API description); off unless asked."""
        api = FastAPI(title="echospec datastore service", version="1", lifespan=self._lifespan,
                      redirect_slashes=False,  # a URL with a trailing slash is unknown (404), not redirected
                      **({} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}))
        api.add_exception_handler(ServiceError, self._error_response)
        api.add_exception_handler(RequestValidationError, lambda request, e: self._error_response(
            request, validation_error(e.errors())))
        api.add_exception_handler(StarletteHTTPException, lambda request, e: self._error_response(
            request, ServiceError(e.status_code, "http_error", str(e.detail))))

        @api.get("/healthz")
        def health() -> Response:
            """Liveness: the service answers and has these stores open (pid: which process answered); "degraded"
            names the damaged ones, and only when every store is damaged is the answer a 503."""
            damaged = {name: h.damage for name, h in sorted(self.stores.items()) if h.snapshot is None}
            body = {"status": "degraded" if damaged else "ok", "stores": sorted(self.stores), "pid": os.getpid()}
            if damaged:
                body["damaged"] = damaged
            return JSONResponse(body, status_code=503 if len(damaged) == len(self.stores) else 200)

        @api.get("/v1/stores")
        def list_stores() -> dict:
            """Every store: vocabulary, sizes, speakers with their utterance and token counts (a damaged one:
            its name and what is wrong)."""
            return {"stores": [{"name": h.name, "damaged": h.damage} if h.snapshot is None else h.describe()
                               for h in self.stores.values()]}

        @api.get("/v1/stores/{store}")
        def get_store(store: str) -> dict:
            """One store, as in /v1/stores."""
            return self._store(store).describe()

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
        error = self._failed(route(request.url.path)[0], error, f"{request.method} {request.url.path}")
        return JSONResponse(error.body(), status_code=error.status)

    async def _enroll(self, store: str, speaker: str, request: EnrollRequest) -> dict:
        handle = self._store(store)
        check_request_name("speaker", speaker)
        self._check_utterances(request.utterances, handle.current())
        utterances = [u.model_dump() for u in request.utterances]
        snapshot, done = await run_in_threadpool(handle.enroll, speaker, utterances, request.replace)
        self.metrics.enrollments[store] += 1
        self.metrics.set_store(store, snapshot.info)
        return {"store": store, "speaker": speaker, "replace": request.replace, "enrolled": done.added,
                "unchanged": done.unchanged, **snapshot.info["speakers"][speaker]}

    def _check_utterances(self, utterances: list[Utterance], snapshot: Snapshot) -> None:
        if len(utterances) > self.limits.max_utterances:
            raise ServiceError(422, "too_many_utterances",
                               f"{len(utterances)} utterances, the limit is {self.limits.max_utterances}")
        lo, hi = snapshot.speech_offset, snapshot.speech_offset + snapshot.vocab_size
        for i, utt in enumerate(utterances):
            tokens = int64_ids(utt.tokens, f"utterances[{i}]")
            outside = (tokens < lo) | (tokens >= hi)
            if outside.any():
                bad = tokens[outside]
                bad = bad[~np.isin(bad, list(snapshot.stop_ids))] if snapshot.stop_ids else bad
                if bad.size:
                    raise ServiceError(422, "id_out_of_range", f"utterances[{i}] holds raw id {int(bad[0])}; "
                                                               f"speech ids are {lo}..{hi - 1} (raw model ids)")

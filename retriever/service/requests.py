"""What a request may be, written once for both HTTP paths (the inline binary propose of fast_http.py and
the ASGI app): routes, names, content types, body limits, request bodies, options, and the error answer."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence
from urllib.parse import parse_qsl

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ...datastore import DatastoreError
from ...datastore.names import check_name
from ..client.wire import BINARY

BINARY_TYPE = BINARY.encode()
JSON_TYPE = b"application/json"
MAX_ID_LENGTH = 256


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, how long it may take to arrive and how large its head may be;
    anything past a limit is a 413 or a 422, never a slow answer, and a request not in whole within
    `read_timeout` seconds of its first byte (or of connecting), or with a head over `max_head_bytes`,
    has its connection closed. At most `max_connections` connections are held, the idle ones closed first
    to make room, and a kept-alive connection idle for `keep_alive` seconds is closed (read_guard.py)."""

    max_body_bytes: int = 8 << 20
    max_batch: int = 256  # contexts per propose request
    max_context: int = 1 << 16  # tokens per context
    max_nodes: int = 1024  # node budget per tree
    max_depth: int = 64
    max_utterances: int = 10_000  # per enrollment
    read_timeout: float = 30.0  # seconds
    max_head_bytes: int = 64 << 10  # request line and headers
    max_connections: int = 1024
    keep_alive: float = 75.0  # seconds; longer than a load balancer's usual 60 s idle timeout


class ServiceError(Exception):
    """An error meant for the client: becomes a JSON response with `status`."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def json(self) -> bytes:
        return json.dumps(self.body()).encode()

    def body(self) -> dict:
        return {"error": {"status": self.status, "code": self.code, "message": self.message}}


def internal_error() -> ServiceError:
    return ServiceError(500, "internal", "internal error (see the service log)")


def check_request_name(kind: str, name: str) -> None:
    """The datastore's name rule (datastore/names.py) on a name a request gives, as a client error (422)."""
    try:
        check_name(kind, name)
    except DatastoreError as e:
        raise ServiceError(422, "invalid_name", str(e)) from None


# ---------------------------------------------------------------------------------------------------
# Routes

ROUTES = (  # (endpoint label, pattern): labels keep the metrics' cardinality bounded
    ("propose", re.compile(r"/v1/stores/([^/]+)/propose")),
    ("enroll", re.compile(r"/v1/stores/[^/]+/speakers/[^/]+")),
    ("store", re.compile(r"/v1/stores/[^/]+")),
    ("stores", re.compile(r"/v1/stores")),
    ("health", re.compile(r"/healthz")),
    ("metrics", re.compile(r"/metrics")),
)


def route(path: str) -> tuple[str, re.Match | None]:
    """(endpoint label, match) of a decoded request path; ("other", None) for anything unknown."""
    for endpoint, pattern in ROUTES:
        match = pattern.fullmatch(path)
        if match:
            return endpoint, match
    return "other", None


# ---------------------------------------------------------------------------------------------------
# Headers: content type and body size


BODY_TYPES = {"propose": (JSON_TYPE, BINARY_TYPE), "enroll": (JSON_TYPE,)}
"""The media types each route with a body takes. A body's type is what its Content-Type says, whatever
its size and on either HTTP path; a body without one is refused like any other type (415)."""


def media_type(content_type: bytes | None) -> bytes:
    """The media type of a Content-Type header value, lower case, without parameters; b"" for none."""
    return (content_type or b"").split(b";")[0].strip().lower()


def body_type(endpoint: str, content_type: bytes | None) -> bytes:
    """The media type of a request body on `endpoint` (one of BODY_TYPES[endpoint]), or a 415."""
    given = media_type(content_type)
    accepted = BODY_TYPES[endpoint]
    if given not in accepted:
        names = " or ".join(t.decode() for t in accepted)
        got = f"not {given.decode(errors='replace')!r}" if given else "none was given"
        raise ServiceError(415, "unsupported_media_type", f"{endpoint} takes Content-Type {names}; {got}")
    return given


def length_within(content_length: bytes, limit: int) -> bool:
    """Whether a Content-Length header value is a plain number of at most `limit` bytes."""
    return content_length.isdigit() and int(content_length) <= limit


def body_too_large(limit: int) -> ServiceError:
    return ServiceError(413, "body_too_large", f"request body over {limit} bytes")


# ---------------------------------------------------------------------------------------------------
# Request bodies (JSON) and options


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ProposeRequest(_Strict):
    """JSON propose: exactly one of `context` (answer `{"tree": ...}`) or `contexts` (`{"trees": [...]}`)."""

    context: list[int] | None = None
    contexts: list[list[int]] | None = None
    speaker: str | None = None
    speakers: list[str | None] | None = None  # one per context (None: the general store), for mixed batches
    max_nodes: int | None = None
    max_depth: int | None = None


class Utterance(_Strict):
    id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    tokens: list[int] = Field(min_length=1)


class EnrollRequest(_Strict):
    """Utterances in raw model ids, exactly as a corpus line has them; `replace` drops the old ones."""

    utterances: list[Utterance] = Field(min_length=1)
    replace: bool = False


def validation_error(errors: list[dict]) -> ServiceError:
    """pydantic's (or FastAPI's) validation errors as one client error."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return ServiceError(400, "bad_json", "the body is not valid JSON")
    parts = [f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
             for e in errors[:5]]
    return ServiceError(422, "invalid_request", "; ".join(parts))


def int64_ids(ids: Sequence[int], where: str) -> np.ndarray:
    """Token ids from a JSON body (strict validation made them ints) as int64; an id past 64 bits is a
    client error, `where` says where it was."""
    try:
        return np.array(ids, np.int64) if len(ids) else np.zeros(0, np.int64)
    except OverflowError:
        raise ServiceError(422, "id_out_of_range", f"{where}: an id does not fit in 64 bits") from None


def parse_query(query: bytes) -> dict[str, Any]:
    """A propose's options from its query string: speaker, or speakers (one per context, comma-separated,
    empty for the general store), max_nodes, max_depth."""
    options: dict[str, Any] = {}
    text = query.decode("latin-1")
    for key, value in parse_qsl(text, keep_blank_values=True) if text else ():
        if key == "speaker":
            options[key] = value
        elif key == "speakers":
            options[key] = [name or None for name in value.split(",")]
        elif key in ("max_nodes", "max_depth"):
            if not (value.isascii() and value.isdigit()) or len(value) > 9:
                raise ServiceError(422, "invalid_request", f"{key} must be an integer >= 0, got {value!r}")
            options[key] = int(value)
        else:
            raise ServiceError(422, "invalid_request", f"unknown query parameter {key!r}")
    return options


def merge_options(body: dict[str, Any], query: dict[str, Any]) -> dict[str, Any]:
    """A JSON propose's options: its body's, and its query string's where the body gives none; one given
    in both with different values is a 400."""
    merged = dict(body)
    for key, value in query.items():
        if merged.get(key) is None:
            merged[key] = value
        elif merged[key] != value:
            raise ServiceError(400, "conflicting_options", f"{key} is {merged[key]!r} in the body but {value!r} "
                                                           "in the query string")
    return merged

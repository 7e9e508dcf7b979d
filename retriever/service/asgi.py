"""ASGI helpers of the service's plain propose path: headers, the body read under its limit, the body handed on
to the FastAPI app, and the responses sent."""

from __future__ import annotations

from .requests import JSON_TYPE, ServiceError, body_too_large, length_within


class ClientGone(Exception):
    pass


def header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def read_body(scope, receive, limit: int) -> bytes:
    length = header(scope, b"content-length")
    if length is not None and not length_within(length, limit):
        raise body_too_large(limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def replay_body(body: bytes, receive):
    """A `receive` that hands the already-read body to the inner app, then defers to the real one."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


async def send_body(send, status: int, body: bytes, content_type: bytes, extra_headers=()) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send, error: ServiceError) -> None:
    # After a 413 the rest of the body is still in the socket: close rather than parse it as a request.
    extra = [(b"connection", b"close")] if error.status == 413 else []
    await send_body(send, error.status, error.json(), JSON_TYPE, extra)

"""fast_http's protocol under an app that is not a `Service` (bench_service's floor server) or a Service
behind uvicorn's proxy-headers middleware: it serves with the default limits instead of failing."""

from __future__ import annotations

import threading
import time

import uvicorn
from service_testing import free_port, request

from echospec.retriever.service import ServiceHttpProtocol


async def hello(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"hi"})


def test_any_asgi_app_is_served_with_the_default_limits():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(hello, host="127.0.0.1", port=port, http=ServiceHttpProtocol,
                                           lifespan="off", log_level="warning"))  # proxy headers on: a middleware
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        for _ in range(3):
            assert request(f"http://127.0.0.1:{port}", "GET", "/", timeout=5)[::2] == (200, b"hi")
    finally:
        server.should_exit = True
        thread.join(10)

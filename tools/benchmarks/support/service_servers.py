"""The servers bench_service measures: `echospec serve` in a process of its own, and the floor, the HTTP stack
alone (uvicorn with the service's protocol, every propose answered with the same bytes)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(store_dir: Path, store_name: str, port: int) -> subprocess.Popen:
    from ....retriever.client import RemoteRetriever, RetrieverUnavailable

    echospec = str(Path(sys.executable).with_name("echospec"))
    proc = subprocess.Popen([echospec, "serve", f"{store_name}={store_dir}", "--port", str(port)])
    probe = RemoteRetriever(f"http://127.0.0.1:{port}", store=store_name, timeout=1.0, backoff=0.0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            probe.info()
            return proc
        except RetrieverUnavailable:
            if proc.poll() is not None:
                raise SystemExit(f"the service exited with {proc.returncode}") from None
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the service did not come up within 120 s")


class FloorApp:
    """The HTTP stack alone: what `serve` runs, with an app answering every request with the same bytes."""

    def __init__(self, answer: bytes):
        from ....retriever.service import Limits

        self.answer = answer
        self.limits = Limits()  # the service's defaults, which ServiceHttpProtocol reads from its app

    async def __call__(self, scope, receive, send):  # everything but inline proposals: GET /metrics here
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    def answer_binary_propose(self, store, query, body, started):  # ServiceHttpProtocol's inline path
        return 200, b"application/x-echospec", self.answer


def serve_floor(port: int, answer: bytes) -> None:
    import uvicorn

    from ....retriever.service import ServiceHttpProtocol

    uvicorn.run(FloorApp(answer), host="127.0.0.1", port=port, log_level="warning", access_log=False,
                server_header=False, http=ServiceHttpProtocol, proxy_headers=False, lifespan="off")


def start_floor(store_dir: str, request: tuple, port: int):
    """`serve_floor` in a forked process, answering every propose with the tree of `request` (context, speaker),
    a typical one."""
    from ....retriever import Retriever
    from ....retriever.client.wire import encode_trees

    context, speaker = request
    answer = encode_trees([Retriever(store_dir).propose(context, speaker=speaker)])
    proc = mp.get_context("fork").Process(target=serve_floor, args=(port, answer), daemon=True)
    proc.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("the floor server did not come up within 30 s")

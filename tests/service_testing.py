"""Shared pieces of the service tests: a real `echospec serve` subprocess on a free loopback port."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from echospec.datastore import build
from echospec.tools.corpus.synth_corpus import SynthConfig, generate

API_KEY = "test-key-0123456789"
ECHOSPEC = str(Path(sys.executable).with_name("echospec"))  # the console script of the venv running the tests
VOCAB = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic_corpus(n_tokens: int, n_speakers: int = 3, seed: int = 3) -> list[dict]:
    """Speech-like utterances `{"id", "speaker", "tokens"}` over a VOCAB-id vocabulary."""
    synth = generate(SynthConfig(n_tokens=n_tokens, vocab=VOCAB, n_phones=32, n_speakers=n_speakers, seed=seed))
    return [{"id": synth.utterance_id(i), "speaker": synth.speaker_name(i), "tokens": synth.utterance(i).tolist()}
            for i in range(len(synth))]


def write_jsonl(utterances: list[dict], path: Path) -> Path:
    with open(path, "w") as f:
        f.writelines(json.dumps(u) + "\n" for u in utterances)
    return path


def make_store(root: Path, n_tokens: int = 20_000, n_speakers: int = 3, seed: int = 3) -> tuple[Path, list[dict]]:
    """A datastore (general + per-speaker exact stores, no FAISS) and the corpus it was built from."""
    corpus = synthetic_corpus(n_tokens, n_speakers, seed)
    root.mkdir(parents=True, exist_ok=True)
    build(write_jsonl(corpus, root / "corpus.jsonl"), root / "store", vocab_size=VOCAB, faiss=False, progress=False)
    return root / "store", corpus


def copy_store(store: Path, target: Path) -> Path:
    shutil.copytree(store, target)
    return target


SERVE = """\
import json, sys
options = json.loads(sys.argv[1])
if "uvicorn_version" in options:  # make the service believe the installed uvicorn is that version
    import uvicorn
    uvicorn.__version__ = options.pop("uvicorn_version")
from echospec.retriever.service import Limits, serve
serve(sys.argv[3:], port=int(sys.argv[2]), limits=Limits(**options.pop("limits", {})), **options)
"""
"""`serve(STORE..., port=N, **options)` in a fresh interpreter: the library call `echospec serve` makes, for
what the command line does not offer. `uvicorn_version` makes the real check in fast_http.py refuse the
fast path (it was written for another version), and the service runs on uvicorn's own protocol."""


def smaps_fields(path: Path, field: str, pid: int | str = "self") -> list[list[str]]:
    """The values of `field` (e.g. "VmFlags", "Rss") in every mapping of `path` in process `pid` (Linux's
    /proc/PID/smaps), one list of words per mapping."""
    values, current = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:  # a mapping's header line
                current = len(parts) >= 6 and parts[5] == str(path)
            elif current and parts[0] == f"{field}:":
                values.append(parts[1:])
    return values


def vm_flags(path: Path, pid: int | str = "self") -> list[set[str]]:
    """The VmFlags of every mapping of `path` in process `pid`: "rr" where the mapping is advised MADV_RANDOM."""
    return [set(words) for words in smaps_fields(path, "VmFlags", pid)]


def resident_bytes(path: Path, pid: int | str = "self") -> int:
    """Bytes of `path` that process `pid` has mapped and resident (the Rss of its mappings of it)."""
    return sum(int(words[0]) * 1024 for words in smaps_fields(path, "Rss", pid))


class Server:
    """`echospec serve STORE --port N ARGS` as a subprocess, or with `options` the library's `serve(...)`
    (see SERVE); `url` once `/healthz` answers."""

    def __init__(self, *stores: Path | str, port: int | None = None, api_key: str | None = API_KEY,
                 args: tuple[str, ...] = (), options: dict | None = None):
        self.stores, self.port, self.api_key, self.args = [str(s) for s in stores], port or free_port(), api_key, args
        self.options = options
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile()  # the service's stdout and stderr, every start

    def output(self) -> str:
        """What the service has printed so far (its log)."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def start(self, timeout: float = 60.0) -> "Server":
        env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
        env.pop("ECHOSPEC_API_KEY", None)
        if self.api_key:
            env["ECHOSPEC_API_KEY"] = self.api_key
        if self.options is None:
            command = [ECHOSPEC, "serve", *self.stores, "--port", str(self.port), *self.args]
        else:
            command = [sys.executable, "-c", SERVE, json.dumps(self.options), str(self.port), *self.stores]
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.output()}")
            try:
                status, _, body = request(self.url, "GET", "/healthz", timeout=1.0)
                if status == 200 and json.loads(body)["pid"] == self.process.pid:  # ours, not a port squatter
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"server on port {self.port} did not answer /healthz within {timeout} s")

    def stop(self) -> None:
        """SIGTERM (graceful), then SIGKILL if it lingers."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        """kill -9: no shutdown, no flush, no cleanup."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def request(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """One HTTP request on a fresh connection: (status, headers, body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def post_json(url: str, path: str, payload, api_key: str | None = None, timeout: float = 30.0):
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    status, _, body = request(url, "POST", path, json.dumps(payload).encode(), headers, timeout)
    return status, json.loads(body)

"""Starting the service: the write key, the HTTP protocol, the open-file limit, and `serve`, which runs `Service`
on uvicorn."""

from __future__ import annotations

import ipaddress
import logging
import os
import resource
from pathlib import Path
from typing import Sequence

from .app import API_KEY_ENV, Service
from .read_guard import StockHttpProtocol, stock_protocol_class
from .requests import Limits
from .stores import parse_store_arg

log = logging.getLogger("echospec.service")


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


def http_protocol():
    """fast_http's ServiceHttpProtocol when the installed uvicorn is the one it was written for, else
    uvicorn's own protocol (with the read guard): slower, the same answers."""
    try:
        from .fast_http import ServiceHttpProtocol
    except ImportError as e:
        log.warning("%s: serving with uvicorn's own HTTP protocol (slower, the same answers)", e)
    else:
        return ServiceHttpProtocol
    try:
        stock_protocol_class()
    except (ImportError, AttributeError, KeyError) as e:  # a uvicorn that moved its protocol table
        log.warning("uvicorn's protocol table not found (%s): slow clients are not timed out", e)
        return "auto"
    return StockHttpProtocol


def serve(stores: Sequence[str], host: str = "127.0.0.1", port: int = 8750, api_key_file: str | None = None,
          limits: Limits = Limits(), retriever_options: dict | None = None, reload_interval: float | None = 1.0,
          log_level: str = "warning", docs: bool = False, strict: bool = False, access: str = "auto") -> None:
    """Open `stores` (`PATH` or `NAME=PATH`) and serve them until interrupted; `docs` also serves the API's
    description (/docs, /redoc, /openapi.json); `strict` refuses to start when a store is damaged; `access`
    says how the stores read from disk (open_datastore's: "auto", "random", "stream" or "readahead")."""
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
    service = Service(named, api_key, limits, retriever_options, reload_interval, docs, strict, access)
    allow_open_files(limits.max_connections + OPEN_FILES_BESIDE_CONNECTIONS)
    # uvicorn answers 503 at max_connections + 1: read_guard closes idle connections first, so only when
    # every connection is busy.
    uvicorn.run(service, host=host, port=port, log_level=log_level, access_log=False, server_header=False,
                timeout_keep_alive=limits.keep_alive, limit_concurrency=limits.max_connections + 1,
                http=http_protocol(), proxy_headers=False)  # no proxy in front: X-Forwarded-* would only cost time


OPEN_FILES_BESIDE_CONNECTIONS = 512  # the stores' memory maps, the log, the catalog polls


def allow_open_files(needed: int) -> None:
    """Raise this process's open-file limit to `needed` where the hard limit allows (many systems start
    services at 1024, fewer than the connections the service holds plus its stores' files)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning("open-file limit %d is below the %d that --max-connections needs; raise it (ulimit -n)",
                    target, needed)

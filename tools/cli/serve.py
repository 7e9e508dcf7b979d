"""`echospec serve`: a thin layer over echospec.retriever.service.serve."""

from __future__ import annotations

import click

from ...retriever.tree import MAX_DEPTH, MAX_NODES
from ..commands import fail_cleanly, needs_extra


@click.command()
@click.argument("stores", nargs=-1, required=True, metavar="STORE...")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Loopback by default; anything else exposes proposals to the network.")
@click.option("--port", default=8750, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False), show_default="$ECHOSPEC_API_KEY",
              help="File holding the write (enrollment) API key. Without one, enrollment is disabled.")
@click.option("--max-body-mb", default=8.0, show_default=True, type=click.FloatRange(min=0.001),
              help="Largest request body.")
@click.option("--max-batch", default=256, show_default=True, type=click.IntRange(min=1),
              help="Most contexts in one propose request.")
@click.option("--max-nodes", default=MAX_NODES, show_default=True, type=click.IntRange(min=0),
              help="Default node budget of a proposal (a request may ask for another).")
@click.option("--max-depth", default=MAX_DEPTH, show_default=True, type=click.IntRange(min=1),
              help="Default depth of a proposal (a request may ask for another).")
@click.option("--weights", default=None, metavar="P,S,G,F", callback=lambda ctx, param, value: parse_weights(value),
              help="Source weights (prompt, speaker, general, faiss) of every proposal; default the retriever's "
                   "1,1,1,0.5. Engines drafting chains (vLLM) do better with 5,1,1,0.5, their default in-process.")
@click.option("--reload-interval", default=1.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds between checks for writes made by other processes (0: never check).")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="The least severe log lines printed.")
@click.option("--docs", is_flag=True, help="Also serve the API's description: /docs, /redoc, /openapi.json.")
@click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Connections held at once; past it the idle ones are closed first, and only when all are busy "
                   "is a request answered 503.")
@click.option("--keep-alive", default=75.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds an idle kept-alive connection stays open.")
@click.option("--read-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds a request may take to arrive whole.")
@click.option("--strict", is_flag=True, help="Refuse to start when a store is damaged (without it, the others are "
              "served and requests for it answered 503).")
@click.option("--access", type=click.Choice(["auto", "random", "stream", "readahead"]), default="auto",
              show_default=True,
              help="How stores read from disk on a page-cache miss: readahead (large reads, for a store that fits in "
              "memory), random (4 kB, for one that does not), stream (the token stream read into memory at start, the "
              "suffix array random: for a replica with RAM for a third of the store), auto (random when the store "
              "takes over half the available memory, else readahead).")
@needs_extra("service")
@fail_cleanly
def serve(stores, host, port, api_key_file, max_body_mb, max_batch, max_nodes, max_depth, weights, reload_interval,
          log_level, docs, max_connections, keep_alive, read_timeout, strict, access) -> None:
    """Serve datastores over HTTP: propose, list stores and speakers, enroll, /healthz, /metrics.

    Each STORE is a datastore directory, served under its directory name, or NAME=DIR.
    """
    from ...retriever.service import Limits
    from ...retriever.service import serve as run

    limits = Limits(max_body_bytes=int(max_body_mb * (1 << 20)), max_batch=max_batch, max_connections=max_connections,
                    keep_alive=keep_alive, read_timeout=read_timeout)
    run(stores, host=host, port=port, api_key_file=api_key_file, limits=limits,
        retriever_options={"max_nodes": max_nodes, "max_depth": max_depth, **({"weights": weights} if weights else {})},
        reload_interval=reload_interval or None,
        log_level=log_level, docs=docs, strict=strict, access=access)


def parse_weights(value: str | None) -> tuple[float, ...] | None:
    if value is None:
        return None
    try:
        weights = tuple(float(w) for w in value.split(","))
    except ValueError:
        weights = ()
    if len(weights) != 4 or min(weights) < 0:
        raise click.BadParameter(f"need four non-negative numbers, prompt,speaker,general,faiss; got {value!r}")
    return weights


COMMANDS = (serve,)

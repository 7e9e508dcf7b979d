"""`echospec build | enroll | info | query`: datastores from the shell (thin layers over
echospec.datastore and echospec.retriever)."""

from __future__ import annotations

import atexit
import json
import shlex
import sys
import time
from pathlib import Path

import click
import numpy as np

from ...datastore import N_MAX, N_MIN, DatastoreError, open_datastore
from ...datastore import build as build_datastore
from ...datastore import enroll as enroll_speaker
from ...retriever.tree import MAX_DEPTH, MAX_NODES
from ..commands import fail_cleanly


@click.command()
@click.argument("corpus", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--per-speaker/--no-per-speaker", default=True, show_default=True,
              help="Also build one exact store per speaker (every utterance then needs a speaker).")
@click.option("--faiss/--no-faiss", default=True, show_default=True, help="Build the FAISS store.")
@click.option("--embeddings", type=click.Path(path_type=Path), show_default="from the corpus",
              help="Token embedding table for the FAISS store (.npy or .safetensors).")
@click.option("--faiss-dim", default=None, type=click.IntRange(1, 256), show_default="16",
              help="Dimensions per token in FAISS context vectors.")
@click.option("--faiss-max-vectors", default=None, type=click.IntRange(1), show_default="200000",
              help="Most contexts the FAISS store indexes (evenly strided).")
@click.option("--speech-offset", default=0, show_default=True, help="Raw id of local speech id 0 (LLaSA: 128264).")
@click.option("--vocab-size", type=int, show_default="the largest id + 1",
              help="Number of speech ids (CosyVoice 2: 6561).")
@click.option("--stop-id", "stop_ids", multiple=True, type=int,
              help="Raw id that ends speech (repeatable); never stored (CosyVoice 2: 6561 6562 6563).")
@click.option("--drop-id", "drop_ids", multiple=True, type=int,
              help="Raw marker id removed wherever it occurs (repeatable; LLaSA: 128260).")
@click.option("--drop-non-speech", is_flag=True,
              help="Remove ids outside the speech range (text, global or time tokens of a training dump) instead of "
                   "refusing them; says how many. Needs --vocab-size.")
@click.option("--codebooks", default=1, show_default=True, type=click.IntRange(1),
              help="Interleaved codebooks in the speech ids, cycling in order (Orpheus: 7).")
@click.option("--n-min", default=N_MIN, show_default=True, type=int, help="Shortest context suffix matched.")
@click.option("--n-max", default=N_MAX, show_default=True, type=int, help="Longest context suffix matched.")
@click.option("--shards", default=1, show_default=True, type=click.IntRange(1, 65536),
              help="Split the general store into this many shards (each holds < 2^31 tokens).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="auto", default=None, metavar="[auto|ADDRESS]",
              help="Run the build's tasks on Ray: the running cluster (--ray alone, or auto) or ADDRESS.")
@click.option("--workers", type=click.IntRange(1), show_default="one per shard, up to the cores",
              help="Local worker processes without --ray.")
@click.option("--force", is_flag=True, help="Replace STORE if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@fail_cleanly
def build(corpus, store, per_speaker, faiss, embeddings, faiss_dim, faiss_max_vectors, speech_offset, vocab_size,
          stop_ids, drop_ids, drop_non_speech, codebooks, n_min, n_max, shards, ray_address, workers, force, quiet):
    """Build datastore STORE from CORPUS files or globs (.jsonl, a .jsonl manifest of .npy files, .npz,
    .parquet)."""
    started = time.perf_counter()
    ds = build_datastore(list(corpus), store, per_speaker=per_speaker, faiss=faiss, embeddings=embeddings,
                         speech_offset=speech_offset, vocab_size=vocab_size, stop_ids=stop_ids,
                         drop_ids=drop_ids, codebooks=codebooks, n_min=n_min, n_max=n_max, shards=shards,
                         ray=ray_address, workers=workers, force=force, progress=not quiet,
                         drop_non_speech=drop_non_speech,
                         faiss_options={k: v for k, v in (("dim", faiss_dim), ("max_vectors", faiss_max_vectors))
                                        if v is not None})
    info = ds.info()
    click.echo(f"built {store}: {info['utterances']} utterances, {info['tokens']} tokens"
               + (f" in {len(info['shards'])} shards" if len(info['shards']) > 1 else "")
               + f", {len(info['speakers'])} speaker stores, {info['general_bytes_per_token']} B/token general"
               + (f", FAISS {info['faiss_bytes'] / 1e6:.1f} MB" if ds.has_faiss else "")
               + f" in {time.perf_counter() - started:.1f} s")
    dropped = info["build"].get("dropped_non_speech")
    if dropped is not None:
        click.echo(f"dropped {dropped['tokens']} ids outside the speech range from {dropped['utterances']} utterances")


@click.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.argument("speaker")
@click.argument("corpus", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--replace", is_flag=True, help="Replace the speaker's store instead of adding to it.")
@fail_cleanly
def enroll(store, speaker, corpus, replace):
    """Add SPEAKER's utterances from CORPUS to STORE (the general store is left untouched). An utterance id
    SPEAKER already has is skipped when its tokens are the same and refused when they differ (unless
    --replace), so enrolling the same file twice changes nothing."""
    done = enroll_speaker(store, speaker, list(corpus), replace=replace)
    row = done.datastore.info()["speakers"][speaker]
    unchanged = f"; {done.unchanged} already enrolled, unchanged" if done.unchanged else ""
    click.echo(f"{'replaced' if replace else 'enrolled'} {speaker}: {done.added} utterances added{unchanged}; "
               f"now {row['utterances']} utterances, {row['tokens']} tokens")


@click.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the catalog as JSON.")
@click.option("--verify", is_flag=True, help="Also check every file's sha256.")
@fail_cleanly
def info(store, as_json, verify):
    """Describe datastore STORE from its catalog."""
    data = open_datastore(store, verify=verify).info()
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    vocab = data["vocabulary"]
    click.echo(f"datastore {data['path']} (format {data['format_version']}, updated {data['updated_at']})")
    click.echo(f"  vocabulary  {vocab['size']} speech ids from raw id {vocab['speech_offset']}"
               + (f" in {vocab['codebooks']} interleaved codebooks" if vocab["codebooks"] > 1 else "")
               + f", stop ids {vocab['stop_ids'] or 'none'}"
               + (f", dropped ids {vocab['drop_ids']}" if vocab["drop_ids"] else "") + f", stored as {vocab['dtype']}")
    click.echo(f"  contexts    n = {data['n_min']}..{data['n_max']}")
    click.echo(f"  corpus      {data['utterances']} utterances, {data['tokens']} tokens, "
               f"{len(data['speakers'])} speakers")
    click.echo(f"  disk        exact {data['exact_bytes'] / 1e6:.2f} MB "
               f"({data['general_bytes_per_token']} B/token general), FAISS {data['faiss_bytes'] / 1e6:.2f} MB")
    serving = data["serving"]
    mapped = (serving["stream_bytes"] + serving["sa_bytes"]) / 1e6
    click.echo(f"  serving     general store {mapped:.2f} MB in RAM to read ahead ({serving['stream_bytes'] / 1e6:.2f} "
               f"MB for --access stream); here auto: {serving['access']}")
    width = max(len(row["name"]) for row in data["stores"]) + 2
    click.echo(f"  {'store':<{width}} {'kind':<6} {'utterances':>10} {'tokens':>12} {'bytes':>12}")
    for row in data["stores"]:
        count = row.get("tokens", row.get("vectors"))
        click.echo(f"  {row['name']:<{width}} {row['kind']:<6} {row['utterances']:>10} {count:>12} {row['bytes']:>12}")
    if len(data["shards"]) > 1:
        click.echo(f"  general store in {len(data['shards'])} shards:")
        click.echo(f"  {'shard':>7} {'utterances':>10} {'tokens':>12} {'bytes':>12}  {'sha256':<16} directory")
        for row in data["shards"]:
            click.echo(f"  {row['shard']:>7} {row['utterances']:>10} {row['tokens']:>12} {row['bytes']:>12}  "
                       f"{row['sha256'][:16]} {row['directory']}")
    if verify:
        click.echo("  checksums   all files verified"
                   + (f" (every shard's too: {len(data['shards'])})" if len(data["shards"]) > 1 else ""))


HELP = """type token ids (spaces or commas) to see the proposal for that context;
  :speaker NAME   propose with NAME's store     :speaker     general only
  :open STORE     switch datastore              :speakers    list speakers
  :nodes N        node budget                   :depth N     depth budget
  :help           this text                     :quit        leave (or Ctrl-D)"""


@click.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--context", help="One-shot: propose for these ids (e.g. '12 7 7 301') and exit.")
@click.option("--speaker", help="Use this speaker's store too.")
@click.option("--max-nodes", default=MAX_NODES, show_default=True, type=click.IntRange(min=1),
              help="Most nodes of a proposed tree.")
@click.option("--max-depth", default=MAX_DEPTH, show_default=True, type=click.IntRange(min=1),
              help="Deepest path of a proposed tree, in tokens.")
@click.option("--raw-ids", is_flag=True, help="Ids are the model's (minus the store's speech offset).")
@click.option("--no-faiss", is_flag=True, help="Exact stores and prompt lookup only.")
@click.option("--no-prompt", is_flag=True, help="No prompt lookup on the context itself.")
@click.option("--json", "as_json", is_flag=True, help="Print the tree as JSON.")
@fail_cleanly
def query(store, context, speaker, max_nodes, max_depth, raw_ids, no_faiss, no_prompt, as_json):
    """Propose candidate trees from STORE: interactively, or once with --context."""
    session = _QuerySession(store, speaker, max_nodes, max_depth, raw_ids, not no_faiss, not no_prompt)
    if context is not None:
        try:
            ids = session.parse(context)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--context") from None
        _show(session, ids, as_json, fail=True)
        return
    _enable_history()
    click.echo(f"{session.describe()}\n{HELP}")
    while True:
        try:
            line = input("echospec> ").strip()
        except (EOFError, KeyboardInterrupt):
            click.echo()
            return
        if not line:
            continue
        if line.startswith(":"):
            if session.command(line) is False:
                return
            continue
        try:
            ids = session.parse(line)
        except ValueError as e:
            click.echo(f"error: {e}")
            continue
        _show(session, ids, as_json, fail=False)


def _show(session: _QuerySession, ids: np.ndarray, as_json: bool, fail: bool) -> None:
    try:
        tree, seconds = session.propose(ids)
    except ValueError as e:
        if fail:
            raise click.ClickException(str(e)) from None
        click.echo(f"error: {e}")
        return
    _, repeat = session.propose(ids)  # the first call also pulls the store's pages into memory
    if as_json:
        click.echo(json.dumps({"speaker": session.speaker, "context_length": len(ids),
                               "latency_us": round(seconds * 1e6, 1), "repeat_latency_us": round(repeat * 1e6, 1),
                               "tree": tree.to_dict()}))
        return
    click.echo(tree.draw())
    click.echo(f"-- {len(tree)} nodes, depth {tree.max_depth}, {seconds * 1e6:.0f} us "
               f"({repeat * 1e6:.0f} us repeated){', speaker ' + session.speaker if session.speaker else ''}")


class _QuerySession:
    """What the query prompt remembers between lines: the datastore, speaker and budgets."""

    def __init__(self, store, speaker, max_nodes, max_depth, raw_ids, use_faiss, prompt_lookup):
        self.max_nodes, self.max_depth, self.raw_ids = max_nodes, max_depth, raw_ids
        self.options = {"use_faiss": use_faiss, "prompt_lookup": prompt_lookup}
        self.open(store)
        self.speaker = None
        if speaker is not None:
            self.use_speaker(speaker)

    def open(self, store) -> None:
        from ...retriever import Retriever
        self.retriever = Retriever(open_datastore(store), **self.options)  # its kernels loaded before timing
        self.store = store

    def use_speaker(self, speaker: str | None) -> None:
        if speaker is not None and speaker not in self.retriever.speakers:
            raise DatastoreError(f"unknown speaker {speaker!r}; this store has: "
                                 f"{', '.join(self.retriever.speakers) or 'no speaker stores'}")
        self.speaker = speaker

    def describe(self) -> str:
        ds = self.retriever.datastore
        return (f"{self.store}: {ds.info()['tokens']} tokens, vocabulary 0..{ds.vocab_size - 1}, "
                f"{len(ds.speakers)} speakers, FAISS {'on' if self.retriever.faiss else 'off'}")

    def parse(self, text: str) -> np.ndarray:
        parts = text.replace(",", " ").replace("[", " ").replace("]", " ").split()
        if not parts:
            raise ValueError("no token ids given")
        try:
            ids = np.array([int(p) for p in parts], np.int64)
        except ValueError:
            bad = next(p for p in parts if not p.lstrip("-").isdigit())
            raise ValueError(f"{bad!r} is not an integer token id") from None
        return ids - self.retriever.datastore.speech_offset if self.raw_ids else ids

    def propose(self, ids: np.ndarray):
        started = time.perf_counter()
        tree = self.retriever.propose(ids, speaker=self.speaker, max_nodes=self.max_nodes,
                                      max_depth=self.max_depth)
        return tree, time.perf_counter() - started

    def command(self, line: str) -> bool | None:
        """Run one `:command`; False means quit."""
        name, *args = shlex.split(line[1:]) or [""]
        try:
            if name in ("quit", "q", "exit"):
                return False
            if name == "speaker":
                self.use_speaker(args[0] if args else None)
                click.echo(f"speaker: {self.speaker or '(general only)'}")
            elif name == "speakers":
                click.echo(" ".join(self.retriever.speakers) or "(no speaker stores)")
            elif name == "open" and args:
                self.open(Path(args[0]))
                self.speaker = None
                click.echo(self.describe())
            elif name in ("nodes", "depth") and args and args[0].isdigit() and int(args[0]) > 0:
                setattr(self, "max_nodes" if name == "nodes" else "max_depth", int(args[0]))
                click.echo(f"{name}: {args[0]}")
            else:
                click.echo(HELP)
        except DatastoreError as e:
            click.echo(f"error: {e}")
        return None


def _enable_history() -> None:
    """Line editing and history for the prompt when a terminal is attached, kept across sessions in
    ~/.echospec_history (readline is not on every platform; without it the prompt still works)."""
    if not sys.stdin.isatty():
        return
    try:
        import readline
    except ImportError:
        return
    path = Path.home() / ".echospec_history"
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)
    atexit.register(_save_history, readline, path)


def _save_history(readline, path: Path) -> None:
    try:
        readline.write_history_file(path)
    except OSError:
        pass


COMMANDS = (build, enroll, info, query)

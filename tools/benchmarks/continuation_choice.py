"""Which occurrences a proposal reads its continuations from, and what it costs in acceptance.

A proposal whose matched suffix occurs more than `cap` times reads `cap` of them. Today (kernels.gather_store) it
takes the block of the suffix array around the longer suffix: the occurrences whose further-left context is closest
to this one's, from `cap` scattered places of the stream (about half of a cold proposal's stream misses; its binary
searches make the rest, docs/scaling.md). Continuations stored beside the sampled index would spare those reads but
give occurrences spread evenly
over the matched range instead; a mix reads `near` occurrences around the longer suffix from the stream and the rest
from the spread. This measures each mix by oracle tokens per step on held-out utterances (the general store only: no
prompt rows, one shard), with the gather replayed in Python from the proposal's own steps (retriever/replay.py), so `--near` at the cap (32)
must equal what `Retriever.propose` gives with the prompt lookup off.

    python -m echospec.tools.benchmarks.continuation_choice --store bench/b200/store-phased-1 --held bench/b200/held.npz
"""

from __future__ import annotations

import click
import numpy as np

from ...datastore import open_datastore
from ...retriever import Retriever, replay
from ...retriever.tree import CandidateTree
from .bench_shards import oracle

def propose(general: replay.GeneralStore, ctx: np.ndarray, near: int) -> CandidateTree | None:
    """The general store's tree for `ctx`, its `cap` rows the `near` occurrences around the longer suffix (as
    gather_store takes all of them) and the rest spread evenly over the matched range."""
    match = general.match(ctx)
    d = match.length
    if d < general.n_min:
        return None
    lo, hi, count = match.los[0, d], match.his[0, d], match.occurrences
    m = min(count, general.cap)
    k = min(near, m)
    start = min(max(lo, ((match.los[0, d + 1] + match.his[0, d + 1]) >> 1) - k // 2), hi - k)
    spread = lo + ((np.arange(m - k) + 0.5) * count / max(m - k, 1)).astype(np.int64)
    entries = np.concatenate([np.arange(start, start + k), spread])
    return general.tree(general.continuations(entries), match)


class Chosen:
    """A retriever whose general-store rows are chosen with `near` occurrences around the longer suffix (for
    bench_shards.oracle)."""

    def __init__(self, r: Retriever, near: int):
        self.general, self.near = replay.GeneralStore(r), near

    def propose(self, context) -> CandidateTree:
        return propose(self.general, np.asarray(context, np.int64), self.near) or CandidateTree.empty()


def held_out(path) -> list[np.ndarray]:
    with np.load(path) as data:
        tokens, lengths = data["tokens"].astype(np.int64), data["lengths"]
    return np.split(tokens, np.cumsum(lengths)[:-1])


@click.command()
@click.option("--store", type=click.Path(exists=True, file_okay=False), required=True,
              help="a one-shard datastore (bench_shards --keep: OUT/store-phased-1)")
@click.option("--held", type=click.Path(exists=True, dir_okay=False), required=True,
              help=".npz of held-out utterances (tokens, lengths)")
@click.option("--near", default="32,16,8,4,0", show_default=True,
              help="occurrences read around the longer suffix, the rest of the cap spread evenly (cap: today's gather)")
def main(store, held, near):
    """Oracle tokens per step against how many of the cap continuations come from around the longer suffix."""
    r = Retriever(open_datastore(store), prompt_lookup=False, use_faiss=False)
    if len(r.datastore.shards) != 1:
        raise click.BadParameter("needs a one-shard store", param_hint="--store")
    utterances = held_out(held)
    for k in (int(x) for x in near.split(",")):
        result = oracle(Chosen(r, k), utterances)
        click.echo(f"{k} near, {max(r.cap - k, 0)} spread: {result['tokens_per_step']:.4f} tokens/step "
                   f"[{result['ci95'][0]:.3f}, {result['ci95'][1]:.3f}]")


if __name__ == "__main__":
    main()

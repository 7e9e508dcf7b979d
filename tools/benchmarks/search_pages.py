"""Which stream pages a proposal reads, and what its search would spare with bounds searched together or with an
in-memory table of the frequent n-grams.

A proposal from a cold cache misses pages of the stream in two places: its binary searches (kernels.narrow: each
probe reads the token `depth` places left of a suffix-array entry's position, somewhere in the stream) and its
continuations (the rows gather_store takes). This replays the general store's search from the proposal's own steps,
checking every range it finds against kernels.match, and counts the distinct stream pages a proposal touches:

  today      the sampled index, then a lower- and an upper-bound binary search per depth (what narrow does)
  together   the same, the upper bound's search starting from what the lower bound's probes saw
  heavy T    the ranges of the reversed n-grams (2..n_max tokens) occurring at least T times in a shard held in
             memory (start, end, token: 10 B each); a range not there is searched as today within its parent's
             range (so this is an upper bound on what such a table leaves)

with the continuations' pages beside them, and each table's size against the store's stream and suffix array.
The table is simulated, not built: a prototype that binary-searched its rows in memory made warm matches slower
at 16 shards than the interleaved probes it spares (docs/scaling.md).

    python -m echospec.tools.benchmarks.search_pages --store bench/pages/store --held bench/pages/held.npz
"""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from ...datastore import open_datastore
from ...retriever import Retriever, replay
from .bench_pages import contexts

PAGE = 4096


def heavy_ranges(tokens: np.ndarray, sa: np.ndarray, n_max: int, threshold: int) -> list[set[tuple[int, int]]]:
    """ranges[t]: the sa ranges [start, end) of the reversed t-grams occurring at least `threshold` times (t >= 2)."""
    positions = sa.astype(np.int64)
    change = np.zeros(len(sa), bool)
    change[:1] = True
    ranges: list[set[tuple[int, int]]] = [set(), set()]
    for t in range(1, n_max + 1):
        left = tokens[np.maximum(positions - (t - 1), 0)]
        change[1:] |= left[1:] != left[:-1]
        if t >= 2:
            starts = np.flatnonzero(change)
            ends = np.append(starts[1:], len(sa))
            keep = ends - starts >= threshold
            ranges.append(set(zip(starts[keep].tolist(), ends[keep].tolist())))
    return ranges


class Shard:
    """One shard's stream and suffix array, and narrow's search over them, recording the stream pages it probes."""

    def __init__(self, general: replay.GeneralStore, s: int):
        self.tokens, self.sa = general.stream(s), general.suffix_array(s)
        self.general, self.s = general, s
        self.per_page = PAGE // self.tokens.itemsize

    def key(self, m: int, depth: int, pages: set) -> int:
        position = int(self.sa[m]) - depth
        pages.add((self.s, position // self.per_page))
        return int(self.tokens[position])

    def bounds(self, lo: int, hi: int, depth: int, c: int, pages: set, together: bool) -> tuple[int, int]:
        """narrow's range of the entries in [lo, hi) whose token `depth` places left is c."""
        a, b = self.general.narrowed(self.s, lo, hi, depth, c, False)
        upper_lo, upper_hi = lo, hi  # where the lower bound's probes put the upper bound
        while a < b:
            m = (a + b) >> 1
            v = self.key(m, depth, pages)
            if v < c:
                a = m + 1
            else:
                b = m
            if v <= c:
                upper_lo = max(upper_lo, m + 1)
            else:
                upper_hi = min(upper_hi, m)
        low = a
        if not together:
            upper_lo, upper_hi = low, hi
        a, b = self.general.narrowed(self.s, max(upper_lo, low), upper_hi, depth, c, True)
        while a < b:
            m = (a + b) >> 1
            if self.key(m, depth, pages) <= c:
                a = m + 1
            else:
                b = m
        return low, a


def searched_depths(counts: np.ndarray, limit: int, n_min: int, min_support: int) -> list[int]:
    """The depths kernels.match narrowed at (after the first-token table), from the counts it returned: it stops
    where the count falls below min_support after a depth that had it, at no occurrence, or at the limit."""
    depths, t = [], 1
    while t < limit and counts[1] > 0:
        depths.append(t)
        if (counts[t + 1] < min_support and t >= n_min and counts[t] >= min_support) or counts[t + 1] == 0:
            break
        t += 1
    return depths


def measure(r: Retriever, ctxs: list[np.ndarray], thresholds: tuple[int, ...]) -> dict:
    """Mean distinct stream pages a proposal's search touches (per variant) and its continuations touch."""
    general = replay.GeneralStore(r)
    n_max = general.n_max
    shards = [Shard(general, s) for s in range(general.shards)]
    heavy = {t: [heavy_ranges(sh.tokens, sh.sa, n_max, t) for sh in shards] for t in thresholds}
    variants = ["today", "together", *(f"heavy {t}" for t in thresholds)]
    searched, both = dict.fromkeys(variants, 0), dict.fromkeys(variants, 0)
    continued = 0
    for ctx in ctxs:
        match = general.match(ctx)
        los, his, d = match.los, match.his, match.length
        depths = searched_depths(match.counts, min(n_max, len(ctx)), general.n_min, general.min_support)
        read: set = set()  # the continuations' pages
        takes = general.shares(match)
        for sh, take in zip(shards, takes):
            centre = (los[sh.s, d + 1] + his[sh.s, d + 1]) >> 1
            start = min(max(los[sh.s, d], centre - take // 2), his[sh.s, d] - take)
            for p in sh.sa[start:start + take].astype(np.int64):
                read.update({(sh.s, (p + 1) // sh.per_page), (sh.s, (p + r.max_depth) // sh.per_page)})
        continued += len(read)
        for variant in variants:
            pages: set = set()
            for sh in shards:
                table = heavy[int(variant.split()[1])][sh.s] if variant.startswith("heavy") else None
                for t in ([] if general.has_first_table(sh.s) else [0]) + depths:
                    found = (int(los[sh.s, t + 1]), int(his[sh.s, t + 1]))
                    if table is not None and t + 1 < len(table) and found in table[t + 1]:
                        continue
                    got = sh.bounds(int(los[sh.s, t]), int(his[sh.s, t]), t, int(ctx[len(ctx) - 1 - t]), pages,
                                    variant == "together")
                    assert got == found, (variant, sh.s, t, got, found)  # the replay is narrow's own search
            searched[variant] += len(pages)
            both[variant] += len(pages | read)
    store_bytes = sum(sh.tokens.nbytes + sh.sa.nbytes for sh in shards)
    n = len(ctxs)
    return {"proposals": n, "continuation_pages": continued / n,
            "search_pages": {v: searched[v] / n for v in variants}, "pages": {v: both[v] / n for v in variants},
            "table_share": {t: 10 * sum(len(x) for h in heavy[t] for x in h) / store_bytes for t in thresholds}}


@click.command()
@click.option("--store", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--held", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="held-out utterances (.npz: tokens, lengths), as bench_pages and bench_shards --keep write them")
@click.option("--proposals", type=click.IntRange(min=10), default=3000, show_default=True)
@click.option("--heavy", default="32,64", show_default=True, help="the tables' thresholds, comma-separated")
def main(store, held, proposals, heavy):
    """Stream pages a proposal's search and continuations touch; what bounds searched together or an in-memory
    table of the frequent n-grams would spare."""
    try:
        thresholds = tuple(int(t) for t in heavy.split(",") if t.strip())
    except ValueError:
        raise click.BadParameter("give whole numbers, e.g. 32,64", param_hint="--heavy") from None
    r = Retriever(open_datastore(store, access="readahead"), use_faiss=False, prompt_lookup=False)
    result = measure(r, contexts(held, proposals), thresholds)
    lines = [f"Stream pages a proposal touches ({result['proposals']} proposals; the continuations alone: "
             f"{result['continuation_pages']:.2f})", "",
             "| search | its pages | with the continuations' | table, share of the store |", "|---|---|---|---|"]
    for variant, pages in result["search_pages"].items():
        share = result["table_share"].get(int(variant.split()[1])) if variant.startswith("heavy") else None
        lines.append(f"| {variant} | {pages:.2f} | {result['pages'][variant]:.2f} | "
                     f"{'' if share is None else f'{share:.2%}'} |")
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()

"""Retriever: context -> CandidateTree in microseconds.

Sources, in order: prompt lookup (the request's own prompt speech and output so far), the speaker's
exact store, the general exact store, and the FAISS store when no exact store matched even the last
token. Each exact source takes the longest context suffix with at least `min_support` occurrences;
when it has more than `cap`, it takes the `cap` whose further-left context is nearest (a contiguous
block of the suffix array, which also reads memory in order). Every gathered continuation is one row
worth its source's weight times the source's match length. A node's probability is the weight of
the rows through it over the total (counts turned into probabilities, as SuffixDecoding does); the
merged trie keeps the `max_nodes` most probable nodes up to `max_depth`.

With interleaved codebooks (a store built with `codebooks` > 1, as Orpheus' 7-token SNAC frames), every
row is cut at its first id outside the codebook due at its place, and FAISS neighbours are taken among
contexts ending in the context's own codebook, so no source proposes an id impossible at its position.

Defaults, chosen by oracle acceptance (tokens per step = accepted + 1) on 60 held-out utterances of a
1M-token speech-like corpus, each replayed behind a 6 s same-speaker prompt; every figure changes one
setting from the defaults, which score 2.635 (`python -m echospec.tools.benchmarks.retriever_defaults`):
  min_support 32   1 (longest match only, as SuffixDecoding): 2.456; 8: 2.599; 16: 2.632;
                   64: 2.628 — speech tokens are noisy, so a longer context seen once predicts
                   worse than a shorter one seen often.
  cap 32           16: 2.541; 64 and 128: 2.648 — +0.5% for twice the rows and trie; 32 keeps
                   propose near 30 us on a 10M-token store. (Sampling evenly over the whole range
                   instead of the nearest block needed cap 128 for the same score.)
  pooled rows      weighing each source to equal mass instead scored 2.53 in an earlier sweep: a
                   source with 3 occurrences should not outvote one with 32.
  weights 1,1,1,.5 speaker x2: 2.604; general x2: 2.627; general store only: 2.554.
  n_min 1          2: 1.907; 3: 1.549 — a one-token match still beats proposing nothing.
  n_max 8          4: 2.628; 6, 12, 16: 2.635-2.636 — longer suffixes seldom have the support.
  prompt_n_min 2   1: 2.636; 3: 2.633; no prompt lookup: 2.632.
  faiss_below 1    2: 2.643; 3: 2.641; no FAISS: 2.635. Consulting FAISS whenever fewer than 2
                   tokens match gains 0.3% but calls it on >10% of steps at ~45 us each (IVF
                   search), so by default it answers only contexts whose last token no exact
                   store has seen — the contexts exact matching cannot serve at all.
  max_depth 8      6: 2.622; 12: 2.630.
Indicative only: one synthetic corpus; the benchmark (echospec.tools.benchmarks.bench_retriever) compares peers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ..datastore import DamagedStoreError, Datastore, ExactStore, open_datastore
from . import kernels
from .tree import MAX_DEPTH, MAX_NODES, CandidateTree

DEFAULT_WEIGHTS = (1.0, 1.0, 1.0, 0.5)
"""Source weights (prompt, speaker, general, faiss) per gathered continuation, times match length.
FAISS neighbours only approximately share the context, so they count half."""


class Retriever:
    """Proposes candidate trees from a datastore. Deterministic; thread-safe (calls share nothing
    mutable, and the kernels release the GIL).

    max_nodes, max_depth  default budget of a proposal (tree.MAX_NODES, tree.MAX_DEPTH)
    prompt_lookup         also match the context against itself
    use_faiss             consult the FAISS store when exact stores matched fewer than
                          `faiss_below` tokens (1: only when they matched nothing)
    cap                   most occurrences taken per exact source (those nearest in left context)
    min_support           back off to a shorter suffix until it has this many occurrences
    weights               source weights (prompt, speaker, general, faiss)
    """

    def __init__(self, store: str | Path | Datastore, max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH,
                 prompt_lookup: bool = True, use_faiss: bool = True, cap: int = 32, min_support: int = 32,
                 n_min: int | None = None, n_max: int | None = None, prompt_n_min: int = 2,
                 prompt_window: int = 4096, faiss_below: int = 1, faiss_k: int = 16,
                 weights: tuple[float, float, float, float] = DEFAULT_WEIGHTS):
        self.datastore = store if isinstance(store, Datastore) else open_datastore(store)
        ds = self.datastore
        self.max_nodes, self.max_depth = int(max_nodes), int(max_depth)
        self.n_min = ds.n_min if n_min is None else int(n_min)
        self.n_max = ds.n_max if n_max is None else min(int(n_max), ds.sort_depth)
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}")
        if self.max_nodes < 0 or self.max_depth < 1:
            raise ValueError("max_nodes must be >= 0 and max_depth >= 1")
        self.prompt_lookup = bool(prompt_lookup)
        self.faiss = ds.faiss_store() if use_faiss else None
        self.cap, self.min_support = int(cap), int(min_support)
        self.prompt_n_min, self.prompt_window = int(prompt_n_min), int(prompt_window)
        self.faiss_below, self.faiss_k = int(faiss_below), int(faiss_k)
        self.weights = np.asarray(weights, np.float64)
        if self.weights.shape != (4,) or np.any(self.weights < 0):
            raise ValueError("weights must be 4 non-negative numbers (prompt, speaker, general, faiss)")
        self.vocab_size, self.codebooks = ds.vocab_size, ds.codebooks
        self._width = ds.vocab_size // ds.codebooks  # ids per codebook
        self._general = kernel_store(ds.shards)  # ds (self.datastore) keeps the shards mapped
        self._speaker_stores: dict[str, tuple] = {}
        shards = ds.shards  # named in errors: the one shard's directory, or the one holding them all
        self._general_dir = shards[0].directory if len(shards) == 1 else shards[0].directory.parent
        # the settings every proposal passes to the kernels, fixed here: changing an attribute later has no effect
        self._settings = kernels.gather_settings(
            use_prompt=self.prompt_lookup, n_min=self.n_min, n_max=self.n_max, prompt_n_min=self.prompt_n_min,
            min_support=self.min_support, cap=self.cap, prompt_window=self.prompt_window,
            extra_rows=0 if self.faiss is None else self.faiss_k, vocab_size=self.vocab_size)
        self.propose(np.zeros(1, np.int64))  # JIT warm-up (numba's cache): the first request pays nothing

    @property
    def speakers(self) -> tuple[str, ...]:
        return self.datastore.speakers

    def propose(self, context, speaker: str | None = None, max_nodes: int | None = None,
                max_depth: int | None = None) -> CandidateTree:
        """Candidate continuations of `context`: 1-D ints, store-local ids (the request's prompt speech
        tokens followed by its output so far). Raises ValueError for ids outside the vocabulary or an
        unknown speaker, and DamagedStoreError (a DatastoreError) when the store it reads is corrupted.

        Worked example: if the store holds "5 6 7 8" twice and "5 6 9" once, the context [1, 5, 6] matches
        the suffix "5 6" three times (with `min_support` <= 3), so the rows gathered are [7, 8], [7, 8] and
        [9]; the tree is 7 -> 8 and 9, with probabilities 2/3, 2/3 and 1/3 (a node's share of the rows
        passing through it). With the prompt lookup on, earlier places in the context itself add rows too.
        """
        ctx = np.asarray(context, dtype=np.int64)
        if ctx.ndim != 1:
            raise ValueError(f"context must be 1-D, got shape {ctx.shape}")
        if not kernels.context_is_valid(ctx, self.vocab_size):
            raise ValueError(f"context ids must be in 0..{self.vocab_size - 1}")
        max_nodes = self.max_nodes if max_nodes is None else int(max_nodes)
        max_depth = self.max_depth if max_depth is None else int(max_depth)
        if len(ctx) == 0 or max_nodes <= 0 or max_depth <= 0:
            return CandidateTree.empty()
        speaker_store = self._general if speaker is None else self._speaker(speaker)
        faiss = self.faiss
        # positional: the two calls every proposal makes (numba dispatches keyword arguments slower)
        conts, stats = kernels.gather_exact(ctx, self._general, speaker_store, speaker is not None, max_depth,
                                            self._settings)
        # the stats record, read once: (FIRST_ROW, ROWS, MATCH, OCCURRENCES) per source; FAISS's first row is where
        # the exact rows end, or DAMAGED
        exact_rows = stats[kernels.FAISS, kernels.FIRST_ROW]
        if exact_rows == kernels.DAMAGED:
            speaker_damaged = stats[kernels.SPEAKER, kernels.ROWS] == kernels.DAMAGED
            raise self._damaged(self._speaker_stores[speaker][1].directory if speaker_damaged else self._general_dir,
                                "an entry of its suffix array, first-token table or token stream is out of range")
        exact_match = max(stats[kernels.SPEAKER, kernels.MATCH], stats[kernels.GENERAL, kernels.MATCH])
        faiss_rows = 0
        if faiss is not None and exact_match < self.faiss_below:
            # with interleaved codebooks only neighbours ending in the context's own codebook are taken (their
            # continuations start in the codebook due next): ask for codebooks x as many, so enough remain
            faiss_rows = kernels.gather_positions(store=self._general,
                                                  positions=faiss.search(ctx, self.faiss_k * self.codebooks),
                                                  vocab_size=self.vocab_size, width=self._width,
                                                  book=ctx[-1] // self._width, out=conts, row0=exact_rows)
            if faiss_rows == kernels.DAMAGED:
                raise self._damaged(f"{self.datastore.root / 'faiss'} or the general store",
                                    "a neighbour's id or its continuation is out of range")
            # a neighbour's match is one token, its support the rows found
            stats[kernels.FAISS, kernels.ROWS:] = (faiss_rows, 1, faiss_rows)
        if self.codebooks > 1:
            kernels.keep_layout(conts=conts, n_rows=exact_rows + faiss_rows, last=ctx[-1], width=self._width,
                                codebooks=self.codebooks)
        return CandidateTree.trusted(kernels.finish(conts, stats, self.weights, max_nodes))

    def _speaker(self, speaker: str) -> tuple:
        cached = self._speaker_stores.get(speaker)
        if cached is None:
            exact = self.datastore.speaker_store(speaker)
            if exact is None:
                raise ValueError(f"unknown speaker {speaker!r}")
            # the store itself stays beside its view: the view holds addresses of its mapped arrays
            cached = self._speaker_stores.setdefault(speaker, (kernel_store((exact,)), exact))
        return cached[0]

    def _damaged(self, where, what: str) -> DamagedStoreError:
        return DamagedStoreError(f"{where}: store is damaged ({what}); "
                                 f"run `echospec info --verify {self.datastore.root}`")


def kernel_store(shards: tuple[ExactStore, ...]) -> tuple:
    """The kernels' view of a store (see kernels.SHARD_TOKENS): a table of its shards' array addresses and
    lengths (and sampled indexes), and shard 0's arrays for their dtypes. The caller keeps `shards` alive
    while it uses the view."""
    table = np.zeros((len(shards), kernels.SHARD_COLUMNS), np.int64)
    for row, shard in zip(table, shards):
        columns = (kernels.SHARD_TOKENS, kernels.SHARD_SA, kernels.SHARD_FIRST)
        for column, a in zip(columns, (shard.tokens, shard.sa, shard.first)):
            row[column:column + 2] = a.ctypes.data if len(a) else 0, len(a)
        if len(getattr(shard, "index", ())):  # a store built before index.npy has none
            bits = int(shard.vocab_size).bit_length()
            words = -(-shard.index_depth // (64 // bits))
            row[kernels.SHARD_INDEX:] = (shard.index.ctypes.data, len(shard.index) // words, shard.index_step,
                                         shard.index_depth, bits, words)
    return table, shards[0].tokens, shards[0].sa, shards[0].first, getattr(shards[0], "index", _NO_INDEX)


_NO_INDEX = np.zeros(0, np.uint64)

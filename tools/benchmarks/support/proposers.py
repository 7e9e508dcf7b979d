"""The proposers bench_retriever compares, each timed on its own call: echospec's retriever, REST's algorithm
(rest_reference) and SuffixDecoding driven as vLLM's SuffixDecodingProposer drives it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import click
import numpy as np


@dataclass
class Proposer:
    """A proposer under test; `step` times only the proposer's own call."""

    name: str
    family: str
    nodes: int
    build: dict = field(default_factory=dict)

    def step(self, u: int, pos: int) -> tuple[int, int, np.ndarray, np.ndarray]:
        """(propose ns, per-request state update ns, tree tokens, tree parents) for held[u][:pos]."""
        raise NotImplementedError

    def finish(self) -> None:
        """Forget per-request state (between passes)."""


class RetrieverProposer(Proposer):
    """echospec's in-process `Retriever.propose`, timed alone (the vLLM drafter is retriever/engines/proposer.py's
    EchospecProposer)."""

    def __init__(self, name, retriever, held, speakers, nodes, build):
        super().__init__(name, "echospec", nodes, build)
        self.retriever, self.held, self.speakers = retriever, held, speakers

    def step(self, u, pos):
        context, speaker = self.held[u][:pos], None if self.speakers is None else self.speakers[u]
        t = time.perf_counter_ns()
        tree = self.retriever.propose(context, speaker=speaker, max_nodes=self.nodes)
        elapsed = time.perf_counter_ns() - t
        return elapsed, 0, tree.tokens, tree.parents


class RestProposer(Proposer):
    def __init__(self, name, rest, held, build):
        super().__init__(name, "REST (reference)", rest.max_nodes, build)
        self.rest, self.held = rest, held

    def step(self, u, pos):
        context = self.held[u][:pos]
        t = time.perf_counter_ns()
        tree = self.rest.propose(context)
        elapsed = time.perf_counter_ns() - t
        return elapsed, 0, tree.tokens, tree.parents


class SuffixProposer(Proposer):
    """One held-out utterance = one vLLM request: its new tokens go in with add_active_response (the
    per-step state update vLLM pays, timed separately), then speculate() on the last max_tree_depth tokens
    is the proposal."""

    def __init__(self, name, cache, held, options, build):
        super().__init__(name, "SuffixDecoding", options["max_spec_tokens"], build)
        self.cache, self.options = cache, options
        self.held = [h.astype(np.int32) for h in held]
        self.request, self.utterance, self.fed, self.serial = None, -1, 0, 0

    def step(self, u, pos):
        if u != self.utterance or pos < self.fed:
            self.finish()
            self.serial += 1
            self.request, self.utterance, self.fed = (self.name, self.serial), u, 0
            self.cache.start_request(self.request, np.zeros(0, np.int32))
        tokens = self.held[u]
        update = 0
        if pos > self.fed:
            t = time.perf_counter_ns()
            self.cache.add_active_response(self.request, tokens[self.fed : pos])
            update = time.perf_counter_ns() - t
            self.fed = pos
        pattern = tokens[max(0, pos - self.cache.max_tree_depth) : pos]
        t = time.perf_counter_ns()
        draft = self.cache.speculate(self.request, pattern, **self.options)
        elapsed = time.perf_counter_ns() - t
        return elapsed, update, np.asarray(draft.token_ids, np.int64), np.asarray(draft.parents, np.int64)

    def finish(self):
        # The held-out utterance must not stay in the global cache: echospec's store never sees it either.
        if self.request is not None:
            self.cache.stop_request(self.request)
            self.cache.evict_cached_response(self.request)
            self.request = None


def feed_suffix_cache(train: list[np.ndarray], max_tree_depth: int):
    """A SuffixDecoding cache holding every training utterance as a past request's response."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        raise click.ClickException("SuffixDecoding peer missing: pip install nanobind==2.9.2 cmake ninja && "
                                   "pip install --no-build-isolation arctic-inference==0.3.0")

    cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=-1)
    empty = np.zeros(0, np.int32)
    for i, tokens in enumerate(train):
        cache.start_request(("train", i), empty)
        cache.add_active_response(("train", i), tokens.astype(np.int32))
        cache.stop_request(("train", i))
    return cache

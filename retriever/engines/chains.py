"""Drafts for engines that verify a chain per request, not a tree (vLLM): each row's history becomes
the root path of echospec's tree most worth sending.

    drafter = ChainDrafter(Retriever("voices"), k=8)
    chains = drafter.propose([history_a, history_b])   # model ids, prompt then output; -> [[ids], []]

An engine verifies a draft token by token and keeps the longest accepted prefix. If a node's `probs`
is the chance that the path to it is what the model says next, a chain's expected accepted length is
the sum of its nodes' probs, and each draft token costs about `token_cost` of a decoding step to
verify (more on a CPU or a full batch, little on an idle GPU). So the chain sent is the root path
with the largest sum of (prob - token_cost): the tree's most promising branch, cut where the next
token no longer pays for its verification; an empty draft where nothing pays.

Engines say nothing about the request, so the speaker store is chosen from the prompt itself
(`speakers.SpeakerChoice`). The drafter's memory (passed in, see `memory`) may remember each request, with
how much of its drafts the engine accepted, so a request that accepts little is sent less; a prompt served
again (a TTS service hears the same sentence in the same voice often) is then also drafted from the earlier
output of that prompt (`Request.replay`): greedy, it says it again token for token. `NullMemory` (the
default) remembers nothing, so a row's chain depends on its history alone. Imports no torch and no engine.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Mapping, Sequence

import numpy as np

from ..client.remote import RemoteRetriever, RetrieverUnavailable
from ..kernels import best_chain
from ..retriever import Retriever
from .memory import NullMemory, Request, RequestMemory
from .speakers import SpeakerChoice, local_speech

log = logging.getLogger("echospec.drafts")

REQUEST_ROWS = 128  # contexts per service request, under `echospec serve`'s default --max-batch (256)
TOKEN_COST = 0.1
"""Default verification cost of one draft token, in decoding steps: chains keep nodes with p > 0.1. Replaying
the shipped sample model's greedy outputs (16 held-out prompts, general store, k = 8), costs 0.05 / 0.1 / 0.15
/ 0.25 gave 2.08 / 1.99 / 1.89 / 1.66 tokens per step for 1.56 / 0.93 / 0.81 / 0.54 draft tokens verified
per output token: 0.1 keeps most of the acceptance for 60% of the verified tokens."""
DRAFT_WEIGHTS = (5.0, 1.0, 1.0, 0.5)
"""Source weights (prompt, speaker, general, faiss) of the retriever that drafts chains: a model's greedy output
repeats itself more than the natural speech in a store, and a chain has one branch to spend. Replaying the shipped
sample model's greedy outputs (general store, k = 8), the request's own tokens weighted 1 / 3 / 5 / 10 gave
1.87 / 1.94 / 1.96 tokens per step on its 120 held-out prompts, and 2.11 / 2.17 / 2.20 / 2.21 on 60 prompts of
corpus texts, for 0.93 / 1.03 / 1.10 draft tokens per output token. The Hugging Face path's trees keep the
retriever's defaults (tuned on natural speech)."""


def replay_chain(rate: float, token_cost: float, most: int) -> tuple[int, float]:
    """How many tokens of a replay to send, and what they are worth: the t-th is accepted with chance rate ** t
    (each after the one before), and is sent while that pays for its verification."""
    length, chance, gain = 0, rate, 0.0
    while length < most and chance > token_cost:
        length, gain, chance = length + 1, gain + chance - token_cost, chance * rate
    return length, gain


class ChainDrafter:
    """One draft chain per row, from a `Retriever` or a `RemoteRetriever`.

    k            longest draft (the engine's num_speculative_tokens)
    token_cost   a draft token's verification cost in steps: chains keep nodes with prob > token_cost
    speaker      "auto" (choose from the prompt, see SpeakerChoice), None (the general store alone) or a
                 speaker's name (every row)
    speaker_tokens, min_speech   SpeakerChoice's
    step_timeout seconds a step may spend proposing; rows not served by then get no draft. None: no deadline,
                 every row is drafted every step, so its chain depends on its history alone and not on the
                 machine's load (what a relaxed rule's output needs to be reproducible; a slow store then slows
                 the step instead)
    context      most recent speech tokens given to the retriever
    speech_offset  model id of store-local id 0 (default: the store's, from its catalog)
    memory       what is kept of the requests between calls: NullMemory() (default, nothing) or RequestMemory()
    """

    def __init__(self, retriever, k: int = 8, token_cost: float = TOKEN_COST, speaker: str | None = "auto",
                 speaker_tokens: Mapping[str, Sequence[int]] | None = None, min_speech: int = 16,
                 step_timeout: float | None = 0.05, context: int = 4096, speech_offset: int | None = None,
                 max_nodes: int | None = None, memory: NullMemory | RequestMemory | None = None):
        if k < 1 or not 0 <= token_cost < 1 or (step_timeout is not None and step_timeout <= 0) or context < 1:
            raise ValueError("need k >= 1, 0 <= token_cost < 1, step_timeout > 0 (or None) and context >= 1")
        self.retriever, self.k, self.token_cost = retriever, int(k), float(token_cost)
        self.step_timeout = None if step_timeout is None else float(step_timeout)
        self.context, self.max_nodes = int(context), max_nodes
        vocabulary = store_vocabulary(retriever)
        self.offset = vocabulary["speech_offset"] if speech_offset is None else int(speech_offset)
        self.vocab_size = int(vocabulary["size"])
        self.remote = isinstance(retriever, RemoteRetriever)
        if speaker not in ("auto", None) and not self.remote and speaker not in retriever.speakers:
            raise ValueError(f"unknown speaker {speaker!r}; the store has {list(retriever.speakers)}")
        self.choose_speaker = lambda prompt: speaker
        if speaker == "auto":
            # scored on the stores alone: the prompt lookup and FAISS would add the same rows to every candidate
            scorer = retriever if self.remote else Retriever(retriever.datastore, prompt_lookup=False,
                                                             use_faiss=False, max_nodes=retriever.max_nodes)
            self.choose_speaker = SpeakerChoice(partial(self._propose_rows, retriever=scorer), self._speakers,
                                                self.offset, self.vocab_size, speaker_tokens, depth=self.k,
                                                min_speech=min_speech)
        self.memory = NullMemory() if memory is None else memory
        self._speaker_list: tuple[float, tuple[str, ...]] = (-np.inf, ())

    def propose(self, histories: Sequence[np.ndarray]) -> list[list[int]]:
        """A chain of model ids per history (1-D model ids: prompt, then output so far); [] for a row whose
        last token is not speech, whose tree is empty or worth nothing, or that the step's time ran out
        on. Raises RetrieverUnavailable when a service does not answer in time."""
        rows, contexts, requests = [], [], []
        for i, history in enumerate(histories):
            history = np.asarray(history, np.int64)
            if not len(history) or not 0 <= history[-1] - self.offset < self.vocab_size:
                continue
            request = self.request(history)
            request.observe(history)
            rows.append((i, history))
            contexts.append(local_speech(history[-self.context:], self.offset, self.vocab_size))
            requests.append(request)
        drafts: list[list[int]] = [[] for _ in histories]
        # the clock starts after the speaker choices: a new request's is made once, and must not starve its step
        deadline = None if self.step_timeout is None else time.perf_counter() + self.step_timeout
        trees = self._propose_rows(contexts, [r.speaker for r in requests], self.k, deadline)
        for (i, history), request, tree in zip(rows, requests, trees):
            chain = np.zeros(0, np.int64)
            if tree is not None and len(tree):
                chain = best_chain(tree.parents, tree.probs * request.scale, self.token_cost)
            replay = request.replay(history, self.k)
            length, replay_gain = replay_chain(request.replay_rate, self.token_cost, len(replay))
            if length and replay_gain > float((tree.probs[chain] * request.scale - self.token_cost).sum()
                                              if len(chain) else 0.0):
                drafts[i] = replay[:length].tolist()
                request.sent(history, drafts[i], None)
            elif len(chain):
                drafts[i] = (tree.tokens[chain] + self.offset).tolist()
                request.sent(history, drafts[i], float(tree.probs[chain].sum()))
        return drafts

    def request(self, history: np.ndarray) -> Request:
        """What the memory knows of the request `history` (model ids) belongs to."""
        return self.memory.find(history, self.choose_speaker)

    def _propose_rows(self, contexts, speakers, depth, deadline=None, retriever=None) -> list:
        """A tree per context, each from its own speaker's store; in-process, None for the contexts
        reached after `deadline` (perf_counter seconds; None: no limit)."""
        retriever = retriever or self.retriever
        if not contexts:
            return []
        if self.remote:  # in requests of at most REQUEST_ROWS contexts: a speaker choice asks for hundreds
            trees = []
            for start in range(0, len(contexts), REQUEST_ROWS):
                timeout = None if deadline is None else max(deadline - time.perf_counter(), 1e-3)
                trees += retriever.propose_batch(contexts[start:start + REQUEST_ROWS],
                                                 speakers[start:start + REQUEST_ROWS], self.max_nodes, depth,
                                                 timeout=timeout)
            return trees
        trees = []
        for context, speaker in zip(contexts, speakers):
            if deadline is not None and time.perf_counter() > deadline:
                return trees + [None] * (len(contexts) - len(trees))
            trees.append(retriever.propose(context, speaker, self.max_nodes, depth))
        return trees

    def _speakers(self) -> tuple[str, ...]:
        """The store's speakers, asked again at most every 30 s (a service may enroll new ones)."""
        asked, speakers = self._speaker_list
        if time.monotonic() - asked > 30:
            try:
                speakers = tuple(self.retriever.speakers)
            except RetrieverUnavailable:
                pass
            self._speaker_list = (time.monotonic(), speakers)
        return speakers


def store_vocabulary(retriever) -> dict:
    """The store's speech vocabulary (speech_offset, size, codebooks, ...), in-process or remote."""
    if isinstance(retriever, RemoteRetriever):
        return retriever.info()["vocabulary"]
    ds = retriever.datastore
    return {"speech_offset": ds.speech_offset, "size": ds.vocab_size, "codebooks": ds.codebooks}

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
(`SpeakerChoice`) and remembered per request (`RequestMemory`), with how much of its drafts the engine
accepted (`Request`), so a request that accepts little is sent less. A prompt served again (a TTS service
hears the same sentence in the same voice often) is also drafted from the earlier output of that prompt
(`Request.replay`): greedy, it says it again token for token. Imports no torch and no engine.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from functools import partial
from typing import Callable, Mapping, Sequence

import numpy as np
from numba import njit

from .remote import RemoteRetriever, RetrieverUnavailable
from .retriever import Retriever
from .tree import matched_path

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


@njit(cache=True, nogil=True)
def best_chain(parents, probs, token_cost):
    """Node indices of the root path maximising sum(probs - token_cost), stopping anywhere (empty when
    no node's prob exceeds token_cost). Nodes are in topological order; ties keep the earlier node
    (the retriever orders siblings by count)."""
    n = parents.shape[0]
    below = np.zeros(n)  # the best gain of going on below node i (0: stop at i)
    next_node = np.full(n, -1, np.int64)
    root_gain, first = 0.0, -1
    for i in range(n - 1, -1, -1):
        gain = probs[i] - token_cost + below[i]
        if gain <= 0.0:
            continue
        p = parents[i]
        if p < 0:
            if gain >= root_gain:
                root_gain, first = gain, i
        elif gain >= below[p]:
            below[p], next_node[p] = gain, i
    chain = np.empty(n, np.int64)
    length, node = 0, first
    while node >= 0:
        chain[length] = node
        length += 1
        node = next_node[node]
    return chain[:length]


def contains(history: np.ndarray, ids: np.ndarray) -> bool:
    """Whether `ids` occurs in `history` as a contiguous run."""
    m = len(ids)
    if m == 0 or m > len(history):
        return False
    if m == 1:
        return bool(np.any(history == ids[0]))
    starts = np.flatnonzero(history[: len(history) - m + 1] == ids[0])
    return any(np.array_equal(history[s:s + m], ids) for s in starts)


class SpeakerChoice:
    """Which speaker store a prompt asks for, or None for the general store alone.

    1. A speaker named in the prompt: `speaker_tokens` maps a speaker to the id run that names it (a
       speaker token, or the tokens of "tara:" in an Orpheus prompt); the first one found wins.
    2. A zero-shot prompt carries the reference speaker's speech: each store (a speaker's with the general
       one, as drafting would use it, and the general one alone) continues that speech from up to `cuts`
       places in it, and the one whose trees put the most probability on what really followed wins: the
       store that would have accepted most on the request's own reference. The general store wins ties; a
       prompt with under `min_speech` speech tokens keeps it. On the shipped sample's 120 held-out
       references this picks the right one of 10 speakers 113 times and the general store 7 times.
    """

    def __init__(self, propose_rows: Callable, speakers: Callable[[], Sequence[str]], speech_offset: int,
                 vocab_size: int, speaker_tokens: Mapping[str, Sequence[int]] | None = None, cuts: int = 64,
                 depth: int = 8, min_speech: int = 16):
        self._propose_rows, self._speakers = propose_rows, speakers
        self.offset, self.vocab_size = int(speech_offset), int(vocab_size)
        self.speaker_tokens = {name: np.asarray(ids, np.int64) for name, ids in (speaker_tokens or {}).items()}
        self.cuts, self.depth, self.min_speech = int(cuts), int(depth), int(min_speech)

    def __call__(self, prompt: np.ndarray) -> str | None:
        for name, ids in self.speaker_tokens.items():
            if contains(prompt, ids):
                return name
        speech = local_speech(prompt, self.offset, self.vocab_size)
        speakers = list(self._speakers())
        if len(speech) < max(self.min_speech, 2) or not speakers:
            return None
        cuts = np.unique(np.linspace(min(4, len(speech) - 1), len(speech) - 1, self.cuts).astype(np.int64))
        candidates = [None, *speakers]
        trees = self._propose_rows([speech[:c] for c in cuts] * len(candidates),
                                   [name for name in candidates for _ in cuts], self.depth)
        scores = [sum(path_probability(tree, speech[c:c + self.depth]) for tree, c in zip(trees[i:], cuts))
                  for i in range(0, len(trees), len(cuts))]
        best = int(np.argmax(scores))  # the first maximum: the general store (index 0) wins ties
        return candidates[best]


def path_probability(tree, sequence) -> float:
    """The summed probability of the tree's nodes along `sequence`: the accepted length the tree expects
    to win on it. 0 for a missing tree."""
    if tree is None:
        return 0.0
    return float(tree.probs[matched_path(tree.tokens, tree.parents, sequence)].sum())


class Request:
    """What the drafter knows of one prompt's requests: the speaker, how much of what they were sent was
    accepted, and the longest history served for the prompt so far.

    vLLM does not say what it accepted, but a row's next history does: the tokens that follow the history a
    chain was sent with are the accepted drafts, then the token the engine sampled. A tree chain's expected
    accepted length is the sum of its nodes' probs; `scale` is accepted over expected so far (from a prior
    of PRIOR tokens at 1:1), and the drafter multiplies the tree's probs by it. A request whose drafts are
    accepted less than the store expects (sampling from a flat distribution, say) is sent shorter chains,
    and none once no token pays; one accepted more is sent longer ones.

    A replayed chain (`replay`) is taken to be accepted token by token with chance `replay_rate`: accepted
    tokens over accepted tokens and rejections so far, from a prior of 9 to 1 (greedy repeats keep it near 1;
    sampled ones, which part ways with the earlier output, lower it)."""

    PRIOR = 4.0
    MOST_SCALE = 2.0
    SENT = 64  # chains awaiting their outcome per request (rows that share a prompt, rows that vanished)
    REPLAY_MATCH = 8  # last ids a history must share with the earlier output to be continued from it
    REPLAY_PRIOR = (9.0, 1.0)  # (accepted tokens, rejections) before any replay was verified

    def __init__(self, speaker: str | None):
        self.speaker = speaker
        self.expected = self.accepted = 0.0
        self.replay_accepted, self.replay_rejected = self.REPLAY_PRIOR
        self.longest = np.zeros(0, np.int32)  # the longest history seen for this prompt (model ids)
        self._sent: OrderedDict[tuple, tuple] = OrderedDict()  # (length, hash of history) -> (chain, expected)

    @property
    def scale(self) -> float:
        return min((self.accepted + self.PRIOR) / (self.expected + self.PRIOR), self.MOST_SCALE)

    @property
    def replay_rate(self) -> float:
        return self.replay_accepted / (self.replay_accepted + self.replay_rejected)

    def observe(self, history: np.ndarray) -> None:
        """Count what was accepted of a chain sent to an earlier history of this row, and keep the history if
        it is the prompt's longest yet."""
        for key in [key for key in self._sent if key[0] < len(history)]:
            length, digest = key
            if hash(history[:length].tobytes()) == digest:
                chain, expected = self._sent.pop(key)
                accepted = prefix_length(chain, history[length:])
                if expected is None:  # a replay
                    self.replay_accepted += accepted
                    self.replay_rejected += accepted < len(chain)
                else:
                    self.accepted += accepted
                    self.expected += expected
        if len(history) > len(self.longest):
            self.longest = history.astype(np.int32)

    def sent(self, history: np.ndarray, chain: list[int], expected: float | None) -> None:
        """Remember a chain sent to `history`: a tree's with its expected accepted length, a replay with None."""
        self._sent[len(history), hash(history.tobytes())] = (chain, expected)
        while len(self._sent) > self.SENT:
            self._sent.popitem(last=False)

    def replay(self, history: np.ndarray, k: int) -> np.ndarray:
        """Up to k ids that followed the history's last REPLAY_MATCH ids in the longest history served for this
        prompt, at the place nearest the history's own end (a greedy repeat is there; a sampled one may meet
        the earlier output again elsewhere). Empty where that history goes no further or shares no such run."""
        stored, n, m = self.longest, len(history), self.REPLAY_MATCH
        if len(stored) <= n or n < m:
            return stored[:0]
        tail = history[n - m:]
        if np.array_equal(stored[n - m:n], tail):
            return stored[n:n + k]
        ends = np.flatnonzero(stored[m - 1:-1] == tail[-1]) + m  # places whose last id agrees, then the whole run
        ends = ends[(stored[ends[:, None] - m + np.arange(m)] == tail).all(axis=1)]
        if not len(ends):
            return stored[:0]
        at = ends[np.argmin(np.abs(ends - n))]
        return stored[at:at + k]


def replay_chain(rate: float, token_cost: float, most: int) -> tuple[int, float]:
    """How many tokens of a replay to send, and what they are worth: the t-th is accepted with chance rate ** t
    (each after the one before), and is sent while that pays for its verification."""
    length, chance, gain = 0, rate, 0.0
    while length < most and chance > token_cost:
        length, gain, chance = length + 1, gain + chance - token_cost, chance * rate
    return length, gain


def prefix_length(draft: Sequence[int], truth: Sequence[int]) -> int:
    """How many of `draft`'s first tokens `truth` begins with."""
    n = 0
    while n < len(draft) and n < len(truth) and draft[n] == truth[n]:
        n += 1
    return n


class RequestMemory:
    """Each request's `Request`, found again at every later step.

    vLLM gives no request ids, only each row's tokens, and reorders rows as requests come and go. A
    request is first seen right after its prefill, when its history is the prompt plus one sampled token:
    its prompt is then history[:-1] (a request seen again after its entry was evicted takes its history
    so far), and `choose(prompt)` names its speaker. Entries are found by a hash of their first `HEAD`
    tokens, then checked on their whole prompt; the `capacity` most recently used are kept, so nothing grows
    with the requests served (each keeps its prompt's longest history: 4096 of 2,000 ids are 33 MB).
    Requests with the same prompt share an entry."""

    HEAD = 16

    def __init__(self, choose: Callable[[np.ndarray], str | None], capacity: int = 4096):
        self.choose, self.capacity = choose, int(capacity)
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()  # (length, hash) -> (Request, head)
        self._by_head: dict[tuple, set] = {}  # (head length, head hash) -> entry keys
        self._head_lengths: dict[int, int] = {}  # head length -> entries with it (almost always HEAD)

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, history: np.ndarray) -> Request:
        for head_len in self._head_lengths:
            if head_len >= len(history):
                continue
            for key in self._by_head.get((head_len, hash(history[:head_len].tobytes())), ()):
                length, digest = key
                if length < len(history) and hash(history[:length].tobytes()) == digest:
                    self._entries.move_to_end(key)
                    return self._entries[key][0]
        prompt = history[:max(len(history) - 1, 1)]
        request = Request(self.choose(prompt))
        self._remember(prompt, request)
        return request

    def _remember(self, prompt: np.ndarray, request: Request) -> None:
        head_len = min(self.HEAD, len(prompt))
        key, head = (len(prompt), hash(prompt.tobytes())), (head_len, hash(prompt[:head_len].tobytes()))
        if key not in self._entries:
            self._by_head.setdefault(head, set()).add(key)
            self._head_lengths[head_len] = self._head_lengths.get(head_len, 0) + 1
        self._entries[key] = (request, head)
        while len(self._entries) > self.capacity:
            old, (_, old_head) = self._entries.popitem(last=False)
            keys = self._by_head[old_head]
            keys.discard(old)
            if not keys:
                del self._by_head[old_head]
            self._head_lengths[old_head[0]] -= 1
            if not self._head_lengths[old_head[0]]:
                del self._head_lengths[old_head[0]]


def local_speech(history: np.ndarray, offset: int, vocab_size: int) -> np.ndarray:
    """The store-local ids of the speech tokens in `history` (model ids), other tokens dropped."""
    local = np.asarray(history, np.int64) - offset
    return local[(local >= 0) & (local < vocab_size)]


class ChainDrafter:
    """One draft chain per row, from a `Retriever` or a `RemoteRetriever`.

    k            longest draft (the engine's num_speculative_tokens)
    token_cost   a draft token's verification cost in steps: chains keep nodes with prob > token_cost
    speaker      "auto" (choose from the prompt, see SpeakerChoice), None (the general store alone) or a
                 speaker's name (every row)
    speaker_tokens, min_speech   SpeakerChoice's
    step_timeout seconds a step may spend proposing; rows not served by then get no draft
    context      most recent speech tokens given to the retriever
    speech_offset  model id of store-local id 0 (default: the store's, from its catalog)
    """

    def __init__(self, retriever, k: int = 8, token_cost: float = TOKEN_COST, speaker: str | None = "auto",
                 speaker_tokens: Mapping[str, Sequence[int]] | None = None, min_speech: int = 16,
                 step_timeout: float = 0.05, context: int = 4096, speech_offset: int | None = None,
                 max_nodes: int | None = None):
        if k < 1 or not 0 <= token_cost < 1 or step_timeout <= 0 or context < 1:
            raise ValueError("need k >= 1, 0 <= token_cost < 1, step_timeout > 0 and context >= 1")
        self.retriever, self.k, self.token_cost = retriever, int(k), float(token_cost)
        self.step_timeout, self.context, self.max_nodes = float(step_timeout), int(context), max_nodes
        vocabulary = store_vocabulary(retriever)
        self.offset = vocabulary["speech_offset"] if speech_offset is None else int(speech_offset)
        self.vocab_size = int(vocabulary["size"])
        self.remote = isinstance(retriever, RemoteRetriever)
        if speaker not in ("auto", None) and not self.remote and speaker not in retriever.speakers:
            raise ValueError(f"unknown speaker {speaker!r}; the store has {list(retriever.speakers)}")
        choose: Callable[[np.ndarray], str | None] = lambda prompt: speaker
        if speaker == "auto":
            # scored on the stores alone: the prompt lookup and FAISS would add the same rows to every candidate
            scorer = retriever if self.remote else Retriever(retriever.datastore, prompt_lookup=False,
                                                             use_faiss=False, max_nodes=retriever.max_nodes)
            choose = SpeakerChoice(partial(self._propose_rows, retriever=scorer), self._speakers, self.offset,
                                   self.vocab_size, speaker_tokens, depth=self.k, min_speech=min_speech)
        self.requests = RequestMemory(choose)
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
            request = self.requests.find(history)
            request.observe(history)
            rows.append((i, history))
            contexts.append(local_speech(history[-self.context:], self.offset, self.vocab_size))
            requests.append(request)
        drafts: list[list[int]] = [[] for _ in histories]
        # the clock starts after the speaker choices: a new request's is made once, and must not starve its step
        deadline = time.perf_counter() + self.step_timeout
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

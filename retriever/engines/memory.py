"""What a chain drafter remembers of the requests it drafts for, passed to `ChainDrafter` as an object:

    RequestMemory()   each request found again at every step (vLLM: `EchospecProposer` uses it): its speaker chosen
                      once, its chains scaled by how much of its drafts it accepted, earlier outputs of its prompt
                      replayed. What a row is sent then depends on what the engine served before.
    NullMemory()      nothing kept: every row is a new request, its speaker chosen from its history, its chains
                      unscaled and never replayed, so a row's draft depends on its history alone (tests,
                      reproducible runs).

Imports no torch and no engine.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

Choose = Callable[[np.ndarray], "str | None"]
"""A prompt's speaker store (SpeakerChoice, or a fixed name)"""


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
    so far), and `choose(prompt)` (what `find` is given) names its speaker. Entries are found by a hash of
    their first `HEAD` tokens, then checked on their whole prompt; the `capacity` most recently used are kept,
    so nothing grows with the requests served (each keeps its prompt's longest history: 4096 of 2,000 ids are
    33 MB).
    Requests with the same prompt share an entry."""

    HEAD = 16

    def __init__(self, capacity: int = 4096):
        self.capacity = int(capacity)
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()  # (length, hash) -> (Request, head)
        self._by_head: dict[tuple, set] = {}  # (head length, head hash) -> entry keys
        self._head_lengths: dict[int, int] = {}  # head length -> entries with it (almost always HEAD)

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, history: np.ndarray, choose: Choose) -> Request:
        """The request whose prompt begins `history`, or a new one with the speaker `choose` names."""
        for head_len in self._head_lengths:
            if head_len >= len(history):
                continue
            for key in self._by_head.get((head_len, hash(history[:head_len].tobytes())), ()):
                length, digest = key
                if length < len(history) and hash(history[:length].tobytes()) == digest:
                    self._entries.move_to_end(key)
                    return self._entries[key][0]
        prompt = request_prompt(history)
        request = Request(choose(prompt))
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


class NullMemory:
    """Remembers nothing: each `find` is a new request, its speaker chosen from the history's prompt as a first
    step's would be (every step, so "auto" costs a speaker choice a row a step)."""

    def __len__(self) -> int:
        return 0

    def find(self, history: np.ndarray, choose: Choose) -> Request:
        return Request(choose(request_prompt(history)))


def request_prompt(history: np.ndarray) -> np.ndarray:
    """A request's prompt as its first drafting step sees it: the history less the token sampled after prefill."""
    return history[:max(len(history) - 1, 1)]

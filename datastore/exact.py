"""The exact store: a token stream and a suffix array over it read right to left.

Files (in one directory):
  tokens.npy  uint16 (vocab < 65535) or uint32: every utterance segment, each preceded by a sentinel
              (the dtype's largest value) and the stream closed by one, so no match or continuation
              crosses a boundary: contexts never contain the sentinel and continuations stop at it.
  sa.npy      int32: the positions i that have a continuation (S[i] and S[i+1] are tokens), sorted by
              the reversed n-gram S[i], S[i-1], ..., S[i-depth+1]. Matching the context's suffix one
              more token to the left narrows a contiguous range of `sa`.
  first.npy   int64[vocab + 1]: sa range of each last token, so the first step is a table look-up.
That is 2 + 4 = 6 bytes per corpus token with a uint16 vocabulary (8 with uint32), plus 8 * vocab.

The sort is bounded to `depth` (= n_max): the reversed n-grams are packed into uint64 key words
(read sequentially from the stream) and sorted by a numba LSD radix sort that carries the keys, so
no pass reads at random (10M tokens at depth 8: ~1 s; argsort-based prefix doubling took ~6 s and a
radix sort gathering tokens through the permutation ~3 s).
Ties beyond the depth keep stream order (every pass is stable), so the layout and every answer are
deterministic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from numba import njit

from .errors import DatastoreError

FILES = ("tokens.npy", "sa.npy", "first.npy")
MAX_TOKENS = 2**31 - 2  # int32 suffix array


def stream_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < np.iinfo(np.uint16).max else np.dtype(np.uint32)


def concat_segments(segments: Sequence[np.ndarray], vocab_size: int) -> np.ndarray:
    """One stream: sentinel, segment, sentinel, segment, ..., sentinel."""
    dtype = stream_dtype(vocab_size)
    sentinel = np.iinfo(dtype).max
    total = sum(len(s) for s in segments) + len(segments) + 1
    if total > MAX_TOKENS:
        raise DatastoreError(f"a store holds at most {MAX_TOKENS} tokens; this one would hold {total}")
    stream = np.full(total, sentinel, dtype)
    at = 1
    for seg in segments:
        stream[at:at + len(seg)] = seg
        at += len(seg) + 1
    return stream


def suffix_array(stream: np.ndarray, vocab_size: int, depth: int) -> np.ndarray:
    """Positions with a continuation, sorted by their reversed n-gram to `depth` tokens."""
    sentinel = np.iinfo(stream.dtype).max
    positions = np.flatnonzero((stream[:-1] != sentinel) & (stream[1:] != sentinel)).astype(np.int32)
    keys = _packed_keys(stream, positions, vocab_size, depth)
    return _radix_sort(keys, positions)


@njit(cache=True)
def _packed_keys(stream, positions, vocab_size, depth):
    """uint64[words, n]: the tokens 0..depth-1 places left of each position, packed most significant
    first; the sentinel (and anything left of the stream) is `vocab_size`, after every token.
    Positions ascend, so building the keys reads the stream sequentially."""
    bits = 0
    while (1 << bits) <= vocab_size:
        bits += 1
    per_word = 64 // bits
    words = (depth + per_word - 1) // per_word
    n = positions.shape[0]
    sentinel = np.iinfo(stream.dtype).max
    keys = np.zeros((words, n), np.uint64)
    for i in range(n):
        p = positions[i]
        for d in range(depth):
            code = vocab_size if p - d < 0 or stream[p - d] == sentinel else stream[p - d]
            keys[d // per_word, i] |= np.uint64(code) << np.uint64(bits * (per_word - 1 - d % per_word))
    return keys


@njit(cache=True)
def _radix_sort(keys, positions):
    """Stable LSD radix sort of `positions` by the key words (word 0 most significant), 11 bits a
    pass, carrying the keys along so no pass reads memory at random. Passes whose digit is the same
    for every element are skipped."""
    words, n = keys.shape
    keys = keys.copy()
    order = positions.copy()
    spare_keys = np.empty_like(keys)
    spare_order = np.empty_like(order)
    counts = np.empty(2049, np.int64)
    for word in range(words - 1, -1, -1):
        for shift in range(0, 64, 11):
            counts[:] = 0
            for i in range(n):
                counts[((keys[word, i] >> shift) & 2047) + 1] += 1
            if counts.max() == n:
                continue
            for c in range(2048):
                counts[c + 1] += counts[c]
            for i in range(n):
                digit = (keys[word, i] >> shift) & 2047
                at = counts[digit]
                counts[digit] = at + 1
                spare_order[at] = order[i]
                for w in range(words):
                    spare_keys[w, at] = keys[w, i]
            keys, spare_keys = spare_keys, keys
            order, spare_order = spare_order, order
    return order


def first_index(stream: np.ndarray, sa: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.searchsorted(stream[sa], np.arange(vocab_size + 1), side="left").astype(np.int64)


def write_exact_store(directory: Path, segments: Sequence[np.ndarray], vocab_size: int, depth: int) -> dict:
    """Build the three files into `directory` (the caller fsyncs); returns token and segment counts."""
    stream = concat_segments(segments, vocab_size)
    sa = suffix_array(stream, vocab_size, depth)
    first = first_index(stream, sa, vocab_size)
    directory.mkdir(parents=True, exist_ok=True)
    for name, arr in zip(FILES, (stream, sa, first)):
        save_npy(directory / name, arr)
    return {"tokens": int(sum(len(s) for s in segments)), "segments": len(segments)}


def save_npy(path: Path, arr: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, arr, allow_pickle=False)


class ExactStore:
    """A memory-mapped exact store. Opening maps three files: the cost does not grow with the corpus."""

    __slots__ = ("directory", "tokens", "sa", "first", "vocab_size", "sentinel")

    def __init__(self, directory: str | Path, vocab_size: int):
        self.directory = Path(directory)
        try:
            self.tokens = np.load(self.directory / "tokens.npy", mmap_mode="r", allow_pickle=False)
            self.sa = np.load(self.directory / "sa.npy", mmap_mode="r", allow_pickle=False)
            self.first = np.load(self.directory / "first.npy", mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DatastoreError(f"{self.directory}: cannot map exact store: {e}") from None
        if self.first.shape != (vocab_size + 1,) or self.tokens.dtype != stream_dtype(vocab_size):
            raise DatastoreError(f"{self.directory}: exact store does not match the catalog's vocabulary")
        self.vocab_size = vocab_size
        self.sentinel = int(np.iinfo(self.tokens.dtype).max)

    def segments(self) -> list[np.ndarray]:
        """The stored segments (used to append to a speaker's store)."""
        stream = np.asarray(self.tokens)
        cuts = np.flatnonzero(stream == self.sentinel)
        return [stream[a + 1:b].astype(np.int64) for a, b in zip(cuts[:-1], cuts[1:]) if b > a + 1]

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

The sort is bounded to `depth` (>= n_max) by prefix doubling: pack as many tokens as fit into one
int64 key, then double the sorted depth with rank pairs. Ties beyond the depth keep stream order
(every sort is stable), so the layout and every answer are deterministic.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

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
    """Positions with a continuation, sorted by their reversed n-gram to at least `depth` tokens."""
    sentinel = np.iinfo(stream.dtype).max
    code = stream.astype(np.int64)
    code[stream == sentinel] = vocab_size  # keeps order: the sentinel sorts after every token
    bits = int(vocab_size).bit_length()
    per_word = max(1, 62 // bits)
    n = len(stream)
    key = np.zeros(n, np.int64)
    for j in range(per_word):  # key[i] = code[i], code[i-1], ... packed most significant first
        shifted = np.full(n, vocab_size, np.int64)
        shifted[j:] = code[: n - j] if j else code
        key = (key << bits) | shifted
    has_next = (stream[:-1] != sentinel) & (stream[1:] != sentinel)
    positions = np.flatnonzero(has_next).astype(np.int64)
    sorted_depth = per_word
    while sorted_depth < depth:
        _, rank = np.unique(key, return_inverse=True)
        rank = rank.astype(np.int64).ravel()
        n_ranks = int(rank.max()) + 1
        behind = np.zeros(n, np.int64)  # rank of the n-gram ending sorted_depth tokens further left
        behind[sorted_depth:] = rank[: n - sorted_depth]
        behind[:sorted_depth] = rank[0]  # position 0 is a sentinel: anything left of it is too
        key = rank * n_ranks + behind
        sorted_depth *= 2
    order = np.argsort(key[positions], kind="stable")
    return positions[order].astype(np.int32)


def first_index(stream: np.ndarray, sa: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.searchsorted(stream[sa], np.arange(vocab_size + 1), side="left").astype(np.int64)


def write_exact_store(directory: Path, segments: Sequence[np.ndarray], vocab_size: int, depth: int) -> dict:
    """Build the three files into `directory` (fsynced); returns token and utterance-segment counts."""
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
        f.flush()
        os.fsync(f.fileno())


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

"""The exact store: a token stream and a suffix array over it read right to left.

Files (in one directory):
  tokens.npy  uint16 (vocab < 65535) or uint32: every utterance segment, each preceded by a sentinel
              (the dtype's largest value) and the stream closed by one, so no match or continuation
              crosses a boundary: contexts never contain the sentinel and continuations stop at it.
  sa.npy      int32: the positions i that have a continuation (S[i] and S[i+1] are tokens), sorted by
              the reversed n-gram S[i], S[i-1], ..., S[i-depth+1]. Matching the context's suffix one
              more token to the left narrows a contiguous range of `sa`.
  first.npy   int64[vocab + 1]: sa range of each last token, so the first step is a table look-up;
              empty when the table would outweigh a quarter of sa (a small speaker's store), which
              then binary-searches that step too.
  index.npy   uint64: the sampled upper levels of sa: a header (step, depth, bits, words), then the packed
              sort key (as _packed_keys packs it) of every INDEX_STEP-th suffix. A search narrows its range
              to the INDEX_STEP entries between two samples before it reads sa or the stream, so a look-up
              reads about one page of sa per step instead of log2(range / 1024) scattered ones. 1-1.3% of
              the store; a store without it (built before it existed) is searched as before.
That is 2 + 4 = 6 bytes per corpus token with a uint16 vocabulary (8 with uint32), plus at most 1.

The sort is bounded to `depth` (= n_max): the reversed n-grams are packed into uint64 key words
(read sequentially from the stream) and sorted in numba: one counting pass by the last token, then a
radix sort inside each (cache-resident) bucket. argsort-based prefix doubling took ~6x as long.
Ties beyond the depth keep stream order (every pass is stable), so the layout and every answer are
deterministic.
"""

from __future__ import annotations

import itertools
import mmap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from numba import njit

from .errors import DamagedStoreError, DatastoreError, one_line

FILES = ("tokens.npy", "sa.npy", "first.npy", "index.npy")
MAX_TOKENS = 2**31 - 2  # int32 suffix array
INDEX_STEP = 256
"""Suffixes between two samples of index.npy: its keys (16-24 B each) cost 1-1.3% of the store's 6-8 B per
token, and the entries between two samples (1 KB of sa) are about one page."""
INDEX_HEADER = 4


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
    bits = int(vocab_size).bit_length()
    keys = _packed_keys(stream, positions, vocab_size, depth)
    return _radix_sort(keys, positions, bits, 64 // bits)


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
def _radix_sort(keys, positions, bits, per_word):
    """Stable sort of `positions` by the key words (word 0 most significant; its top `bits` hold the
    token at depth 0). One counting-sort pass over the whole array buckets by that token (its high 16
    bits for vocabularies over 65536); each bucket
    (about n / vocab entries, cache-resident) is then finished on its own — insertion sort when tiny,
    an LSD radix sort over 8-bit digits otherwise. Only the first pass streams through memory, which
    made the whole sort ~3x faster than LSD passes over the full array."""
    words, n = keys.shape
    top_bits = min(bits, 16)  # bucket by the token's high bits when the vocabulary is huge
    top_shift = bits * per_word - top_bits
    n_top = 1 << top_bits
    starts = np.zeros(n_top + 1, np.int64)
    for i in range(n):
        starts[(keys[0, i] >> top_shift) + 1] += 1
    for b in range(n_top):
        starts[b + 1] += starts[b]
    fill = starts[:-1].copy()
    out_keys = np.empty_like(keys)
    order = np.empty_like(positions)
    for i in range(n):
        b = keys[0, i] >> top_shift
        at = fill[b]
        fill[b] = at + 1
        order[at] = positions[i]
        for w in range(words):
            out_keys[w, at] = keys[w, i]
    spare_keys = keys  # our own scratch from _packed_keys
    spare_order = np.empty_like(order)
    counts = np.empty(257, np.int64)
    for b in range(n_top):
        lo = starts[b]
        hi = starts[b + 1]
        if hi - lo <= 24:
            _insertion_sort(out_keys, order, lo, hi)
        else:
            _lsd_sort(out_keys, order, spare_keys, spare_order, lo, hi, counts)
    return order


@njit(cache=True)
def _key_less(keys, a, b):
    for w in range(keys.shape[0]):
        if keys[w, a] != keys[w, b]:
            return keys[w, a] < keys[w, b]
    return False


@njit(cache=True)
def _insertion_sort(keys, order, lo, hi):
    words = keys.shape[0]
    held = np.empty(words, keys.dtype)
    for i in range(lo + 1, hi):
        j = i
        while j > lo and _key_less(keys, i, j - 1):
            j -= 1
        if j == i:
            continue
        for w in range(words):
            held[w] = keys[w, i]
        held_order = order[i]
        for k in range(i, j, -1):
            order[k] = order[k - 1]
            for w in range(words):
                keys[w, k] = keys[w, k - 1]
        order[j] = held_order
        for w in range(words):
            keys[w, j] = held[w]


@njit(cache=True)
def _lsd_sort(keys, order, spare_keys, spare_order, lo, hi, counts):
    """Stable LSD radix sort of keys[:, lo:hi] (with order) over 8-bit digits, carrying the keys so
    no pass reads at random; digits equal across the range are skipped. Leaves the result in place."""
    words = keys.shape[0]
    src_keys, src_order, dst_keys, dst_order = keys, order, spare_keys, spare_order
    n = hi - lo
    for word in range(words - 1, -1, -1):
        for shift in range(0, 64, 8):
            counts[:] = 0
            for i in range(lo, hi):
                counts[((src_keys[word, i] >> shift) & 255) + 1] += 1
            if counts.max() == n:
                continue
            counts[0] = lo
            for c in range(256):
                counts[c + 1] += counts[c]
            for i in range(lo, hi):
                digit = (src_keys[word, i] >> shift) & 255
                at = counts[digit]
                counts[digit] = at + 1
                dst_order[at] = src_order[i]
                for w in range(words):
                    dst_keys[w, at] = src_keys[w, i]
            src_keys, dst_keys = dst_keys, src_keys
            src_order, dst_order = dst_order, src_order
    if src_order is not order:
        for i in range(lo, hi):
            order[i] = src_order[i]
            for w in range(words):
                keys[w, i] = src_keys[w, i]


def first_index(stream: np.ndarray, sa: np.ndarray, vocab_size: int) -> np.ndarray:
    if 8 * (vocab_size + 1) > len(sa):
        return np.zeros(0, np.int64)
    return np.searchsorted(stream[sa], np.arange(vocab_size + 1), side="left").astype(np.int64)


def sampled_index(stream: np.ndarray, sa: np.ndarray, vocab_size: int, depth: int) -> np.ndarray:
    """index.npy: (step, depth, bits, words), then the sort key of sa[0], sa[step], sa[2 step], ... row by row."""
    bits = int(vocab_size).bit_length()
    keys = _packed_keys(stream, np.ascontiguousarray(sa[::INDEX_STEP]), vocab_size, depth)
    header = np.array([INDEX_STEP, depth, bits, keys.shape[0]], np.uint64)
    return np.concatenate([header, keys.T.ravel()])


def index_keys(index: np.ndarray, sa_length: int, vocab_size: int) -> tuple[np.ndarray, int, int] | None:
    """index.npy's keys (rows x words, flat), its step and depth, if its header fits the store; else None."""
    if index.dtype != np.uint64 or index.ndim != 1 or len(index) < INDEX_HEADER:
        return None
    step, depth, bits, words = (int(v) for v in index[:INDEX_HEADER])
    rows = -(-sa_length // step) if step > 0 else -1
    if (step < 1 or bits != int(vocab_size).bit_length() or not 1 <= depth <= 64
            or words != -(-depth // (64 // bits)) or len(index) != INDEX_HEADER + rows * words):
        return None
    return index[INDEX_HEADER:], step, depth


def write_exact_store(directory: Path, segments: Sequence[np.ndarray], vocab_size: int, depth: int) -> dict:
    """Build the store's files into `directory` (the caller fsyncs); returns token and segment counts."""
    stream = concat_segments(segments, vocab_size)
    sa = suffix_array(stream, vocab_size, depth)
    first = first_index(stream, sa, vocab_size)
    index = sampled_index(stream, sa, vocab_size, depth)
    directory.mkdir(parents=True, exist_ok=True)
    for name, arr in zip(FILES, (stream, sa, first, index)):
        save_npy(directory / name, arr)
    return {"tokens": int(sum(len(s) for s in segments)), "segments": len(segments)}


def load_npy(path: Path, mmap: bool = False) -> np.ndarray:
    """A stored array (memory-mapped with `mmap`), or DamagedStoreError in one line: numpy's header
    parser answers a damaged header with any of half a dozen exception types, some over several lines."""
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except Exception as e:
        raise DamagedStoreError(f"{path}: unreadable array, damaged or not a .npy file ({one_line(e)})") from None
    if not isinstance(arr, np.ndarray):  # np.load opens anything with a zip header as an archive
        raise DamagedStoreError(f"{path}: unreadable array (not a .npy file)")
    return np.asarray(arr)


def save_npy(path: Path, arr: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, arr, allow_pickle=False)


class ExactStore:
    """A memory-mapped exact store. Opening maps its files: the cost does not grow with the corpus.

    The stream and the suffix array are advised MADV_RANDOM: a look-up reads a few scattered pages, and the
    kernel's read-around (8 MB a fault on a disk set up as this one is) would read and map whole stretches
    of the store on every miss, so a replica without RAM for the store would read it all from disk (3,000
    cold proposals on a 20M-token store mapped 100% of it with the default advice, 60% with this one)."""

    __slots__ = ("directory", "first", "index", "index_depth", "index_step", "sa", "sentinel", "tokens",
                 "vocab_size")

    def __init__(self, directory: str | Path, vocab_size: int):
        self.directory = Path(directory)
        # plain ndarray views of the maps: numba dispatches them ~3 us faster than np.memmap
        self.tokens, self.sa, self.first = (load_npy(self.directory / name, mmap=True) for name in FILES[:3])
        self.index, self.index_step, self.index_depth = np.zeros(0, np.uint64), 0, 0
        if (self.directory / FILES[3]).exists():
            found = index_keys(load_npy(self.directory / FILES[3], mmap=True), len(self.sa), vocab_size)
            if found is None:
                raise DamagedStoreError(f"{self.directory}: exact store is damaged (index.npy does not fit its "
                                        f"suffix array); run `echospec info --verify`")
            self.index, self.index_step, self.index_depth = found
        for arr in (self.tokens, self.sa):
            _advise_random(arr)
        if self.first.shape not in ((vocab_size + 1,), (0,)) or self.tokens.dtype != stream_dtype(vocab_size):
            raise DatastoreError(f"{self.directory}: exact store does not match the catalog's vocabulary")
        # What a header can get wrong that the kernels cannot survive (their entries they check per read).
        if (self.tokens.ndim != 1 or self.sa.ndim != 1 or self.sa.dtype != np.int32 or self.first.dtype != np.int64
                or len(self.sa) >= len(self.tokens)):
            raise DamagedStoreError(f"{self.directory}: exact store is damaged (array shapes or types are wrong); "
                                    f"run `echospec info --verify`")
        self.vocab_size = vocab_size
        self.sentinel = int(np.iinfo(self.tokens.dtype).max)

    def segments(self) -> list[np.ndarray]:
        """The stored segments (used to append to a speaker's store); DamagedStoreError if a stored id is
        outside the vocabulary (it would corrupt the sort of the store they go into)."""
        stream = load_npy(self.directory / FILES[0])  # read whole, not page by page through the random-advised map
        cuts = np.flatnonzero(stream == self.sentinel)
        segments = [stream[a + 1:b].astype(np.int64) for a, b in itertools.pairwise(cuts) if b > a + 1]
        if any(s.max() >= self.vocab_size for s in segments):
            raise DamagedStoreError(f"{self.directory}: exact store is damaged (a stored id is outside the "
                                    f"vocabulary); run `echospec info --verify`")
        return segments


def _advise_random(arr: np.ndarray) -> None:
    """madvise(MADV_RANDOM) on the memory map under `arr`, where the platform has it."""
    mapped = getattr(arr.base, "_mmap", None)
    if mapped is not None and hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)

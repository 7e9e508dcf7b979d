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
(several tokens a word, by the vocabulary's bit width, packed sliding along the stream) and sorted in
numba (_suffix_sort): counting passes bucket the positions by their last token, then each bucket is
radix-sorted by its first key word and only runs of equal words are sorted by the next one.
argsort-based prefix doubling took ~6x as long as the bucketed radix sort, which took 3-4x this.
Ties beyond the depth keep stream order (every pass is stable), so the layout and every answer are
deterministic.
"""

from __future__ import annotations

import itertools
import mmap
import sys
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
    tokens = np.concatenate(segments) if len(segments) else np.zeros(0, np.int64)
    return join_segments(tokens, np.array([len(s) for s in segments], np.int64), vocab_size)


def join_segments(tokens: np.ndarray, lengths: np.ndarray, vocab_size: int) -> np.ndarray:
    """concat_segments of the segments `tokens` holds one after another, `lengths` tokens each."""
    dtype = stream_dtype(vocab_size)
    total = len(tokens) + len(lengths) + 1
    if total > MAX_TOKENS:
        raise DatastoreError(f"a store holds at most {MAX_TOKENS} tokens; this one would hold {total}")
    stream = np.full(total, np.iinfo(dtype).max, dtype)
    is_token = np.ones(total, bool)
    is_token[0] = False
    is_token[np.cumsum(np.asarray(lengths, np.int64) + 1)] = False
    stream[is_token] = tokens
    return stream


def suffix_array(stream: np.ndarray, vocab_size: int, depth: int) -> np.ndarray:
    """Positions with a continuation, sorted by their reversed n-gram to `depth` tokens."""
    return _suffix_sort(stream, vocab_size, depth)


@njit(cache=True)
def _bit_length(value):
    bits = 0
    while (1 << bits) <= value:
        bits += 1
    return bits


@njit(cache=True)
def _packed_keys(stream, positions, vocab_size, depth):
    """uint64[words, n]: the tokens 0..depth-1 places left of each position, packed most significant
    first; the sentinel (and anything left of the stream) is `vocab_size`, after every token.
    Positions ascend, so building the keys reads the stream sequentially."""
    bits = _bit_length(vocab_size)
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
def _suffix_sort(stream, vocab_size, depth):
    """sa: every position p with a continuation, sorted stably (ties beyond the depth in stream order) by
    its packed key words (as _packed_keys packs them). The positions are bucketed by the token at p (its
    high 16 bits for vocabularies over 65536) in two counting passes of at most 8 bits, carrying key words
    0 and 1 (packed by sliding along the stream): one pass into a few thousand buckets thrashes the cache,
    and two cost a third. Each bucket is then sorted by word 0 and only its runs of equal words by the
    next word (_sort_bucket): after four tokens three suffixes in four are told apart.
    Memory: the stream, sa (4 B a token), words 0 and 1 (16 B) and scratch for the largest bucket."""
    bits = _bit_length(vocab_size)
    per_word = 64 // bits
    words = (depth + per_word - 1) // per_word
    masks = np.empty(words, np.uint64)
    for w in range(words):
        empty_slots = per_word - min(per_word, depth - w * per_word)
        masks[w] = ~((np.uint64(1) << np.uint64(bits * empty_slots)) - np.uint64(1))
    top_bits = min(bits, 16)
    high_bits = min(top_bits, 8)
    sa, keys0, keys1, starts = _scatter_by_token(stream, vocab_size, bits, per_word, masks, high_bits)
    low_bits = top_bits - high_bits
    largest = 0
    for b in range(starts.shape[0] - 1):
        largest = max(largest, starts[b + 1] - starts[b])
    spare = (np.empty(largest, np.int32), np.empty(largest, np.uint64), np.empty(largest, np.uint64))
    scratch = (np.empty(largest, np.int32), np.empty(largest, np.uint64), np.empty(largest, np.int32),
               np.empty(largest, np.bool_), np.empty(largest, np.int32), np.empty((8, 257), np.int64))
    shift = np.uint64(bits * per_word - top_bits)
    for b in range(starts.shape[0] - 1):
        lo, hi = starts[b], starts[b + 1]
        inner = _split_by_bits(sa[lo:hi], keys0[lo:hi], keys1[lo:hi], shift, low_bits, spare)
        for c in range(inner.shape[0] - 1):
            a, z = lo + inner[c], lo + inner[c + 1]
            if z - a > 1:
                _sort_bucket(stream, vocab_size, depth, bits, per_word, sa[a:z], keys0[a:z], keys1[a:z], scratch)
    return sa


@njit(cache=True)
def _scatter_by_token(stream, vocab_size, bits, per_word, masks, high_bits):
    """The positions with a continuation, bucketed stably by the high `high_bits` bits of their token, with
    key words 0 and 1 (1 only when the key has two words); returns (sa, keys0, keys1, bucket starts)."""
    sentinel = np.iinfo(stream.dtype).max
    n_buckets = 1 << high_bits
    down = bits - high_bits
    starts = np.zeros(n_buckets + 1, np.int64)
    for p in range(stream.shape[0] - 1):
        if stream[p] != sentinel and stream[p + 1] != sentinel:
            starts[(stream[p] >> down) + 1] += 1
    for b in range(n_buckets):
        starts[b + 1] += starts[b]
    n = starts[n_buckets]
    sa = np.empty(n, np.int32)
    keys0 = np.empty(n, np.uint64)
    keys1 = np.empty(n if masks.shape[0] > 1 else 0, np.uint64)
    fill = starts[:-1].copy()
    ubits, top, stop = np.uint64(bits), np.uint64(bits * (per_word - 1)), np.uint64(vocab_size)
    outside = _outside_word(vocab_size, bits, per_word)
    recent = np.full(per_word, outside)  # the words of the last per_word positions: word 1 is one of them
    word, slot = outside, 0
    for p in range(stream.shape[0] - 1):
        code = stop if stream[p] == sentinel else np.uint64(stream[p])
        earlier = recent[slot]  # the word at p - per_word
        word = (word >> ubits) | (code << top)  # stream[p], stream[p - 1], ... packed
        recent[slot] = word
        slot = slot + 1 if slot + 1 < per_word else 0
        if stream[p] != sentinel and stream[p + 1] != sentinel:
            b = stream[p] >> down
            at = fill[b]
            fill[b] = at + 1
            sa[at] = p
            keys0[at] = word & masks[0]
            if keys1.shape[0]:
                keys1[at] = earlier & masks[1]
    return sa, keys0, keys1, starts


@njit(cache=True)
def _split_by_bits(sa, keys0, keys1, shift, n_bits, spare):
    """A stable counting sort of one bucket by the n_bits bits of keys0 above `shift`; returns the starts of
    its sub-buckets (one sub-bucket when n_bits is 0)."""
    n = sa.shape[0]
    starts = np.zeros((1 << n_bits) + 1, np.int64)
    if n_bits == 0:
        starts[1] = n
        return starts
    mask = np.uint64((1 << n_bits) - 1)
    for i in range(n):
        starts[((keys0[i] >> shift) & mask) + 1] += 1
    for c in range(1 << n_bits):
        starts[c + 1] += starts[c]
    fill = starts[:-1].copy()
    spare_sa, spare_keys0, spare_keys1 = spare[0][:n], spare[1][:n], spare[2][:n]
    for i in range(n):
        c = (keys0[i] >> shift) & mask
        at = fill[c]
        fill[c] = at + 1
        spare_sa[at] = sa[i]
        spare_keys0[at] = keys0[i]
        if keys1.shape[0]:
            spare_keys1[at] = keys1[i]
    sa[:] = spare_sa
    keys0[:] = spare_keys0
    if keys1.shape[0]:
        keys1[:] = spare_keys1
    return starts


@njit(cache=True)
def _outside_word(vocab_size, bits, per_word):
    """A key word made of positions left of the stream: every slot vocab_size."""
    word = np.uint64(0)
    for _ in range(per_word):
        word = (word >> np.uint64(bits)) | (np.uint64(vocab_size) << np.uint64(bits * (per_word - 1)))
    return word


@njit(cache=True)
def _key_word(stream, vocab_size, depth, bits, per_word, p, w):
    """Word w of position p's key, as _packed_keys packs it."""
    sentinel = np.iinfo(stream.dtype).max
    word = np.uint64(0)
    for d in range(w * per_word, min(depth, (w + 1) * per_word)):
        code = vocab_size if p - d < 0 or stream[p - d] == sentinel else stream[p - d]
        word |= np.uint64(code) << np.uint64(bits * (per_word - 1 - d % per_word))
    return word


@njit(cache=True)
def _sort_bucket(stream, vocab_size, depth, bits, per_word, sa, keys0, keys1, scratch):
    """sa sorted stably by key word 0 (keys0), then each run of entries equal in words 0..w-1 by word w,
    for w = 1, 2, ... while runs remain: word 1 from keys1, later ones packed from the stream. The sort
    carries each entry's slot in the bucket, through which its position and word 1 are found."""
    slots, spare_keys, spare_slots, tied, held, counts = scratch
    n = sa.shape[0]
    for i in range(n):
        slots[i] = i
    _sort_range(keys0, slots[:n], spare_keys, spare_slots, counts)
    any_tied = False
    tied[0] = False
    for i in range(1, n):
        tied[i] = keys0[i] == keys0[i - 1]
        any_tied |= tied[i]
    w = 1
    while any_tied and w * per_word < depth:
        any_tied = False
        i = 1
        while i < n:
            if not tied[i]:
                i += 1
                continue
            a, b = i - 1, i + 1
            while b < n and tied[b]:
                b += 1
            for k in range(a, b):
                keys0[k] = keys1[slots[k]] if w == 1 else _key_word(stream, vocab_size, depth, bits, per_word,
                                                                    sa[slots[k]], w)
            _sort_range(keys0[a:b], slots[a:b], spare_keys, spare_slots, counts)
            for k in range(a + 1, b):
                tied[k] = keys0[k] == keys0[k - 1]
                any_tied |= tied[k]
            i = b
        w += 1
    for i in range(n):
        held[i] = sa[slots[i]]
    sa[:] = held[:n]


@njit(cache=True)
def _sort_range(keys, order, spare_keys, spare_order, counts):
    """Stable sort of keys (with order) in place: insertion sort when short, else an LSD radix sort over
    8-bit digits that skips the digits equal across the range (one pass counts all eight)."""
    n = keys.shape[0]
    if n <= 16:
        _insertion_sort(keys, order)
        return
    counts[:, :] = 0
    for i in range(n):
        key = keys[i]
        for digit in range(8):
            counts[digit, ((key >> np.uint64(8 * digit)) & np.uint64(255)) + 1] += 1
    src_keys, src_order, dst_keys, dst_order = keys, order, spare_keys[:n], spare_order[:n]
    moved = False
    for digit in range(8):
        row = counts[digit]
        if row.max() == n:
            continue
        for c in range(256):
            row[c + 1] += row[c]
        shift = np.uint64(8 * digit)
        for i in range(n):
            bucket = (src_keys[i] >> shift) & np.uint64(255)
            at = row[bucket]
            row[bucket] = at + 1
            dst_keys[at] = src_keys[i]
            dst_order[at] = src_order[i]
        src_keys, dst_keys = dst_keys, src_keys
        src_order, dst_order = dst_order, src_order
        moved = not moved
    if moved:
        keys[:] = src_keys
        order[:] = src_order


@njit(cache=True)
def _insertion_sort(keys, order):
    for i in range(1, keys.shape[0]):
        key, held = keys[i], order[i]
        j = i
        while j > 0 and key < keys[j - 1]:
            keys[j] = keys[j - 1]
            order[j] = order[j - 1]
            j -= 1
        keys[j] = key
        order[j] = held


def first_index(stream: np.ndarray, sa: np.ndarray, vocab_size: int) -> np.ndarray:
    """first.npy: where each token's range of sa starts (and len(sa) last), counted along the stream."""
    if 8 * (vocab_size + 1) > len(sa):
        return np.zeros(0, np.int64)
    return _first_index(stream, vocab_size)


@njit(cache=True)
def _first_index(stream, vocab_size):
    sentinel = np.iinfo(stream.dtype).max
    first = np.zeros(vocab_size + 1, np.int64)
    for p in range(stream.shape[0] - 1):
        if stream[p] != sentinel and stream[p + 1] != sentinel:
            first[stream[p] + 1] += 1
    for t in range(vocab_size):
        first[t + 1] += first[t]
    return first


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
    return write_exact_stream(directory, concat_segments(segments, vocab_size), vocab_size, depth)


def write_exact_stream(directory: Path, stream: np.ndarray, vocab_size: int, depth: int) -> dict:
    """write_exact_store of a stream that concat_segments or join_segments made."""
    sa = suffix_array(stream, vocab_size, depth)
    first = first_index(stream, sa, vocab_size)
    index = sampled_index(stream, sa, vocab_size, depth)
    directory.mkdir(parents=True, exist_ok=True)
    for name, arr in zip(FILES, (stream, sa, first, index)):
        save_npy(directory / name, arr)
    segments = int(np.count_nonzero(stream == np.iinfo(stream.dtype).max)) - 1
    return {"tokens": len(stream) - segments - 1, "segments": segments}


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
    """A memory-mapped exact store. Opening maps its files: the cost does not grow with the corpus, except
    with `access="stream"`, which reads the stream into memory.

    `access` (see store.choose_access): "random" advises the stream and the suffix array MADV_RANDOM, so a
    look-up's misses read the few scattered pages it touches rather than the kernel's read-around of each (8
    MB a fault on a disk set up as this one is), which would read and map whole stretches of a store that
    does not fit in RAM (3,000 cold proposals on a 20M-token store mapped 100% of it with the default advice,
    46% with this one and the index); "stream" reads the stream in and advises only the suffix array random;
    "readahead" leaves both to the read-around, for a store that fits."""

    __slots__ = ("directory", "first", "index", "index_depth", "index_step", "sa", "sentinel", "tokens",
                 "vocab_size")

    def __init__(self, directory: str | Path, vocab_size: int, access: str = "random"):
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
        if access in ("random", "stream"):
            _advise(self.sa, "MADV_RANDOM")
        if access == "random":
            _advise(self.tokens, "MADV_RANDOM")
        elif access == "stream":
            _read_in(self.tokens)
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


MADV_POPULATE_READ = 22 if sys.platform.startswith("linux") else None
"""Linux's (5.14+) advice that reads a map's pages in and maps them, before returning; Python's mmap module
does not name it."""


def _advise(arr: np.ndarray, advice: str) -> bool:
    """madvise(mmap.<advice>) on the memory map under `arr`; False where the platform or kernel lacks it."""
    mapped = getattr(arr.base, "_mmap", None)
    option = MADV_POPULATE_READ if advice == "MADV_POPULATE_READ" else getattr(mmap, advice, None)
    if mapped is None or not hasattr(mapped, "madvise") or option is None or not len(arr):
        return False
    try:
        mapped.madvise(option)
    except OSError:  # EINVAL: a kernel before 5.14 has no MADV_POPULATE_READ
        return False
    return True


def _read_in(arr: np.ndarray) -> None:
    """Read the file under `arr`'s map into memory and map it: at once where the kernel can, else in the
    background (MADV_WILLNEED)."""
    if not _advise(arr, "MADV_POPULATE_READ"):
        _advise(arr, "MADV_WILLNEED")

"""The FAISS store: nearest stored contexts by vector similarity, for contexts with no exact match.

Speech tokens are ambiguous (neighbouring ids sound alike), so an exact suffix match often fails
where an approximate one would do. A context's vector is its last `window` tokens' embeddings,
each reduced to `dim` dimensions, scaled by a recency decay, concatenated and L2-normalised; the
store indexes the vectors of (a deterministic, evenly strided sample of) stream positions that have
a continuation (at most 200k), with the positions as ids (`shard << 32 | position`), so a search returns
positions whose continuations the retriever reads from the general exact store's shards.

Embeddings: a user table (.npy, or .safetensors — e.g. the TTS model's input embeddings or the
codec codebook; rows either cover the local vocabulary or the model's ids from speech_offset) is
reduced by PCA. Without one, the build derives a table from the corpus: a seeded random projection
of each token's co-occurrence profile (tokens used in similar contexts get similar vectors), which
costs a few bincounts and is deterministic.

Index by size: exact IndexFlatL2 up to `flat_max` (8192) vectors, else IVF with 8-bit scalar
quantisation (nlist = 2 sqrt(n) within 64..1024, 10 k-means iterations on 16 points a list, nprobe 8)
— 64 B + 8 B id per vector at the default 64 dimensions. Measured on 200k random 64-d vectors
(one thread): flat 1.6 ms a search; IVF1024-SQ8 33 us a search, built in 0.9 s; HNSW32 88 us and
72 s to build — so flat only while it stays under ~100 us, IVF above.

Files: faiss/index.faiss, faiss/embeddings.npy (the reduced table, float32[vocab, dim]).
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import faiss
import numpy as np
from numba import njit

from .errors import DamagedStoreError, DatastoreError, one_line
from .exact import ExactStore, load_npy, save_npy

DIM = 16
CONTEXT_WINDOW = 4
CONTEXT_DECAY = 0.75
MAX_VECTORS = 200_000
FLAT_MAX = 8_192
NPROBE = 8
SEED = 1234
SAMPLE_TOKENS = 4_000_000  # of the corpus, for the derived embeddings


def load_embeddings(path: str | Path, vocab_size: int, speech_offset: int = 0) -> np.ndarray:
    """A float32[vocab_size, d] table of the local speech ids from a .npy or .safetensors file."""
    path = Path(path)
    if not path.is_file():
        raise DatastoreError(f"{path}: embedding file not found")
    table = _read_safetensors(path) if path.suffix == ".safetensors" else _read_npy(path)
    if table.ndim != 2 or not np.issubdtype(table.dtype, np.floating):
        raise DatastoreError(f"{path}: embeddings must be a 2-D float table, got {table.dtype} {table.shape}")
    if len(table) == vocab_size:
        pass
    elif len(table) >= speech_offset + vocab_size:
        table = table[speech_offset:speech_offset + vocab_size]
    else:
        raise DatastoreError(f"{path}: {len(table)} rows cannot cover {vocab_size} speech ids "
                             f"(from id {speech_offset})")
    table = np.asarray(table, np.float32)
    if not np.all(np.isfinite(table)):
        raise DatastoreError(f"{path}: embeddings contain NaN or infinity")
    return table


def _read_npy(path: Path) -> np.ndarray:
    try:
        return load_npy(path)
    except DatastoreError as e:
        raise DatastoreError(f"cannot read embeddings: {e}") from None


_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _read_safetensors(path: Path) -> np.ndarray:
    """The largest 2-D float tensor of a .safetensors file (bf16 included: numpy has no bf16,
    so it is widened by hand; no torch needed). Sizes and offsets are checked against the file's
    length before anything is read: a damaged header must not make it allocate more than the file holds."""
    file_size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than its 8-byte header length")
            (size,) = struct.unpack("<Q", head)
            if size > file_size - 8:
                raise ValueError(f"the header declares {size} bytes, the file holds {file_size}")
            header = json.loads(f.read(size))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            candidates = [entry for key, value in header.items() if key != "__metadata__"
                          and (entry := _float_matrix(value, file_size - 8 - size)) is not None]
            if not candidates:
                raise DatastoreError(f"{path}: no 2-D float tensor in the file")
            shape, dtype, begin, end = max(candidates, key=lambda entry: entry[0][0] * entry[0][1])
            f.seek(8 + size + begin)
            raw = np.frombuffer(f.read(end - begin), dtype)
    except (OSError, ValueError, struct.error) as e:
        raise DatastoreError(f"{path}: not a readable .safetensors file ({one_line(e)})") from None
    if dtype == np.uint16:  # BF16
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.reshape(shape)


def _float_matrix(entry, data_bytes: int):
    """(shape, dtype, begin, end) of a header entry describing a 2-D float tensor that lies inside the
    file's `data_bytes` and fills its offsets exactly; None for any other entry. ValueError if malformed."""
    if not isinstance(entry, dict):
        raise ValueError("a tensor entry is not a JSON object")
    shape, dtype, offsets = entry.get("shape"), _SAFETENSORS_DTYPES.get(entry.get("dtype")), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)):
        raise ValueError("a tensor entry lacks an integer shape or data_offsets")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise ValueError(f"a tensor's data_offsets {offsets} lie outside the file's {data_bytes} data bytes")
    if len(shape) != 2 or dtype is None:
        return None
    if shape[0] * shape[1] * np.dtype(dtype).itemsize != end - begin:
        raise ValueError(f"a tensor's shape {shape} does not fill its data_offsets {offsets}")
    return shape, dtype, begin, end


def reduce(table: np.ndarray, dim: int) -> np.ndarray:
    """PCA to `dim` dimensions (centred; sign-fixed so the result is deterministic), rows normalised."""
    centred = table - table.mean(axis=0)
    if table.shape[1] > dim:
        _, _, vt = np.linalg.svd(centred.astype(np.float64), full_matrices=False)
        vt = vt[:dim] * np.sign(vt[:dim, :1] + 1e-30)
        centred = centred @ vt.T
    else:
        centred = np.pad(centred, ((0, 0), (0, dim - table.shape[1])))
    norms = np.linalg.norm(centred, axis=1, keepdims=True)
    return (centred / np.maximum(norms, 1e-12)).astype(np.float32)


def derived_embeddings(stream: np.ndarray, vocab_size: int, dim: int, reach: int = 2) -> np.ndarray:
    """Random projection of each token's co-occurrence profile within `reach` tokens (either side)."""
    projection = np.random.default_rng(SEED).standard_normal((vocab_size, dim))
    table = _cooccurrence_projection(np.asarray(stream[:SAMPLE_TOKENS]), projection, reach)
    return reduce(table, dim)


@njit(cache=True)
def _cooccurrence_projection(stream, projection, reach):
    """table[a] = sum over neighbours b of a (within `reach`, same segment) of projection[b] / distance."""
    vocab, dim = projection.shape
    table = np.zeros((vocab, dim))
    for i in range(stream.shape[0]):
        a = stream[i]
        if a >= vocab:
            continue
        for shift in range(1, reach + 1):
            for j in (i - shift, i + shift):
                if 0 <= j < stream.shape[0] and stream[j] < vocab:
                    b = stream[j]
                    for k in range(dim):
                        table[a, k] += projection[b, k] / shift
    return table


def context_vectors(stream: np.ndarray, positions: np.ndarray, table: np.ndarray, sentinel: int,
                    window: int = CONTEXT_WINDOW, decay: float = CONTEXT_DECAY) -> np.ndarray:
    """float32[len(positions), window * dim]: recency-weighted embeddings of the last `window`
    tokens up to each position, zero past an utterance boundary, L2-normalised."""
    vocab, dim = table.shape
    padded = np.vstack([table, np.zeros((1, dim), np.float32)])  # row `vocab` = boundary
    out = np.zeros((len(positions), window * dim), np.float32)
    alive = np.ones(len(positions), bool)
    for j in range(window):
        ids = np.asarray(stream[np.maximum(positions - j, 0)]).astype(np.int64)
        alive &= (ids != sentinel) & (positions - j >= 0)
        ids = np.where(alive, np.minimum(ids, vocab), vocab)
        out[:, j * dim:(j + 1) * dim] = padded[ids] * decay**j
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.maximum(norms, 1e-12)


def write_faiss_store(directory: Path, shard_dirs: list[Path], vocab_size: int, embeddings=None,
                      speech_offset: int = 0, dim: int = DIM, window: int = CONTEXT_WINDOW,
                      max_vectors: int = MAX_VECTORS, flat_max: int = FLAT_MAX) -> dict:
    """Build the FAISS store of the general exact store, whose shards are in `shard_dirs`; returns its
    catalog params. A vector's id is `shard << 32 | position in that shard's stream`."""
    shards = [ExactStore(d, vocab_size) for d in shard_dirs]
    if embeddings is None:
        # the first tokens of every shard: a shard is a hash-sample of the corpus, so this sample is too
        share = -(-SAMPLE_TOKENS // len(shards))
        sample = np.concatenate([np.asarray(s.tokens[:share]) for s in shards])
        table, source = derived_embeddings(sample, vocab_size, dim), "corpus co-occurrence (random projection)"
    else:
        table = reduce(load_embeddings(embeddings, vocab_size, speech_offset), dim)
        source = str(embeddings)
    ids, vectors = _sampled_contexts(shards, table, window, max_vectors)
    index, kind = _make_index(vectors, flat_max)
    index.add_with_ids(vectors, ids)
    directory.mkdir(parents=True, exist_ok=True)
    faiss.write_index(index, str(directory / "index.faiss"))
    save_npy(directory / "embeddings.npy", table)
    return {"vectors": len(ids), "index": kind, "dim": dim, "window": window, "decay": CONTEXT_DECAY,
            "nprobe": NPROBE, "embeddings": source}


def _sampled_contexts(shards: list[ExactStore], table: np.ndarray, window: int, max_vectors: int):
    """Ids and vectors of at most `max_vectors` positions with a continuation, evenly strided over all
    shards in order (deterministic, spread over the corpus). Streams are read a block at a time, so memory
    stays bounded however large the shards are."""
    def valid(stream, sentinel):
        return np.flatnonzero((stream[:-1] != sentinel) & (stream[1:] != sentinel))

    block = 1 << 24
    counts = [sum(len(valid(s.tokens[a:a + block + 1], s.sentinel)) for a in range(0, len(s.tokens), block))
              for s in shards]
    total = sum(counts)
    wanted = np.arange(total) if total <= max_vectors else np.linspace(0, total - 1, max_vectors).astype(np.int64)
    ids, vectors, seen = [], [], 0
    for number, (shard, count) in enumerate(zip(shards, counts)):
        mine = wanted[(wanted >= seen) & (wanted < seen + count)] - seen  # ranks among this shard's valid
        stream, passed = shard.tokens, 0
        for a in range(0, len(stream), block):
            positions = valid(stream[a:a + block + 1], shard.sentinel) + a
            chosen = positions[mine[(mine >= passed) & (mine < passed + len(positions))] - passed]
            passed += len(positions)
            if len(chosen):
                ids.append((np.int64(number) << 32) | chosen.astype(np.int64))
                vectors.append(context_vectors(stream, chosen, table, shard.sentinel, window))
        seen += count
    if not ids:
        return np.zeros(0, np.int64), np.zeros((0, window * table.shape[1]), np.float32)
    return np.concatenate(ids), np.concatenate(vectors)


def _make_index(vectors: np.ndarray, flat_max: int):
    d = vectors.shape[1]
    if len(vectors) <= flat_max:
        return faiss.IndexIDMap2(faiss.IndexFlatL2(d)), "flat"
    nlist = int(np.clip(2 * np.sqrt(len(vectors)), 64, 1024))
    quantizer = faiss.IndexFlatL2(d)
    index = faiss.IndexIVFScalarQuantizer(quantizer, d, nlist, faiss.ScalarQuantizer.QT_8bit)
    sample = vectors[np.linspace(0, len(vectors) - 1, min(len(vectors), 16 * nlist)).astype(np.int64)]
    index.cp.seed, index.cp.niter, index.cp.min_points_per_centroid = SEED, 10, 16
    index.train(sample)
    return index, f"ivf{nlist},sq8"


class FaissStore:
    """An opened FAISS store; `search` returns stream positions of the nearest stored contexts."""

    def __init__(self, directory: Path, params: dict, vocab_size: int):
        try:
            # Read into memory: a memory-mapped IVF index searches ~10x slower (measured 260 vs 24 us).
            self.index = faiss.read_index(str(directory / "index.faiss"))
        except RuntimeError as e:
            raise DamagedStoreError(f"{directory}: cannot read FAISS index: {str(e).splitlines()[0]}") from None
        try:
            self.window = int(params.get("window", CONTEXT_WINDOW))
            self.scales = (float(params.get("decay", CONTEXT_DECAY)) ** np.arange(self.window)).astype(np.float32)
            if hasattr(self.index, "nprobe"):
                self.index.nprobe = int(params.get("nprobe", NPROBE))
        except (TypeError, ValueError, OverflowError):
            raise DamagedStoreError(f"{directory}: the catalog's FAISS parameters are damaged: {params}") from None
        self.table = load_npy(directory / "embeddings.npy")
        # _query_vector reads table[id] for every context id < vocab_size, unchecked (compiled)
        if (self.table.ndim != 2 or self.table.dtype != np.float32 or self.table.shape[0] < vocab_size
                or self.window < 1 or self.index.d != self.window * self.table.shape[1]):
            raise DamagedStoreError(f"{directory}: FAISS store is damaged (its embedding table "
                                    f"{self.table.dtype}{list(self.table.shape)} does not fit its index or the "
                                    f"vocabulary); run `echospec info --verify`")

    def search(self, context: np.ndarray, k: int) -> np.ndarray:
        """int64 ids (`shard << 32 | position` in the general store) of up to k contexts nearest to
        `context`'s end."""
        query = _query_vector(np.asarray(context, np.int64), self.table, self.scales)
        _, ids = self.index.search(query, k)
        return ids[0][ids[0] >= 0]


@njit(cache=True, nogil=True)
def _query_vector(context, table, scales):
    """context_vectors for the end of one context (numpy's version costs ~10 us a query)."""
    dim = table.shape[1]
    query = np.zeros((1, scales.shape[0] * dim), np.float32)
    norm = 0.0
    for j in range(min(scales.shape[0], context.shape[0])):
        row = context[context.shape[0] - 1 - j]
        for d in range(dim):
            v = table[row, d] * scales[j]
            query[0, j * dim + d] = v
            norm += v * v
    if norm > 0:
        query /= np.float32(np.sqrt(norm))
    return query


_OPEN: dict[tuple, FaissStore] = {}
_OPEN_LOCK = threading.Lock()


def open_faiss_store(directory: Path, params: dict, vocab_size: int) -> FaissStore:
    """Open (or reuse) a FAISS store. Enrollment never changes it, so a datastore reopened after an
    enrollment shares the loaded index: reopening stays cheap however large the index is."""
    try:
        stat = os.stat(directory / "index.faiss")
    except OSError as e:
        raise DamagedStoreError(f"{directory}: cannot read FAISS index ({one_line(e)})") from None
    key = (str(Path(directory).resolve()), stat.st_ino, stat.st_mtime_ns, stat.st_size, vocab_size)
    with _OPEN_LOCK:
        store = _OPEN.get(key)
        if store is None:
            store = _OPEN[key] = FaissStore(directory, params, vocab_size)
    return store

"""The propose wire format shared by the service and `RemoteRetriever`: raw little-endian arrays.

Request body (`Content-Type: application/x-echospec`), options travel in the query string:
    u32 n | u32 lengths[n] | i32 tokens[sum(lengths)]
Response body:
    u32 n | u32 sizes[n] | i64 tokens[T] | i32 parents[T] | i32 depths[T] | f32 counts[T] | f32 probs[T]
    | u8 sources[T]                                              (T = sum(sizes), trees concatenated)

Decoding is a handful of `np.frombuffer` calls, with no per-token Python work; JSON is the readable
alternative (see retriever/service/). Errors are always JSON.
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np
from numba import njit

from ..tree import DTYPES, SOURCES, CandidateTree, tree_is_valid

BINARY = "application/x-echospec"
JSON = "application/json"

TREE_COLUMNS = tuple(DTYPES.items())
"""CandidateTree's arrays in wire order (its fields' order: decode_trees hands columns to CandidateTree.trusted),
with their in-memory dtypes (little-endian on the wire)."""
_LITTLE = {dtype: np.dtype(dtype).newbyteorder("<") for _, dtype in TREE_COLUMNS}
_U32 = struct.Struct("<I")
_ONE_TREE = struct.Struct("<II")  # n = 1, then its size
_TREE_BYTES_PER_NODE = sum(np.dtype(dtype).itemsize for _, dtype in TREE_COLUMNS)


class WireError(ValueError):
    """A body that does not follow the wire format: truncated, trailing bytes, counts past a limit."""


def encode_contexts(contexts: Sequence[Sequence[int] | np.ndarray]) -> bytes:
    """Pack contexts as `u32 n | u32 lengths[n] | i32 tokens`; ids must fit in int32."""
    arrays = [np.asarray(c) for c in contexts]
    for a in arrays:
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise ValueError(f"a context must be a 1-D sequence of integer ids, got {a.dtype} of shape {a.shape}")
    tokens = arrays[0] if len(arrays) == 1 else np.concatenate(arrays) if arrays else np.zeros(0, "<i4")
    if tokens.size and not _fits_int32(tokens):
        raise ValueError("context ids must fit in int32")
    lengths = _U32.pack(len(arrays[0])) if len(arrays) == 1 else np.array([a.size for a in arrays], "<u4").tobytes()
    return _U32.pack(len(arrays)) + lengths + tokens.astype("<i4").tobytes()


def decode_contexts(body: bytes, max_batch: int) -> list[np.ndarray]:
    """Unpack `encode_contexts`'s bytes into int64 arrays; the length must match exactly."""
    n = _count(body, max_batch, "contexts")
    if n == 1:  # the common case, without array arithmetic on the header
        total = _U32.unpack_from(body, 4)[0]
    else:
        lengths = np.frombuffer(body, "<u4", n, 4).astype(np.int64)
        total = int(lengths.sum())
    expected = 4 + 4 * n + 4 * total
    if len(body) != expected:
        raise WireError(f"binary contexts: body has {len(body)} bytes, its header says {expected}")
    tokens = np.frombuffer(body, "<i4", offset=4 + 4 * n).astype(np.int64)
    return [tokens] if n == 1 else np.split(tokens, np.cumsum(lengths)[:-1]) if n else []


def encode_trees(trees: Sequence[CandidateTree]) -> bytes:
    """Pack trees column by column after a `u32 n | u32 sizes[n]` header."""
    if len(trees) == 1:  # the common case, without concatenating
        (tree,) = trees
        return b"".join([_ONE_TREE.pack(1, len(tree)), *(getattr(tree, name).astype(_LITTLE[dtype], copy=False)
                                                           .tobytes() for name, dtype in TREE_COLUMNS)])
    parts = [_U32.pack(len(trees)), np.array([len(t) for t in trees], "<u4").tobytes()]
    for name, dtype in TREE_COLUMNS:
        column = [getattr(t, name) for t in trees]
        joined = np.concatenate(column) if column else np.zeros(0, dtype)
        parts.append(joined.astype(_LITTLE[dtype], copy=False).tobytes())
    return b"".join(parts)


def decode_trees(body: bytes) -> list[CandidateTree]:
    """Unpack `encode_trees`'s bytes; each tree gets its own arrays in the CandidateTree dtypes.

    The bytes come from the network, so every tree is checked (`tree_is_valid`) before it is trusted."""
    n = _count(body, None, "trees")
    sizes = [_U32.unpack_from(body, 4)[0]] if n == 1 else np.frombuffer(body, "<u4", n, 4).astype(np.int64)
    total = int(sizes[0]) if n == 1 else int(sizes.sum())
    expected = 4 + 4 * n + total * _TREE_BYTES_PER_NODE
    if len(body) != expected:
        raise WireError(f"binary trees: body has {len(body)} bytes, its header says {expected}")
    offset, columns = 4 + 4 * n, []
    for _, dtype in TREE_COLUMNS:
        array = np.frombuffer(body, _LITTLE[dtype], total, offset)
        offset += array.nbytes
        columns.append(array.astype(dtype))  # native byte order, a writable copy
    if n == 1:
        trees = [columns]
    else:
        bounds = np.cumsum(sizes)[:-1]
        trees = list(zip(*(np.split(column, bounds) for column in columns))) if n else []
    for i, (tokens, parents, depths, counts, probs, sources) in enumerate(trees):
        if not tree_is_valid(parents, depths, sources, len(SOURCES)):
            raise WireError(f"binary trees: tree {i} is malformed (a parent after its child, a depth that is "
                            f"not its parent's + 1, or an unknown source)")
    return [CandidateTree.trusted(columns) for columns in trees]


@njit(cache=True, nogil=True)
def _fits_int32(ids):
    for x in ids:
        if x < -2**31 or x >= 2**31:
            return False
    return True


def _count(body: bytes, limit: int | None, what: str) -> int:
    if len(body) < 4:
        raise WireError(f"binary {what}: body of {len(body)} bytes is shorter than its 4-byte header")
    n = _U32.unpack_from(body)[0]
    if limit is not None and n > limit:
        raise WireError(f"binary {what}: {n} in one request, the limit is {limit}")
    if len(body) < 4 + 4 * n:
        raise WireError(f"binary {what}: header announces {n} entries but the body has {len(body)} bytes")
    return n

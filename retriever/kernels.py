"""Numba kernels of the proposer: suffix-array matching, continuation gathering and the trie.

Everything a `propose` call does per token lives here, compiled (`cache=True`, `nogil=True` so
threads can propose in parallel); the Python side only picks stores and wraps the result. The
kernels that call each other stay in this one file: numba's on-disk cache is invalidated per source
file, so a caller cached in another file would keep running a stale copy of a changed callee.
Continuations are gathered as rows of a [rows, max_depth] int64 table padded with -1, each row with
a source, a count weight (estimated support) and a probability weight.

Store files are untrusted: a damaged suffix array or first-token table must not make a kernel read
outside its arrays (numba does not bounds-check). Every suffix-array entry and table value is checked
before it indexes anything, and a bad one makes the store's kernel answer DAMAGED instead; valid stores
never trigger it, and the checks cost a compare per binary-search probe and per gathered row.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

# Sources, in the order of `tree.SOURCES` (numba folds these module constants into the kernels).
PROMPT, SPEAKER, GENERAL, FAISS = 0, 1, 2, 3
N_SOURCES = 4
# Columns of the per-source `stats` table that `gather_exact` returns, one row per source.
FIRST_ROW, ROWS, MATCH, OCCURRENCES = 0, 1, 2, 3
"""first row of the source's continuations in `conts`, rows written, match length, occurrences of the
matched suffix in the store (its estimated support)"""
DAMAGED = -1
"""stats[source, ROWS] (and match's d, gather_store's and gather_positions' rows) when a store's files
hold an out-of-range entry."""
# Columns of the `settings` array gather_exact reads: a retriever's fixed settings, built once by
# `gather_settings`. One int64 array rather than ten arguments: numba dispatches a call by the types of
# its arguments, and each argument (more so a keyword one, or a namedtuple's every field) costs the hot
# call time; measured side by side, keywords cost propose ~4% at p50, a namedtuple ~5%, this array nothing.
SETTING_USE_PROMPT, SETTING_N_MIN, SETTING_N_MAX, SETTING_PROMPT_N_MIN, SETTING_MIN_SUPPORT, SETTING_CAP, \
    SETTING_PROMPT_WINDOW, SETTING_EXTRA_ROWS, SETTING_VOCAB_SIZE = range(9)


def gather_settings(*, use_prompt: bool, n_min: int, n_max: int, prompt_n_min: int, min_support: int, cap: int,
                    prompt_window: int, extra_rows: int, vocab_size: int) -> np.ndarray:
    """gather_exact's `settings`: the values by name, in their columns."""
    values = {SETTING_USE_PROMPT: use_prompt, SETTING_N_MIN: n_min, SETTING_N_MAX: n_max,
              SETTING_PROMPT_N_MIN: prompt_n_min, SETTING_MIN_SUPPORT: min_support, SETTING_CAP: cap,
              SETTING_PROMPT_WINDOW: prompt_window, SETTING_EXTRA_ROWS: extra_rows, SETTING_VOCAB_SIZE: vocab_size}
    return np.array([int(values[column]) for column in range(len(values))], np.int64)


@njit(cache=True, nogil=True)
def context_is_valid(ctx, vocab_size):
    for i in range(ctx.shape[0]):
        if ctx[i] < 0 or ctx[i] >= vocab_size:
            return False
    return True


# A store (the general store, or a speaker's) is a tuple (shards, tokens0, sa0, first0, index0): `shards`
# an int64 table with one row per shard, the addresses and lengths of its tokens, sa and first arrays and
# of its sampled index's keys (with the index's step, depth, bits per token and words per key; 0 rows: no
# index), and shard 0's arrays, which give the kernels their dtypes. The caller keeps every shard's arrays
# alive. Addresses rather than a list of arrays: reading a shard's array from a numba typed list costs
# ~25 ns a time, more than a binary-search step; from the table it is a pointer and a length, and the
# call passes five arrays however many shards there are.
SHARD_TOKENS, SHARD_TOKENS_LEN, SHARD_SA, SHARD_SA_LEN, SHARD_FIRST, SHARD_FIRST_LEN = 0, 1, 2, 3, 4, 5
SHARD_INDEX, SHARD_INDEX_ROWS, SHARD_INDEX_STEP, SHARD_INDEX_DEPTH, SHARD_INDEX_BITS, SHARD_INDEX_WORDS = range(6, 12)
SHARD_COLUMNS = 12


@intrinsic
def _pointer(typingctx, address, like):
    """`address` (an int64) as a pointer to elements of `like`'s dtype."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return types.CPointer(like.dtype)(address, like), codegen


@njit(cache=True, nogil=True, inline="always")
def shard_tokens(store, s):
    return carray(_pointer(store[0][s, SHARD_TOKENS], store[1]), store[0][s, SHARD_TOKENS_LEN])


@njit(cache=True, nogil=True, inline="always")
def shard_sa(store, s):
    return carray(_pointer(store[0][s, SHARD_SA], store[2]), store[0][s, SHARD_SA_LEN])


@njit(cache=True, nogil=True, inline="always")
def shard_first(store, s):
    return carray(_pointer(store[0][s, SHARD_FIRST], store[3]), store[0][s, SHARD_FIRST_LEN])


@njit(cache=True, nogil=True, inline="always")
def shard_index(store, s):
    return carray(_pointer(store[0][s, SHARD_INDEX], store[4]),
                  store[0][s, SHARD_INDEX_ROWS] * store[0][s, SHARD_INDEX_WORDS])


@njit(cache=True, nogil=True, inline="always")
def _before(key, c, upper):
    """Whether a binary search for the first key >= c (> c when `upper`) goes on past `key`: the one rule of
    every search here (the sampled index's, one shard's, the shards' in turn)."""
    return key < c or (upper and key == c)


@njit(cache=True, nogil=True)
def index_range(store, s, a, b, depth, c, upper):
    """A part of [a, b) that holds the first entry of shard s's sa range [a, b) whose token `depth` places
    left is >= c (> c when `upper`), or b: found among the index's sampled keys (every step-th entry's),
    so the binary search that follows probes at most `step` entries, about one page of sa, and as many
    fewer stream pages. The range is sorted by that token (all shallower ones being equal), so the
    samples are too. Unchanged without an index, beyond its depth, or for a range of one step or less."""
    table = store[0]
    step = table[s, SHARD_INDEX_STEP]
    if table[s, SHARD_INDEX_ROWS] == 0 or depth >= table[s, SHARD_INDEX_DEPTH] or b - a <= step:
        return a, b
    bits = table[s, SHARD_INDEX_BITS]
    words = table[s, SHARD_INDEX_WORDS]
    per_word = 64 // bits
    word = depth // per_word
    shift = np.uint64(bits * (per_word - 1 - depth % per_word))
    mask = np.uint64((1 << bits) - 1)
    keys = shard_index(store, s)
    first = (a + step - 1) // step  # the samples inside [a, b)
    lo = first
    hi = min((b - 1) // step + 1, table[s, SHARD_INDEX_ROWS])
    end = hi
    while lo < hi:
        m = (lo + hi) >> 1
        code = np.int64((keys[m * words + word] >> shift) & mask)
        if _before(code, c, upper):
            lo = m + 1
        else:
            hi = m
    if lo > first:  # sample lo - 1 is before the answer
        a = max(a, (lo - 1) * step + 1)
    if lo < end:  # sample lo qualifies: the answer is at it or before
        b = min(b, lo * step)
    return a, b


@njit(cache=True, nogil=True)
def copy_continuation(stream, start, stop_at, out, row):
    """out[row] = stream[start:] up to the row's width, cut at the first id >= stop_at, -1 padded."""
    width = out.shape[1]
    end = min(stream.shape[0], start + width)
    t = 0
    while start + t < end:
        v = stream[start + t]
        if v >= stop_at:
            break
        out[row, t] = v
        t += 1
    for u in range(t, width):
        out[row, u] = -1
    return t


@njit(cache=True, nogil=True)
def gather_store(store, ctx, n_min, n_max, min_support, cap, out, row0, vocab_size):
    """Continuations of the longest context suffix (n_min..n_max) with at least `min_support`
    occurrences (the longest match when none has that many) in a store of one or more shards. An
    utterance lives in one shard and no continuation crosses one, so the store's count of a suffix is
    the sum of the shards' counts: the suffix is chosen on the sums, as one store holding every shard
    would choose it. With more than `cap` occurrences, each shard gives its share of the `cap` (in
    proportion to its count, largest remainders first), taken as a contiguous block of its suffix
    array centred where the next longer suffix sits: the occurrences whose further-left context is
    closest to this one's, read from consecutive memory. The rows are then put in content order.
    So the tree is one store's exactly (whatever the split into shards) when the chosen suffix occurs at
    most `cap` times: the suffix and its count are chosen on the sums and every occurrence is taken. When
    it occurs more often, one store takes the `cap` occurrences around one place of its range and the
    shards take their shares around a place in each, so the continuations, and the tree, may differ: with
    the defaults in 2 of 1,989 held-out contexts of a 210M-token corpus (issue 36), at 1.003x and 1.013x
    one store's accepted length at 4 and 16 shards (docs/scaling.md).
    Returns (rows written, match length, occurrences); rows is DAMAGED when a shard's files hold an
    out-of-range entry (an id >= vocab_size in a continuation included: a verifier would index its
    embedding table with it)."""
    los, his, counts, d = match(store, ctx, n_min, n_max, min_support)
    if d == DAMAGED:
        return DAMAGED, 0, 0
    if d < n_min:
        return 0, d, 0
    count = counts[d]
    m = min(count, cap, out.shape[0] - row0)
    takes = proportional_shares(los[:, d], his[:, d], m)
    row = row0
    for s in range(takes.shape[0]):
        take = takes[s]
        if take == 0:
            continue
        tokens = shard_tokens(store, s)
        sa = shard_sa(store, s)
        lo = los[s, d]
        hi = his[s, d]
        centre = (los[s, d + 1] + his[s, d + 1]) >> 1
        start = min(max(lo, centre - take // 2), hi - take)
        sentinel = np.iinfo(tokens.dtype).max
        n = tokens.shape[0]
        for j in range(take):
            p = sa[start + j]
            if p < 0 or p >= n:
                return DAMAGED, 0, 0
            # stop at any id outside the vocabulary: only the sentinel may be one
            t = copy_continuation(tokens, p + 1, vocab_size, out, row)
            if t < out.shape[1] and p + 1 + t < n and tokens[p + 1 + t] != sentinel:
                return DAMAGED, 0, 0
            row += 1
    sort_rows(out, row0, row)
    return m, d, count


@njit(cache=True, nogil=True)
def match(store, ctx, n_min, n_max, min_support):
    """The suffix length d that gather_store takes, with every shard's sa ranges.

    los[s, t], his[s, t]: shard s's sa range of the context's last t tokens; counts[t] their sum over
    shards. `sa` is sorted by the reversed n-gram, so one more token to the left narrows a range by two
    binary searches; all shards go one depth at a time. The row after d holds where the next longer
    suffix sits in each shard (its range, the insertion point when it does not occur, or the middle
    when there is no longer suffix to try). The search stops as soon as the count falls below
    `min_support` after a depth >= n_min that had it (no deeper suffix can be chosen then); when no depth
    has the support it goes on to the deepest match. d < n_min: nothing to gather; d is DAMAGED when a
    shard's first-token table or suffix array holds an out-of-range entry.
    """
    n_shards = store[0].shape[0]
    los = np.zeros((n_shards, n_max + 2), np.int64)
    his = np.zeros((n_shards, n_max + 2), np.int64)
    counts = np.zeros(n_max + 2, np.int64)
    n = ctx.shape[0]
    if n == 0:
        return los, his, counts, 0
    c = ctx[n - 1]
    for s in range(n_shards):
        first = shard_first(store, s)
        if first.shape[0]:
            if 0 <= c < first.shape[0] - 1:
                lo = first[c]
                hi = first[c + 1]
                if lo < 0 or hi < lo or hi > store[0][s, SHARD_SA_LEN]:
                    return los, his, counts, DAMAGED
                los[s, 1] = lo
                his[s, 1] = hi
        else:  # a small store keeps no first-token table: search its range like any other step
            los[s, 0] = 0
            his[s, 0] = store[0][s, SHARD_SA_LEN]
            if narrow(store, s, los, his, 0, c):
                return los, his, counts, DAMAGED
        counts[1] += his[s, 1] - los[s, 1]
    if counts[1] == 0:
        return los, his, counts, 0
    limit = min(n_max, n)
    t = 1
    while True:
        if t == limit:  # no longer suffix to try: its place is the middle
            for s in range(n_shards):
                los[s, t + 1] = (los[s, t] + his[s, t]) >> 1
                his[s, t + 1] = los[s, t + 1]
        elif narrow(store, -1, los, his, t, ctx[n - 1 - t]):
            return los, his, counts, DAMAGED
        for s in range(n_shards):
            counts[t + 1] += his[s, t + 1] - los[s, t + 1]
        if counts[t + 1] < min_support and t >= n_min and counts[t] >= min_support:
            return los, his, counts, t
        if counts[t + 1] == 0:
            break
        t += 1
    deepest = t
    d = deepest
    while d > n_min and counts[d] < min_support:
        d -= 1
    if counts[d] < min_support:
        d = deepest
    return los, his, counts, d


@njit(cache=True, nogil=True)
def narrow(store, only, los, his, depth, c):
    """los/his[s, depth + 1] = the part of shard s's range los/his[s, depth] whose token `depth` places
    left of the position is c (the range is sorted by that token, all shallower ones being equal); where
    none is, the empty range at the point c would sit. For every shard, or shard `only` when >= 0.
    Returns True (damaged) if a probed entry points outside its stream: in a valid store every entry of
    the range has `depth` tokens before it.

    With several shards their binary searches advance one step at a time in turn: their cache and TLB
    misses are independent, so the CPU overlaps them (16 shards of a 40M-token store, this machine:
    match p50 12.6 us, p99 60 us, against 21.6 and 104 us one shard after the other). One shard keeps its
    bounds in registers."""
    n_shards = los.shape[0]
    if only >= 0 or n_shards == 1:
        for s in range(n_shards) if only < 0 else range(only, only + 1):
            a = _bound(store, s, los[s, depth], his[s, depth], depth, c, False)
            b = _bound(store, s, a, his[s, depth], depth, c, True)
            if a < 0 or b < 0:
                return True
            los[s, depth + 1] = a
            his[s, depth + 1] = b
        return False
    start = los[:, depth + 1]
    end = his[:, depth + 1]
    for s in range(n_shards):
        start[s] = los[s, depth]
        end[s] = his[s, depth]
    if _search(store, start, end, depth, c, False):  # start: the lower ends
        return True
    lo = start.copy()
    for s in range(n_shards):
        end[s] = his[s, depth]
    if _search(store, lo, end, depth, c, True):  # lo: the upper ends
        return True
    end[:] = lo
    return False


@njit(cache=True, nogil=True, inline="always")
def _bound(store, s, a, b, depth, c, upper):
    """The first position of shard s's sa range [a, b) whose token `depth` places left is >= c (> c when
    `upper`), the range first narrowed by the sampled index; -1 (damaged) if a probed entry points outside
    its stream, or if `a` already is -1 (a damaged lower bound). Inlined: one shard's bounds stay in registers."""
    if a < 0:
        return -1
    a, b = index_range(store, s, a, b, depth, c, upper)
    tokens = shard_tokens(store, s)
    sa = shard_sa(store, s)
    n = tokens.shape[0]
    while a < b:
        m = (a + b) >> 1
        p = sa[m] - depth
        if p < 0 or p >= n:
            return -1
        if _before(tokens[p], c, upper):
            a = m + 1
        else:
            b = m
    return a


@njit(cache=True, nogil=True)
def _search(store, lo, hi, depth, c, upper):
    """Every shard's binary search for the first position whose token `depth` places left is >= c
    (> c when `upper`) within [lo[s], hi[s]), one step per shard in turn; the result is left in lo.
    Returns True (damaged) if a probed entry points outside its stream."""
    for s in range(lo.shape[0]):
        lo[s], hi[s] = index_range(store, s, lo[s], hi[s], depth, c, upper)
    active = lo.shape[0]
    while active:
        active = 0
        for s in range(lo.shape[0]):
            if lo[s] < hi[s]:
                m = (lo[s] + hi[s]) >> 1
                p = shard_sa(store, s)[m] - depth
                if p < 0 or p >= store[0][s, SHARD_TOKENS_LEN]:
                    return True
                if _before(shard_tokens(store, s)[p], c, upper):
                    lo[s] = m + 1
                else:
                    hi[s] = m
                active += 1
    return False


@njit(cache=True, nogil=True)
def proportional_shares(los, his, m):
    """How many of `m` rows each shard gives: floor(m * count / total), then one more to each of the
    shards with the largest remainders (ties: lower shard) until the shares add up to m. A share never
    exceeds its shard's count; when m is the total, every shard gives all its occurrences."""
    n = los.shape[0]
    takes = np.zeros(n, np.int64)
    total = 0
    for s in range(n):
        total += his[s] - los[s]
    if total == 0:
        return takes
    given = 0
    remainders = np.zeros(n, np.int64)
    for s in range(n):
        product = m * (his[s] - los[s])
        takes[s] = product // total
        remainders[s] = product - takes[s] * total
        given += takes[s]
    while given < m:
        best = 0
        for s in range(1, n):
            if remainders[s] > remainders[best]:
                best = s
        takes[best] += 1
        remainders[best] = -1
        given += 1
    return takes


@njit(cache=True, nogil=True)
def sort_rows(out, lo, hi):
    """Insertion sort of out[lo:hi] by content (-1 padding first): at most `cap` short rows."""
    width = out.shape[1]
    held = np.empty(width, out.dtype)
    for i in range(lo + 1, hi):
        j = i
        while j > lo and row_less(out, i, j - 1):
            j -= 1
        if j == i:
            continue
        held[:] = out[i]
        for r in range(i, j, -1):
            out[r] = out[r - 1]
        out[j] = held


@njit(cache=True, nogil=True)
def row_less(out, a, b):
    for t in range(out.shape[1]):
        if out[a, t] != out[b, t]:
            return out[a, t] < out[b, t]
    return False


@njit(cache=True, nogil=True)
def gather_prompt(ctx, n_min, n_max, cap, window, out, row0):
    """Prompt lookup: earlier places in the context itself (prompt speech + output so far) whose
    last tokens equal the context's longest-matching suffix; the most recent `cap` of them.
    Returns (rows written, match length)."""
    n = ctx.shape[0]
    best = 0
    m = 0
    cap = min(cap, out.shape[0] - row0)
    for j in range(n - 2, max(-1, n - 2 - window), -1):
        length = 0
        while length < n_max and j - length >= 0 and ctx[j - length] == ctx[n - 1 - length]:
            length += 1
        if length < n_min or length < best:
            continue
        if length > best:
            best = length
            m = 0
        if m < cap:
            copy_continuation(ctx, j + 1, 1 << 62, out, row0 + m)
            m += 1
    return m, best


@njit(cache=True, nogil=True)
def gather_positions(store, positions, vocab_size, width, book, out, row0):
    """Continuations following given stream positions (the FAISS store's neighbours), each
    `shard << 32 | position in that shard's stream`, taking only positions whose token is in codebook
    `book` (ids // width; with one codebook, every id) until `out` is full. Returns the rows written, or
    DAMAGED when a position or a continuation is out of range (the ids come from the index file)."""
    n_shards = store[0].shape[0]
    row = row0
    for j in range(positions.shape[0]):
        if row == out.shape[0]:
            break
        shard = positions[j] >> 32
        p = positions[j] & 0xFFFFFFFF
        if shard < 0 or shard >= n_shards or p >= store[0][shard, SHARD_TOKENS_LEN]:
            return DAMAGED
        tokens = shard_tokens(store, shard)
        if tokens[p] // width != book:
            continue
        t = copy_continuation(tokens, p + 1, vocab_size, out, row)
        if t < out.shape[1] and p + 1 + t < tokens.shape[0] and tokens[p + 1 + t] != np.iinfo(tokens.dtype).max:
            return DAMAGED
        row += 1
    return row - row0


@njit(cache=True, nogil=True)
def keep_layout(conts, n_rows, last, width, codebooks):
    """Interleaved codebooks: cut every row at its first token outside the codebook due at its place.
    The context's last token is in codebook last // width, so row position t must be in codebook
    (last // width + 1 + t) % codebooks. Approximate sources (FAISS) can propose any id; this makes every
    source propose only ids valid at their position."""
    due = (last // width + 1) % codebooks
    for r in range(n_rows):
        for t in range(conts.shape[1]):
            v = conts[r, t]
            if v < 0:
                break
            if v // width != (due + t) % codebooks:
                for u in range(t, conts.shape[1]):
                    conts[r, u] = -1
                break


@njit(cache=True, nogil=True)
def build_tree(conts, n_rows, wcount, wprob, src, max_nodes):
    """Merge continuation rows into a trie and keep the `max_nodes` most probable nodes.

    A node's probability is the summed probability weight of the rows through it; it never exceeds
    its parent's, so best-first expansion from the root (ties: shallower, then first created) keeps
    exactly the global top nodes and always a connected tree. Output is sorted by depth, then
    probability, i.e. topological. Returns tokens, parents, depths, counts, probs, sources.
    """
    tok, par, dep, cnt, prb, srcw, child, sibling, root_child, nodes = _trie(conts, n_rows, wcount, wprob, src)
    keep = _most_probable(prb, dep, child, sibling, root_child, nodes, max_nodes)
    _topological(keep, dep, prb)
    return _tree_arrays(keep, nodes, tok, par, dep, cnt, prb, srcw)


@njit(cache=True, nogil=True)
def _trie(conts, n_rows, wcount, wprob, src):
    """The rows merged into a trie: per node its token, parent, depth, summed count and probability weights and
    probability weight by source, first child and next sibling; the root's first child; the node count."""
    width = conts.shape[1]
    cap_nodes = n_rows * width
    tok = np.empty(cap_nodes, np.int64)  # per-node arrays are filled when a node is created:
    par = np.empty(cap_nodes, np.int64)  # zeroing them all would cost more than the insertions
    dep = np.empty(cap_nodes, np.int64)
    cnt = np.empty(cap_nodes, np.float64)
    prb = np.empty(cap_nodes, np.float64)
    srcw = np.empty((cap_nodes, N_SOURCES), np.float64)
    child = np.empty(cap_nodes, np.int64)
    sibling = np.empty(cap_nodes, np.int64)
    # The root can have a child per row: find them by open addressing, not a sibling walk.
    slots = 16
    while slots < 2 * n_rows:
        slots *= 2
    root_slot = np.full(slots, -1, np.int64)
    root_child = -1
    nodes = 0
    for r in range(n_rows):
        node = -1
        for t in range(width):
            v = conts[r, t]
            if v < 0:
                break
            if node < 0:
                h = (v * 2654435761) & (slots - 1)
                while root_slot[h] >= 0 and tok[root_slot[h]] != v:
                    h = (h + 1) & (slots - 1)
                c = root_slot[h]
            else:
                c = child[node]
                while c >= 0 and tok[c] != v:
                    c = sibling[c]
            if c < 0:
                c = nodes
                nodes += 1
                tok[c] = v
                par[c] = node
                dep[c] = t + 1
                child[c] = -1
                cnt[c] = 0.0
                prb[c] = 0.0
                srcw[c, :] = 0.0
                if node < 0:
                    root_slot[h] = c
                    sibling[c] = root_child
                    root_child = c
                else:
                    sibling[c] = child[node]
                    child[node] = c
            cnt[c] += wcount[r]
            prb[c] += wprob[r]
            srcw[c, src[r]] += wprob[r]
            node = c
    return tok, par, dep, cnt, prb, srcw, child, sibling, root_child, nodes


@njit(cache=True, nogil=True)
def _most_probable(prb, dep, child, sibling, root_child, nodes, max_nodes):
    """The `max_nodes` most probable nodes, expanded best first from the root (ties: shallower, then first
    created), so every node kept has its parent kept."""
    keep = np.empty(min(max_nodes, nodes), np.int64)
    frontier = np.empty(nodes, np.int64)
    n_front = 0
    c = root_child
    while c >= 0:
        frontier[n_front] = c
        n_front += 1
        c = sibling[c]
    n_keep = 0
    while n_keep < keep.shape[0] and n_front > 0:
        best = 0
        for f in range(1, n_front):
            a = frontier[f]
            b = frontier[best]
            if prb[a] > prb[b] or (prb[a] == prb[b] and (dep[a] < dep[b] or (dep[a] == dep[b] and a < b))):
                best = f
        chosen = frontier[best]
        keep[n_keep] = chosen
        n_keep += 1
        n_front -= 1
        frontier[best] = frontier[n_front]
        c = child[chosen]
        while c >= 0:
            frontier[n_front] = c
            n_front += 1
            c = sibling[c]
    return keep[:n_keep]


@njit(cache=True, nogil=True)
def _topological(keep, dep, prb):
    """Insertion sort of the kept nodes by (depth, -probability, creation), in place: parents come first."""
    for i in range(1, keep.shape[0]):
        x = keep[i]
        j = i - 1
        while j >= 0:
            y = keep[j]
            if dep[y] < dep[x] or (dep[y] == dep[x] and (prb[y] > prb[x] or (prb[y] == prb[x] and y < x))):
                break
            keep[j + 1] = y
            j -= 1
        keep[j + 1] = x


@njit(cache=True, nogil=True)
def _tree_arrays(keep, nodes, tok, par, dep, cnt, prb, srcw):
    """The kept nodes as a CandidateTree's arrays (tree.DTYPES), parents re-indexed, each node's source the one
    that gave it the most probability weight."""
    n_keep = keep.shape[0]
    index = np.full(nodes, -1, np.int64)
    for i in range(n_keep):
        index[keep[i]] = i
    out_tok = np.empty(n_keep, np.int64)
    out_par = np.empty(n_keep, np.int32)
    out_dep = np.empty(n_keep, np.int32)
    out_cnt = np.empty(n_keep, np.float32)
    out_prb = np.empty(n_keep, np.float32)
    out_src = np.empty(n_keep, np.uint8)
    for i in range(n_keep):
        c = keep[i]
        out_tok[i] = tok[c]
        out_par[i] = -1 if par[c] < 0 else index[par[c]]
        out_dep[i] = dep[c]
        out_cnt[i] = cnt[c]
        out_prb[i] = min(prb[c], 1.0)
        best_src = 0
        for s in range(1, N_SOURCES):
            if srcw[c, s] > srcw[c, best_src]:
                best_src = s
        out_src[i] = best_src
    return out_tok, out_par, out_dep, out_cnt, out_prb, out_src


@njit(cache=True, nogil=True)
def record(stats, source, first_row, rows, match_length, occurrences):
    stats[source, FIRST_ROW] = first_row
    stats[source, ROWS] = rows
    stats[source, MATCH] = match_length
    stats[source, OCCURRENCES] = occurrences


@njit(cache=True, nogil=True)
def gather_exact(ctx, general, speaker, use_speaker, max_depth, settings):
    """Continuation rows of the prompt, the speaker store and the general store.

    `general` and `speaker` are stores (see SHARD_TOKENS above); `settings` is gather_settings' array
    (read by column: SETTING_N_MIN, SETTING_CAP, ...). Returns `conts`, a [rows, max_depth] table with room for
    settings[SETTING_EXTRA_ROWS] more (FAISS), and `stats[source]` = (FIRST_ROW, ROWS, MATCH, OCCURRENCES);
    stats[FAISS, FIRST_ROW] is where FAISS rows would start, or DAMAGED when a damaged store stopped the
    gathering (stats[that source, ROWS] is DAMAGED too): one value for the caller to check.
    """
    n_min = settings[SETTING_N_MIN]
    n_max = settings[SETTING_N_MAX]
    min_support = settings[SETTING_MIN_SUPPORT]
    cap = settings[SETTING_CAP]
    vocab_size = settings[SETTING_VOCAB_SIZE]
    conts = np.empty((3 * cap + settings[SETTING_EXTRA_ROWS], max_depth), np.int64)
    stats = np.zeros((N_SOURCES, 4), np.int64)
    row = 0
    if settings[SETTING_USE_PROMPT]:
        m, k = gather_prompt(ctx, settings[SETTING_PROMPT_N_MIN], n_max, cap, settings[SETTING_PROMPT_WINDOW],
                             conts, row)
        record(stats, PROMPT, row, m, k, m)
        row += m
    if use_speaker:
        m, k, occ = gather_store(speaker, ctx, n_min, n_max, min_support, cap, conts, row, vocab_size)
        record(stats, SPEAKER, row, m, k, occ)
        if m == DAMAGED:
            stats[FAISS, FIRST_ROW] = DAMAGED
            return conts, stats
        row += m
    m, k, occ = gather_store(general, ctx, n_min, n_max, min_support, cap, conts, row, vocab_size)
    record(stats, GENERAL, row, m, k, occ)
    stats[FAISS, FIRST_ROW] = DAMAGED if m == DAMAGED else row + m
    return conts, stats


@njit(cache=True, nogil=True)
def finish(conts, stats, weights, max_nodes):
    """Weigh the rows and build the tree. Rows are pooled: each counts its source's weight times
    the source's match length, so a node's probability is the weighted share of all gathered
    continuations that pass through it."""
    n_rows = stats[FAISS, FIRST_ROW] + stats[FAISS, ROWS]
    wcount = np.zeros(n_rows, np.float64)
    wprob = np.zeros(n_rows, np.float64)
    src = np.zeros(n_rows, np.int64)
    total = 0.0
    for s in range(N_SOURCES):
        total += weights[s] * stats[s, MATCH] * stats[s, ROWS]
    for s in range(N_SOURCES):
        m = stats[s, ROWS]
        for r in range(stats[s, FIRST_ROW], stats[s, FIRST_ROW] + m):
            wcount[r] = weights[s] * stats[s, OCCURRENCES] / m
            wprob[r] = weights[s] * stats[s, MATCH] / total
            src[r] = s
    return build_tree(conts, n_rows, wcount, wprob, src, max_nodes)


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

"""How a datastore's maps read from disk (open_datastore's `access`): random advice for a store bigger than
half the available memory, the kernel's read-around for one that fits; the advice is the kernel's own (read
back from /proc/self/smaps), and answers never depend on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from service_testing import copy_store, make_store, vm_flags

from echospec.datastore import open_datastore
from echospec.datastore.files import proc_bytes
from echospec.datastore.store import random_access
from echospec.retriever import Retriever

GB = 1 << 30


def test_auto_advises_random_only_where_the_store_would_not_fit_in_half_the_memory():
    assert not random_access("auto", 1 * GB, 4 * GB)
    assert random_access("auto", 3 * GB, 4 * GB)
    assert random_access("auto", 1, None)  # memory unknown: the advice that never reads what it does not need
    assert random_access("random", 1, 64 * GB) and not random_access("readahead", 64 * GB, 1 * GB)
    with pytest.raises(ValueError, match="access must be one of"):
        random_access("sequential", 1, 1)
    available = proc_bytes("/proc/meminfo", "MemAvailable")
    assert available is None or available > 0


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the advice back from Linux's smaps")
def test_the_kernel_gets_the_advice_and_proposals_do_not_depend_on_it(tmp_path):
    store, corpus = make_store(tmp_path / "a", n_tokens=20_000, n_speakers=2)
    other = copy_store(store, tmp_path / "b")
    randomly, read_ahead = open_datastore(store, access="random"), open_datastore(other, access="readahead")
    assert randomly.random_access and not read_ahead.random_access
    for ds, advised in ((randomly, True), (read_ahead, False)):
        for name in ("tokens.npy", "sa.npy"):
            flags = vm_flags((ds.shards[0].directory / name).resolve())
            assert flags and all(("rr" in f) == advised for f in flags), (name, flags)
        speaker = ds.speakers[0]
        speaker_flags = vm_flags((ds.speaker_store(speaker).directory / "tokens.npy").resolve())
        assert speaker_flags and all(("rr" in f) == advised for f in speaker_flags)
    a, b = Retriever(randomly, use_faiss=False), Retriever(read_ahead, use_faiss=False)
    for u in corpus[:20]:
        context = np.array(u["tokens"][:30])
        ta, tb = a.propose(context, u["speaker"]), b.propose(context, u["speaker"])
        assert np.array_equal(ta.tokens, tb.tokens) and np.array_equal(ta.parents, tb.parents)
        assert np.array_equal(ta.probs, tb.probs)

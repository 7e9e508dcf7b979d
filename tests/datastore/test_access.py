"""How a datastore's maps read from disk (open_datastore's `access`): random advice for a store bigger than
half the available memory, the kernel's read-around for one that fits, and on request the stream read in with
the suffix array random; the advice is the kernel's own (read back from /proc/self/smaps), and answers never
depend on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from service_testing import copy_store, make_store, resident_bytes, vm_flags

from echospec.datastore import open_datastore
from echospec.datastore.files import proc_bytes
from echospec.datastore.store import choose_access
from echospec.retriever import Retriever

GB = 1 << 30


def test_auto_advises_random_only_where_the_store_would_not_fit_in_half_the_memory():
    assert choose_access("auto", GB // 2, GB // 2, 4 * GB) == "readahead"
    assert choose_access("auto", GB, 2 * GB, 4 * GB) == "random"  # the stream alone would fit: auto never reads it in
    assert choose_access("auto", 1, 1, None) == "random"  # memory unknown: the advice that reads only what it needs
    assert choose_access("random", 1, 1, 64 * GB) == "random"
    assert choose_access("readahead", 64 * GB, 0, GB) == "readahead"
    assert choose_access("stream", 1, 1, None) == "stream"
    with pytest.raises(ValueError, match="access must be one of"):
        choose_access("sequential", 1, 1, 1)
    available = proc_bytes("/proc/meminfo", "MemAvailable")
    assert available is None or available > 0


@pytest.mark.slow  # about 80 s on a 2-core machine: a store per access mode
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the advice back from Linux's smaps")
def test_the_kernel_gets_the_advice_and_proposals_do_not_depend_on_it(tmp_path):
    store, corpus = make_store(tmp_path / "a", n_tokens=20_000, n_speakers=2)
    opened = {access: open_datastore(copy_store(store, tmp_path / access), access=access)
              for access in ("random", "stream", "readahead")}
    random_advice = {"random": {"tokens.npy": True, "sa.npy": True}, "stream": {"tokens.npy": False, "sa.npy": True},
                     "readahead": {"tokens.npy": False, "sa.npy": False}}
    for access, ds in opened.items():
        assert ds.access == access
        speaker = ds.speakers[0]
        for directory in (ds.shards[0].directory, ds.speaker_store(speaker).directory):
            for name, advised in random_advice[access].items():
                flags = vm_flags((directory / name).resolve())
                assert flags and all(("rr" in f) == advised for f in flags), (access, name, flags)
            # "stream" reads the whole stream in when it opens; the others map pages only as proposals touch them
            stream = (directory / "tokens.npy").resolve()
            assert (resident_bytes(stream) >= stream.stat().st_size - 4096) == (access == "stream"), access
    retrievers = [Retriever(ds, use_faiss=False) for ds in opened.values()]
    for u in corpus[:20]:
        context = np.array(u["tokens"][:30])
        first, *others = (r.propose(context, u["speaker"]) for r in retrievers)
        for tree in others:
            assert np.array_equal(first.tokens, tree.tokens) and np.array_equal(first.parents, tree.parents)
            assert np.array_equal(first.probs, tree.probs)

"""The id rule of every corpus reader: raw model ids to store-local speech ids, checked.

local = raw - speech_offset, 0 <= local < size; stop ids become -1 (a segment boundary) and never enter a store;
drop ids (markers) are removed wherever they occur; with drop_non_speech other ids outside the speech range are
removed and counted instead of refused. A build applies it to a batch of utterances at once, an enrollment to each
utterance as a batch of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import CorpusError


@dataclass(frozen=True)
class Vocabulary:
    """How raw model ids map to store-local ids: local = raw - speech_offset, 0 <= local < size."""

    speech_offset: int = 0
    size: int | None = None  # None: the largest local id seen + 1
    stop_ids: tuple[int, ...] = ()  # raw ids that end a segment and are never stored
    drop_ids: tuple[int, ...] = ()  # raw marker ids removed wherever they occur (they split nothing)
    drop_non_speech: bool = False  # remove (and count) ids outside the speech range instead of refusing them


def local_ids(arr: np.ndarray, offsets: np.ndarray, vocab: Vocabulary, where):
    """The one id rule, over utterances `arr[offsets[u]:offsets[u + 1]]` at once: marker ids removed, every id
    checked (an error names the first utterance holding a bad id, `where(u)`), stop ids -1. Returns the local ids,
    their offsets, and the ids outside the speech range removed from each utterance (vocab.drop_non_speech; else
    None)."""
    remove = np.isin(arr, np.asarray(vocab.drop_ids, np.int64)) if vocab.drop_ids else None
    stop = np.isin(arr, np.asarray(vocab.stop_ids, np.int64)) if vocab.stop_ids else None
    offset = vocab.speech_offset
    outside = arr < offset
    if vocab.size is not None:
        outside |= arr >= offset + vocab.size
    if stop is not None:
        outside &= ~stop
    if remove is not None:
        outside &= ~remove
    negative = arr < 0
    if remove is not None:
        negative &= ~remove
    bad = negative if vocab.drop_non_speech else negative | outside
    if bad.any():
        u = utterance_of(offsets, int(np.argmax(bad)))
        _refuse(arr, slice(offsets[u], offsets[u + 1]), remove, stop, vocab, where(u))
    dropped = None
    if vocab.drop_non_speech and outside.any():
        dropped = np.diff(np.concatenate([[0], np.cumsum(outside)])[offsets])
        remove = outside if remove is None else remove | outside
    if remove is not None and remove.any():
        kept = np.zeros(len(arr) + 1, np.int64)
        np.cumsum(~remove, out=kept[1:])
        offsets = kept[offsets]
        arr = arr[~remove]
        stop = None if stop is None else stop[~remove]
    local = arr - offset if offset else arr
    return (local if stop is None else np.where(stop, -1, local)), offsets, dropped


def _refuse(arr: np.ndarray, utterance: slice, remove, stop, vocab: Vocabulary, where: str):
    """Raise the CorpusError for the utterance holding a bad id: its lowest id if negative, else its speech ids'
    lowest below the speech range or highest above it."""
    ids = arr[utterance]
    kept = np.ones(len(ids), bool) if remove is None else ~remove[utterance]
    if int(ids[kept].min()) < 0:
        raise CorpusError(f"{where}: negative token id {int(ids[kept].min())}")
    speech = ids[kept if stop is None else kept & ~stop[utterance]]
    offset = vocab.speech_offset
    if int(speech.min()) < offset:
        raise CorpusError(f"{where}: token id {int(speech.min())} is below the speech range "
                          f"(speech_offset {offset}) and is not a stop id (a marker id? drop it: --drop-id, "
                          "or keep only the speech range: --drop-non-speech)")
    raise CorpusError(f"{where}: token id {int(speech.max())} is outside the speech range "
                      f"{offset}..{offset + vocab.size - 1} and is not a stop id (a marker id? drop it: "
                      "--drop-id, or keep only the speech range: --drop-non-speech)")


def utterance_of(offsets: np.ndarray, index: int) -> int:
    """The utterance holding id `index` of utterances concatenated at `offsets`."""
    return int(np.searchsorted(offsets, index, side="right")) - 1

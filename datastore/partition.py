"""A partition task's writer: a corpus unit's batches split into per-shard and per-speaker-group files, by
whole arrays (Python runs per batch and per shard, and per utterance only to hash its id and speaker and to
keep its catalog row's strings).

Files (tasks.py names them): `chunk-NNNN.shard-SSSSS.npz` (tokens, segment lengths, the ids the corpus
gave with their places), `chunk-NNNN.group-GGGGG.npz` (tokens, segment lengths, each segment's speaker)
and `chunk-NNNN.meta.npz` (the catalog rows of the utterances with speech, in corpus order). A chunk
is written whenever CHUNK_TOKENS tokens are held, which bounds a task's memory whatever its unit's size.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from .catalog import sha256
from .corpus import Batch
from .errors import CorpusError, DatastoreError
from .names import check_name

CHUNK_TOKENS = 1 << 24
"""Tokens a partition task holds before writing its files."""


def stable_hash(text: str) -> int:
    """The same on every machine and Python run (unlike hash(), which is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _buckets(names: list[str], n: int) -> np.ndarray:
    """stable_hash(name) % n for each name (all 0 when n is 1: nothing to hash)."""
    if n == 1:
        return np.zeros(len(names), np.int64)
    return np.fromiter((stable_hash(name) % n for name in names), np.int64, len(names))


class PartitionWriter:
    def __init__(self, directory: Path, shards: int, groups: int):
        self.directory, self.shards, self.groups = directory, shards, groups
        self.files: dict[str, int] = {}
        self.digests: dict[str, str] = {}
        self.chunk = 0
        self.shard_tokens = [0] * shards
        self.shard_segments = [0] * shards
        self.shard_utterances = [0] * shards
        self.group_tokens = [0] * groups
        self.utterances = self.tokens = self.skipped = 0
        self.first_skipped: str | None = None
        self.dropped_tokens = self.dropped_utterances = 0
        self.first_dropped: str | None = None
        self.max_id = -1
        self.speakers: dict[str, int] = {}  # every speaker seen (checked once), numbered
        self.speaker_group = np.zeros(0, np.int64)  # each speaker's group
        self._reset()

    def _reset(self):
        self.held = 0
        self.shard_parts: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(self.shards)]
        self.shard_ids: list[dict[str, list[str]]] = [{"ids": [], "wheres": []} for _ in range(self.shards)]
        self.group_parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in range(self.groups)]
        self.meta: dict[str, list] = {"ids": [], "speakers": [], "tokens": [], "sources": [], "extras": []}

    def add(self, batch: Batch) -> None:
        ids, wheres = batch.utterance_ids(), batch.wheres()
        self._count_dropped(batch)
        speaker_of = self._speakers(batch, ids, wheres) if self.groups else None
        shard_of = _buckets(ids, self.shards)
        if batch.ids is not None:  # the ids the corpus gave, for build_shard's check that none repeats
            given = [i for i, uid in enumerate(batch.ids) if uid is not None]
            for i in given:
                record = self.shard_ids[shard_of[i]]
                record["ids"].append(ids[i])
                record["wheres"].append(wheres[i])
        tokens, offsets = batch.tokens, batch.offsets
        speech = tokens >= 0
        if speech.all():  # nearly every batch: no stop ids, and a cumulative sum over its tokens saved
            per_utterance = np.diff(offsets)
        else:
            per_utterance = np.diff(np.concatenate([[0], np.cumsum(speech)])[offsets])
        kept = np.flatnonzero(per_utterance > 0)
        if len(kept) < len(ids):
            self.skipped += len(ids) - len(kept)
            self.first_skipped = self.first_skipped or wheres[int(np.argmax(per_utterance == 0))]
        seg_utt, seg_len, values = _segments(tokens, offsets, speech)
        for s, part, lengths, _ in _split(shard_of[seg_utt], seg_len, values, self.shards):
            self.shard_parts[s].append((part, lengths))
            self.shard_tokens[s] += int(lengths.sum())
            self.shard_segments[s] += len(lengths)
        for s, count in enumerate(np.bincount(shard_of[kept], minlength=self.shards).tolist()):
            self.shard_utterances[s] += count
        if self.groups:
            self._add_groups(speaker_of, seg_utt, seg_len, values)
        self._add_meta(batch, ids, wheres, kept, per_utterance)
        n = int(seg_len.sum())
        self.utterances += len(kept)
        self.tokens += n
        if n:
            self.max_id = max(self.max_id, int(values.max()))
        self.held += n
        if self.held >= CHUNK_TOKENS:
            self._flush()

    def _count_dropped(self, batch: Batch) -> None:
        if batch.dropped_tokens:
            self.dropped_tokens += batch.dropped_tokens
            self.dropped_utterances += batch.dropped_utterances
            self.first_dropped = self.first_dropped or batch.first_dropped

    def _speakers(self, batch: Batch, ids: list[str], wheres: list[str]) -> np.ndarray:
        """Each utterance's speaker number; a missing or unusable speaker is a corpus error naming its place."""
        names = batch.speakers if batch.speakers is not None else [None] * len(ids)
        numbers = np.empty(len(names), np.int64)
        for i, name in enumerate(names):
            number = self.speakers.get(name)
            if number is None:
                self._check_speaker(name, ids[i], wheres[i])
                number = self.speakers[name] = len(self.speakers)
            numbers[i] = number
        return numbers

    @staticmethod
    def _check_speaker(name: str | None, uid: str, where: str) -> None:
        if name is None:
            raise CorpusError(f"{where}: utterance {uid!r} has no 'speaker', "
                              "but per-speaker stores were asked for (use --no-per-speaker or add speakers)")
        try:
            check_name("speaker", name)
        except DatastoreError as e:
            raise CorpusError(f"{where}: {e}; rename the speaker in the corpus, or build with "
                              f"per_speaker=False (--no-per-speaker)") from None

    def _add_groups(self, speaker_of: np.ndarray, seg_utt: np.ndarray, seg_len: np.ndarray, values: np.ndarray):
        new = list(self.speakers)[len(self.speaker_group):]
        self.speaker_group = np.concatenate([self.speaker_group, _buckets(new, self.groups)])
        seg_speaker = speaker_of[seg_utt]
        for g, part, lengths, mine in _split(self.speaker_group[seg_speaker], seg_len, values, self.groups):
            self.group_parts[g].append((part, lengths, seg_speaker[mine]))
            self.group_tokens[g] += int(lengths.sum())

    def _add_meta(self, batch: Batch, ids: list[str], wheres: list[str], kept: np.ndarray,
                  per_utterance: np.ndarray) -> None:
        rows = kept.tolist() if len(kept) < len(ids) else range(len(ids))
        speakers = batch.speakers or [None] * len(ids)
        self.meta["ids"].extend(ids[i] for i in rows)
        self.meta["speakers"].extend(speakers[i] or "" for i in rows)
        self.meta["tokens"].append(per_utterance[kept])
        self.meta["sources"].extend(wheres[i] for i in rows)
        if batch.extras is None:
            self.meta["extras"].extend([""] * len(kept))
        else:
            self.meta["extras"].extend(json.dumps(batch.extras[i], default=str) if batch.extras[i] else ""
                                       for i in rows)

    def _flush(self) -> None:
        prefix = f"chunk-{self.chunk:04d}"
        for shard, (parts, ids) in enumerate(zip(self.shard_parts, self.shard_ids)):
            if parts or ids["ids"]:
                self._save(f"{prefix}.shard-{shard:05d}.npz", **_pack_segments(parts),
                           **pack_strings("ids", ids["ids"]), **pack_strings("wheres", ids["wheres"]))
        names = list(self.speakers)
        for group, parts in enumerate(self.group_parts):
            if parts:
                speaker = np.concatenate([p[2] for p in parts])
                used = sorted(set(speaker.tolist()), key=names.__getitem__)  # by name, as np.unique ordered them
                index = np.zeros(len(names), np.int32)
                index[used] = np.arange(len(used), dtype=np.int32)
                self._save(f"{prefix}.group-{group:05d}.npz", **_pack_segments([p[:2] for p in parts]),
                           owner=index[speaker], **pack_strings("names", [names[i] for i in used]))
        if self.meta["ids"]:
            self._save(f"{prefix}.meta.npz", tokens=np.concatenate(self.meta["tokens"]).astype(np.int64),
                       **{k: v for key in ("ids", "speakers", "sources", "extras")
                          for k, v in pack_strings(key, self.meta[key]).items()})
        self.chunk += 1
        self._reset()

    def _save(self, name: str, **arrays) -> None:
        path = self.directory / name
        with open(path, "wb") as f:
            np.savez(f, **arrays)
        self.files[name] = path.stat().st_size
        self.digests[name] = sha256(path)

    def close(self) -> dict:
        self._flush()
        return {"utterances": self.utterances, "tokens": self.tokens, "max_id": self.max_id,
                "skipped": self.skipped, "first_skipped": self.first_skipped,
                "dropped_tokens": self.dropped_tokens, "dropped_utterances": self.dropped_utterances,
                "first_dropped": self.first_dropped,
                "shard_tokens": self.shard_tokens, "shard_segments": self.shard_segments,
                "shard_utterances": self.shard_utterances,
                "group_tokens": self.group_tokens, "files": self.files, "sha256": self.digests}


def _split(seg_bucket: np.ndarray, seg_len: np.ndarray, values: np.ndarray, buckets: int):
    """The segments of each bucket (shard or speaker group) that has any: (bucket, its tokens, its segments'
    lengths, its segments' mask). Each token's bucket as uint16 (buckets <= 65536): the per-bucket masks read 2
    bytes a token, not 8, and none at all for one bucket."""
    token_bucket = np.repeat(seg_bucket.astype(np.uint16), seg_len) if buckets > 1 else None
    for b in range(buckets):
        mine = seg_bucket == b
        if mine.any():
            yield b, values if token_bucket is None else values[token_bucket == b], seg_len[mine], mine


def _segments(tokens: np.ndarray, offsets: np.ndarray, speech: np.ndarray):
    """The non-empty runs of speech tokens between utterance boundaries and stop ids (-1), in order: each
    one's utterance, its length, and all their tokens concatenated."""
    stops = np.flatnonzero(~speech)
    starts = np.sort(np.concatenate([offsets[:-1], stops + 1]))
    ends = np.sort(np.concatenate([stops, offsets[1:]]))
    lengths = ends - starts
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    utterance = np.searchsorted(offsets, starts, side="right") - 1
    values = tokens[speech] if len(stops) else tokens
    return utterance, lengths, values.astype(_token_dtype(values))


def _token_dtype(values: np.ndarray) -> np.dtype:
    """The files' token type: uint16 while the ids fit below its top value (exact.stream_dtype's sentinel),
    else uint32; chosen per batch, so that a chunk's arrays are narrowed once, not copied again when saved."""
    return np.dtype(np.uint16) if values.max(initial=0) < np.iinfo(np.uint16).max else np.dtype(np.uint32)


def _pack_segments(parts: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    tokens = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.uint16)
    lengths = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    return {"tokens": tokens.astype(_token_dtype(tokens), copy=False), "lengths": lengths.astype(np.int64, copy=False)}


def pack_strings(key: str, strings: list[str]) -> dict:
    """Strings as one UTF-8 blob and offsets: a fixed-width NumPy string array would pad every entry to
    the longest (one long transcript in `extras` would cost every utterance its length)."""
    joined = "".join(strings)
    offsets = np.zeros(len(strings) + 1, np.int64)
    if joined.isascii():  # one encode, and a character is a byte (ids and places nearly always are)
        np.cumsum(np.fromiter(map(len, strings), np.int64, len(strings)), out=offsets[1:])
        return {f"{key}_blob": np.frombuffer(joined.encode(), np.uint8), f"{key}_offsets": offsets}
    blobs = [s.encode() for s in strings]
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    return {f"{key}_blob": np.frombuffer(b"".join(blobs), np.uint8), f"{key}_offsets": offsets}


def unpack_strings(data, key: str) -> list[str]:
    blob, offsets = data[f"{key}_blob"].tobytes(), data[f"{key}_offsets"].tolist()
    text = blob.decode()
    if len(text) == len(blob):  # ASCII: slice the decoded text, not each string's bytes
        return [text[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    return [blob[a:b].decode() for a, b in zip(offsets[:-1], offsets[1:])]

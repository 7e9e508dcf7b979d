"""Reading speech-token corpora: JSONL, a JSONL manifest of `.npy` files, `.npz`, or Parquet.

Every reader yields `Utterance`s whose tokens are already store-local speech ids (raw id minus
`speech_offset`, checked against `vocab_size`). Stop ids split an utterance where they occur and never
enter a store, so no continuation runs through an end-of-speech token. Drop ids (markers such as LLaSA's
<|SPEECH_GENERATION_START|>) are removed wherever they occur, as a decoder leaves them out of the
retriever's context.

Formats
  * JSONL, one utterance a line: ``{"id": "u1", "speaker": "ann", "tokens": [12, 7, ...]}``.
    Other fields are kept in the catalog. A line may give ``"path": "u1.npy"`` (relative to the
    file) instead of ``"tokens"``: that makes the JSONL a manifest of per-utterance `.npy` files.
  * ``.npz`` with ``tokens`` (all utterances concatenated, 1-D ints) and ``lengths`` (1-D ints),
    optionally ``ids`` and ``speakers`` (1-D string arrays of the same length as ``lengths``).
  * ``.parquet`` with a ``tokens`` list-of-integers column, optionally ``id`` and ``speaker``; other
    columns are kept in the catalog. Text columns may be dictionary-encoded, large_string or string_view.
    Needs pyarrow (the ``ray`` extra installs it).

A corpus is one or more files or glob patterns ("shards/*.parquet"). A build reads it in units
that tasks can read independently: a JSONL or .npz file, or one Parquet row group.
"""

from __future__ import annotations

import glob
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from .errors import CorpusError, one_line
from .ids import Vocabulary, local_ids, utterance_of

log = logging.getLogger(__name__)


@dataclass
class Utterance:
    id: str
    speaker: str | None
    tokens: np.ndarray  # int64, store-local ids, stop ids removed (segments split by -1 if any)
    where: str  # "file:line" for messages
    extra: dict = field(default_factory=dict)
    id_given: bool = True  # False: the id is the default "<file stem>:<line>", not from the corpus


_INT = {int}
BATCH_TOKENS = 1 << 22
"""Tokens a reader puts in one Batch (a Parquet row group is one batch whatever its size)."""


@dataclass
class Batch:
    """Consecutive utterances of one corpus file as arrays, checked and mapped to local ids as a whole:
    what a build reads. Only the ids, speakers and other fields a corpus gives are Python objects."""

    source: str  # the file
    kind: str  # how a message names an utterance's place: "line" (JSONL), "row" (Parquet), "utterance" (.npz)
    numbers: np.ndarray  # int64, each utterance's line, row or utterance number in its file
    tokens: np.ndarray  # int64 store-local ids, -1 at stop ids; the utterances concatenated
    offsets: np.ndarray  # int64[n + 1]: utterance i is tokens[offsets[i]:offsets[i + 1]]
    ids: list | None = None  # the ids the corpus gives (str; None where it gives none)
    speakers: list | None = None  # str or None
    extras: list | None = None  # dicts of the other fields, or None when the corpus has none
    dropped_tokens: int = 0  # ids outside the speech range removed (Vocabulary.drop_non_speech)
    dropped_utterances: int = 0  # ... from this many utterances
    first_dropped: str | None = None  # where the first of them is

    def __len__(self) -> int:
        return len(self.numbers)

    def where(self, i: int) -> str:
        number = int(self.numbers[i])
        return f"{self.source}:{number}" if self.kind == "line" else f"{self.source}:{self.kind} {number}"

    def wheres(self) -> list[str]:
        prefix = f"{self.source}:" if self.kind == "line" else f"{self.source}:{self.kind} "
        return [prefix + str(n) for n in self.numbers.tolist()]

    def utterance_ids(self) -> list[str]:
        """Each utterance's id: the corpus's, else "<file stem>:<line, row or utterance number>"."""
        stem = Path(self.source).stem
        if self.ids is None:
            return [f"{stem}:{n}" for n in self.numbers.tolist()]
        return [f"{stem}:{n}" if uid is None else uid for uid, n in zip(self.ids, self.numbers.tolist())]

    def utterances(self) -> Iterator[Utterance]:
        ids, offsets = self.utterance_ids(), self.offsets
        for i in range(len(self)):
            yield Utterance(ids[i], None if self.speakers is None else self.speakers[i],
                            self.tokens[offsets[i]:offsets[i + 1]], self.where(i),
                            {} if self.extras is None else self.extras[i],
                            id_given=self.ids is not None and self.ids[i] is not None)


def read_corpus(paths: str | Path | Sequence[str | Path], vocab: Vocabulary) -> Iterator[Utterance]:
    """Yield the utterances of one or more corpus files, checked and mapped to local ids."""
    for unit in corpus_units(corpus_files(paths)):
        yield from read_unit(unit, vocab)


def corpus_files(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """The corpus files named by `paths`, glob patterns expanded (sorted), in the order given."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise CorpusError("no corpus file given")
    files = []
    for name in map(str, paths):
        if not Path(name).exists() and glob.has_magic(name):
            matched = sorted(glob.glob(name))
            if not matched:
                raise CorpusError(f"{name}: no corpus file matches this pattern")
            files.extend(map(Path, matched))
        else:
            files.append(Path(name))
    for path in files:
        if not path.exists():
            raise CorpusError(f"{path}: corpus file not found")
        if path.is_dir():
            raise CorpusError(f"{path}: is a directory; give .jsonl, manifest .jsonl, .npz or .parquet files "
                              "(or a glob such as 'dir/*.parquet')")
    return files


def corpus_units(files: Sequence[Path]) -> list[tuple[str, int]]:
    """(file, part) pairs that can be read independently: part is a Parquet row group, else 0."""
    units = []
    for path in files:
        if _is_parquet(path):
            units.extend((str(path), group) for group in range(_parquet_file(path).num_row_groups))
        else:
            units.append((str(path), 0))
    return units


def read_unit(unit: tuple[str, int], vocab: Vocabulary) -> Iterator[Utterance]:
    for batch in read_batches(unit, vocab):
        yield from batch.utterances()


def read_batches(unit: tuple[str, int], vocab: Vocabulary) -> Iterator[Batch]:
    """The utterances of one corpus unit in batches, each checked and mapped as whole arrays."""
    path, part = Path(unit[0]), unit[1]
    if _is_parquet(path):
        return _read_parquet_group(path, part, vocab)
    return _read_npz(path, vocab) if path.suffix == ".npz" else _read_jsonl(path, vocab)


# --- JSONL -------------------------------------------------------------------------------------------------


def _read_jsonl(path: Path, vocab: Vocabulary) -> Iterator[Batch]:
    """One JSON parse per line (unavoidable), the checks and mapping per batch."""
    name = str(path)
    lines = _JsonlLines(name)
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{name}:{number}"
            row = _parse_line(line, where)
            if "tokens" in row:
                try:
                    tokens = _as_array(row.pop("tokens"), where)
                except CorpusError:  # orjson reads an integer beyond 64 bits as a float: json words it exactly
                    _as_array(json.loads(line)["tokens"], where)
                    raise
            elif "path" in row:
                tokens = _as_array(_load_npy(path.parent / str(row.pop("path")), where), where)
            else:
                raise CorpusError(f"{where}: utterance has no 'tokens' (or 'path' to a .npy file)")
            lines.add(number, row, tokens, where)
            if lines.held >= BATCH_TOKENS:
                yield lines.batch(vocab)
    if lines.numbers:
        yield lines.batch(vocab)


class _JsonlLines:
    """The lines of a JSONL batch being read."""

    def __init__(self, source: str):
        self.source = source
        self._reset()

    def _reset(self):
        self.numbers: list[int] = []
        self.parts: list[np.ndarray] = []
        self.ids: list = []
        self.speakers: list = []
        self.extras: list[dict] = []
        self.held = 0

    def add(self, number: int, row: dict, tokens: np.ndarray, where: str) -> None:
        uid, speaker = row.pop("id", None), row.pop("speaker", None)
        if speaker is not None and not isinstance(speaker, (str, int)):
            raise CorpusError(f"{where}: 'speaker' must be a string")
        if uid is not None and not isinstance(uid, (str, int)):
            raise CorpusError(f"{where}: 'id' must be a string")
        self.numbers.append(number)
        self.parts.append(tokens)
        self.ids.append(None if uid is None else str(uid))
        self.speakers.append(None if speaker in (None, "") else str(speaker))
        self.extras.append(row)
        self.held += len(tokens)

    def batch(self, vocab: Vocabulary) -> Batch:
        lengths = np.fromiter(map(len, self.parts), np.int64, len(self.parts))
        raw = np.concatenate(self.parts) if self.parts else np.zeros(0, np.int64)
        batch = _batch(self.source, "line", np.asarray(self.numbers, np.int64), raw, lengths, vocab,
                       ids=self.ids, speakers=self.speakers,
                       extras=self.extras if any(self.extras) else None)
        self._reset()
        return batch


def _parse_line(line: bytes, where: str) -> dict:
    """The line's JSON object. orjson parses a speech-token line 2-4x faster than `json` (bench_ingest);
    what it refuses goes to `json`, which reads integers beyond 64 bits (the checks then name them) and
    words the errors."""
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorpusError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: expected a JSON object with 'tokens', got {type(row).__name__}")
    return row


def _as_array(raw, where: str) -> np.ndarray:
    """One utterance's tokens as a 1-D int64 array: a JSON list has every item checked, an array from a
    .npy file its shape and dtype."""
    if not isinstance(raw, np.ndarray):
        if not isinstance(raw, list):
            raise CorpusError(f"{where}: 'tokens' must be a list of integers")
        if not set(map(type, raw)) <= _INT:  # bool is no token id, though NumPy would take it for one
            bad = next(t for t in raw if type(t) is not int)
            if isinstance(bad, list):
                raise CorpusError(f"{where}: tokens must be a 1-D list of integers, found a nested list")
            raise CorpusError(f"{where}: token {bad!r} is not an integer")
        try:
            raw = np.array(raw, dtype=np.int64)
        except OverflowError:
            raise CorpusError(f"{where}: token id too large for a 64-bit integer") from None
    if raw.ndim != 1:
        raise CorpusError(f"{where}: tokens must be a 1-D sequence, got shape {raw.shape}")
    if raw.dtype.kind not in "iu" and raw.size:
        raise CorpusError(f"{where}: tokens must be integers, got {raw.dtype} values")
    if raw.dtype == np.uint64 and raw.size and raw.max() > np.iinfo(np.int64).max:
        raise CorpusError(f"{where}: token id too large for a 64-bit integer")
    return raw.astype(np.int64, copy=False)


def _load_npy(path: Path, where: str) -> np.ndarray:
    try:  # numpy answers a damaged file with many exception types, some messages over several lines
        arr = np.load(path, allow_pickle=False)
    except Exception as e:
        raise CorpusError(f"{where}: cannot read {path}: {one_line(e)}") from None
    if not isinstance(arr, np.ndarray):
        arr.close()
        raise CorpusError(f"{where}: cannot read {path}: not a .npy file")
    return arr


# --- .npz --------------------------------------------------------------------------------------------------


def _read_npz(path: Path, vocab: Vocabulary) -> Iterator[Batch]:
    try:  # a fake or damaged archive fails in zipfile, zlib or numpy, each with its own exception types
        data = np.load(path, allow_pickle=False)
        if not hasattr(data, "files"):
            raise ValueError("a .npy file, not a .npz archive")
        with data:
            missing = next((name for name in ("tokens", "lengths") if name not in data.files), None)
            if missing is not None:
                raise CorpusError(f"{path}: .npz needs arrays 'tokens' and 'lengths' (missing '{missing}')")
            tokens, lengths = data["tokens"], data["lengths"]
            ids = data["ids"] if "ids" in data.files else None
            speakers = data["speakers"] if "speakers" in data.files else None
    except CorpusError:
        raise
    except Exception as e:
        raise CorpusError(f"{path}: cannot read .npz: {one_line(e)}") from None
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or np.any(lengths < 0):
        raise CorpusError(f"{path}: 'lengths' must be a 1-D array of non-negative integers")
    if int(lengths.sum()) != len(tokens):
        raise CorpusError(f"{path}: 'lengths' sum to {int(lengths.sum())} but 'tokens' holds {len(tokens)}")
    for name, arr in (("ids", ids), ("speakers", speakers)):
        if arr is not None and len(arr) != len(lengths):
            raise CorpusError(f"{path}: '{name}' has {len(arr)} entries, 'lengths' has {len(lengths)}")
    if tokens.ndim != 1:
        raise CorpusError(f"{path}: 'tokens' must be a 1-D array, got shape {tokens.shape}")
    ends = np.cumsum(lengths, dtype=np.int64)
    cuts = np.searchsorted(ends, np.arange(BATCH_TOKENS, len(tokens), BATCH_TOKENS), side="left") + 1
    bounds = np.unique(np.concatenate([[0], cuts, [len(lengths)]]))
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        start = int(ends[a - 1]) if a else 0
        yield _batch(str(path), "utterance", np.arange(a, b, dtype=np.int64), tokens[start:ends[b - 1] if b else 0],
                     lengths[a:b].astype(np.int64), vocab,
                     ids=None if ids is None else ids[a:b].astype(str).tolist(),
                     speakers=None if speakers is None else [s or None for s in speakers[a:b].astype(str).tolist()])


# --- Parquet -----------------------------------------------------------------------------------------------


def _is_parquet(path: Path) -> bool:
    return path.suffix in (".parquet", ".pq")


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"{path}: reading Parquet needs pyarrow: install the parquet extra: "
                          "pip install -e '.[parquet]' in a checkout") from None
    try:
        return pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's errors subclass these
        raise CorpusError(f"{path}: cannot read Parquet: {one_line(e)}") from None


def _read_parquet_group(path: Path, group: int, vocab: Vocabulary) -> Iterator[Batch]:
    import pyarrow as pa

    parquet = _parquet_file(path)
    if "tokens" not in parquet.schema_arrow.names:
        raise CorpusError(f"{path}: Parquet corpus needs a 'tokens' column (a list of integers per utterance)")
    first_row = sum(parquet.metadata.row_group(g).num_rows for g in range(group))
    table = parquet.read_row_group(group)
    column = table.column("tokens").combine_chunks()
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)) \
            or not pa.types.is_integer(column.type.value_type):
        raise CorpusError(f"{path}: column 'tokens' must be a list of integers, not {column.type}")
    if column.null_count:
        row = first_row + column.is_null().to_numpy(zero_copy_only=False).argmax()
        raise CorpusError(f"{path}:row {row}: 'tokens' is null")
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.to_numpy(zero_copy_only=False)  # offsets index the unsliced values
    ids = _parquet_names(table, "id", path, first_row)
    speakers = _parquet_names(table, "speaker", path, first_row)
    if speakers is not None:
        speakers = [s or None for s in speakers]
    others = [name for name in table.column_names if name not in ("tokens", "id", "speaker")]
    extras = None
    if others:  # other fields go to the catalog row by row
        columns = [_plain_text(table.column(name)).to_pylist() for name in others]
        extras = [dict(zip(others, values_)) for values_ in zip(*columns)]
    yield _batch(str(path), "row", np.arange(first_row, first_row + len(offsets) - 1, dtype=np.int64),
                 values[offsets[0]:offsets[-1]], np.diff(offsets), vocab, ids=ids, speakers=speakers, extras=extras)


def _parquet_names(table, name: str, path: Path, first_row: int) -> list | None:
    """An id or speaker column as strings (None where null); strings or integers only."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if name not in table.column_names:
        return None
    column = _plain_text(table.column(name))
    if not (pa.types.is_string(column.type) or pa.types.is_integer(column.type) or pa.types.is_null(column.type)):
        row = first_row + int(np.argmax(column.is_valid().to_numpy(zero_copy_only=False)))
        raise CorpusError(f"{path}:row {row}: '{name}' must be a string")
    if pa.types.is_integer(column.type):
        column = pc.cast(column, pa.string())
    return column.to_pylist()


def _plain_text(column):
    """An Arrow column as the reader expects text: dictionary-encoded values (pandas categoricals, and what many
    Parquet writers make of a repeated string column) decoded, large_string and string_view as string. The
    values are the same strings; only their encoding differs. Columns of other types are returned as they are."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = column.type.value_type if pa.types.is_dictionary(column.type) else column.type
    if pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        kind = pa.string()
    return column if kind == column.type else pc.cast(column, kind)


# --- checking and mapping ids ------------------------------------------------------------------------------


def _batch(source: str, kind: str, numbers: np.ndarray, raw: np.ndarray, lengths: np.ndarray, vocab: Vocabulary,
           **columns) -> Batch:
    """A Batch of utterances whose raw ids are `raw` (concatenated, `lengths` each), checked and mapped."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    batch = Batch(source, kind, numbers, raw, offsets, **columns)
    if raw.dtype.kind not in "iu" and raw.size:
        first = int(np.argmax(lengths > 0))
        raise CorpusError(f"{batch.where(first)}: tokens must be integers, got {raw.dtype} values")
    if raw.dtype == np.uint64 and raw.size and raw.max() > np.iinfo(np.int64).max:
        first = utterance_of(offsets, int(np.argmax(raw > np.iinfo(np.int64).max)))
        raise CorpusError(f"{batch.where(first)}: token id too large for a 64-bit integer")
    batch.tokens, batch.offsets, dropped = local_ids(raw.astype(np.int64, copy=False), offsets, vocab, batch.where)
    if dropped is not None:
        batch.dropped_tokens = int(dropped.sum())
        batch.dropped_utterances = int(np.count_nonzero(dropped))
        batch.first_dropped = batch.where(int(np.argmax(dropped > 0)))
    return batch


def counted_local_ids(raw, where: str, vocab: Vocabulary) -> tuple[np.ndarray, int]:
    """One utterance's raw ids checked and mapped to local ids (stop ids -1, a segment boundary), and how many ids
    outside the speech range were removed (with vocab.drop_non_speech; else 0): the utterance checked as a batch
    of one."""
    arr = _as_array(raw, where).astype(np.int64, copy=False)
    local, _, dropped = local_ids(arr, np.array([0, len(arr)], np.int64), vocab, lambda u: where)
    return local, 0 if dropped is None else int(dropped[0])


def split_segments(tokens: np.ndarray) -> list[np.ndarray]:
    """The non-empty runs of an utterance between stop ids (-1)."""
    if not tokens.size or tokens.min() >= 0:
        return [tokens] if tokens.size else []
    cuts = np.flatnonzero(tokens < 0)
    parts = (part[part >= 0] for part in np.split(tokens, cuts))
    return [part for part in parts if part.size]


def split_layout_breaks(segments: list[np.ndarray], vocab_size: int, codebooks: int) -> tuple[list[np.ndarray], int]:
    """With interleaved codebooks, a token must be in the codebook after its predecessor's (cyclically):
    split segments where one is not (a lost token), so no stored continuation crosses a break. Returns the
    segments and the number of breaks."""
    if codebooks == 1:
        return segments, 0
    width, out, breaks = vocab_size // codebooks, [], 0
    for seg in segments:
        book = seg // width
        cuts = np.flatnonzero(book[1:] != (book[:-1] + 1) % codebooks) + 1
        breaks += len(cuts)
        out.extend(np.split(seg, cuts) if len(cuts) else [seg])
    return out, breaks
def has_speech(utt: Utterance) -> bool:
    """False for an utterance with no speech tokens (`"tokens": []`, or only stop ids): it is skipped."""
    return bool((utt.tokens >= 0).any())


class UniqueIds:
    """Refuses a repeated utterance id, naming both places (the same utterance twice would double its
    counts). Ids a corpus does not give ("<file stem>:<line>") are not checked."""

    def __init__(self):
        self.seen: dict[str, str] = {}

    def add(self, utt_id: str, where: str) -> None:
        if utt_id in self.seen:
            raise CorpusError(f"{where}: utterance id {utt_id!r} is already used at {self.seen[utt_id]}")
        self.seen[utt_id] = where


def warn_dropped(first: str, tokens: int, utterances: int, vocab: Vocabulary) -> None:
    """One warning for every id left out for being outside the speech range (Vocabulary.drop_non_speech)."""
    top = "" if vocab.size is None else f"..{vocab.speech_offset + vocab.size - 1}"
    log.warning("%s: %d token ids outside the speech range %d%s dropped from %d utterances (this is the first; "
                "drop_non_speech)", first, tokens, vocab.speech_offset, top, utterances)


def warn_skipped(first: str, count: int) -> None:
    """One warning for all the utterances skipped for having no speech tokens; `first` is where the first is."""
    others = f" (and {count - 1} more utterances like it)" if count > 1 else ""
    log.warning("%s: utterance has no speech tokens; skipped%s", first, others)


def collect(utterances: Iterable[Utterance]) -> list[Utterance]:
    """Materialise an enrollment's corpus, checked as a whole as a build checks its own (tasks.py):
    repeated ids refused, utterances with no speech tokens skipped with one warning."""
    out, skipped, ids = [], [], UniqueIds()
    for utt in utterances:
        if utt.id_given:
            ids.add(utt.id, utt.where)
        (out if has_speech(utt) else skipped).append(utt)
    if skipped:
        warn_skipped(skipped[0].where, len(skipped))
    return out

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
    columns are kept in the catalog. Needs pyarrow (the ``ray`` extra installs it).

A corpus is one or more files or glob patterns ("shards/*.parquet"). A build reads it in units
that tasks can read independently: a JSONL or .npz file, or one Parquet row group.
"""

from __future__ import annotations

import glob
import json
import logging
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import CorpusError, one_line

log = logging.getLogger(__name__)


@dataclass
class Utterance:
    id: str
    speaker: str | None
    tokens: np.ndarray  # int64, store-local ids, stop ids removed (segments split by -1 if any)
    where: str  # "file:line" for messages
    extra: dict = field(default_factory=dict)
    id_given: bool = True  # False: the id is the default "<file stem>:<line>", not from the corpus


@dataclass(frozen=True)
class Vocabulary:
    """How raw model ids map to store-local ids: local = raw - speech_offset, 0 <= local < size."""

    speech_offset: int = 0
    size: int | None = None  # None: the largest local id seen + 1
    stop_ids: tuple[int, ...] = ()  # raw ids that end a segment and are never stored
    drop_ids: tuple[int, ...] = ()  # raw marker ids removed wherever they occur (they split nothing)


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
    path, part = Path(unit[0]), unit[1]
    if _is_parquet(path):
        return _read_parquet_group(path, part, vocab)
    return _read_npz(path, vocab) if path.suffix == ".npz" else _read_jsonl(path, vocab)


def _read_jsonl(path: Path, vocab: Vocabulary) -> Iterator[Utterance]:
    with open(path, "rb") as f:
        name = str(path)
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{name}:{number}"
            row, raw = _parse_line(line, where)
            if raw is None:
                if "tokens" in row:
                    raw = row.pop("tokens")
                elif "path" in row:
                    raw = _load_npy(path.parent / str(row.pop("path")), where)
                else:
                    raise CorpusError(f"{where}: utterance has no 'tokens' (or 'path' to a .npy file)")
            yield _utterance(row.pop("id", None), row.pop("speaker", None), raw, where, vocab, extra=row,
                             default_id=f"{path.stem}:{number}")


def _parse_line(line: bytes, where: str) -> tuple[dict, np.ndarray | None]:
    """The line's object and, when they are plain integers, its tokens already as an array.

    Parsing a long token list with `json` costs most of a build's reading time; NumPy's text
    parser is ~5x faster. Anything unusual falls back to `json`, whose errors the
    checks report.
    """
    start = line.find(b'"tokens"')
    if start >= 0:
        open_at = line.find(b"[", start)
        close_at = line.find(b"]", open_at)
        if open_at > 0 and close_at > 0 and line[start + 8:open_at].strip() == b":":
            try:
                body = line[open_at + 1:close_at]
                with warnings.catch_warnings():
                    warnings.simplefilter("error", DeprecationWarning)  # older numpy warns on stray text
                    tokens = np.fromstring(body, dtype=np.int64, sep=",") if body.strip() else np.zeros(0, np.int64)
                row = json.loads(line[:open_at] + b"[]" + line[close_at + 1:])
            except (ValueError, DeprecationWarning, UnicodeDecodeError):
                pass
            else:
                # fromstring clips huge ids, reads a lone "-" as 0 and forgives a trailing comma:
                # leave those lines to json and the checks
                exact = (b"-" not in body and len(tokens) == body.count(b",") + bool(body.strip())
                         and not (tokens.size and tokens.max() >= np.iinfo(np.int64).max))
                if exact and isinstance(row, dict) and row.pop("tokens", None) == []:
                    return row, tokens
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorpusError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: expected a JSON object with 'tokens', got {type(row).__name__}")
    return row, None


def _load_npy(path: Path, where: str) -> np.ndarray:
    try:  # numpy answers a damaged file with many exception types, some messages over several lines
        arr = np.load(path, allow_pickle=False)
    except Exception as e:
        raise CorpusError(f"{where}: cannot read {path}: {one_line(e)}") from None
    if not isinstance(arr, np.ndarray):
        arr.close()
        raise CorpusError(f"{where}: cannot read {path}: not a .npy file")
    return arr


def _read_npz(path: Path, vocab: Vocabulary) -> Iterator[Utterance]:
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
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(len(lengths)):
        speaker = None if speakers is None else str(speakers[i]) or None
        yield _utterance(None if ids is None else str(ids[i]), speaker, tokens[starts[i]:starts[i + 1]],
                         f"{path}:utterance {i}", vocab, default_id=f"{path.stem}:{i}")


def _is_parquet(path: Path) -> bool:
    return path.suffix in (".parquet", ".pq")


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"{path}: reading Parquet needs pyarrow (pip install 'echospec[ray]')") from None
    try:
        return pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's errors subclass these
        raise CorpusError(f"{path}: cannot read Parquet: {one_line(e)}") from None


def _read_parquet_group(path: Path, group: int, vocab: Vocabulary) -> Iterator[Utterance]:
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
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False)  # offsets index the unsliced values
    ids = table.column("id").to_pylist() if "id" in table.column_names else None
    speakers = table.column("speaker").to_pylist() if "speaker" in table.column_names else None
    others = [name for name in table.column_names if name not in ("tokens", "id", "speaker")]
    extras = {name: table.column(name).to_pylist() for name in others}
    for i in range(len(offsets) - 1):
        row = first_row + i
        yield _utterance(None if ids is None else ids[i], None if speakers is None else speakers[i],
                         values[offsets[i]:offsets[i + 1]], f"{path}:row {row}", vocab,
                         extra={name: extras[name][i] for name in others}, default_id=f"{path.stem}:{row}")


def _utterance(uid, speaker, raw, where: str, vocab: Vocabulary, extra: dict | None = None,
               default_id: str = "") -> Utterance:
    if speaker is not None and not isinstance(speaker, (str, int)):
        raise CorpusError(f"{where}: 'speaker' must be a string")
    if uid is not None and not isinstance(uid, (str, int)):
        raise CorpusError(f"{where}: 'id' must be a string")
    tokens = to_local_ids(raw, where, vocab)
    speaker = None if speaker in (None, "") else str(speaker)
    return Utterance(str(uid) if uid is not None else default_id, speaker, tokens, where, extra or {},
                     id_given=uid is not None)


def to_local_ids(raw, where: str, vocab: Vocabulary) -> np.ndarray:
    """Check raw ids and map them to local ids; stop ids become -1 (a segment boundary)."""
    if isinstance(raw, np.ndarray):
        arr = raw
    else:  # a JSON list the fast path did not take: check every item (bool is not a token id)
        if not isinstance(raw, list):
            raise CorpusError(f"{where}: 'tokens' must be a list of integers")
        bad = next((t for t in raw if type(t) is not int), None)
        if bad is not None:
            if isinstance(bad, list):
                raise CorpusError(f"{where}: tokens must be a 1-D list of integers, found a nested list")
            raise CorpusError(f"{where}: token {bad!r} is not an integer")
        try:
            arr = np.array(raw, dtype=np.int64)
        except OverflowError:
            raise CorpusError(f"{where}: token id too large for a 64-bit integer") from None
    if arr.ndim != 1:
        raise CorpusError(f"{where}: tokens must be a 1-D sequence, got shape {arr.shape}")
    if arr.dtype.kind not in "iu" and arr.size:
        raise CorpusError(f"{where}: tokens must be integers, got {arr.dtype} values")
    arr = arr.astype(np.int64, copy=False)
    if not arr.size:
        return arr
    if vocab.drop_ids:
        arr = arr[~np.isin(arr, np.asarray(vocab.drop_ids, np.int64))]
        if not arr.size:
            return arr
    lowest, highest = int(arr.min()), int(arr.max())
    if lowest < 0:
        raise CorpusError(f"{where}: negative token id {lowest}")
    stop = np.isin(arr, np.asarray(vocab.stop_ids, np.int64)) if vocab.stop_ids else None
    if stop is not None and stop.any():
        speech = arr[~stop]
        lowest, highest = (int(speech.min()), int(speech.max())) if speech.size else (vocab.speech_offset,) * 2
    else:
        stop = None
    offset = vocab.speech_offset
    if lowest < offset:
        raise CorpusError(f"{where}: token id {lowest} is below the speech range "
                          f"(speech_offset {offset}) and is not a stop id (a marker id? drop it: --drop-id)")
    if vocab.size is not None and highest >= offset + vocab.size:
        raise CorpusError(f"{where}: token id {highest} is outside the speech range "
                          f"{offset}..{offset + vocab.size - 1} and is not a stop id (a marker id? drop it: --drop-id)")
    local = arr - offset if offset else arr
    return local if stop is None else np.where(stop, -1, local)


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

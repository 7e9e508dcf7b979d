"""The sample TTS model's vocabulary and prompt format, and a loader for the shipped checkpoint.

Vocabulary layout (ids in this order; recorded in `echospec_tts.json` beside the checkpoint):

    0 <pad>, 1 <bos> | characters | speaker tokens | <tts> task token | speech tokens (contiguous) | <eos_speech>

Prompt = <bos> speaker text-symbols <tts>; the model continues with speech tokens (model id =
speech_offset + store-local id) and ends with <eos_speech> (`stop_id`). The text symbols are what the
checkpoint's front end makes of the text (`front_end`): "phonemes", eSpeak NG's IPA (tools/corpus/phonemes.py;
the shipped sample), or "characters", the text lower-cased with runs of whitespace collapsed. A symbol
outside the map is an error rather than silently dropped.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ...datastore.files import atomic_file
from . import SAMPLE_MODEL_DIR

META_FILE = "echospec_tts.json"
FORMAT = "echospec-tts/1"
PAD_ID, BOS_ID = 0, 1
FRONT_ENDS = ("phonemes", "characters")


class PromptError(ValueError):
    """A text, speaker or token sequence the model's vocabulary cannot express, or a bad metadata file."""


@dataclass(frozen=True)
class TTSMeta:
    """Where every kind of token lives in the model's vocabulary."""

    char_to_id: dict[str, int]
    speaker_to_id: dict[str, int]
    task_id: int
    speech_offset: int
    speech_vocab_size: int
    stop_id: int
    vocab_size: int
    pad_id: int = PAD_ID
    bos_id: int = BOS_ID
    frame_rate: float = 25.0
    format: str = FORMAT
    front_end: str = "characters"  # what `char_to_id` maps: see text_symbols

    @classmethod
    def build(cls, chars: Iterable[str], speakers: Iterable[str], speech_vocab_size: int, frame_rate: float = 25.0,
              front_end: str = "characters") -> TTSMeta:
        """Lay out specials, sorted text symbols, sorted speakers, the task token, speech tokens, stop token."""
        if front_end not in FRONT_ENDS:
            raise PromptError(f"front end {front_end!r}: expected one of {FRONT_ENDS}")
        chars, speakers = sorted(set(chars)), sorted(set(speakers))
        if speech_vocab_size < 1 or not chars or not speakers:
            raise PromptError("a TTS vocabulary needs characters, speakers and at least one speech token")
        char_to_id = {c: 2 + i for i, c in enumerate(chars)}
        speaker_to_id = {s: 2 + len(chars) + i for i, s in enumerate(speakers)}
        task_id = 2 + len(chars) + len(speakers)
        offset = task_id + 1
        stop_id = offset + speech_vocab_size
        return cls(char_to_id, speaker_to_id, task_id, offset, speech_vocab_size, stop_id, stop_id + 1,
                   frame_rate=frame_rate, front_end=front_end)

    @property
    def speakers(self) -> list[str]:
        return list(self.speaker_to_id)

    def save(self, model_dir: str | os.PathLike) -> None:
        """Write META_FILE into model_dir atomically."""
        with atomic_file(Path(model_dir) / META_FILE) as f:
            json.dump({**asdict(self), "stop_ids": [self.stop_id]}, f, indent=1, ensure_ascii=False)

    @classmethod
    def load(cls, model_dir: str | os.PathLike) -> TTSMeta:
        path = Path(model_dir) / META_FILE
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            raw.pop("stop_ids", None)
            meta = cls(**raw)
        except FileNotFoundError:
            raise PromptError(f"{path} not found: is {model_dir} an echospec TTS checkpoint?") from None
        except (json.JSONDecodeError, TypeError) as e:
            raise PromptError(f"{path}: not a valid {FORMAT} file ({e})") from None
        if meta.format != FORMAT or meta.front_end not in FRONT_ENDS:
            raise PromptError(f"{path}: format {meta.format!r} with front end {meta.front_end!r}, expected "
                              f"{FORMAT!r} with one of {FRONT_ENDS}")
        return meta


def normalise_text(text: str) -> str:
    """Lower-case and collapse whitespace: the characters front end's form of a text."""
    return re.sub(r"\s+", " ", text).strip().lower()


def text_symbols(text: str, front_end: str) -> str:
    """What a model with `front_end` reads of `text`: its IPA phonemes, or its normalised characters."""
    if front_end == "phonemes":
        from .phonemes import to_phonemes

        return to_phonemes(normalise_text(text))
    return normalise_text(text)


def encode_prompt(meta: TTSMeta, text: str, speaker: str) -> list[int]:
    """<bos> speaker text-symbols <tts>: model input ids that ask for `speaker` saying `text`."""
    if speaker not in meta.speaker_to_id:
        raise PromptError(f"unknown speaker {speaker!r}; the model knows {meta.speakers}")
    symbols = text_symbols(text, meta.front_end)
    if not symbols:
        raise PromptError("empty text")
    unknown = sorted({c for c in symbols if c not in meta.char_to_id})
    if unknown:
        raise PromptError(f"{meta.front_end} {unknown} are not in the model's vocabulary")
    return [meta.bos_id, meta.speaker_to_id[speaker], *(meta.char_to_id[c] for c in symbols), meta.task_id]


def encode_target(meta: TTSMeta, tokens: Sequence[int]) -> list[int]:
    """Model ids of store-local speech tokens followed by the stop token."""
    bad = [t for t in tokens if not 0 <= int(t) < meta.speech_vocab_size]
    if bad:
        raise PromptError(f"speech tokens {bad[:5]} are outside 0..{meta.speech_vocab_size - 1}")
    return [meta.speech_offset + int(t) for t in tokens] + [meta.stop_id]


def decode_speech(meta: TTSMeta, model_ids: Sequence[int]) -> list[int]:
    """Store-local speech tokens of generated model ids, up to (not including) the first stop token."""
    tokens = []
    for t in map(int, model_ids):
        if t == meta.stop_id:
            break
        if not meta.speech_offset <= t < meta.stop_id:
            raise PromptError(f"model id {t} is not a speech token")
        tokens.append(t - meta.speech_offset)
    return tokens


def load_sample_tts(path: str | os.PathLike = SAMPLE_MODEL_DIR, dtype=None):
    """(model, meta): an echospec TTS checkpoint (default: the shipped sample) in eval mode, float32 unless told."""
    import torch

    from ...decoder.compat import load_causal_lm

    meta = TTSMeta.load(path)
    model = load_causal_lm(path, dtype or torch.float32)
    if model.config.vocab_size < meta.vocab_size:
        raise PromptError(f"{path}: model vocabulary {model.config.vocab_size} < metadata's {meta.vocab_size}")
    return model, meta

"""The mapping between a model's token ids and a datastore's store-local speech ids."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import DecoderInputError


@dataclass(frozen=True)
class SpeechVocab:
    """Speech ids occupy `offset .. offset + size - 1` of the model's vocabulary; store-local id = model id - offset.

    `stop_ids` are model ids that end generation (they may lie inside or outside the speech range).
    LLaSA: `SpeechVocab(128264, 65536, stop_ids=(128261,))`; CosyVoice 2: `SpeechVocab(0, 6561, (6561, 6562, 6563))`.
    """

    offset: int
    size: int
    stop_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.offset < 0 or self.size <= 0:
            raise DecoderInputError(f"SpeechVocab needs offset >= 0 and size > 0, got {self.offset} and {self.size}")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))

    def is_speech(self, model_id: int) -> bool:
        return self.offset <= model_id < self.offset + self.size

    def to_local(self, model_ids) -> list[int]:
        """Store-local ids of the speech tokens among `model_ids` (non-speech ids are dropped)."""
        return [int(t) - self.offset for t in model_ids if self.is_speech(int(t))]

    def to_model(self, local_ids) -> list[int]:
        """Model ids of store-local ids; raises DecoderInputError on ids outside 0..size-1."""
        ids = np.asarray(local_ids, dtype=np.int64).ravel()  # one array op: the decoder converts every tree
        if ids.size and (ids.min() < 0 or ids.max() >= self.size):
            bad = ids[(ids < 0) | (ids >= self.size)].tolist()
            raise DecoderInputError(f"speech ids {bad[:5]} are outside the store's vocabulary 0..{self.size - 1}")
        return (ids + self.offset).tolist()


def length_limits(text_length: int, min_ratio: float = 2.0, max_ratio: float = 20.0) -> tuple[int, int]:
    """(min_new_tokens, max_new_tokens) by CosyVoice 2's rule: between 2x and 20x the text length in tokens."""
    if text_length <= 0:
        raise DecoderInputError(f"text_length must be positive, got {text_length}")
    return int(text_length * min_ratio), int(text_length * max_ratio)

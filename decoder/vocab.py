"""The mapping between a model's token ids and a datastore's store-local speech ids."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import DecoderInputError


@dataclass(frozen=True)
class SpeechVocab:
    """Speech ids occupy `offset .. offset + size - 1` of the model's vocabulary; store-local id = model id - offset.

    `stop_ids` are model ids that end generation (they may lie inside or outside the speech range).
    `codebooks` > 1 says the speech ids interleave that many codebooks: local id // (size / codebooks) is
    a token's codebook, and codebooks follow each other in order, 0, 1, ..., codebooks - 1, 0, ...
    LLaSA: `SpeechVocab(128264, 65536, stop_ids=(128261,))`; CosyVoice 2: `SpeechVocab(0, 6561, (6561, 6562, 6563))`;
    Orpheus (a SNAC frame is 7 tokens, position p using 128266 + 4096 p + code):
    `SpeechVocab(128266, 7 * 4096, (128258,), codebooks=7)`. `echospec.decoder.presets` has them all.
    """

    offset: int
    size: int
    stop_ids: tuple[int, ...] = field(default=())
    codebooks: int = 1

    def __post_init__(self) -> None:
        if self.offset < 0 or self.size <= 0:
            raise DecoderInputError(f"SpeechVocab needs offset >= 0 and size > 0, got {self.offset} and {self.size}")
        if self.codebooks < 1 or self.size % self.codebooks:
            raise DecoderInputError(f"SpeechVocab's size {self.size} does not split into {self.codebooks} codebooks")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))

    def codebook(self, local_id: int) -> int:
        """The codebook of a store-local speech id (0 when there is one codebook)."""
        return int(local_id) // (self.size // self.codebooks)

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


def eos_ids(generation_config) -> tuple[int, ...]:
    """A generation config's eos_token_id (None, an int or a list) as a tuple of stop ids."""
    eos = getattr(generation_config, "eos_token_id", None)
    return () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(t) for t in eos)

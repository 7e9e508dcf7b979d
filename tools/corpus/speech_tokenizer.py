"""A k-means speech tokenizer: 16 kHz audio -> log-mel frames at 25 Hz -> nearest centroid ids.

The stand-in for a neural speech tokenizer (CosyVoice's S3, LLaSA's X-codec): it turns audio into a
sequence of discrete ids at a fixed frame rate, which is all echospec needs from one. The mel filterbank is
written out in NumPy (the HTK mel scale, triangular filters) rather than taken from librosa/torchaudio: it
is twenty lines, and it keeps the tool free of two heavy dependencies for one matrix.

Saved as one `.npz`: centroids (in the normalised feature space), the per-dimension mean/std used to
normalise log-mels, the frame parameters, and optionally a token-to-mel decoder, so that `tokens_to_logmel`
can map ids back to log-mel frames (for the stand-in vocoder and distortion measures) and new audio can be
tokenized the same way.

The decoder is what makes the tokens speak. A centroid is the mean of every frame that fell in its cell, so
decoding each token alone blurs every phone towards its neighbours' (Whisper tiny.en: 60-75% WER on the
sample's 25 Hz tokens). Real codecs decode with context (CosyVoice's flow model reads the whole token
sequence and the speaker); ours is the least that does: a ridge regression from the tokens at t-c..t+c to the
log-mel frame at t, fitted on the corpus audio in one linear solve (`fit_decoder`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import faiss
import numpy as np

from ...datastore.files import atomic_file


@dataclass(frozen=True)
class MelConfig:
    """Frame parameters: hop 640 at 16 kHz gives 25 frames (tokens) per second."""

    sample_rate: int = 16000
    n_fft: int = 1024
    hop_length: int = 640
    n_mels: int = 80
    fmin: float = 0.0
    fmax: float = 8000.0

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.hop_length


DEFAULT_MEL = MelConfig()


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + hz / 700.0)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_filterbank(cfg: MelConfig) -> np.ndarray:
    """float32[n_mels, n_fft//2+1]: triangular filters equally spaced on the HTK mel scale."""
    fft_hz = np.linspace(0.0, cfg.sample_rate / 2, cfg.n_fft // 2 + 1)
    edges_hz = _mel_to_hz(np.linspace(_hz_to_mel(np.float64(cfg.fmin)), _hz_to_mel(np.float64(cfg.fmax)), cfg.n_mels + 2))
    lower, center, upper = edges_hz[:-2, None], edges_hz[1:-1, None], edges_hz[2:, None]
    rising = (fft_hz[None] - lower) / (center - lower)
    falling = (upper - fft_hz[None]) / (upper - center)
    return np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)


def resample(wave: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Band-limited resampling by truncating or zero-padding the spectrum (exact for whole clips)."""
    if sr_in == sr_out:
        return wave.astype(np.float32)
    n_out = round(len(wave) * sr_out / sr_in)
    spectrum = np.fft.rfft(wave.astype(np.float64))
    resized = np.zeros(n_out // 2 + 1, dtype=np.complex128)
    keep = min(len(spectrum), len(resized))
    resized[:keep] = spectrum[:keep]
    return (np.fft.irfft(resized, n_out) * (n_out / len(wave))).astype(np.float32)


def log_mel(wave: np.ndarray, cfg: MelConfig = DEFAULT_MEL) -> np.ndarray:
    """float32[frames, n_mels] natural-log mel energies; frames = 1 + len(wave) // hop (centred frames)."""
    if wave.ndim != 1 or len(wave) == 0:
        raise ValueError(f"log_mel expects a non-empty mono waveform, got shape {wave.shape}")
    padded = np.pad(wave.astype(np.float32), cfg.n_fft // 2, mode="reflect" if len(wave) > cfg.n_fft // 2 else "constant")
    n_frames = 1 + len(wave) // cfg.hop_length
    starts = np.arange(n_frames) * cfg.hop_length
    frames = padded[starts[:, None] + np.arange(cfg.n_fft)[None]] * np.hanning(cfg.n_fft).astype(np.float32)
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    return np.log(np.maximum(power @ mel_filterbank(cfg).T, 1e-6)).astype(np.float32)


class SpeechTokenizer:
    """Nearest-centroid tokenizer over normalised log-mel frames."""

    def __init__(self, centroids: np.ndarray, mean: np.ndarray, std: np.ndarray, cfg: MelConfig = DEFAULT_MEL,
                 decoder: np.ndarray | None = None):
        if centroids.ndim != 2 or centroids.shape[1] != cfg.n_mels or mean.shape != (cfg.n_mels,) or std.shape != (cfg.n_mels,):
            raise ValueError(f"tokenizer shapes disagree: centroids {centroids.shape}, mean {mean.shape}, n_mels {cfg.n_mels}")
        if decoder is not None and (decoder.ndim != 3 or decoder.shape[1:] != centroids.shape or decoder.shape[0] % 2 != 1):
            raise ValueError(f"decoder shape {decoder.shape} is not [2 * context + 1, {len(centroids)}, {cfg.n_mels}]")
        self.centroids = np.ascontiguousarray(centroids, dtype=np.float32)
        self.mean = mean.astype(np.float32)
        self.std = std.astype(np.float32)
        self.cfg = cfg
        self.decoder = None if decoder is None else np.ascontiguousarray(decoder, dtype=np.float32)
        self._index = faiss.IndexFlatL2(cfg.n_mels)
        self._index.add(self.centroids)

    @property
    def vocab_size(self) -> int:
        return len(self.centroids)

    def normalise(self, mels: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray((mels - self.mean) / self.std, dtype=np.float32)

    def encode_logmel(self, mels: np.ndarray) -> np.ndarray:
        """int64[frames]: the nearest centroid of each log-mel frame."""
        _, ids = self._index.search(self.normalise(mels), 1)
        return ids[:, 0].astype(np.int64)

    def encode(self, wave: np.ndarray) -> np.ndarray:
        """int64[frames]: tokens of a 16 kHz (cfg.sample_rate) mono waveform."""
        return self.encode_logmel(log_mel(wave, self.cfg))

    def tokens_to_logmel(self, tokens) -> np.ndarray:
        """float32[len(tokens), n_mels]: the tokens decoded to log-mel frames, by the context decoder when the
        tokenizer has one, else each token's centroid."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"speech tokens must lie in [0, {self.vocab_size}), got [{tokens.min()}, {tokens.max()}]")
        if self.decoder is None:
            return self.centroids[tokens] * self.std + self.mean
        normalised = np.zeros((len(tokens), self.cfg.n_mels), np.float32)
        for offset, weights in zip(_offsets(len(self.decoder) // 2), self.decoder):
            normalised += weights[_shifted(tokens, offset)]
        return normalised * self.std + self.mean

    def save(self, path: str | os.PathLike) -> None:
        """Write the .npz atomically (temporary file, fsync, rename)."""
        decoder = {} if self.decoder is None else {"decoder": self.decoder.astype(np.float16)}  # halves the file
        with atomic_file(path, "wb") as f:
            np.savez(f, centroids=self.centroids, mean=self.mean, std=self.std, **decoder,
                     **{k: np.asarray(v) for k, v in asdict(self.cfg).items()})

    @classmethod
    def load(cls, path: str | os.PathLike) -> SpeechTokenizer:
        try:
            with np.load(path) as z:
                cfg = MelConfig(**{k: type(getattr(MelConfig, k))(z[k]) for k in MelConfig.__dataclass_fields__})
                return cls(z["centroids"], z["mean"], z["std"], cfg, z["decoder"] if "decoder" in z else None)
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: not a speech tokenizer file ({e})") from e


def train_tokenizer(mels: list[np.ndarray], vocab_size: int, seed: int = 0, cfg: MelConfig = DEFAULT_MEL, niter: int = 25) -> SpeechTokenizer:
    """k-means (faiss) over the normalised frames of `mels`; single-threaded so the result depends only on seed."""
    frames = np.concatenate(mels).astype(np.float32)
    if len(frames) < vocab_size * 4:
        raise ValueError(f"{len(frames)} frames are too few to train {vocab_size} centroids (need >= {vocab_size * 4})")
    mean, std = frames.mean(0), frames.std(0) + 1e-5
    normalised = np.ascontiguousarray((frames - mean) / std, dtype=np.float32)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        kmeans = faiss.Kmeans(cfg.n_mels, vocab_size, niter=niter, seed=seed, max_points_per_centroid=1000)
        kmeans.train(normalised)
    finally:
        faiss.omp_set_num_threads(threads)
    return SpeechTokenizer(kmeans.centroids, mean, std, cfg)


def _offsets(context: int) -> range:
    return range(-context, context + 1)


def _shifted(tokens: np.ndarray, offset: int) -> np.ndarray:
    """tokens[t + offset] for every t, the first or last token standing in past either end."""
    return tokens[np.clip(np.arange(len(tokens)) + offset, 0, len(tokens) - 1)]


def fit_decoder(tokenizer: SpeechTokenizer, tokens: list[np.ndarray], mels: list[np.ndarray], context: int = 2,
                ridge: float = 1.0) -> SpeechTokenizer:
    """`tokenizer` with a context decoder fitted on (token sequence, log-mel frames) pairs of the same audio.

    Each frame's normalised log-mel is a sum of one learned vector per (offset, token) in the window t-c..t+c:
    a linear model over one-hot features, solved exactly by ridge regression. The normal equations are built
    from co-occurrence counts, so the fit costs one dense solve of (2c + 1) * vocabulary unknowns. Deterministic."""
    vocab, width = tokenizer.vocab_size, 2 * context + 1
    sequences = [np.asarray(sequence, dtype=np.int64) for sequence in tokens]
    # the token at each window offset, for every frame of every utterance: one column per offset
    columns = [np.concatenate([_shifted(s, offset) for s in sequences]) for offset in _offsets(context)]
    targets = tokenizer.normalise(np.concatenate(mels)).astype(np.float64)
    gram = np.empty((width, vocab, width, vocab))
    rhs = np.zeros((width, vocab, tokenizer.cfg.n_mels))
    for k, at_k in enumerate(columns):
        for j in range(k, width):  # how often token a at offset k meets token b at offset j (the gram is symmetric)
            gram[k, :, j, :] = np.bincount(at_k * vocab + columns[j], minlength=vocab * vocab).reshape(vocab, vocab)
            gram[j, :, k, :] = gram[k, :, j, :].T
        np.add.at(rhs[k], at_k, targets)
    gram = gram.reshape(width * vocab, width * vocab) + ridge * np.eye(width * vocab)
    # the mean is carried by the centre token's rows
    weights = np.linalg.solve(gram, rhs.reshape(width * vocab, -1))
    decoder = weights.reshape(width, vocab, tokenizer.cfg.n_mels)
    return SpeechTokenizer(tokenizer.centroids, tokenizer.mean, tokenizer.std, tokenizer.cfg, decoder)

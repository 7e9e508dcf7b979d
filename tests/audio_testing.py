"""Scorers for the audio tests, importable by name in the scoring workers (spawned: they import what they run)."""


def asr_failing_on_short_audio(waveform, sample_rate):
    """An ASR that fails on audio under 3 s and hears nothing in the rest."""
    if len(waveform) < 3 * sample_rate:
        raise RuntimeError("too short for this ASR")
    return ""


def constant_mos(waveform, sample_rate):
    return 3.0

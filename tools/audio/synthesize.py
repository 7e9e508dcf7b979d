"""`synthesize`: one text spoken by an echospec TTS checkpoint (the shipped sample by default), as a WAV."""

from __future__ import annotations

import time
from pathlib import Path

from ..corpus import SAMPLE_MODEL_DIR, SAMPLE_TOKENIZER
from .vocoder import load_vocoder, write_wav


def synthesize(text: str, speaker: str, wav, *, policy: str = "exact-sampling", store=None,
               checkpoint=SAMPLE_MODEL_DIR, vocoder=None, tokenizer=None, seed: int = 0, max_new_tokens: int = 400,
               max_nodes: int | None = None, threads: int = 1, settings=None) -> dict:
    """Speak `text` in `speaker`'s voice with `checkpoint` (an echospec TTS checkpoint: `echospec_tts.json` beside
    the weights) under `policy` (a name of decoder.registry, at the registry's defaults or at `settings`': a
    calibration file `echospec bench --sweep` wrote, or its content), drafting from `store`
    (None: autoregressive steps), and write the audio to `wav` through `vocoder` (a callable or "module:callable";
    default the k-means stand-in of `tokenizer`, the sample's for the sample model). Returns the speech tokens and
    the speed: tokens, seconds, tokens per forward, LM real-time factor, audio seconds."""
    import torch

    from ...decoder import RAS, generate
    from ...decoder.registry import load_relaxed_settings, make_policy
    from ..bench.load import load_model, speech_vocab
    from ..corpus.tts_prompt import encode_prompt

    torch.set_num_threads(threads)
    if tokenizer is None and vocoder is None and Path(checkpoint).resolve() == SAMPLE_MODEL_DIR.resolve():
        tokenizer = SAMPLE_TOKENIZER
    chosen = load_relaxed_settings(settings, model=checkpoint).get(policy, {}) if settings is not None else {}
    chosen = make_policy(policy, RAS(), seed=seed, **chosen)  # before loading: a bad name or file fails first
    speak = load_vocoder(vocoder, tokenizer)  # before decoding: a bad vocoder fails before the work
    model, meta = load_model(checkpoint)
    if meta is None:
        raise ValueError(f"{checkpoint}: not an echospec TTS checkpoint (no echospec_tts.json); other models "
                         "synthesize with generate() and their own vocoder")
    retriever = None
    if store is not None:
        from ...retriever import Retriever

        retriever = Retriever(store)
    speech = speech_vocab(meta, None, model)
    options = {} if max_nodes is None else {"max_nodes": max_nodes}
    result = generate(model, retriever, input_ids=encode_prompt(meta, text, speaker), policy=chosen, speech=speech,
                      speaker=speaker if retriever is not None else None, max_new_tokens=max_new_tokens,
                      token_rate=meta.frame_rate, **options)
    tokens = result.speech_tokens
    if not tokens:
        raise ValueError("the model ended speech before its first token; try another seed")
    start = time.perf_counter()
    waveform, sample_rate = speak(tokens)
    vocoder_seconds = time.perf_counter() - start
    write_wav(wav, waveform, sample_rate)
    stats = result.stats
    return {"tokens": tokens, "new_tokens": stats.new_tokens, "seconds": stats.wall_seconds,
            "tokens_per_forward": stats.tokens_per_forward, "lm_rtf": stats.lm_rtf,
            "time_per_token_ms": 1e3 * stats.time_per_token, "audio_seconds": len(waveform) / sample_rate,
            "vocoder_seconds": vocoder_seconds, "wav": str(wav), "policy": policy,
            "store": None if store is None else str(store)}

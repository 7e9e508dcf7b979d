"""vllm_side_by_side's quality measures for its sampling cells, against no speculation's sampling paired by prompt:
the target's log-likelihood and the log-mel DTW distortion to the reference, as `echospec bench` computes them
(score_tokens), and SIM, WER and MOS on audio through the bench's vocoder and scorers (score_on_audio). Run after
every vLLM engine has closed: numba and the scorers must not load before vLLM (vllm_engines)."""

from __future__ import annotations

from pathlib import Path


def quality_change(runs: list[dict], base: dict) -> dict:
    """Against no speculation's sampling, paired by prompt (same round, prompts and seeds): the change of the
    target's mean log-likelihood and of the log-mel DTW distortion to the reference, with 95% intervals, where
    the runs were scored (`score_tokens`)."""
    if not runs or "log_likelihood" not in runs[0]:
        return {}
    from echospec.tools.bench.quality import relative_difference_ci

    out = {}
    for measure in ("log_likelihood", "mel_distortion"):
        pairs = [(a, b) for r in runs for a, b in zip(r[measure], base[r["round"]][measure])
                 if a is not None and b is not None]
        if pairs:
            change = relative_difference_ci([a for a, _ in pairs], [b for _, b in pairs])
            out[measure] = {"change": round(change.mean, 4), "ci95": [round(change.low, 4), round(change.high, 4)]}
    return out


def score_tokens(records: list[dict], model_dir: str, meta, tokenizer_path) -> None:
    """Each sampling record's per-prompt quality, as `echospec bench` measures it: the target's mean log-likelihood
    (decoder.scoring, the Hugging Face model in float32) and the log-mel DTW distortion to the prompt's reference
    utterance (tools.bench.quality, through the sample's tokenizer). After every engine has closed."""
    from echospec.decoder.scoring import mean_log_likelihood
    from echospec.tools.bench.quality import dtw_distance
    from echospec.tools.corpus.speech_tokenizer import SpeechTokenizer

    from ...corpus.tts_prompt import load_sample_tts

    model, _ = load_sample_tts(model_dir)
    mel = SpeechTokenizer.load(tokenizer_path).tokens_to_logmel
    local = lambda tokens: [t - meta.speech_offset for t in tokens  # noqa: E731
                            if meta.speech_offset <= t < meta.speech_offset + meta.speech_vocab_size]
    for r in records:
        if r["mode"] != "sampling":
            continue
        r["log_likelihood"] = [mean_log_likelihood(model, tokens, input_ids=prompt) if tokens else None
                               for prompt, tokens in zip(r["prompts"], r["tokens"])]
        r["mel_distortion"] = [float(dtw_distance(mel(local(tokens)), mel(reference)))
                               if reference and local(tokens) else None
                               for tokens, reference in zip(r["tokens"], r["references"])]


def score_on_audio(records: list[dict], cells: dict, meta, tokenizer_path, out: Path, summary: list[dict]) -> dict:
    """SIM, WER and MOS of every sampling output and of each prompt's reference, through the checkpoint's k-means
    vocoder and the bench's scorers (tools.bench.audio: its workers, score cache and summaries; WAVs under
    out/audio/k8-b1-<system>/), each system's change paired by prompt against no speculation in its own cell; added
    to `summary`'s rows as "audio". Returns the floor (the references' scores). After every engine has closed."""
    from echospec.decoder.vocab import SpeechVocab
    from echospec.tools.audio.scorers import Setup
    from echospec.tools.bench.audio import MEASURES, score_audio
    from echospec.tools.bench.harness import Prompt

    report: dict = {"systems": {}, "utterances": {}}
    sampled = sorted((r for r in records if r["mode"] == "sampling"), key=lambda r: (r["k"], r["batch"], r["round"]))
    for r in sampled:
        name, base = (f"k{r['k']}-b{r['batch']}-{system}".replace("/", "-") for system in (r["system"], "none"))
        report["systems"].setdefault(name, {"baseline": base, "row": (r["k"], r["batch"], r["mode"], r["system"])})
        report["utterances"].setdefault(name, []).extend({"prompt": prompt_id, "round": r["round"], "tokens": tokens}
                                                         for prompt_id, tokens in zip(r["ids"], r["tokens"]))
    prompts = [Prompt(id, cell["speaker"], None, cell["reference"], text=cell["text"]) for id, cell in cells.items()]
    speech = SpeechVocab(meta.speech_offset, meta.speech_vocab_size)
    score_audio(report, prompts, speech, Setup(tokenizer=str(tokenizer_path)), out_dir=out, audio_dir=out / "audio")
    by_row = {entry["row"]: entry for entry in report["systems"].values()}
    for row in summary:
        entry = by_row.get((row["k"], row["batch"], row["mode"], row["system"]))
        if entry is not None:
            row["audio"] = {key: entry.get(key) for m in MEASURES for key in (m, f"{m}_change")}
    return report["floor"]

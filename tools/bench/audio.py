"""The bench's scores on audio: every utterance and every prompt's reference through one vocoder, scored for
WER, SIM and MOS after decoding (echospec.tools.audio.scorers), summarised beside the speed, and the paper's table.

For each system: each score's mean with a 95% bootstrap interval, and its change against the system's baseline
paired by utterance (`wer_change`, ...). The floor: the same scores of the reference tokens through the same
vocoder and scorers, what the stand-ins can resolve at best.

The resolution check: each baseline's utterances with a tenth of their tokens replaced at random (seeded), scored
by the same ears. A table whose WER cannot tell that damage from the baseline (its paired interval reaches 0)
cannot see a policy lose words either, and says so; the exact policies' rows show zero change beside it.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import numpy as np

from ..audio import quality_missing
from .harness import BenchError
from .quality import bootstrap_ci, difference_ci

MEASURES = ("wer", "sim", "mos")
REFERENCE = "reference"  # the floor's name in the report and the folder of its WAVs
DAMAGE_FRACTION = 0.1  # of the baseline's tokens replaced at random in the resolution check
DAMAGED = "damaged"  # the resolution check's system: "<baseline>/damaged"


def wav_name(prompt_id: str, round_: int) -> str:
    return f"{prompt_id}.wav" if round_ == 0 else f"{prompt_id}-r{round_}.wav"


def score_audio(report: dict, prompts, speech, setup, out_dir=None, audio_dir=None, workers: int = 2,
                progress: bool = True) -> None:
    """Vocode and score every utterance of `report` and each prompt's reference; add the scores to the
    utterances' rows, each system's summary and `report["floor"]`. Cached in out_dir/audio_scores.jsonl."""
    from ..audio.scorers import ScoreCache, scoring_pool

    missing = quality_missing()
    if missing is not None:
        raise BenchError(f"scores on audio need the quality extra ({missing} is not installed): "
                         "pip install -e '.[quality]' in a checkout")
    cache = ScoreCache(None if out_dir is None else Path(out_dir) / "audio_scores.jsonl")
    folder = None if audio_dir is None else Path(audio_dir)

    def wav(system: str, prompt_id: str, round_: int = 0):
        return None if folder is None else str(folder / system / wav_name(prompt_id, round_))

    start = time.perf_counter()
    with scoring_pool(setup, workers) as pool:
        floor = _score_references_then_outputs(report, prompts, speech, setup, cache, pool, wav, progress)
    summarise_audio(report, floor, prompts)
    report["resolution"] = resolution_check(report)
    report["audio"]["seconds"] = time.perf_counter() - start  # workers' start-up, vocoding, scoring, WAVs


def _score_references_then_outputs(report, prompts, speech, setup, cache, pool, wav, progress):
    """Each prompt's reference first (SIM compares every output with its reference's embedding), then every
    utterance; adds the scores to the utterances' rows. Returns the references' results by prompt id."""
    from ..audio.scorers import Job, job_key, score_all

    by_id = {p.id: p for p in prompts}
    references = {p.id: Job(job_key(setup, p.reference, p.text, None), tuple(p.reference), p.text, None,
                            wav(REFERENCE, p.id)) for p in prompts if p.reference}
    scored = score_all(list(references.values()), pool, cache, progress)
    floor = {prompt_id: scored[job.key] for prompt_id, job in references.items()}
    embedding = {prompt_id: result.get("embedding") for prompt_id, result in floor.items()}
    jobs, placed = [], []
    damaged = {f"{name}/{DAMAGED}": damage(report["utterances"][name], speech)
               for name, entry in report["systems"].items() if entry["baseline"] == name}
    for system, rows in [*report["utterances"].items(), *damaged.items()]:
        for row in rows:
            tokens = tuple(speech.to_local(row["tokens"]))
            reference = embedding.get(row["prompt"])
            reference = None if reference is None else tuple(reference)
            if not tokens:
                row["audio_errors"] = {"vocoder": "no speech tokens"}
                continue
            text = by_id[row["prompt"]].text
            jobs.append(Job(job_key(setup, tokens, text, reference), tokens, text, reference,
                            wav(system, row["prompt"], row["round"])))
            placed.append(row)
    results = score_all(jobs, pool, cache, progress)
    report["damaged"] = damaged
    for row, job in zip(placed, jobs):
        result = results[job.key]
        row.update({m: result[m] for m in MEASURES} | {"transcript": result.get("transcript")})
        if job.reference_embedding is None:
            row["sim"] = None  # no reference audio to compare the voice with
        if result["errors"]:
            row["audio_errors"] = result["errors"]
    report["audio"] = setup.names()
    return floor


def summarise_audio(report: dict, floor: dict, prompts) -> None:
    """Each system's WER, SIM and MOS (mean, 95% interval), their change against its baseline paired by
    utterance, how many utterances a scorer failed on; the floor's scores."""
    systems, utterances = report["systems"], report["utterances"]
    for name, entry in systems.items():
        rows, base = utterances[name], utterances[entry["baseline"]]
        for measure in MEASURES:
            values = [r.get(measure) for r in rows]
            scored = [v for v in values if v is not None]
            entry[measure] = bootstrap_ci(scored).to_dict() | {"utterances": len(scored)} if scored else None
            if entry["baseline"] != name:
                pairs = [(v, b.get(measure)) for v, b in zip(values, base)
                         if v is not None and b.get(measure) is not None]
                entry[f"{measure}_change"] = (difference_ci(*zip(*pairs)).to_dict() | {"utterances": len(pairs)}
                                              if pairs else None)
        failed = [{"prompt": r["prompt"], "round": r["round"], "errors": r["audio_errors"]}
                  for r in rows if r.get("audio_errors")]
        entry["audio_failures"] = failed
    report["floor"] = {measure: _mean([r[measure] for r in floor.values()]) for measure in ("wer", "mos")}
    report["floor"]["sim"] = _mean(same_voice_similarity(floor, prompts))
    report["floor"]["failures"] = {prompt_id: r["errors"] for prompt_id, r in floor.items() if r["errors"]}
    report["floor"]["utterances"] = len(floor)
    report["floor"]["prompts"] = {prompt_id: {m: r.get(m) for m in ("wer", "mos", "transcript")}
                                  for prompt_id, r in floor.items()}


def damage(rows: list[dict], speech, fraction: float = DAMAGE_FRACTION, seed: int = 0) -> list[dict]:
    """Copies of a baseline's utterance rows with `fraction` of each one's speech tokens replaced by random speech
    ids of the same codebook (seeded by the row's place, so the same rows are damaged the same way in every run)."""
    damaged, book = [], speech.size // speech.codebooks
    for i, row in enumerate(rows):
        tokens = np.asarray(row["tokens"])
        local = tokens - speech.offset
        is_speech = (local >= 0) & (local < speech.size)
        rng = np.random.default_rng([seed, i])
        hit = is_speech & (rng.random(len(tokens)) < fraction)
        replacement = speech.offset + local // book * book + rng.integers(0, book, len(tokens))
        tokens = np.where(hit, replacement, tokens)
        damaged.append({"prompt": row["prompt"], "round": row["round"], "tokens": tokens.tolist()})
    return damaged


def resolution_check(report: dict) -> dict:
    """For each baseline: the WER change its damaged copy shows (paired, 95% interval) and whether the interval
    excludes zero; beside it, the change each exact policy against it shows (zero where its tokens are the
    baseline's)."""
    checks = {}
    for name, rows in report.pop("damaged").items():
        baseline = name.rsplit("/", 1)[0]
        pairs = [(d["wer"], b["wer"]) for d, b in zip(rows, report["utterances"][baseline])
                 if d.get("wer") is not None and b.get("wer") is not None]
        change = difference_ci(*zip(*pairs)).to_dict() | {"utterances": len(pairs)} if pairs else None
        exact = {system: (entry.get("wer_change") or {}).get("mean") for system, entry in report["systems"].items()
                 if entry["baseline"] == baseline and system != baseline and entry.get("identical_to_baseline")}
        checks[baseline] = {"damage": f"{DAMAGE_FRACTION:.0%} of the tokens replaced at random",
                            "wer_change": change, "resolves": bool(change and change["ci95"][0] > 0),
                            "exact_wer_change": exact}
    return checks


def resolution_lines(report: dict) -> list[str]:
    """The resolution check in words, for the paper's table."""
    lines = []
    for baseline, check in (report.get("resolution") or {}).items():
        change = check["wer_change"]
        if change is None:
            lines.append(f"  Resolution check ({baseline}): no WER was scored: the table cannot show a loss of words.")
            continue
        low, high = (100 * c for c in change["ci95"])
        seen = (f"{100 * change['mean']:+.1f} [{low:+.1f}, {high:+.1f}] points of WER: the table sees a loss of words "
                f"that size" if check["resolves"] else
                f"{100 * change['mean']:+.1f} [{low:+.1f}, {high:+.1f}] points, an interval that reaches zero: these "
                f"ears cannot see a loss of words that size, so read no WER below as evidence either way")
        exact = ", ".join(f"{system} {100 * value:+.1f}" for system, value in check["exact_wer_change"].items()
                          if value is not None)
        lines += textwrap.wrap(f"Resolution check ({baseline}, {check['damage']}): {seen}"
                               + (f"; exact policies: {exact}." if exact else "."), width=100, initial_indent="  ",
                               subsequent_indent="    ")
    return lines


def _mean(values) -> dict | None:
    scored = [v for v in values if v is not None]
    return bootstrap_ci(scored).to_dict() | {"utterances": len(scored)} if scored else None


def same_voice_similarity(floor: dict, prompts) -> list[float]:
    """SIM's floor: each reference against the next reference of the same speaker (another sentence in the same
    voice, through the same vocoder), since a reference against itself is 1 by definition."""
    import numpy as np

    by_speaker = {}
    for p in prompts:
        if floor.get(p.id, {}).get("embedding") is not None:
            by_speaker.setdefault(p.speaker, []).append(np.asarray(floor[p.id]["embedding"]))
    cosines = []
    for embeddings in by_speaker.values():
        for a, b in zip(embeddings, embeddings[1:]):
            cosines.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    return cosines


def _score(entry: dict | None, measure: str, scale: float = 1.0, digits: int = 2) -> str:
    value = (entry or {}).get(measure)
    return "-" if not value else f"{scale * value['mean']:.{digits}f}"


def score_change(entry: dict, measure: str, scale: float = 1.0, digits: int = 2) -> str:
    """A score's paired change against the baseline, `scale`d, with its 95% interval; "-" where there is none."""
    change = entry.get(f"{measure}_change")
    if not change:
        return "-"
    low, high = (scale * c for c in change["ci95"])
    return f"{scale * change['mean']:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def paper_table(report: dict, full: bool = False, systems=None) -> str:
    """The retrieval paper's table: system, SIM, WER, MOS, LM-RTF, TPT (ms/token), speed-up, tokens/forward;
    the floor first. `full` adds each score's change against the baseline with its 95% interval."""
    entries = report["systems"]
    names = [n for n in (systems or entries) if n in entries]
    header = (f"  {'system':34} {'SIM':>6} {'WER %':>6} {'MOS':>5} {'LM-RTF':>6} {'TPT ms':>7} {'speed-up':>8} "
              f"{'tok/fwd':>7}")
    if full:
        header += f"  {'SIM change':>22} {'WER change (points)':>22} {'MOS change':>22}"
    floor = report.get("floor")
    lines = ["The paper's table (SIM: speaker cosine x100; WER: % of words; MOS: DNSMOS P.808 unless replaced):",
             header]
    if floor:
        lines.append(f"  {'floor: reference tokens, vocoded':34} {_score(floor, 'sim', 100, 1):>6} "
                     f"{_score(floor, 'wer', 100, 1):>6} {_score(floor, 'mos'):>5} {'-':>6} {'-':>7} {'-':>8} "
                     f"{'-':>7}")
    for name in names:
        s = entries[name]
        line = (f"  {name:34} {_score(s, 'sim', 100, 1):>6} {_score(s, 'wer', 100, 1):>6} {_score(s, 'mos'):>5} "
                f"{s['lm_rtf']:6.3f} {s['time_per_token_ms']['median']:7.2f} {s['speedup']:7.2f}x "
                f"{s['tokens_per_forward']:7.2f}")
        if full:
            line += (f"  {score_change(s, 'sim', 100, 1):>22} {score_change(s, 'wer', 100, 1):>22} "
                     f"{score_change(s, 'mos'):>22}")
        lines.append(line)
    lines += resolution_lines(report)
    failures = sum(len(entries[n].get("audio_failures", ())) for n in names)
    if failures:
        lines.append(f"  ({failures} utterances had a scorer fail; bench.json's audio_failures say which and why)")
    return "\n".join(lines)


def has_audio_scores(report: dict) -> bool:
    return "floor" in report

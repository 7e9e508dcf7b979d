"""listen.html: per prompt, the reference and every system's output side by side as audio players, each with
its scores (from a bench report whose WAVs were written with `audio_dir`)."""

from __future__ import annotations

import html
import os
from pathlib import Path

from ...datastore.files import atomic_file

STYLE = """body{font-family:sans-serif;margin:1.5em;max-width:1500px}.row{display:flex;flex-wrap:wrap;gap:8px}
.card{border:1px solid #ccc;border-radius:4px;padding:6px 8px;width:250px;font-size:13px}.card b{display:block}
audio{width:240px;height:32px}.scores{color:#333}.heard{color:#777;font-style:italic}h3{margin-top:1.6em}"""


def _scores(row: dict | None) -> str:
    if not row:
        return ""
    parts = []
    if row.get("wer") is not None:
        parts.append(f"WER {100 * row['wer']:.0f}%")
    if row.get("sim") is not None:
        parts.append(f"SIM {row['sim']:.3f}")
    if row.get("mos") is not None:
        parts.append(f"MOS {row['mos']:.2f}")
    if row.get("time_per_token") is not None:
        parts.append(f"{1e3 * row['time_per_token']:.2f} ms/token")
    if row.get("audio_errors"):
        parts.append("failed: " + "; ".join(f"{k}: {v}" for k, v in row["audio_errors"].items()))
    return html.escape(", ".join(parts))


def listen_page(report: dict, audio_dir, path, prompts, systems=None) -> Path:
    """Write `path` (listen.html): one table per prompt — its text, then a player for the reference and for each
    of `systems` (default: every system but the sweeps'), each with its scores; links are relative to `path`."""
    audio_dir, path = Path(audio_dir), Path(path)
    names = systems or [n for n in report["systems"] if "=" not in n]
    by_prompt = {name: {(r["prompt"], r["round"]): r for r in report["utterances"][name]} for name in names}
    floor = report.get("floor") or {}
    audio = report.get("audio", {})
    body = [f"<h1>echospec: listen</h1><p>Vocoder {html.escape(str(audio.get('vocoder')))} "
            f"(tokenizer {html.escape(str(audio.get('tokenizer')))}), ASR {html.escape(str(audio.get('asr')))}, "
            f"speaker encoder {html.escape(str(audio.get('speaker_encoder')))}, "
            f"MOS {html.escape(str(audio.get('mos')))}"
            " ('default': pocketsphinx, resemblyzer, DNSMOS P.808). The reference is the prompt's reference tokens "
            "through the same vocoder: the floor of what the stand-ins resolve (WER "
            f"{100 * (floor.get('wer') or {}).get('mean', float('nan')):.0f}%, MOS "
            f"{(floor.get('mos') or {}).get('mean', float('nan')):.2f} on average). In grey, what the ASR heard.</p>"]
    for prompt in prompts:
        rounds = sorted({key[1] for rows in by_prompt.values() for key in rows if key[0] == prompt.id})
        for round_ in rounds:
            body.append(f"<h3 class=prompt>{html.escape(prompt.id)} ({html.escape(str(prompt.speaker))}"
                        f"{'' if round_ == 0 else f', round {round_}'}): {html.escape(prompt.text or '')}</h3>")
            reference = floor.get("prompts", {}).get(prompt.id, {})
            cells = [("reference", _player(audio_dir / "reference" / f"{prompt.id}.wav", path), _scores(reference),
                      html.escape(reference.get("transcript") or ""))]
            for name in names:
                row = by_prompt[name].get((prompt.id, round_)) or {}
                name_wav = f"{prompt.id}.wav" if round_ == 0 else f"{prompt.id}-r{round_}.wav"
                cells.append((name, _player(audio_dir / name / name_wav, path), _scores(row),
                              html.escape(row.get("transcript") or "")))
            body.append("<div class=row>" + "".join(
                f"<div class=card><b>{html.escape(name)}</b>{player}<div class=scores>{scores}</div>"
                f"<div class=heard>{heard}</div></div>" for name, player, scores, heard in cells) + "</div>")
    page = (f"<!DOCTYPE html><html><head><meta charset=utf-8><title>echospec: listen</title><style>{STYLE}</style>"
            f"</head><body>{''.join(body)}</body></html>\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        f.write(page)
    return path


def _player(wav: Path, page: Path) -> str:
    if not wav.exists():
        return "<em>no audio</em>"
    return f'<audio controls preload=none src="{html.escape(os.path.relpath(wav, page.parent))}"></audio>'

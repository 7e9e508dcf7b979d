"""`demo`: the embedded default end to end — build stores from the shipped sample, query one, benchmark."""

from __future__ import annotations

import json
from pathlib import Path

from ..corpus import SAMPLE_CORPUS, SAMPLE_MODEL_DIR, SAMPLE_PROMPTS, SAMPLE_TOKENIZER
from ..audio import quality_missing
from ..audio.listen import listen_page
from ..corpus.tts_prompt import TTSMeta
from .load import load_prompts, native_bfloat16
from .report import format_table
from .run import bench
from .spec import BenchSpec, Inputs, Scoring

DEMO_SWEEPS = {"tau": (40,), "beta": (0.4,), "threshold": (0.3,)}
"""One other setting of each relaxed knob beside its default (looser β and threshold, a stricter τ): the demo's
frontier.png shows what a step of each knob trades (the full sweep behind the defaults is in docs/results.md)."""


def demo(out_dir="runs/demo", limit: int = 10, threads: int = 1, dtype: str = "float32", full: bool = False,
         echo=print, progress: bool = True, audio: bool = True) -> dict:
    """Build a general and per-speaker datastore from the sample corpus, show one query, and benchmark
    autoregressive decoding against each acceptance policy on `limit` held-out sentences, in `dtype`
    ("bfloat16" where the CPU computes it natively: AVX512-BF16 or AMX); prints the short table, or the `full` one
    (bench.md has it either way). With `audio` (and the quality extra), every utterance is also vocoded into
    out_dir/audio/<system>/, scored (the paper's table) and laid out side by side in out_dir/listen.html; each
    relaxed knob is also tried at one more setting (DEMO_SWEEPS) for out_dir/frontier.png."""
    from ...datastore import build
    from ...retriever import Retriever

    out_dir = Path(out_dir)
    store = out_dir / "store"
    echo(f"Building a general and per-speaker datastore from {SAMPLE_CORPUS.name} into {store} ...")
    datastore = build(SAMPLE_CORPUS, store, per_speaker=True, faiss=True, force=True, progress=progress)
    info = datastore.info()
    echo(f"{info['utterances']} utterances, {info['tokens']} tokens, {len(info['speakers'])} speaker stores, "
         f"{info['general_bytes_per_token']:.2f} bytes/token (general exact store)")

    first = json.loads(SAMPLE_PROMPTS.read_text(encoding="utf-8").splitlines()[0])
    context = first["reference_tokens"][:50]
    tree = Retriever(store).propose(context, speaker=first["speaker"])
    echo(f"\nQuery: speaker {first['speaker']}, context ...{context[-8:]} -> {len(tree)} candidate nodes")
    echo(tree.draw())

    if dtype == "bfloat16" and not native_bfloat16():
        echo("Note: this CPU has no native bfloat16 (AVX512-BF16 or AMX); torch emulates it, slower than float32.")
    echo(f"\nSynthesizing {limit} held-out sentences with each system ({dtype}) ...")
    if audio and quality_missing() is not None:
        echo(f"Note: no audio ({quality_missing()} is not installed): pip install -e '.[quality]' for WAVs, "
             "listen.html and the paper's table.")
        audio = False
    audio_dir = out_dir / "audio" if audio else None
    inputs = Inputs(SAMPLE_MODEL_DIR, store, SAMPLE_PROMPTS, limit, threads=threads, dtype=dtype)
    report = bench(BenchSpec(inputs, sweeps=DEMO_SWEEPS, out_dir=out_dir, progress=progress,
                             scoring=Scoring(SAMPLE_TOKENIZER, audio=audio, audio_dir=audio_dir)))
    echo(format_table(report, full=full))
    echo(f"\nWrote {out_dir / 'bench.json'}, the full table {out_dir / 'bench.md'}, the plot {out_dir / 'bench.png'} "
         f"and the speed-quality frontier {out_dir / 'frontier.png'}")
    if audio:
        page = listen_page(report, audio_dir, out_dir / "listen.html",
                           load_prompts(SAMPLE_PROMPTS, TTSMeta.load(SAMPLE_MODEL_DIR), limit))
        utterances = sum(map(len, report["utterances"].values()))
        echo(f"Listen: {page} (the WAVs are in {audio_dir}/<system>/<prompt id>.wav; {utterances} utterances and "
             f"their references vocoded and scored in {report['audio']['seconds']:.0f} s after decoding)")
    return report

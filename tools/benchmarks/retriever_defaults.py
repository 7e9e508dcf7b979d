"""How the retriever's defaults were chosen: oracle acceptance on held-out utterances.

Builds a datastore from a seeded speech-like corpus (tools/corpus/synth_corpus.py) minus every 20th
utterance, then replays each held-out utterance as a TTS request would see it: the context is a
prompt (the speaker's last stored utterance, 150 tokens = 6 s) followed by the output so far; at
every step the proposal is verified against the true continuation (oracle), the accepted tokens plus
the verifier's own token are appended. Reports tokens per step (= mean accepted + 1) for the
defaults and for each setting changed one at a time from them (the store is sorted to depth 16 so
n_max can be varied down from the default 8 and up). Not a speed benchmark.

    python -m echospec.tools.benchmarks.retriever_defaults --tokens 1000000
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from ...datastore import build
from ...retriever import Retriever
from ..corpus.synth_corpus import SynthConfig, generate


def replay(retriever: Retriever, requests, prompt_tokens: int = 150) -> float:
    steps = tokens = 0
    for prompt, speaker, utt in requests:
        t = 0
        while t < len(utt):
            ctx = np.concatenate([prompt[-prompt_tokens:], utt[:t]]).astype(np.int64)
            t += retriever.propose(ctx, speaker=speaker).matched_depth(utt[t:]) + 1
            steps += 1
        tokens += len(utt)
    return tokens / steps


@click.command()
@click.option("--tokens", default=1_000_000, show_default=True)
@click.option("--held-out", default=60, show_default=True, help="held-out utterances replayed")
@click.option("--seed", default=0, show_default=True)
def main(tokens: int, held_out: int, seed: int) -> None:
    """Oracle tokens per step for the retriever's defaults and for each setting changed one at a time."""
    corpus = generate(SynthConfig(n_tokens=tokens, seed=seed))
    test = set(range(0, len(corpus), 20)[:held_out])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.jsonl"
        last = {}
        with open(path, "w") as f:
            for i in range(len(corpus)):
                if i not in test:
                    f.write(json.dumps({"speaker": corpus.speaker_name(i), "tokens": corpus.utterance(i).tolist()}) + "\n")
                    last[corpus.speaker_name(i)] = corpus.utterance(i)
        started = time.perf_counter()
        ds = build(path, Path(tmp) / "store", progress=False, n_max=16)
        click.echo(f"built {ds.info()['tokens']} tokens in {time.perf_counter() - started:.1f} s")
        requests = [(last[corpus.speaker_name(i)], corpus.speaker_name(i), corpus.utterance(i))
                    for i in sorted(test) if corpus.speaker_name(i) in last]
        settings = [{}] + [{k: v} for k, vs in {
            "min_support": [1, 8, 16, 64], "cap": [16, 64, 128], "n_min": [2, 3], "n_max": [4, 6, 12, 16],
            "weights": [(2, 1, 1, 0.5), (1, 2, 1, 0.5), (1, 1, 2, 0.5), (1, 1, 1, 0.25), (1, 1, 1, 1),
                        (0, 0, 1, 0)],
            "prompt_lookup": [False], "prompt_n_min": [1, 3], "use_faiss": [False], "faiss_below": [2, 3],
            "max_depth": [6, 12],
        }.items() for v in vs]
        for setting in settings:
            started = time.perf_counter()
            score = replay(Retriever(ds, **{"n_max": 8, **setting}), requests)
            click.echo(f"{setting or 'defaults'!s:40s} tokens/step {score:.3f}   "
                       f"({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()

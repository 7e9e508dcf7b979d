"""A large speech-like corpus made from real speech tokens: the sample's utterances resampled and perturbed.

The embedded sample (tools/sample/corpus.jsonl: 4,000 utterances, 316k k-means tokens of 10 voices) is too
small to benchmark a build at scale, and the phrase-list generator (synth_corpus.py) repeats itself more
regularly than speech does. This draws utterances from the sample and changes each as a new rendering would:

- a time stretch (rate 0.85-1.15: frames dropped or doubled evenly) and, per frame, a 3% chance of swapping
  the token for another one of the utterance (a mis-tokenised frame);
- a speaker of its own (`speakers` of them, Zipf-distributed), whose "timbre" spreads every sample id over
  `expand` ids: id * expand + the speaker's variant of that id, changed at random on 15% of frames.
  With expand 8 the 512-id sample becomes a 4,096-id vocabulary, near what speech codecs use.

So repetition is speech-like (the same texts said again by other voices, at other rates, never exactly),
and the token statistics are real ones. Everything is vectorised: 50M tokens take about ten seconds.

    python -m echospec.tools.corpus.resample_corpus --tokens 20000000 --files 4 --out big/   # big/part-*.npz
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from . import SAMPLE_CORPUS


@dataclass
class Resampled:
    tokens: np.ndarray  # int32, utterances concatenated
    lengths: np.ndarray  # int64 per utterance
    speakers: np.ndarray  # int32 speaker index per utterance
    vocab_size: int

    def utterance(self, i: int, starts: np.ndarray) -> np.ndarray:
        return self.tokens[starts[i]:starts[i] + self.lengths[i]]


def load_sample(path: Path = SAMPLE_CORPUS) -> list[np.ndarray]:
    with open(path) as f:
        return [np.asarray(json.loads(line)["tokens"], np.int32) for line in f if line.strip()]


def resample(n_tokens: int, seed: int = 0, speakers: int = 400, expand: int = 8,
             source: list[np.ndarray] | None = None) -> Resampled:
    """About `n_tokens` tokens of resampled, perturbed sample utterances (see the module docstring)."""
    rng = np.random.default_rng(seed)
    source = load_sample() if source is None else source
    base_vocab = int(max(int(s.max()) for s in source)) + 1
    src_tokens = np.concatenate(source)
    src_starts = np.concatenate([[0], np.cumsum([len(s) for s in source])[:-1]])
    src_lengths = np.array([len(s) for s in source], np.int64)
    n_utts = int(n_tokens / src_lengths.mean()) + 1
    pick = rng.integers(0, len(source), n_utts)
    rate = rng.uniform(0.85, 1.15, n_utts)
    lengths = np.maximum(1, np.floor(src_lengths[pick] * rate)).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    utt = np.repeat(np.arange(n_utts), lengths)
    within = np.arange(len(utt)) - starts[utt]
    frame = np.minimum((within / rate[utt]).astype(np.int64), src_lengths[pick][utt] - 1)
    tokens = src_tokens[src_starts[pick][utt] + frame]
    swap = rng.random(len(tokens)) < 0.03  # a mis-tokenised frame: another frame of the same utterance
    other = src_starts[pick][utt[swap]] + rng.integers(0, src_lengths[pick][utt[swap]])
    tokens[swap] = src_tokens[other]
    ranks = np.arange(1, speakers + 1, dtype=np.float64)
    speaker = rng.choice(speakers, n_utts, p=(1 / ranks) / (1 / ranks).sum()).astype(np.int32)
    variant = rng.integers(0, expand, (speakers, base_vocab))  # each speaker's timbre of each id
    sub = variant[speaker[utt], tokens]
    noisy = rng.random(len(tokens)) < 0.15
    sub[noisy] = rng.integers(0, expand, int(noisy.sum()))
    return Resampled((tokens.astype(np.int64) * expand + sub).astype(np.int32), lengths, speaker,
                     base_vocab * expand)


def write_npz(corpus: Resampled, out: Path, files: int, first: int = 0, prefix: str = "part") -> list[Path]:
    """The corpus as `files` .npz files (tokens, lengths, ids, speakers), utterances dealt in order."""
    out.mkdir(parents=True, exist_ok=True)
    n = len(corpus.lengths)
    bounds = np.linspace(0, n, files + 1).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(corpus.lengths)])
    paths = []
    for k in range(files):
        a, b = bounds[k], bounds[k + 1]
        path = out / f"{prefix}-{k:03d}.npz"
        np.savez(path, tokens=corpus.tokens[starts[a]:starts[b]].astype(np.uint16), lengths=corpus.lengths[a:b],
                 ids=np.array([f"u{first + i:09d}" for i in range(a, b)]),
                 speakers=np.array([f"spk{s:04d}" for s in corpus.speakers[a:b]]))
        paths.append(path)
    return paths


@click.command()
@click.option("--tokens", "n_tokens", type=click.IntRange(min=1000), default=20_000_000, show_default=True)
@click.option("--speakers", type=click.IntRange(min=1), default=400, show_default=True)
@click.option("--expand", type=click.IntRange(min=1, max=64), default=8, show_default=True,
              help="Ids each sample id spreads over (vocabulary = 512 x expand).")
@click.option("--files", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
def main(n_tokens: int, speakers: int, expand: int, files: int, seed: int, out: Path) -> None:
    """Write a resampled speech-like corpus as OUT/part-NNN.npz."""
    corpus = resample(n_tokens, seed, speakers, expand)
    paths = write_npz(corpus, out, files)
    click.echo(f"{out}: {len(paths)} files, {len(corpus.lengths)} utterances, {len(corpus.tokens)} tokens, "
               f"vocabulary {corpus.vocab_size}")


if __name__ == "__main__":
    main()

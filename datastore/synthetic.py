"""A speech-like synthetic corpus for tests and measurements (no real TTS data ships with the repo).

Speech tokens at 25 tokens/s behave like this: each phone lasts several frames, the codec emits a
token from a small cluster of acoustically similar ids for each frame, speakers differ in which ids
of a cluster they favour and in speaking rate, and the same sentence said twice gives near-repeats
(same phones, jittered durations, some ids swapped for neighbours). The generator reproduces those
traits deterministically from a seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def speech_like_corpus(n_tokens: int, vocab_size: int = 4096, n_speakers: int = 8, n_sentences: int = 400,
                       n_phones: int = 48, cluster: int = 6, seed: int = 0) -> list[dict]:
    """Utterances `{"id", "speaker", "tokens"}` totalling about `n_tokens` tokens."""
    rng = np.random.default_rng(seed)
    clusters = rng.choice(vocab_size, size=(n_phones, cluster), replace=False if n_phones * cluster <= vocab_size
                          else True)
    lexicon = [rng.integers(0, n_phones, rng.integers(3, 7)) for _ in range(300)]
    sentences = [np.concatenate([lexicon[w] for w in rng.integers(0, len(lexicon), rng.integers(4, 12))])
                 for _ in range(n_sentences)]
    popularity = rng.zipf(1.3, n_sentences).astype(float)
    popularity /= popularity.sum()
    speakers = [{"name": f"spk{i:02d}", "rate": rng.uniform(2.0, 4.0),
                 "timbre": rng.dirichlet(np.full(cluster, 0.3), n_phones)} for i in range(n_speakers)]
    out, total = [], 0
    while total < n_tokens:
        spk = speakers[int(rng.integers(n_speakers))]
        phones = sentences[int(rng.choice(n_sentences, p=popularity))]
        durations = np.maximum(1, rng.poisson(spk["rate"], len(phones)))
        frames = np.repeat(phones, durations)
        choice = np.array([rng.choice(cluster, p=spk["timbre"][p]) for p in frames])
        tokens = clusters[frames, choice]
        noise = rng.random(len(tokens)) < 0.08
        tokens[noise] = rng.integers(0, vocab_size, int(noise.sum()))
        out.append({"id": f"utt{len(out):06d}", "speaker": spk["name"], "tokens": tokens.tolist()})
        total += len(tokens)
    return out


def write_jsonl(utterances: list[dict], path: str | Path) -> Path:
    path = Path(path)
    with open(path, "w") as f:
        for utt in utterances:
            f.write(json.dumps(utt) + "\n")
    return path

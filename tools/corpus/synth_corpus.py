"""A seeded generator of speech-like token corpora, for benchmarks and tests.

Real speech-token corpora (CosyVoice S3 tokens, X-codec ids, ...) cannot ship with the repository, so the
retriever benchmark runs on a synthetic corpus built to fail exact matching the way real speech tokens do:

- 25 tokens per second; utterances of about 2-15 s.
- Phone-like units: each phone owns a cluster of the vocabulary (neighbouring tokens sound alike) and lasts
  several frames with jittered, speaker-dependent durations; inside a phone the token drifts between
  neighbours (a random walk over the cluster) or repeats.
- Per-speaker statistics: every speaker has its own preferred token within each phone, its own spread, its
  own tendency to stay on a token, its own speaking rate and its own favourite phrases.
- Repeated and near-repeated phrases: a phrase said again by the same speaker is sometimes an exact copy of an
  earlier rendering, sometimes a near copy (a few tokens swapped for neighbours, frames dropped or doubled),
  sometimes rendered afresh; another speaker saying it may give a near copy with more substitutions. Novel
  phrases and pauses fill the rest. So an exact suffix match finds something sometimes and fails often.

Everything is vectorised NumPy: 10M tokens take a few seconds. Command line:

    python -m echospec.tools.corpus.synth_corpus --tokens 10000000 --out corpus.jsonl
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import click
import numpy as np

from ...datastore.files import atomic_file

FRAME_RATE = 25  # tokens per second
MIN_SECONDS, MAX_SECONDS = 2.0, 15.0


@dataclass(frozen=True)
class SynthConfig:
    """Knobs of the generator; the defaults mimic CosyVoice 2 speech tokens (6561 ids, 25 Hz)."""

    n_tokens: int = 1_000_000
    vocab: int = 6561
    n_speakers: int = 64
    n_phones: int = 81  # 81 clusters of 81 tokens cover 6561 exactly
    n_phrases: int = 20_000  # the inventory of phrases that recur across the corpus
    phrase_zipf: float = 1.1  # popularity of inventory phrases
    novel_share: float = 0.35  # share of phrase slots filled by a never-repeated phrase
    favourite_share: float = 0.2  # share of slots a speaker fills from its own favourite phrases
    n_favourites: int = 40
    pause_share: float = 0.12  # share of slots that are a pause (silence phone)
    same_exact: float = 0.25  # a speaker repeating a phrase: exact copy of its first rendering
    same_near: float = 0.35  # ... near copy of it (otherwise: rendered afresh)
    cross_near: float = 0.35  # a speaker's first time on a phrase another speaker said: near copy
    near_sub: float = 0.06  # per frame, near copy by the same speaker: swap for a neighbouring token
    near_stretch: float = 0.03  # per frame: drop it, and (separately) double it
    cross_sub: float = 0.15
    cross_stretch: float = 0.06
    seed: int = 0


@dataclass(frozen=True)
class Corpus:
    """Utterances as one flat token array cut by `offsets` (utterance i is tokens[offsets[i]:offsets[i+1]])."""

    tokens: np.ndarray  # int32[T]
    offsets: np.ndarray  # int64[U+1]
    speakers: np.ndarray  # int32[U]

    def __len__(self) -> int:
        return len(self.speakers)

    def utterance(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def speaker_name(self, i: int) -> str:
        return f"spk{int(self.speakers[i]):03d}"

    def utterance_id(self, i: int) -> str:
        return f"utt{i:07d}"


def generate(config: SynthConfig = SynthConfig()) -> Corpus:
    """A corpus of about `config.n_tokens` tokens; the same config gives the same corpus."""
    if config.vocab < config.n_phones * 3:
        raise ValueError(f"vocab {config.vocab} is too small for {config.n_phones} phones of at least 3 tokens")
    rng = np.random.default_rng(config.seed)
    world = _World.draw(config, rng)
    slots, utt_of_slot, utt_speaker = _plan_utterances(config, world, rng)
    speaker_of_slot = utt_speaker[utt_of_slot]
    chunks = _render(config, world, slots, speaker_of_slot, rng)
    return _assemble(chunks, utt_of_slot, utt_speaker, config.n_tokens)


@dataclass(frozen=True)
class _World:
    """Phones, the token layout, phrases and speakers: everything drawn once per corpus."""

    cluster: np.ndarray  # int32[n_phones, size]: the tokens of each phone, neighbours adjacent
    phone_frames: np.ndarray  # float64[n_phones]: mean duration in frames
    phrase_ptr: np.ndarray  # int64[P+1]: phrase p is phrase_phones[phrase_ptr[p]:phrase_ptr[p+1]]
    phrase_phones: np.ndarray  # int32
    phrase_frames: np.ndarray  # float64[P]: expected frames at rate 1
    popularity: np.ndarray  # float64[n_phrases]: cumulative Zipf weights of the inventory
    favourites: np.ndarray  # int32[n_speakers, n_favourites]
    centre: np.ndarray  # float64[n_speakers, n_phones]: preferred position in each cluster
    spread: np.ndarray  # float64[n_speakers]
    stay: np.ndarray  # float64[n_speakers]: probability that a frame repeats the previous position
    rate: np.ndarray  # float64[n_speakers]: duration multiplier
    activity: np.ndarray  # float64[n_speakers]: cumulative share of utterances

    @classmethod
    def draw(cls, config: SynthConfig, rng: np.random.Generator) -> "_World":
        size = config.vocab // config.n_phones  # ids past n_phones*size are never used
        cluster = rng.permutation(config.vocab)[: config.n_phones * size].reshape(config.n_phones, size)
        # Phone 0 is the pause; a few phones are long (vowel-like), most are short.
        phone_frames = rng.uniform(1.5, 4.5, config.n_phones)
        phone_frames[0] = 6.0
        phone_use = rng.permutation(1.0 / np.arange(1, config.n_phones + 1) ** 0.7)
        phone_use[0] = 0
        phone_use = np.cumsum(phone_use / phone_use.sum())

        # Phrases: the inventory first, then one novel phrase per expected novel slot (each used once).
        expected_slots = int(config.n_tokens / (12 * phone_frames.mean()) * 1.6) + 16
        n_total = config.n_phrases + expected_slots
        lengths = rng.integers(3, 26, n_total)
        lengths[0] = 1  # phrase 0 is the pause
        phrase_ptr = np.concatenate([[0], np.cumsum(lengths)])
        phrase_phones = np.searchsorted(phone_use, rng.random(phrase_ptr[-1]), side="right").astype(np.int32)
        phrase_phones = np.minimum(phrase_phones, config.n_phones - 1)
        phrase_phones[0] = 0
        phrase_frames = np.add.reduceat(phone_frames[phrase_phones], phrase_ptr[:-1])

        popularity = 1.0 / np.arange(1, config.n_phrases) ** config.phrase_zipf
        popularity = np.concatenate([[0.0], np.cumsum(popularity / popularity.sum())])  # never draws the pause
        favourites = rng.integers(1, config.n_phrases, (config.n_speakers, config.n_favourites)).astype(np.int32)

        centre = np.clip(rng.normal(size / 2, size / 3.5, (config.n_speakers, config.n_phones)), 0, size - 1)
        activity = rng.pareto(1.5, config.n_speakers) + 1
        return cls(
            cluster=cluster.astype(np.int32),
            phone_frames=phone_frames,
            phrase_ptr=phrase_ptr,
            phrase_phones=phrase_phones,
            phrase_frames=phrase_frames,
            popularity=popularity,
            favourites=favourites,
            centre=centre,
            spread=rng.uniform(1.5, 6.0, config.n_speakers),
            stay=rng.uniform(0.3, 0.7, config.n_speakers),
            rate=rng.uniform(0.8, 1.25, config.n_speakers),
            activity=np.cumsum(activity / activity.sum()),
        )


def _plan_utterances(config: SynthConfig, world: _World, rng: np.random.Generator):
    """Phrase ids of every slot, the utterance of every slot, and every utterance's speaker."""
    n_slots = len(world.phrase_frames) - config.n_phrases
    kind = rng.random(n_slots)
    slots = np.searchsorted(world.popularity, rng.random(n_slots), side="right").astype(np.int64)
    slots = np.clip(slots, 1, config.n_phrases - 1)
    novel = kind < config.novel_share
    slots[novel] = config.n_phrases + np.arange(novel.sum())  # each novel phrase once
    slots[(kind >= config.novel_share) & (kind < config.novel_share + config.pause_share)] = 0

    # Cut the slot stream into utterances of 2-15 s (by expected length), then give each a speaker.
    seconds = rng.uniform(MIN_SECONDS, MAX_SECONDS, n_slots)
    target = np.cumsum(seconds * FRAME_RATE)
    filled = np.cumsum(world.phrase_frames[slots])
    utt_of_slot = np.searchsorted(target, filled, side="left")
    n_utts = int(utt_of_slot[-1]) + 1  # some utterance numbers may get no slot; _assemble drops them
    utt_speaker = np.searchsorted(world.activity, rng.random(n_utts), side="right").astype(np.int32)
    utt_speaker = np.minimum(utt_speaker, config.n_speakers - 1)

    # Speakers say their favourite phrases more often than the population does.
    favourite = (kind >= config.novel_share + config.pause_share) & (
        kind < config.novel_share + config.pause_share + config.favourite_share
    )
    picks = rng.integers(0, config.n_favourites, favourite.sum())
    slots[favourite] = world.favourites[utt_speaker[utt_of_slot[favourite]], picks]

    return slots, utt_of_slot, utt_speaker


def _render(config: SynthConfig, world: _World, slots, speakers, rng: np.random.Generator):
    """Token sequences of every slot: fresh renderings first, then copies of them in order of depth."""
    n = len(slots)
    order = np.arange(n)
    first_of_pair = _first_index(slots * config.n_speakers + speakers)
    first_of_phrase = _first_index(slots)
    u = rng.random(n)
    source = order.copy()  # source[i] == i: rendered afresh
    sub = np.zeros(n)
    stretch = np.zeros(n)

    cross = (first_of_pair == order) & (first_of_phrase != order) & (u < config.cross_near) & (slots != 0)
    source[cross], sub[cross], stretch[cross] = first_of_phrase[cross], config.cross_sub, config.cross_stretch
    again = (first_of_pair != order) & (slots != 0)
    exact = again & (u < config.same_exact)
    near = again & ~exact & (u < config.same_exact + config.same_near)
    source[exact] = first_of_pair[exact]
    source[near], sub[near], stretch[near] = first_of_pair[near], config.near_sub, config.near_stretch

    depth = np.zeros(n, np.int8)
    depth[source != order] = 1
    depth[(source != order) & (source[source] != source)] = 2

    chunks: list[np.ndarray | None] = [None] * n
    fresh = np.flatnonzero(source == order)
    for i, tokens in zip(fresh, _render_fresh(world, slots[fresh], speakers[fresh], rng)):
        chunks[i] = tokens
    for level in (1, 2):
        copies = np.flatnonzero(depth == level)
        for i, tokens in zip(copies, _copy(world, [chunks[s] for s in source[copies]], sub[copies], stretch[copies], rng)):
            chunks[i] = tokens
    return chunks


def _first_index(keys: np.ndarray) -> np.ndarray:
    """For every element, the index of the first element with the same key."""
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    return first[inverse]


def _render_fresh(world: _World, phrases, speakers, rng: np.random.Generator) -> list[np.ndarray]:
    """Phones -> jittered durations -> a per-speaker random walk over each phone's token cluster."""
    size = world.cluster.shape[1]
    starts, ends = world.phrase_ptr[phrases], world.phrase_ptr[phrases + 1]
    phones = world.phrase_phones[_ranges(starts, ends)]
    phone_speaker = np.repeat(speakers, ends - starts)
    jitter = np.exp(rng.normal(0, 0.25, len(phones)))
    frames = np.maximum(1, np.rint(world.phone_frames[phones] * world.rate[phone_speaker] * jitter)).astype(np.int64)

    frame_phone = np.repeat(phones, frames)
    frame_speaker = np.repeat(phone_speaker, frames)
    segment_start = np.concatenate([[0], np.cumsum(frames)[:-1]])
    start_pos = world.centre[phone_speaker, phones] + rng.normal(0, 1, len(phones)) * world.spread[phone_speaker]
    steps = np.where(rng.random(len(frame_phone)) < world.stay[frame_speaker], 0, rng.choice((-1, 1), len(frame_phone)))
    steps[segment_start] = 0
    walk = np.cumsum(steps)
    walk -= np.repeat(walk[segment_start], frames)  # restart the walk at every phone
    position = np.clip(np.rint(np.repeat(start_pos, frames) + walk), 0, size - 1).astype(np.int64)
    tokens = world.cluster[frame_phone, position]

    phrase_frames = np.add.reduceat(frames, np.concatenate([[0], np.cumsum(ends - starts)[:-1]]))
    return np.split(tokens, np.cumsum(phrase_frames)[:-1])


def _copy(world: _World, sources: list[np.ndarray], sub, stretch, rng: np.random.Generator) -> list[np.ndarray]:
    """Copies of `sources`, each with its own rate of neighbour substitutions and dropped/doubled frames."""
    lengths = np.array([len(s) for s in sources])
    if not len(lengths):
        return []
    tokens = np.concatenate(sources)
    frame_sub, frame_stretch = np.repeat(sub, lengths), np.repeat(stretch, lengths)
    r = rng.random(len(tokens))
    counts = np.where(r < frame_stretch, 0, np.where(r > 1 - frame_stretch, 2, 1))
    owner = np.repeat(np.arange(len(sources)), lengths)
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    counts[first] = np.maximum(counts[first], 1)  # a copy is never empty
    tokens, owner, frame_sub = np.repeat(tokens, counts), np.repeat(owner, counts), np.repeat(frame_sub, counts)

    swap = rng.random(len(tokens)) < frame_sub
    tokens[swap] = _neighbours(world, tokens[swap], rng)
    return np.split(tokens, np.cumsum(np.bincount(owner, minlength=len(sources)))[:-1])


def _neighbours(world: _World, tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """For each token, the token one step left or right of it in its phone's cluster."""
    size = world.cluster.shape[1]
    where = np.full(world.cluster.max() + 1, -1, np.int64)
    where[world.cluster.ravel()] = np.arange(world.cluster.size)
    flat = where[tokens]
    phone, position = flat // size, flat % size
    position = np.clip(position + rng.choice((-1, 1), len(tokens)), 0, size - 1)
    return world.cluster[phone, position]


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, e) for every pair, without a Python loop."""
    lengths = ends - starts
    total = int(lengths.sum())
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(total) + offsets


def _assemble(chunks, utt_of_slot, utt_speaker, n_tokens: int) -> Corpus:
    """Join slots into utterances of 2-15 s (whole slots; trailing ones dropped) until n_tokens are reached."""
    lo, hi = int(MIN_SECONDS * FRAME_RATE), int(MAX_SECONDS * FRAME_RATE)
    lengths = np.array([len(c) for c in chunks])
    end = np.cumsum(lengths)
    utt_start = np.concatenate([[0], end])[np.searchsorted(utt_of_slot, utt_of_slot, side="left")]
    keep = (end - utt_start <= hi) | (utt_start == end - lengths)  # a first slot is kept (and cut) even if long
    kept_utt = utt_of_slot[keep]
    kept_len = np.minimum(lengths[keep], hi)
    used, utt = np.unique(kept_utt, return_inverse=True)
    utt_len = np.bincount(utt, weights=kept_len).astype(np.int64)
    good = (utt_len >= lo) & (utt_len <= hi)
    n_utts = int(np.searchsorted(np.cumsum(np.where(good, utt_len, 0)), n_tokens) + 1)
    good[n_utts:] = False
    if not good.any():
        raise ValueError("corpus too small: no utterance of 2-15 s fits; ask for more tokens")
    take = good[utt]
    pieces = [c[:hi] for c, k in zip(chunks, keep) if k]
    tokens = np.concatenate([p for p, t in zip(pieces, take) if t]).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(utt_len[good])])
    return Corpus(tokens=tokens, offsets=offsets, speakers=utt_speaker[used[good]].astype(np.int32))


def write_jsonl(corpus: Corpus, path: str | os.PathLike) -> None:
    """One line per utterance, `{"id", "speaker", "tokens"}`; written to a temporary file and renamed."""
    with atomic_file(path) as f:
        for i in range(len(corpus)):
            tokens = ",".join(map(str, corpus.utterance(i).tolist()))
            f.write(f'{{"id": {json.dumps(corpus.utterance_id(i))}, "speaker": "{corpus.speaker_name(i)}", "tokens": [{tokens}]}}\n')


@click.command()
@click.option("--tokens", "n_tokens", type=click.IntRange(min=100), default=10_000_000, show_default=True)
@click.option("--vocab", type=click.IntRange(min=16), default=6561, show_default=True)
@click.option("--speakers", "n_speakers", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="JSONL file to write")
def main(n_tokens: int, vocab: int, n_speakers: int, seed: int, out: str) -> None:
    """Write a synthetic speech-like token corpus as JSONL."""
    n_phones = min(81, vocab // 3)
    try:
        corpus = generate(SynthConfig(n_tokens=n_tokens, vocab=vocab, n_speakers=n_speakers, n_phones=n_phones, seed=seed))
    except ValueError as e:
        raise click.UsageError(str(e))
    write_jsonl(corpus, out)
    click.echo(f"{out}: {len(corpus)} utterances, {len(corpus.tokens)} tokens, {len(np.unique(corpus.speakers))} speakers")


if __name__ == "__main__":
    main()

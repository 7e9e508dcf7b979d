"""`echospec make-corpus` and `echospec train-model`: thin layers over echospec.tools.corpus's
make_corpus.make_corpus and train_model.train_model."""

from __future__ import annotations

import json

import click

from ..commands import device_option, fail_cleanly, needs_extra, threads_option


@click.command("make-corpus")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--speaker", "speakers", multiple=True, show_default="flite's 5 voices",
              help="engine:voice, e.g. espeak-ng:en-us+m3 or flite:slt (repeatable).")
@click.option("--text-file", "text_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              show_default="Debian's fortunes files", help="Fortune-format or plain text (repeatable).")
@click.option("--utterances-per-speaker", default=400, show_default=True, type=click.IntRange(min=1),
              help="Utterances synthesized with each voice.")
@click.option("--prompts", "n_prompts", default=120, show_default=True, type=click.IntRange(min=0),
              help="Held-out utterances for prompts.jsonl (≥ 100 resolve a 5% quality difference).")
@click.option("--vocab-size", default=1024, show_default=True, type=click.IntRange(min=2), help="k-means speech tokens.")
@click.option("--token-rate", default=50, show_default=True, type=click.Choice(["25", "50", "100"]),
              help="Speech tokens a second (CosyVoice 25, LLaSA 50): the log-mel hop at 16 kHz.")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seed of the corpus plan (who says what, at which rate and pitch) and of the k-means tokens.")
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(min=1), help="Engine processes run at once.")
@fail_cleanly
def make_corpus(out_dir, speakers, text_files, utterances_per_speaker, n_prompts, vocab_size, token_rate, seed,
                jobs) -> None:
    """Synthesize a multi-speaker speech-token corpus with flite (or espeak-ng) into OUT_DIR."""
    from ..corpus.make_corpus import DEFAULT_SPEAKERS, Speaker, load_sentences
    from ..corpus.make_corpus import make_corpus as run
    from ..corpus.speech_tokenizer import MelConfig

    manifest = run(
        out_dir,
        sentences=load_sentences(text_files) if text_files else None,
        speakers=[Speaker.parse(s) for s in speakers] or DEFAULT_SPEAKERS,
        utterances_per_speaker=utterances_per_speaker,
        n_prompts=n_prompts,
        vocab_size=vocab_size,
        mel=MelConfig(hop_length=16000 // int(token_rate)),
        seed=seed,
        jobs=jobs,
    )
    click.echo(json.dumps({k: manifest[k] for k in ("utterances", "prompts", "tokens", "unique_texts", "vocab_size")}))


@click.command("train-model")
@click.argument("corpus_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--steps", default=1600, show_default=True, type=click.IntRange(min=1),
              help="Optimizer steps (unless --max-minutes runs out first).")
@click.option("--batch-size", default=16, show_default=True, type=click.IntRange(min=1),
              help="Utterances per optimizer step.")
@click.option("--lr", default=2e-3, show_default=True, type=float,
              help="Peak learning rate (AdamW): warmed up over 100 steps, then annealed to a tenth.")
@click.option("--hidden", default=192, show_default=True, type=click.IntRange(min=8),
              help="Hidden size of the Llama model.")
@click.option("--layers", default=4, show_default=True, type=click.IntRange(min=1), help="Transformer layers.")
@click.option("--heads", default=6, show_default=True, type=click.IntRange(min=1),
              help="Attention heads (dividing --hidden; an even number: 2 key-value heads).")
@click.option("--max-minutes", default=20.0, show_default=True, type=float,
              help="Wall budget: training stops when it is spent; the learning rate anneals by steps or budget, "
                   "whichever runs out first.")
@click.option("--front-end", default="phonemes", show_default=True, type=click.Choice(["phonemes", "characters"]),
              help="What the model reads of a text: eSpeak NG's IPA phonemes, or its characters.")
@threads_option
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seed of the initial weights and the order of the batches.")
@device_option(help="Where the model trains: cpu, cuda, cuda:1, ...; only the CPU run is bit-reproducible.")
@needs_extra("decoder")
@fail_cleanly
def train_model(corpus_dir, out_dir, steps, batch_size, lr, hidden, layers, heads, max_minutes, front_end, threads,
                seed, device) -> None:
    """Train a small Llama TTS LM on CORPUS_DIR/corpus.jsonl; save it to OUT_DIR with save_pretrained."""
    from ..corpus.train_model import TrainConfig
    from ..corpus.train_model import train_model as run

    cfg = TrainConfig(steps=steps, batch_size=batch_size, lr=lr, hidden=hidden, layers=layers, heads=heads,
                      max_minutes=max_minutes, front_end=front_end, threads=threads, seed=seed,
                      device=device)  # fmt: skip
    click.echo(json.dumps(run(corpus_dir, out_dir, cfg), indent=2))


COMMANDS = (make_corpus, train_model)

"""`echospec synthesize`: a thin layer over echospec.tools.audio.synthesize.synthesize."""

from __future__ import annotations

import click

from ..bench.harness import POLICIES
from ..commands import fail_cleanly, needs_extra, threads_option
from ..corpus import SAMPLE_MODEL_DIR


@click.command("synthesize")
@click.argument("text")
@click.option("--speaker", required=True, help="A voice the checkpoint knows (the sample: flite-slt, espeak-en-us-m3, ...).")
@click.option("--wav", required=True, type=click.Path(dir_okay=False), help="The WAV file to write.")
@click.option("--policy", default="exact-sampling", show_default=True, type=click.Choice(POLICIES),
              help="Acceptance policy, at the registry's defaults (or --settings').")
@click.option("--settings", type=click.Path(exists=True, dir_okay=False),
              help="A calibration file (relaxed_settings.json of `echospec bench --sweep`): the policy's setting.")
@click.option("--store", type=click.Path(exists=True, file_okay=False),
              help="Datastore to draft from (without one: autoregressive steps).")
@click.option("--checkpoint", default=str(SAMPLE_MODEL_DIR), show_default="the shipped sample model",
              type=click.Path(exists=True, file_okay=False), help="An echospec TTS checkpoint.")
@click.option("--vocoder", metavar="MODULE:CALLABLE", show_default="the k-means stand-in",
              help="The model's token decoder: tokens -> (waveform, sample_rate).")
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False), show_default="the sample's, for its model",
              help="tokenizer.npz of the k-means stand-in vocoder.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the policy's draws.")
@click.option("--max-new-tokens", default=400, show_default=True, type=click.IntRange(1),
              help="Longest utterance, in speech tokens.")
@threads_option
@needs_extra("quality")
@needs_extra("bench")
@fail_cleanly
def synthesize_command(text, speaker, wav, policy, settings, store, checkpoint, vocoder, tokenizer, seed,
                       max_new_tokens, threads):
    """Speak TEXT with an echospec TTS checkpoint and write it as a WAV; print the speed.

    \b
    echospec synthesize "A gift of a flower will soon be made to you." --speaker flite-slt --wav gift.wav
    echospec synthesize "..." --speaker flite-slt --wav gift.wav --policy tolerance --store runs/demo/store \\
        --settings runs/calibrate/relaxed_settings.json
    """
    from ..audio.synthesize import synthesize
    from ..audio.vocoder import find_callable

    if vocoder is not None:
        try:
            find_callable(vocoder, "--vocoder")
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--vocoder") from None
    result = synthesize(text, speaker, wav, policy=policy, store=store, checkpoint=checkpoint, vocoder=vocoder,
                        tokenizer=tokenizer, seed=seed, max_new_tokens=max_new_tokens, threads=threads,
                        settings=settings)
    click.echo(f"Wrote {result['wav']}: {result['audio_seconds']:.2f} s of audio, {result['new_tokens']} tokens in "
               f"{result['seconds']:.2f} s ({result['time_per_token_ms']:.2f} ms/token, "
               f"{result['tokens_per_forward']:.2f} tokens/forward, LM RTF {result['lm_rtf']:.3f}; "
               f"{policy}, {'store ' + result['store'] if result['store'] else 'no store'}); "
               f"vocoder {result['vocoder_seconds']:.2f} s")


COMMANDS = (synthesize_command,)

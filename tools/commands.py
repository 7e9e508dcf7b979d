"""What every command under tools/ shares, the `echospec` command's and the developer benchmarks' alike.

What goes wrong becomes one line: the project's errors, and a missing extra, end a command with
`Error: <message>` and exit status 1, never a traceback (`fail_cleanly`, `needs_extra`). Options several
commands take are defined once (as sqlite-utils' cli.py shares `output_options`).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
import sys
from importlib.util import find_spec

import click

from .audio import QUALITY_MODULES, quality_missing

EXTRAS = {
    "decoder": ("torch", "transformers", "safetensors"),
    "service": ("fastapi", "uvicorn", "httptools", "prometheus_client"),
    "bench": ("torch", "transformers", "safetensors", "matplotlib", "espeakng_loader"),
    "quality": QUALITY_MODULES,
}
"""The modules a command imports from each extra of pyproject.toml (import names, not distribution names)."""


def user_errors() -> tuple[type[BaseException], ...]:
    """What bad input raises: a datastore or corpus error, a ValueError (bad prompts, checkpoints, options,
    training data), an OSError (a path that cannot be read or written), make-corpus's missing engine or
    failed synthesis, or a missing phoneme front end. Imported when an error is being handled, so no command pays
    for it at start-up."""
    from ..datastore import DatastoreError
    from .corpus.make_corpus import EngineMissingError, SynthesisError
    from .corpus.phonemes import FrontEndMissingError

    return (DatastoreError, EngineMissingError, SynthesisError, FrontEndMissingError, ValueError, OSError)


def fail_cleanly(command):
    """Turn the project's errors into a one-line message with exit status 1."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except click.ClickException:
            raise
        except BrokenPipeError:  # the reader went away (`| head`): nothing to say and nowhere to say it
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except Exception as e:
            if not isinstance(e, user_errors()):
                raise
            raise click.ClickException(str(e)) from None
    return wrapper


def needs_extra(extra: str):
    """Refuse to run, naming the extra to install, when a module the command needs from `extra` is missing."""
    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            missing = next((module for module in EXTRAS[extra] if find_spec(module) is None), None)
            if missing is not None:
                name = click.get_current_context().command_path
                raise click.ClickException(f"{name} needs the {extra} extra ({missing} is not installed): "
                                           f"pip install -e '.[{extra}]' in a checkout")
            return command(*args, **kwargs)
        return wrapper
    return decorate


def threads_option(command):
    """--threads: torch threads for commands that run a model."""
    return click.option("--threads", default=1, show_default=True, type=click.IntRange(1),
                        help="torch threads (a small model runs fastest on one).")(command)


def out_option(default: str | None, help: str = "Folder the results are written to."):
    """--out (the `out_dir` parameter): the folder a command writes its results to; required without a default."""
    return click.option("--out", "out_dir", default=default, required=default is None, show_default=default is not None,
                        type=click.Path(file_okay=False), help=help)


def limit_option(default: int | None = None, help: str = "Use the first N prompts."):
    """--limit: how many prompts (or sentences) a command uses."""
    return click.option("--limit", default=default, show_default=default is not None, type=click.IntRange(1),
                        help=help)


class OldSpellings(click.Option):
    """An option whose secondary names are earlier spellings: still accepted, left out of --help."""

    def get_help_record(self, ctx):
        names = self.opts
        self.opts = names[:1]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = names


class KnobValue(click.ParamType):
    """A relaxed rule's knob value (decoder.registry): a number within the knob's bounds, an integer where written
    as one."""

    def __init__(self, knob, policy: str):
        self.knob, self.policy, self.name = knob, policy, knob.name

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return self.knob.check(self.policy, self.knob.parse(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


def knob_options(command):
    """--tau, --beta, --threshold (old spellings, e.g. --similarity, still accepted): one per knob of
    decoder.registry, each None unless given (the registry's default)."""
    from ..decoder import registry

    for knob in reversed(registry.KNOBS.values()):
        policies = " and ".join(registry.policies_of(knob.name))
        command = click.option(f"--{knob.name}", *(f"--{alias}" for alias in knob.aliases), knob.name,
                               cls=OldSpellings, type=KnobValue(knob, policies), show_default="the registry's",
                               help=f"{policies}'s knob: {knob.means.partition(': ')[2]}.")(command)
    return command


def dtype_option(default: str = "float32", help: str = "Precision the model runs in."):
    """--dtype: float32, bfloat16 or float16."""
    from .bench.harness import DTYPES

    return click.option("--dtype", default=default, show_default=True, type=click.Choice(DTYPES), help=help)


def device_option(default: str = "cpu", help: str = "Where the model runs: cpu, cuda, cuda:1, ..."):
    """--device: where the model runs."""
    return click.option("--device", default=default, show_default=True, help=help)


def audio_options(command):
    """--audio, --audio-scores, --vocoder, --asr, --speaker-encoder, --mos, --scoring-workers: audio out and the
    scores on it (echospec.tools.audio)."""
    options = [
        click.option("--audio", "audio_dir", type=click.Path(file_okay=False),
                     help="Write every utterance as DIR/<system>/<prompt id>.wav (and the references' audio)."),
        click.option("--audio-scores/--no-audio-scores", default=None, show_default="where a vocoder is at hand "
                     "and the quality extra installed", help="Score WER, SIM and MOS on audio."),
        click.option("--vocoder", metavar="MODULE:CALLABLE", show_default="the k-means stand-in from --tokenizer",
                     help="The model's token decoder: tokens -> (waveform, sample_rate)."),
        click.option("--asr", metavar="NAME|DIR|MODULE:CALLABLE", show_default="whisper (tiny.en, bundled)",
                     help="ASR for WER: whisper (Whisper tiny.en, no download), pocketsphinx, a faster-whisper "
                          "model folder (e.g. your large-v3), or (waveform, rate) -> text."),
        click.option("--speaker-encoder", metavar="MODULE:CALLABLE", show_default="resemblyzer",
                     help="Speaker embedding for SIM: (waveform, rate) -> vector."),
        click.option("--mos", metavar="MODULE:CALLABLE", show_default="DNSMOS P.808 (speechmos)",
                     help="MOS predictor: (waveform, rate) -> float."),
        click.option("--scoring-workers", default=2, show_default=True, type=click.IntRange(1),
                     help="Processes scoring audio after decoding."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def scoring(tokenizer, audio_dir, audio_scores, vocoder, asr, speaker_encoder, mos, scoring_workers):
    """The scoring options as the library's `Scoring`, checked: a spec that names nothing loadable is a usage
    error (exit 2); asking for audio without the quality extra names the extra."""
    from .bench.spec import Scoring
    from .audio.scorers import ASR_NAMES
    from .audio.vocoder import find_callable

    asked = audio_dir or audio_scores or any((vocoder, asr, speaker_encoder, mos))
    if asked and audio_scores is not False:
        missing = quality_missing()
        if missing is not None:
            raise click.ClickException(f"scores on audio need the quality extra ({missing} is not installed): "
                                       "pip install -e '.[quality]' in a checkout")
    for name, spec in (("--vocoder", vocoder), ("--asr", asr), ("--speaker-encoder", speaker_encoder),
                       ("--mos", mos)):
        if spec is None or (name == "--asr" and (spec in ASR_NAMES or Path(spec).is_dir())):
            if name == "--asr" and spec is not None and Path(spec).is_dir() and not (Path(spec) / "model.bin").is_file():
                raise click.BadParameter(f"{spec} is not a faster-whisper (CTranslate2) model folder: no model.bin",
                                         param_hint=name)
            continue
        try:
            find_callable(spec, name)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint=name) from None
    return Scoring(tokenizer, audio_scores, vocoder, asr, speaker_encoder, mos, audio_dir, scoring_workers)


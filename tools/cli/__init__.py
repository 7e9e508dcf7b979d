"""The `echospec` command: each subcommand is a thin layer over a library call of the same name.

    store   build, enroll, info, query   echospec.datastore, echospec.retriever
    serve   serve                        echospec.retriever.service (the service extra)
    bench   bench, demo                  echospec.tools.bench (the bench extra)
    audio   synthesize                   echospec.tools.audio (the bench and quality extras)
    corpus  make-corpus, train-model     echospec.tools.corpus (train-model: the decoder extra)

Their one-line errors, missing-extra messages and shared options are echospec.tools.commands's, which the
developer benchmarks use too.
"""

import click

from . import audio, bench, corpus, serve, store


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="echospec")
def main() -> None:
    """Retrieval-based speculative decoding for speech-token TTS language models."""


for _group in (store, serve, bench, audio, corpus):
    for _command in _group.COMMANDS:
        main.add_command(_command)

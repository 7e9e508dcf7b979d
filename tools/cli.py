"""The `echospec` command: each subcommand is a thin layer over a library call of the same name."""

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="echospec")
def main() -> None:
    """Retrieval-based speculative decoding for speech-token TTS language models."""


# Subcommands register themselves here, one import per module (keep this list sorted).
from . import cli_bench  # noqa: E402,F401
from . import cli_corpus  # noqa: E402,F401
from . import cli_serve  # noqa: E402,F401
from . import cli_store  # noqa: E402,F401

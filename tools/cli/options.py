"""Options several commands share, defined once (as sqlite-utils' cli.py shares `output_options`)."""

from __future__ import annotations

import click


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

"""`echospec bench` and `echospec demo`."""

from __future__ import annotations

import click

from ..datastore import DatastoreError
from .bench import POLICIES, BenchError, bench, format_table
from .cli import main

USER_ERRORS = (BenchError, DatastoreError, ValueError, OSError)
"""What a bad checkpoint, store, prompts file or output folder raises: a message, not a traceback."""


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


@main.command("bench")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--store", required=True, type=click.Path(exists=True, file_okay=False), help="Datastore directory.")
@click.option("--prompts", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSONL: input_ids, or text + speaker for an echospec TTS checkpoint; reference_tokens optional.")
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False), help="tokenizer.npz for log-mel distortion.")
@click.option("--policy", "policies", multiple=True, type=click.Choice(POLICIES), help="Policies (default: all).")
@click.option("--stores", default="speaker,general", show_default=True, help="Which stores: speaker, general.")
@click.option("--nodes", default="16", show_default=True, help="Node budget: an integer or 'auto'.")
@click.option("--depth", default=8, show_default=True, type=click.IntRange(1, 64))
@click.option("--sweep-nodes", default="", help="Node budgets to sweep, e.g. 8,32,64.")
@click.option("--sweep-depths", default="", help="Depths to sweep, e.g. 4,12.")
@click.option("--sweep-policy", "sweep_policies", multiple=True, type=click.Choice(POLICIES),
              help="Policies the sweeps run (default: exact-sampling if benchmarked, else the first policy).")
@click.option("--limit", type=click.IntRange(1), help="Use the first N prompts.")
@click.option("--max-new-tokens", default=400, show_default=True, type=click.IntRange(1))
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1),
              help="torch threads (a small model runs fastest on one).")
@click.option("--seed", default=0, show_default=True)
@click.option("--tau", type=click.IntRange(1), help="Filtered: top-tau (default: the paper's 512/6561 of the vocabulary).")
@click.option("--beta", default=0.2, show_default=True, type=click.FloatRange(0, 1), help="Tolerance's beta.")
@click.option("--similarity", default=0.3, show_default=True, type=click.FloatRange(-1, 1),
              help="SimilarityGroups' cosine threshold.")
@click.option("--out", "out_dir", default="runs/bench", show_default=True, type=click.Path(file_okay=False))
def bench_command(checkpoint, store, prompts, tokenizer, policies, stores, nodes, depth, sweep_nodes, sweep_depths,
                  sweep_policies, limit, max_new_tokens, threads, seed, tau, beta, similarity, out_dir):
    """Compare autoregressive, HF prompt lookup and echospec's policies on CHECKPOINT.

    \b
    echospec bench tools/sample/model --store runs/demo/store --prompts tools/sample/prompts.jsonl \\
        --tokenizer tools/sample/tokenizer.npz --limit 20 --sweep-nodes 8,32
    """
    stores = tuple(s.strip() for s in stores.split(",") if s.strip())
    if not stores or set(stores) - {"speaker", "general"}:
        raise click.BadParameter("use speaker and/or general", param_hint="--stores")
    if nodes != "auto" and not nodes.isdigit():
        raise click.BadParameter("an integer or 'auto'", param_hint="--nodes")
    try:
        report = bench(checkpoint, store, prompts, tokenizer=tokenizer, policies=policies or POLICIES, stores=stores,
                       max_nodes=nodes if nodes == "auto" else int(nodes), max_depth=depth,
                       sweep_nodes=_ints(sweep_nodes), sweep_depths=_ints(sweep_depths) or (depth,),
                       sweep_policies=sweep_policies, limit=limit,
                       max_new_tokens=max_new_tokens, threads=threads, seed=seed, tau=tau, beta=beta,
                       similarity=similarity, out_dir=out_dir)
    except USER_ERRORS as e:
        raise click.ClickException(str(e)) from None
    click.echo(format_table(report))
    click.echo(f"\nWrote {out_dir}/bench.json, bench.md and bench.png")


@main.command("demo")
@click.option("--out", "out_dir", default="runs/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--limit", default=12, show_default=True, type=click.IntRange(1), help="Held-out sentences to synthesize.")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1),
              help="torch threads (a small model runs fastest on one).")
def demo_command(out_dir, limit, threads):
    """The embedded default: build stores from the shipped sample, query, and benchmark every policy."""
    from .demo import demo

    try:
        demo(out_dir=out_dir, limit=limit, threads=threads, echo=click.echo)
    except USER_ERRORS as e:
        raise click.ClickException(str(e)) from None

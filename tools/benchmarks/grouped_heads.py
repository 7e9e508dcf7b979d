"""Tree decoding with grouped key/value heads handed to SDPA uncopied (echospec's way on a CPU, `decoder.gqa`)
against transformers' default, which copies the KV cache per query head in every tree forward.

    python -m echospec.tools.benchmarks.grouped_heads --store runs/demo/store --threads 2 --out runs/grouped-heads

The shipped sample model (6 query heads, 2 key/value heads) decodes the sample's prompts three ways, in a
balanced order after a warm-up: autoregressive (the baseline), `--max-nodes` fixed tree nodes as echospec runs
them, and the same with TRANSFORMERS_SDPA_FORCE_GQA=0 (transformers' default: `repeat_kv`). Prints each
system's median time per token, its ratio to autoregressive decoding (ratio of medians and the paired median
ratio) and the paired median ratio of the two tree systems with its 95% interval, and whether their tokens
agree; writes grouped_heads.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
import numpy as np

from ...datastore.files import atomic_file
from ...decoder.gqa import SWITCH
from ..bench.harness import (POLICIES, RelaxedSettings, System, balanced_order, copying_grouped_heads,
                             echospec_run, make_policy, warm_up)
from ..bench.quality import median_ratio_ci, ratio_of_medians_ci
from ..commands import OldSpellings, limit_option, out_option, threads_option
from ..corpus import SAMPLE_MODEL_DIR, SAMPLE_PROMPTS


def copying_kv(run):
    """`run`, its sessions leaving tree forwards to copy the KV cache per query head."""
    def copied(prompt, seed):
        with copying_grouped_heads():
            return run(prompt, seed)
    return copied


def compare(store, nodes: int = 8, policy: str = "exact-sampling", limit: int | None = None, rounds: int = 1,
            threads: int = 1, seed: int = 0) -> dict:
    """Decode the sample's prompts autoregressively, with `nodes` tree nodes, and with the same trees copying
    the KV cache per query head; the report as a dict."""
    import torch

    from ..bench.load import decode_inputs
    from ..bench.spec import Inputs

    if SWITCH in os.environ:
        raise click.UsageError(f"unset {SWITCH}: this benchmark sets it per system")
    model, _, _, retriever, speech, prompts = decode_inputs(Inputs(SAMPLE_MODEL_DIR, store, SAMPLE_PROMPTS, limit,
                                                                   threads=threads))

    def chosen(seed_):
        return make_policy(policy, seed_, RelaxedSettings())

    tree = echospec_run(model, retriever, chosen, speech, max_nodes=nodes, max_new_tokens=400)
    systems = [System("autoregressive", echospec_run(model, None, chosen, speech, max_new_tokens=400)),
               System(f"{nodes} nodes, grouped heads", tree, baseline="autoregressive"),
               System(f"{nodes} nodes, repeat_kv", copying_kv(tree), baseline="autoregressive")]
    warm_up(systems, prompts[0], seed)
    runs = {s.name: [] for s in systems}
    for i, prompt in enumerate(p for _ in range(rounds) for p in prompts):
        for system in balanced_order(systems, i):
            runs[system.name].append(system.run(prompt, seed + i))
    tpt = {name: [r.time_per_token for r in rs] for name, rs in runs.items()}
    base = tpt["autoregressive"]
    grouped, copied = (s.name for s in systems[1:])
    return {
        "threads": threads, "torch": torch.__version__, "policy": policy, "nodes": nodes, "utterances": len(base),
        "systems": {name: {"median_ms_per_token": 1e3 * float(np.median(t)),
                           "speedup": ratio_of_medians_ci(base, t).to_dict(),
                           "speedup_paired": median_ratio_ci(base, t).to_dict("median"),
                           "tokens_per_forward": sum(len(r.tokens) for r in runs[name]) / sum(r.forwards for r in runs[name])}
                    for name, t in tpt.items()},
        "grouped_over_repeat_kv": median_ratio_ci(tpt[copied], tpt[grouped]).to_dict("median"),
        "same_tokens": sum(a.tokens == b.tokens for a, b in zip(runs[grouped], runs[copied])) / len(base),
    }


@click.command()
@click.option("--store", required=True, type=click.Path(exists=True, file_okay=False),
              help="A store built from the sample corpus (echospec demo builds one in runs/demo/store).")
@click.option("--max-nodes", "--nodes", "nodes", cls=OldSpellings, default=8, show_default=True,
              type=click.IntRange(1), help="Tree nodes each step verifies.")
@click.option("--policy", default="exact-sampling", show_default=True, type=click.Choice(POLICIES))
@limit_option()
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1))
@threads_option
@out_option("runs/grouped-heads")
def main(store, nodes, policy, limit, rounds, threads, out_dir) -> None:
    """Tree decoding with grouped key/value heads uncopied against transformers' repeat_kv, side by side."""
    report = compare(store, nodes, policy, limit, rounds, threads)
    for name, s in report["systems"].items():
        click.echo(f"{name:28s} {s['median_ms_per_token']:7.3f} ms/token  speed-up {s['speedup']['mean']:.3f} "
                   f"(paired {s['speedup_paired']['median']:.3f})  {s['tokens_per_forward']:.2f} tokens/forward")
    ratio = report["grouped_over_repeat_kv"]
    click.echo(f"grouped heads over repeat_kv, paired: {ratio['median']:.3f} [{ratio['ci95'][0]:.3f}, "
               f"{ratio['ci95'][1]:.3f}]; same tokens in {report['same_tokens']:.0%} of {report['utterances']} utterances")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / "grouped_heads.json") as f:
        json.dump(report, f, indent=1)
    click.echo(f"wrote {out / 'grouped_heads.json'}")


if __name__ == "__main__":
    main()

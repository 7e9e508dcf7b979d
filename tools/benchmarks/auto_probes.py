"""The "auto" budget under a lossless policy counting each cap's tokens per step at every proposal (`Probes`,
echospec's way) against the same budget reading them off each cap's own blocks (the way before, and the way
of the relaxed policies), beside fixed caps and autoregressive decoding.

    python -m echospec.tools.benchmarks.auto_probes --store runs/demo/store --threads 2 --out runs/auto-probes

The shipped sample model decodes the sample's prompts with each lossless policy (`--policy`, repeatable;
default exact-greedy and exact-sampling) five ways, in a balanced order after a warm-up: autoregressive
(the baseline), "auto" with probes, "auto" with measured tokens (the same policy with `exact = False`, so
its budget keeps rates of its own and never probes), and fixed caps (`--fixed`). Prints each system's median time
per token, its speed-up (ratio of medians, with the paired median ratio) and the share of its steps that ran
no tree, and the paired ratio of the two "auto" systems with its 95% interval; checks that every lossless
system's tokens equal the baseline's; writes auto_probes.json.
"""

from __future__ import annotations

import click
import numpy as np

from ..bench.harness import RelaxedSettings, System, balanced_order, echospec_run, make_policy, save_report, warm_up
from ..bench.quality import median_ratio_ci, ratio_of_medians_ci
from ..cli.options import limit_option, out_option, threads_option
from ..corpus import SAMPLE_MODEL_DIR, SAMPLE_PROMPTS

LOSSLESS = ("exact-greedy", "exact-sampling")


def systems_for(policy: str, model, retriever, speech, speaker: bool, fixed) -> list[System]:
    relaxed = RelaxedSettings.for_vocabulary(speech.size)

    def counted(seed):
        return make_policy(policy, seed, relaxed)

    def inexact(seed):  # declared inexact: its budget keeps rates of its own, read off each cap's blocks
        chosen = counted(seed)
        chosen.exact = False
        return chosen

    def run(chosen, retriever_, **options):
        return echospec_run(model, retriever_, chosen, speech, speaker=speaker, max_new_tokens=400, **options)

    base = f"{policy}/autoregressive"
    return [System(base, run(counted, None)),
            System(f"{policy}/auto, probes", run(counted, retriever), base, base),
            System(f"{policy}/auto, measured", run(inexact, retriever), base, base),
            *(System(f"{policy}/fixed {n}", run(counted, retriever, max_nodes=n), base, base) for n in fixed)]


def compare(store, policies=LOSSLESS, speaker: bool = True, fixed=(4, 8), limit: int | None = None,
            rounds: int = 1, threads: int = 1, seed: int = 0, progress: bool = True) -> dict:
    """Decode the sample's prompts with every system of every policy; the report as a dict."""
    import torch
    from tqdm import tqdm

    from ...retriever import Retriever
    from ..bench.compare import load_model, load_prompts, speech_vocab

    torch.set_num_threads(threads)
    model, meta = load_model(SAMPLE_MODEL_DIR)
    retriever = Retriever(store)
    speech = speech_vocab(meta, retriever.datastore, model)
    prompts = load_prompts(SAMPLE_PROMPTS, meta, limit)
    systems = [s for policy in policies for s in systems_for(policy, model, retriever, speech, speaker, fixed)]
    warm_up(systems, prompts[0], seed)
    runs = {s.name: [] for s in systems}
    utterances = [p for _ in range(rounds) for p in prompts]
    for i, prompt in enumerate(tqdm(utterances, desc="auto-probes", unit="utt", disable=not progress)):
        for system in balanced_order(systems, i):
            runs[system.name].append(system.run(prompt, seed + i))
    tpt = {name: [r.time_per_token for r in rs] for name, rs in runs.items()}
    report = {"threads": threads, "torch": torch.__version__, "store": "speaker" if speaker else "general",
              "utterances": len(prompts) * rounds, "systems": {}, "probes_over_measured": {}}
    for system in systems:
        base, mine = tpt[system.baseline], tpt[system.name]
        caps = [c for r in runs[system.name] for c in (r.caps or [])]
        report["systems"][system.name] = {
            "median_ms_per_token": 1e3 * float(np.median(mine)),
            "speedup": ratio_of_medians_ci(base, mine).to_dict(),
            "speedup_paired": median_ratio_ci(base, mine).to_dict("median"),
            "plain_steps": caps.count(0) / len(caps) if caps else None,
            "caps": {str(c): caps.count(c) / len(caps) for c in sorted(set(caps))},  # share of steps per cap
            "same_tokens": sum(a.tokens == b.tokens for a, b in zip(runs[system.name], runs[system.baseline]))
            / len(mine),
        }
    for policy in policies:
        report["probes_over_measured"][policy] = median_ratio_ci(
            tpt[f"{policy}/auto, measured"], tpt[f"{policy}/auto, probes"]).to_dict("median")
    return report


@click.command()
@click.option("--store", required=True, type=click.Path(exists=True, file_okay=False),
              help="A store built from the sample corpus (echospec demo builds one in runs/demo/store).")
@click.option("--policy", "policies", multiple=True, type=click.Choice(LOSSLESS),
              help="A lossless policy (repeatable; default both).")
@click.option("--general", is_flag=True, help="Ask the general store only (default: the prompt's speaker's).")
@click.option("--fixed", default="4,8", show_default=True, help="Fixed caps beside the two autos, e.g. 4,8.")
@limit_option()
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1))
@threads_option
@out_option("runs/auto-probes")
def main(store, policies, general, fixed, limit, rounds, threads, out_dir) -> None:
    """"auto" counting tokens at every proposal against "auto" reading them off its blocks, side by side."""
    try:
        caps = tuple(int(n) for n in fixed.split(",") if n.strip())
    except ValueError:
        raise click.BadParameter(f"{fixed!r} is not a comma-separated list of node counts", param_hint="--fixed")
    if any(n < 1 for n in caps):
        raise click.BadParameter("fixed caps must be at least 1", param_hint="--fixed")
    report = compare(store, policies or LOSSLESS, not general, caps, limit, rounds, threads)
    for name, s in report["systems"].items():
        plain = "" if s["plain_steps"] is None else f"  plain steps {s['plain_steps']:.0%}"
        click.echo(f"{name:34s} {s['median_ms_per_token']:7.3f} ms/token  speed-up {s['speedup']['mean']:.3f} "
                   f"[{s['speedup']['ci95'][0]:.3f}, {s['speedup']['ci95'][1]:.3f}] (paired "
                   f"{s['speedup_paired']['median']:.3f})  same tokens {s['same_tokens']:.0%}{plain}")
    for policy, ratio in report["probes_over_measured"].items():
        click.echo(f"{policy}: auto with probes over auto with measured tokens, paired: {ratio['median']:.3f} "
                   f"[{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}]")
    click.echo(f"wrote {save_report(report, out_dir, 'auto_probes.json')}")


if __name__ == "__main__":
    main()

"""The acceptance walk's share of decode time, per policy, on the shipped sample.

    python -m echospec.tools.benchmarks.acceptance_share --store runs/voices --limit 40 --out runs/acceptance

Times every `SpeculativeSession.accept` call (the policy's walk: its distributions and its decisions) against the
decode's wall-clock, for each policy with the speaker and the general store, one thread, the policies alternating
per prompt. It reads nothing but the session's public stages, so a copy of it measures an older tree the same way
(PYTHONPATH at that tree, with this file copied into its tools/benchmarks/). Writes acceptance_share.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from ...datastore.files import atomic_file
from ..bench.harness import POLICIES, RelaxedSettings, make_policy
from ..bench.machine import machine
from ..commands import limit_option, out_option


def acceptance_share(store, limit: int = 40, max_new_tokens: int = 400) -> dict:
    """{store: {policy: {"accept_share", "accept_ms_per_step", "steps"}}} over the first `limit` sample prompts."""
    import torch

    from ...decoder import SpeechVocab, generate
    from ...decoder.session import SpeculativeSession
    from ...retriever import Retriever
    from ..corpus import SAMPLE_PROMPTS
    from ..corpus.tts_prompt import encode_prompt, load_sample_tts

    torch.set_num_threads(1)
    model, meta = load_sample_tts()
    speech = SpeechVocab(meta.speech_offset, meta.speech_vocab_size, (meta.stop_id,))
    prompts = [json.loads(line) for line in Path(SAMPLE_PROMPTS).read_text().splitlines()[:limit]]
    timed = {"seconds": 0.0, "calls": 0}
    accept = SpeculativeSession.accept

    def timed_accept(session, verified):
        start = time.perf_counter()
        try:
            return accept(session, verified)
        finally:
            timed["seconds"] += time.perf_counter() - start
            timed["calls"] += 1

    SpeculativeSession.accept = timed_accept
    report = {}
    try:
        for store_kind in ("speaker", "general"):
            retriever = Retriever(store)
            totals = {name: {"accept": 0.0, "wall": 0.0, "steps": 0} for name in POLICIES}
            for i, prompt in enumerate(prompts):
                ids = encode_prompt(meta, prompt["text"], prompt["speaker"])
                for name in [*POLICIES[i % len(POLICIES):], *POLICIES[:i % len(POLICIES)]]:
                    timed.update(seconds=0.0, calls=0)
                    result = generate(model, retriever, input_ids=ids, policy=make_policy(name, i, RelaxedSettings()),
                                      speech=speech, speaker=prompt["speaker"] if store_kind == "speaker" else None,
                                      max_new_tokens=max_new_tokens)
                    totals[name]["accept"] += timed["seconds"]
                    totals[name]["wall"] += result.stats.wall_seconds
                    totals[name]["steps"] += timed["calls"]
            report[store_kind] = {name: {"accept_share": t["accept"] / t["wall"],
                                         "accept_ms_per_step": 1e3 * t["accept"] / max(t["steps"], 1),
                                         "steps": t["steps"]} for name, t in totals.items()}
    finally:
        SpeculativeSession.accept = accept
    return report


@click.command()
@click.option("--store", required=True, type=click.Path(exists=True, file_okay=False))
@limit_option(40)
@out_option("runs/acceptance")
def main(store, limit, out_dir) -> None:
    """The acceptance walk's share of decode time per policy, on the sample."""
    report = {"machine": machine(threads=1), "limit": limit, "stores": acceptance_share(store, limit)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / "acceptance_share.json") as f:
        json.dump(report, f, indent=1)
    for kind, policies in report["stores"].items():
        click.echo(f"{kind}: " + ", ".join(f"{name} {100 * p['accept_share']:.1f}% ({p['accept_ms_per_step']:.3f} ms)"
                                           for name, p in policies.items()))


if __name__ == "__main__":
    main()

"""Benchmark echospec's decoder against Hugging Face generate on a small Llama (CPU, pinned threads).

    python -m echospec.tools.benchmarks.bench_decoder --out bench_out            # a random small Llama
    python -m echospec.tools.benchmarks.bench_decoder --checkpoint path/to/llama  # or a saved causal LM

Systems run A B A B in one process after a warm-up, each prompt in every round, system order rotating:
HF greedy (the baseline), HF prompt lookup decoding, echospec with each policy on a prompt-lookup tree
proposer, and the "nothing is ever accepted" case (a proposer of random paths) with the auto and a fixed
budget. Reports medians of time per token, ratio of medians to HF greedy (with min/max over runs),
tokens per forward, whether greedy outputs are identical, and the model's verify-cost curve. Writes
bench_decoder.json and bench_decoder.png under --out.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import click
import numpy as np

from ...datastore.files import atomic_file
from ...retriever import CandidateTree
from ...retriever.tree import MAX_DEPTH
from ..bench import harness
from ..bench.harness import Prompt, System
from ..commands import out_option, threads_option


class PromptLookupTree:
    """Prompt lookup as a tree: the continuations of every earlier occurrence of the context's last 1..3 tokens."""

    def __init__(self, ngram_max: int = 3, window: int = 1024):
        self.ngram_max, self.window = ngram_max, window

    def propose(self, context, speaker=None, max_nodes=16, max_depth=MAX_DEPTH):
        context = np.asarray(context[-self.window:], np.int64)
        sequences, weights = [], []
        for n in range(min(self.ngram_max, len(context) - 1), 0, -1):
            tail = context[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
            for start in np.flatnonzero((windows == tail).all(1))[-8:]:
                sequences.append(context[start + n: start + n + max_depth].tolist())
                weights.append(float(n * n))
            if sequences:
                break
        return CandidateTree.from_sequences(sequences, weights, max_nodes=max_nodes, max_depth=max_depth)


class RandomPaths:
    """A proposer whose trees are never right: measures pure overhead."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def propose(self, context, speaker=None, max_nodes=16, max_depth=MAX_DEPTH):
        sequences = self.rng.integers(0, self.vocab, (4, max_depth)).tolist()
        return CandidateTree.from_sequences(sequences, max_nodes=max_nodes, max_depth=max_depth)


def small_llama(vocab: int, hidden: int, layers: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 1),
                         num_key_value_heads=max(hidden // 128, 1), max_position_embeddings=4096,
                         attn_implementation="sdpa", eos_token_id=vocab - 1, bos_token_id=vocab - 2)
    return LlamaForCausalLM(config).eval()


def make_systems(model, speech, max_new: int, seed: int) -> list[System]:
    """Every system decodes exactly `max_new` tokens; policies sample from the fixed `seed`."""
    counter = harness.ForwardCounter(model)
    lookup = PromptLookupTree()
    relaxed = harness.RelaxedSettings.for_vocabulary(speech.size)  # the paper's tau share, beta 0.2, similarity 0.3

    def hf(**extra):
        return harness.hf_generate_run(model, counter, max_new_tokens=max_new, min_new_tokens=max_new,
                                       pad_token_id=0, **extra)

    def ours(policy, retriever, max_nodes=16):
        return harness.echospec_run(model, retriever, lambda _: harness.make_policy(policy, seed, relaxed), speech,
                                    speaker=False, max_new_tokens=max_new, min_new_tokens=max_new,
                                    max_nodes=max_nodes)

    never = RandomPaths(speech.size, seed)
    return [
        System("hf-greedy", hf()),
        System("hf-prompt-lookup", hf(prompt_lookup_num_tokens=10)),
        System("echospec-ar-greedy", ours("exact-greedy", None)),
        System("exact-greedy", ours("exact-greedy", lookup)),
        System("exact-greedy-auto", ours("exact-greedy", lookup, "auto")),
        System("echospec-ar-ras", ours("exact-sampling", None)),
        System("exact-sampling-ras-auto", ours("exact-sampling", lookup, "auto")),
        System(f"filtered-tau{relaxed.tau}-auto", ours("filtered", lookup, "auto")),
        System("tolerance-0.2-auto", ours("tolerance", lookup, "auto")),
        System("similarity-0.3-auto", ours("similarity", lookup, "auto")),
        # relaxed rules accept more than the exact output would have followed, which the auto budget's
        # calibration (scored against the output) cannot see until trees are verified: fixed budgets too
        System(f"filtered-tau{relaxed.tau}-16", ours("filtered", lookup)),
        System("tolerance-0.2-16", ours("tolerance", lookup)),
        System("similarity-0.3-16", ours("similarity", lookup)),
        System("never-accepted-auto", ours("exact-greedy", never, "auto")),
        System("never-accepted-16", ours("exact-greedy", never, 16)),
    ]


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    names = [n for n in report["systems"] if n != "hf-greedy"]
    speedups = [1 / report["systems"][n]["ratio_to_hf_greedy"] for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    left.barh(names, speedups, color=["tab:gray" if s < 1 else "tab:green" for s in speedups])
    left.axvline(1.0, color="black", lw=0.8)
    left.set_xlabel("speed-up over HF greedy (median time per token)")
    harness.plot_cost_curve(right, report["cost_curve"])
    fig.tight_layout()
    harness.save_figure(fig, path)


def run_bench(checkpoint, vocab, hidden, layers, prompts, prompt_length, max_new_tokens, rounds, threads, seed,
              command) -> dict:
    import torch

    from ...decoder import SpeechVocab

    harness.pin_threads(threads)
    if checkpoint:
        from ...decoder.compat import load_causal_lm

        model = load_causal_lm(checkpoint, attn_implementation="sdpa")
    else:
        model = small_llama(vocab, hidden, layers, seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    speech = SpeechVocab(0, vocab)
    rng = np.random.default_rng(seed)
    inputs = [Prompt(str(i), None, rng.integers(0, vocab, prompt_length).tolist()) for i in range(prompts)]
    systems = make_systems(model, speech, max_new_tokens, seed)
    with torch.no_grad():
        harness.warm_up(systems, Prompt("warm-up", None, inputs[0].input_ids[:8]), seed)
        runs = {system.name: [] for system in systems}
        for round_ in range(rounds):
            for i, prompt in enumerate(inputs):
                for system in harness.balanced_order(systems, round_ * len(inputs) + i):
                    run = system.run(prompt, seed)
                    sizes = run.tree_sizes or [0]  # HF prompt lookup's candidates are not visible
                    nodes = sum(sizes) / len(sizes)
                    runs[system.name].append({"prompt": i, "tokens": run.tokens, "forwards": run.forwards,
                                              "seconds": run.seconds, "nodes": nodes})
        curve = harness.measure_cost_curve(model, speech, inputs[0].input_ids).to_dict()
    reference = {r["prompt"]: r["tokens"] for r in runs["hf-greedy"]}
    base_runs = [r["seconds"] / len(r["tokens"]) for r in runs["hf-greedy"]]
    base = statistics.median(base_runs)
    report = {"command": command, "threads": threads, "model": type(model).__name__,
              "parameters": sum(p.numel() for p in model.parameters()), "vocab": vocab, "prompts": prompts,
              "rounds": rounds, "max_new_tokens": max_new_tokens, "cost_curve": curve, "systems": {}}
    for name, rs in runs.items():
        per_token = [r["seconds"] / len(r["tokens"]) for r in rs]
        report["systems"][name] = {
            "median_ms_per_token": 1e3 * statistics.median(per_token),
            "ratio_to_hf_greedy": statistics.median(per_token) / base,
            "ratio_min": min(per_token) / base, "ratio_max": max(per_token) / base,
            # each run against the HF greedy run of the same prompt and round: robust to a busy machine
            "paired_ratio_median": statistics.median(p / b for p, b in zip(per_token, base_runs)),
            "tokens_per_forward": sum(len(r["tokens"]) for r in rs) / sum(r["forwards"] for r in rs),
            "mean_nodes_per_step": statistics.mean(r["nodes"] for r in rs),
            "identical_to_hf_greedy": all(r["tokens"] == reference[r["prompt"]] for r in rs),
        }
    return report


@click.command()
@click.option("--checkpoint", help="A saved Hugging Face causal LM (default: a random small Llama).")
@click.option("--vocab", default=1024, show_default=True, type=click.IntRange(min=8))
@click.option("--hidden", default=256, show_default=True, type=click.IntRange(min=8))
@click.option("--layers", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--prompts", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-length", default=48, show_default=True, type=click.IntRange(min=2))
@click.option("--max-new-tokens", default=160, show_default=True, type=click.IntRange(min=1))
@click.option("--rounds", default=2, show_default=True, type=click.IntRange(min=1))
@threads_option
@click.option("--seed", default=0, show_default=True, type=int)
@out_option("bench_out")
def main(checkpoint, vocab, hidden, layers, prompts, prompt_length, max_new_tokens, rounds, threads, seed,
         out_dir) -> None:
    """Benchmark echospec's decoder against Hugging Face generate on a small Llama (CPU, pinned threads)."""
    command = "python -m echospec.tools.benchmarks.bench_decoder " + " ".join(sys.argv[1:])
    report = run_bench(checkpoint, vocab, hidden, layers, prompts, prompt_length, max_new_tokens, rounds, threads,
                       seed, command)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / "bench_decoder.json") as f:
        json.dump(report, f, indent=2)
    plot(report, out / "bench_decoder.png")
    click.echo(f"{report['model']} {report['parameters'] / 1e6:.1f}M params, {threads} thread(s), "
               f"{prompts} prompts x {rounds} rounds, {max_new_tokens} new tokens")
    click.echo("verify-cost curve (nodes: time / one-token time): " + ", ".join(
        f"{n}: {r:.2f}" for n, r in zip(report["cost_curve"]["sizes"], report["cost_curve"]["relative"])))
    click.echo(f"{'system':26s} {'ms/token':>9s} {'ratio':>7s} {'min':>6s} {'max':>6s} {'paired':>7s} "
               f"{'tok/fwd':>8s} {'nodes':>6s}  identical")
    for name, s in report["systems"].items():
        click.echo(f"{name:26s} {s['median_ms_per_token']:9.3f} {s['ratio_to_hf_greedy']:7.3f} {s['ratio_min']:6.3f} "
                   f"{s['ratio_max']:6.3f} {s['paired_ratio_median']:7.3f} {s['tokens_per_forward']:8.2f} "
                   f"{s['mean_nodes_per_step']:6.1f}  {s['identical_to_hf_greedy']}")
    click.echo(f"wrote {out / 'bench_decoder.json'} and {out / 'bench_decoder.png'}")


if __name__ == "__main__":
    main()

"""Benchmark echospec's decoder against Hugging Face generate on a small Llama (CPU, pinned threads).

    python -m echospec.tools.bench_decoder --out bench_out            # a random small Llama from a config
    python -m echospec.tools.bench_decoder --checkpoint path/to/llama  # or a saved causal LM

Systems run A B A B in one process after a warm-up, each prompt in every round, system order rotating:
HF greedy (the baseline), HF prompt lookup decoding, echospec with each policy on a prompt-lookup tree
proposer, and the "nothing is ever accepted" case (a proposer of random paths) with the auto and a fixed
budget. Reports medians of time per token, ratio of medians to HF greedy (with min/max over runs),
tokens per forward, whether greedy outputs are identical, and the model's verify-cost curve. Writes
bench_decoder.json and bench_decoder.png under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ..decoder import RAS, ExactGreedy, ExactSampling, Filtered, SimilarityGroups, SpeechVocab, Tolerance, generate
from ..decoder.session import SpeculativeSession
from ..retriever import CandidateTree


class PromptLookupTree:
    """Prompt lookup as a tree: the continuations of every earlier occurrence of the context's last 1..3 tokens."""

    def __init__(self, ngram_max: int = 3, window: int = 1024):
        self.ngram_max, self.window = ngram_max, window

    def propose(self, context, speaker=None, max_nodes=16, max_depth=8):
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

    def propose(self, context, speaker=None, max_nodes=16, max_depth=8):
        sequences = self.rng.integers(0, self.vocab, (4, max_depth)).tolist()
        return CandidateTree.from_sequences(sequences, max_nodes=max_nodes, max_depth=max_depth)


def small_llama(vocab: int, hidden: int, layers: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 1),
                         num_key_value_heads=max(hidden // 128, 1), max_position_embeddings=4096,
                         attn_implementation="sdpa", eos_token_id=vocab - 1, bos_token_id=vocab - 2)
    return LlamaForCausalLM(config).eval()


def make_systems(model, speech: SpeechVocab, max_new: int, seed: int) -> dict:
    """name -> run(prompt_ids) returning (tokens, target forwards, seconds, mean tree nodes verified per step)."""
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    vocab = speech.size

    def hf(**extra):
        def run(ids):
            ids = torch.tensor([ids])
            forwards[0] = 0
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                                 min_new_tokens=max_new, pad_token_id=0, **extra)
            return out[0, ids.shape[1]:].tolist(), forwards[0], time.perf_counter() - start, 0
        return run

    def ours(policy_factory, retriever, max_nodes=16):
        def run(ids):
            result = generate(model, retriever, input_ids=ids, policy=policy_factory(), speech=speech,
                              max_new_tokens=max_new, min_new_tokens=max_new, max_nodes=max_nodes, max_depth=8)
            stats = result.stats
            nodes = sum(stats.node_budgets) / max(len(stats.node_budgets), 1)
            return result.tokens, stats.target_forwards, stats.wall_seconds, nodes
        return run

    lookup = PromptLookupTree()
    tau = max(1, round(512 / 6561 * vocab))  # the paper's tau = 512 of 6561, scaled to this vocabulary
    return {
        "hf-greedy": hf(),
        "hf-prompt-lookup": hf(prompt_lookup_num_tokens=10),
        "echospec-ar-greedy": ours(ExactGreedy, None),
        "exact-greedy": ours(ExactGreedy, lookup),
        "exact-greedy-auto": ours(ExactGreedy, lookup, "auto"),
        "echospec-ar-ras": ours(lambda: ExactSampling(RAS(), seed=seed), None),
        "exact-sampling-ras-auto": ours(lambda: ExactSampling(RAS(), seed=seed), lookup, "auto"),
        f"filtered-tau{tau}-auto": ours(lambda: Filtered(tau, RAS(), seed=seed), lookup, "auto"),
        "tolerance-0.2-auto": ours(lambda: Tolerance(0.2, RAS(), seed=seed), lookup, "auto"),
        "similarity-0.3-auto": ours(lambda: SimilarityGroups(0.3, RAS(), seed=seed), lookup, "auto"),
        # relaxed rules accept more than the exact output would have followed, which the auto budget's
        # calibration (scored against the output) cannot see until trees are verified: fixed budgets too
        f"filtered-tau{tau}-16": ours(lambda: Filtered(tau, RAS(), seed=seed), lookup),
        "tolerance-0.2-16": ours(lambda: Tolerance(0.2, RAS(), seed=seed), lookup),
        "similarity-0.3-16": ours(lambda: SimilarityGroups(0.3, RAS(), seed=seed), lookup),
        "never-accepted-auto": ours(ExactGreedy, RandomPaths(vocab, seed), "auto"),
        "never-accepted-16": ours(ExactGreedy, RandomPaths(vocab, seed), 16),
    }


def measure_curve(model, speech, prompt) -> dict:
    session = SpeculativeSession(model, None, ExactGreedy(), speech, max_new_tokens=8)
    session.prefill(input_ids=prompt)
    return session.measure_cost_curve(repeats=5).to_dict()


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in report["systems"] if n != "hf-greedy"]
    speedups = [1 / report["systems"][n]["ratio_to_hf_greedy"] for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    left.barh(names, speedups, color=["tab:gray" if s < 1 else "tab:green" for s in speedups])
    left.axvline(1.0, color="black", lw=0.8)
    left.set_xlabel("speed-up over HF greedy (median time per token)")
    curve = report["cost_curve"]
    right.plot(curve["sizes"], curve["relative"], marker="o")
    right.set_xlabel("tree nodes verified")
    right.set_ylabel("forward time / one-token forward")
    right.set_title("verify-cost curve")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_bench(args) -> dict:
    torch.set_num_threads(args.threads)
    if args.checkpoint:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, attn_implementation="sdpa").eval()
    else:
        model = small_llama(args.vocab, args.hidden, args.layers, args.seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    speech = SpeechVocab(0, vocab)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, vocab, args.prompt_length).tolist() for _ in range(args.prompts)]
    systems = make_systems(model, speech, args.max_new_tokens, args.seed)
    with torch.no_grad():
        for run in systems.values():  # warm-up
            run(prompts[0][:8])
        runs = {name: [] for name in systems}
        for round_ in range(args.rounds):
            for i, ids in enumerate(prompts):
                names = list(systems)
                shift = (round_ * len(prompts) + i) % len(names)
                for name in names[shift:] + names[:shift]:
                    tokens, forwards, seconds, nodes = systems[name](ids)
                    runs[name].append({"prompt": i, "tokens": tokens, "forwards": forwards, "seconds": seconds,
                                       "nodes": nodes})
        curve = measure_curve(model, speech, prompts[0])
    reference = {r["prompt"]: r["tokens"] for r in runs["hf-greedy"]}
    base_runs = [r["seconds"] / len(r["tokens"]) for r in runs["hf-greedy"]]
    base = statistics.median(base_runs)
    report = {"command": args.command, "threads": args.threads, "model": type(model).__name__,
              "parameters": sum(p.numel() for p in model.parameters()), "vocab": vocab, "prompts": args.prompts,
              "rounds": args.rounds, "max_new_tokens": args.max_new_tokens, "cost_curve": curve, "systems": {}}
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="a saved Hugging Face causal LM (default: a random small Llama)")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    import sys

    args.command = "python -m echospec.tools.bench_decoder " + " ".join(sys.argv[1:] if argv is None else argv)
    report = run_bench(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_decoder.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "bench_decoder.png")
    print(f"{report['model']} {report['parameters'] / 1e6:.1f}M params, {args.threads} thread(s), "
          f"{args.prompts} prompts x {args.rounds} rounds, {args.max_new_tokens} new tokens")
    print("verify-cost curve (nodes: time / one-token time): " + ", ".join(
        f"{n}: {r:.2f}" for n, r in zip(report["cost_curve"]["sizes"], report["cost_curve"]["relative"])))
    print(f"{'system':26s} {'ms/token':>9s} {'ratio':>7s} {'min':>6s} {'max':>6s} {'paired':>7s} {'tok/fwd':>8s} "
          f"{'nodes':>6s}  identical")
    for name, s in report["systems"].items():
        print(f"{name:26s} {s['median_ms_per_token']:9.3f} {s['ratio_to_hf_greedy']:7.3f} {s['ratio_min']:6.3f} "
              f"{s['ratio_max']:6.3f} {s['paired_ratio_median']:7.3f} {s['tokens_per_forward']:8.2f} "
              f"{s['mean_nodes_per_step']:6.1f}  "
              f"{s['identical_to_hf_greedy']}")
    print(f"wrote {out / 'bench_decoder.json'} and {out / 'bench_decoder.png'}")


if __name__ == "__main__":
    main()

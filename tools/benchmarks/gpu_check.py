"""One command for a GPU: verify-cost curves and the shipped sample's end-to-end bench on the device.

    python -m echospec.tools.benchmarks.gpu_check --device cuda --dtype bfloat16 --out runs/gpu-check

A few minutes on one GPU. It times the verify-cost curve (forward time against tree size, relative to a
one-token step, with 250 tokens cached) of the shipped sample model and of a CosyVoice 2-shaped LM
(Qwen2.5-0.5B's backbone with a 6564-way speech head; random weights, which a forward's cost does not depend
on), then builds the sample's stores and runs `echospec bench` on the device in that dtype: autoregressive
decoding against every policy with the "auto" budget (AdaptiveBudget), and the lossless policies at fixed 16 and 64
nodes too — tokens per forward and wall-clock speed-up per policy, identity with autoregressive decoding and
the logit gaps where it differs, and what each step costs beyond its forward (`step_overhead_ms`: the retriever,
the tree mask, the policy's walk and the cache's compaction) with the walk's share of the decode (`accept_share`).
Writes gpu_check.json and gpu_check.png under --out, the bench's own report under --out/bench. CI runs it on the
CPU with --tiny (a small stand-in for the 0.5B shape, 2 prompts).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import click

from ...datastore.files import atomic_file
from ..bench.harness import DTYPES, POLICIES, pyplot, save_figure
from ..bench.machine import cpu_name, machine
from ..commands import out_option


def gpu_check(device: str = "cuda", dtype: str = "bfloat16", out_dir="runs/gpu-check", tiny: bool = False,
              limit: int = 40, max_new_tokens: int = 400, echo=print) -> dict:
    """Run the check and write its report; returns it as a dict."""
    import torch

    from ...datastore import build
    from ..bench import BenchSpec, Inputs, Scoring, bench, format_table
    from ..corpus import SAMPLE_CORPUS, SAMPLE_MODEL_DIR, SAMPLE_PROMPTS, SAMPLE_TOKENIZER
    from .cost_curves import cost_curve, shape_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cuda = device.startswith("cuda")
    report = {"machine": machine(device=device, dtype=dtype,
                                 device_name=torch.cuda.get_device_name(device) if cuda else cpu_name()),
              "tiny": tiny, "curves": {}}
    started = time.perf_counter()
    for shape in ("sample", "tiny" if tiny else "cosyvoice2"):
        model = shape_model(shape, getattr(torch, dtype), device)
        curve = cost_curve(model, context=250, repeats=3 if tiny else 10)
        report["curves"][shape] = curve.to_dict()
        echo(f"{shape}: one-token step {1e3 * curve.seconds[0]:.2f} ms; "
             + " ".join(f"{n}:{r:.2f}" for n, r in zip(curve.sizes, curve.relative())))
        del model
        if cuda:
            torch.cuda.empty_cache()
    store = out / "store"
    build(SAMPLE_CORPUS, store, per_speaker=True, faiss=False, force=True, progress=False)
    mel = importlib.util.find_spec("faiss") is not None  # the tokenizer's nearest-centroid search needs it
    if not mel:
        echo("faiss is not installed: no log-mel distortion in the bench")
    inputs = Inputs(SAMPLE_MODEL_DIR, store, SAMPLE_PROMPTS, 2 if tiny else limit, device=device, dtype=dtype)
    result = bench(BenchSpec(inputs, policies=POLICIES, stores=("speaker",), max_nodes="auto", sweep_nodes=(16, 64),
                             sweep_policies=("exact-greedy", "exact-sampling"),
                             max_new_tokens=40 if tiny else max_new_tokens, out_dir=out / "bench", progress=False,
                             scoring=Scoring(SAMPLE_TOKENIZER if mel else None)))
    echo(format_table(result))
    echo("per step beyond its forward (retriever, mask, walk, cache): " + ", ".join(
        f"{name} {s['step_overhead_ms']:.2f} ms (walk {100 * s['accept_share']:.1f}%)"
        for name, s in result["systems"].items() if "step_overhead_ms" in s))
    keep = ("tokens_per_forward", "speedup", "forward_cost_speedup", "time_per_token_ms", "identical_to_baseline",
            "divergences", "step_overhead_ms", "accept_share")
    report["bench"] = {name: {k: s[k] for k in keep if k in s} for name, s in result["systems"].items()}
    report["auto_budgets"] = result["auto_budgets"]
    report["seconds"] = time.perf_counter() - started
    with atomic_file(out / "gpu_check.json") as f:
        json.dump(report, f, indent=1)
    plot(report, out / "gpu_check.png")
    echo(f"{report['seconds']:.0f} s; wrote {out / 'gpu_check.json'} and {out / 'gpu_check.png'}")
    return report


def plot(report: dict, path: Path) -> None:
    """The verify-cost curves, and each system's wall-clock speed-up beside its tokens per forward."""
    plt = pyplot()
    fig, (curves, speed) = plt.subplots(1, 2, figsize=(14, 5.5))
    for shape, curve in report["curves"].items():
        curves.plot(curve["sizes"], curve["relative"], marker="o",
                    label=f"{shape} ({1e3 * curve['seconds'][0]:.2f} ms a token)")
    curves.axhline(1.0, color="grey", linestyle="--")
    curves.set(xlabel="tree nodes verified", ylabel="forward time / one-token step",
               title=f"Verify-cost curves: {report['machine']['device_name']}, {report['machine']['dtype']}")
    curves.legend(fontsize=8)
    names = [n for n in report["bench"] if n not in ("autoregressive", "ar-sampling")]
    speed.barh(names, [report["bench"][n]["speedup"] for n in names], color="tab:blue", label="wall-clock speed-up")
    speed.scatter([report["bench"][n]["tokens_per_forward"] for n in names], names, color="black", zorder=3,
                  label="tokens per forward")
    speed.axvline(1.0, color="grey", linestyle="--")
    speed.set(title="The sample end to end on the device", xlabel="x autoregressive decoding")
    speed.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


@click.command()
@click.option("--device", default="cuda", show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(DTYPES))
@click.option("--limit", default=40, show_default=True, type=click.IntRange(1),
              help="Sample prompts in the end-to-end bench.")
@click.option("--tiny", is_flag=True, help="Small shapes and 2 short prompts (a CPU check of the command itself).")
@out_option("runs/gpu-check")
def main(device, dtype, limit, tiny, out_dir) -> None:
    """Verify-cost curves and the sample's end-to-end bench on a device."""
    gpu_check(device, dtype, out_dir, tiny, limit, echo=click.echo)


if __name__ == "__main__":
    main()

"""Verify-cost curves on realistic shapes: forward time against tree size, by dtype, thread count and CPU trick.

    python -m echospec.tools.benchmarks.cost_curves --shapes sample,100m,cosyvoice2 --dtypes float32,bfloat16 \\
        --threads 1,2 --out runs/cost-curves

Random weights (a forward's cost does not depend on them) except for the shipped sample model; `--context`
tokens in the cache; `tools/bench/cost.py`'s `session_cost_curve` (all sizes timed round-robin, each round
relative to its own one-token step, median over rounds). `--variants` adds `mkldnn` (every nn.Linear's
weight prepacked for oneDNN: `echospec.decoder.prepack`), `repeat-kv` (tree forwards as transformers runs them
by default, the KV cache copied per query head: what `echospec.decoder.gqa` saves) and, for float32, `compile`
(torch.compile of the model's forward, dynamic shapes). Prints one line per curve — the one-token step in ms,
then each tree size's forward time relative to it — and writes cost_curves.json and cost_curves.png under --out.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import click

from ..bench.harness import DTYPES, copying_grouped_heads, measure_cost_curve, pyplot, save_figure, write_results
from ..commands import out_option

SHAPES = {
    # the shapes issue 13 and the README quote; 6564 outputs is CosyVoice 2's speech vocabulary (6561 + 3 stops)
    "3.7m": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=6564),
    "100m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=6564),
    # Qwen2.5-0.5B's backbone with CosyVoice 2's speech head
    "cosyvoice2": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=6564),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=600),
}
SIZES = (0, 1, 2, 4, 8, 16, 32, 64)


def shape_model(shape: str, dtype, device="cpu"):
    """A causal LM of `shape`: "sample" (the shipped checkpoint) or a random-weight Qwen2 of SHAPES."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if shape == "sample":
        from ..corpus.tts_prompt import load_sample_tts

        model, _ = load_sample_tts()
        return model.to(device=device, dtype=dtype).eval()
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype=dtype).eval()


def cost_curve(model, context: int = 250, sizes=SIZES, repeats: int = 5):
    """The model's verify-cost curve (a CostCurve) with `context` random tokens cached."""
    import torch

    from ...decoder import SpeechVocab

    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0))
    return measure_cost_curve(model, SpeechVocab(0, vocab), ids[0].tolist(), sizes, repeats=repeats)


def prepacked(model):
    """`model` with each nn.Linear's weight prepacked for oneDNN (CPU inference), in the model's dtype."""
    from ...decoder import prepack

    return prepack(model)


def run(shapes, dtypes, threads, variants, context: int, repeats: int, device: str = "cpu", echo=print) -> list[dict]:
    import torch

    rows = []
    for shape in shapes:
        for dtype in dtypes:
            for variant in ["plain", *(v for v in variants if dtype == "float32" or v != "compile")]:
                model = shape_model(shape, getattr(torch, dtype), device)
                if variant == "mkldnn":
                    model = prepacked(model)
                elif variant == "compile":
                    model.forward = torch.compile(model.forward, dynamic=True)
                for n in threads:
                    torch.set_num_threads(n)  # the forward's pool only (pin_threads would set the environment)
                    start = time.perf_counter()
                    with copying_grouped_heads() if variant == "repeat-kv" else contextlib.nullcontext():
                        curve = cost_curve(model, context, repeats=repeats)
                    row = {"shape": shape, "dtype": dtype, "variant": variant, "threads": n, "context": context,
                           "device": device, "one_step_ms": 1e3 * curve.seconds[0], "sizes": curve.sizes,
                           "relative": curve.relative(), "seconds_to_measure": time.perf_counter() - start}
                    rows.append(row)
                    echo(format_row(row))
                del model
    return rows


def format_row(row: dict) -> str:
    points = " ".join(f"{n}:{r:.2f}" for n, r in zip(row["sizes"], row["relative"]))
    return (f"{row['shape']:10} {row['dtype']:8} {row['variant']:9} {row['threads']}t "
            f"{row['one_step_ms']:8.2f} ms  {points}")


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for row in rows:
        ax.plot(row["sizes"], row["relative"], marker="o",
                label=f"{row['shape']} {row['dtype']} {row['variant']} {row['threads']}t ({row['one_step_ms']:.1f} ms)")
    ax.axhline(1.0, color="grey", linestyle="--")
    ax.set(xlabel="tree nodes verified", ylabel="forward time / one-token step", title="Verify-cost curves")
    ax.legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, path)


def _names(text: str, allowed=None) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if allowed is not None and n not in allowed]
    if bad or not names:
        raise click.BadParameter(f"choose from {', '.join(allowed)}" if allowed else "give at least one")
    return names


@click.command()
@click.option("--shapes", default="sample,100m,cosyvoice2", show_default=True,
              help=f"Comma-separated: sample, {', '.join(SHAPES)}.")
@click.option("--dtypes", default="float32,bfloat16", show_default=True)
@click.option("--threads", default="1,2", show_default=True, help="torch thread counts to time each curve with.")
@click.option("--variants", default="", help="Extras: mkldnn, repeat-kv, compile (float32 only).")
@click.option("--context", default=250, show_default=True, type=click.IntRange(1))
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1))
@click.option("--device", default="cpu", show_default=True)
@out_option("runs/cost-curves")
def main(shapes, dtypes, threads, variants, context, repeats, device, out_dir) -> None:
    """Verify-cost curves on realistic shapes, by dtype, thread count and CPU trick."""
    rows = run(_names(shapes, ("sample", *SHAPES)), _names(dtypes, DTYPES), [int(t) for t in _names(threads)],
               _names(variants, ("mkldnn", "repeat-kv", "compile")) if variants else [], context, repeats, device,
               click.echo)
    click.echo(write_results(out_dir, "cost_curves", rows, plot))


if __name__ == "__main__":
    main()

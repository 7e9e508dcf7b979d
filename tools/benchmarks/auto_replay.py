"""Replay the adaptive node budget (`decoder.budget.CapRates`) on recorded decode steps: how close it comes to
the best fixed cap, over hundreds of runs instead of one.

    python -m echospec.tools.benchmarks.auto_replay record tools/sample/model --store runs/voices \\
        --prompts tools/sample/prompts.jsonl --policy exact-greedy --stores speaker --threads 1 \\
        --out runs/replay/exact-greedy-speaker-1.json
    python -m echospec.tools.benchmarks.auto_replay replay runs/replay/*.json --out runs/replay

Why: on a shared CPU one utterance's time per token moves 15-20% from one run of it to the next (the same prompt,
cap and tokens, seconds apart), so one bench run cannot say whether an adaptive budget comes within a few % of the
best fixed cap.

`record` decodes every prompt under every cap in RECORDED_CAPS, `--repeats` times each, in a fresh random order per
prompt (in `--dtype` on `--device`, as `echospec bench` runs), and keeps what a budget sees of each step: the tokens it
emitted and its seconds. `replay` runs `CapRates` over the prompts in their recorded order (`--cycles` times over,
for a longer run than the recording), many times: each utterance is one recording of the cap it chose, drawn at
random, and every fixed cap is scored on another recording of the same prompt, as a bench's separate runs are
("paired": on the same recording, which leaves only the budget's choices). Per recording it reports the budget's
speed over the best fixed cap (geometric mean over the replays, its 5th percentile, the share within 5%), over
plain steps, and the share of utterances at each cap; `replay.png` shows the spread.

What it leaves out: a live run's cold start, and the other work a live run does between utterances.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter, defaultdict
from pathlib import Path

import click

from ...datastore.files import atomic_file
from ...decoder.budget import CapRates, FixedBudget
from ..bench.harness import DTYPES, POLICIES, BenchError, pyplot, save_figure, write_results
from ..commands import fail_cleanly, limit_option, out_option, threads_option

WITHIN = 0.95  # within 5% of the best fixed cap
RECORDED_CAPS = (0, 4, 8, 16, 32, 64)  # the adaptive budget's caps and larger ones, which it is scored against


class StepLog(FixedBudget):
    """A fixed cap that keeps what each step emitted and took (what an adaptive budget would have counted)."""

    def __init__(self, cap: int):
        super().__init__(cap)
        self.tokens: list[int] = []
        self.seconds: list[float] = []

    def observe(self, tokens: int, seconds: float) -> None:
        self.tokens.append(tokens)
        self.seconds.append(seconds)


def record(checkpoint, store, prompts, *, policy: str, stores: str = "speaker", repeats: int = 2,
           limit: int | None = None, max_new_tokens: int = 400, threads: int = 1, device: str = "cpu",
           dtype: str = "float32", seed: int = 0, progress: bool = True) -> dict:
    """Decode each prompt under every cap in RECORDED_CAPS, `repeats` times in a shuffled order, keeping each step's
    tokens and seconds, with `threads` torch threads, on `device` in `dtype` (as `echospec bench` runs).
    `stores`: "speaker" (the prompt's speaker's store) or "general"."""
    from tqdm import tqdm

    from ...decoder import SpeculativeSession
    from ..bench.harness import RelaxedSettings, make_policy
    from ..bench.load import decode_inputs
    from ..bench.spec import Inputs

    if stores not in ("speaker", "general"):
        raise BenchError(f"--stores must be speaker or general, got {stores!r}")
    if policy not in POLICIES:
        raise BenchError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    model, _, _, retriever, speech, prompts = decode_inputs(Inputs(checkpoint, store, prompts, limit, threads=threads,
                                                                   device=device, dtype=dtype))
    relaxed = RelaxedSettings()  # each policy class's own knobs

    def decode(prompt, index: int, cap: int) -> dict:
        log = StepLog(cap)
        session = SpeculativeSession(model, retriever, make_policy(policy, index, relaxed), speech=speech,
                                     speaker=prompt.speaker if stores == "speaker" else None,
                                     max_new_tokens=max_new_tokens, budget=log)
        session.prefill(**prompt.inputs())
        while not session.finished:
            session.step()
        return {"prompt": prompt.id, "cap": cap, "tokens": log.tokens, "seconds": log.seconds}

    for cap in RECORDED_CAPS:  # untimed: first calls compile and allocate
        decode(prompts[0], 0, cap)
    order, runs = random.Random(seed), []
    for index, prompt in enumerate(tqdm(prompts, desc=f"record {policy}/{stores}", unit="prompt",
                                        disable=not progress)):
        caps = list(RECORDED_CAPS) * repeats
        order.shuffle(caps)
        runs += [decode(prompt, index, cap) for cap in caps]
    return {"policy": policy, "stores": stores, "threads": threads, "device": device, "dtype": dtype,
            "caps": list(RECORDED_CAPS), "repeats": repeats, "checkpoint": str(checkpoint), "runs": runs}


def replay(recording: dict, replays: int = 200, make_rates=CapRates, seed: int = 0, cycles: int = 1) -> dict:
    """Run `make_rates()` (default: the adaptive budget's CapRates) over the recording's prompts in order, `cycles`
    times over, `replays` times; it against every fixed cap, scored on another recording of each prompt and on
    the same one."""
    utterances = defaultdict(list)  # (prompt, cap) -> [(tokens, step seconds), ...]: one per recorded utterance
    for run in recording["runs"]:
        utterances[run["prompt"], run["cap"]].append((sum(run["tokens"]), run["seconds"]))
    prompts = list(dict.fromkeys(run["prompt"] for run in recording["runs"]))
    caps = sorted({cap for _, cap in utterances})
    if min(len(u) for u in utterances.values()) < 2 or len(utterances) < len(prompts) * len(caps):
        raise BenchError("a replay needs every prompt recorded at least twice under every cap (--repeats 2)")
    missing = set(make_rates().caps) - set(caps)
    if missing:
        raise BenchError(f"the recording has no utterances under caps {sorted(missing)}")
    runs = [_replay_once(utterances, prompts * cycles, caps, make_rates(), random.Random(seed + r))
            for r in range(replays)]
    fixed = _rates({cap: [u for (_, c), recorded in utterances.items() if c == cap for u in recorded] for cap in caps})
    best = max(rate for cap, rate in fixed.items() if cap > 0)
    shares = Counter(cap for run in runs for cap in run["caps"])
    return {"policy": recording["policy"], "stores": recording["stores"], "threads": recording["threads"],
            "prompts": len(prompts), "cycles": cycles, "replays": replays,
            "fixed_over_best": {str(cap): rate / best for cap, rate in fixed.items()},
            "adaptive_over_best": _spread([run["over_best"] for run in runs]),
            "adaptive_over_best_paired": _spread([run["over_best_paired"] for run in runs]),
            "adaptive_over_plain": _spread([run["over_plain"] for run in runs]),
            "caps": {str(cap): shares[cap] / sum(shares.values()) for cap in caps},
            "separate": [run["over_best"] for run in runs]}


def _replay_once(utterances: dict, prompts: list, caps: list, rates, draw: random.Random) -> dict:
    """One run of `rates` over `prompts`: each utterance one recording of the cap chosen, each fixed cap of `caps`
    scored on another recording of the prompt (`other`) and on the same one (`same`)."""
    chosen, adaptive, other, same = [], [], defaultdict(list), defaultdict(list)
    for prompt in prompts:
        cap = rates.choose()
        recorded = utterances[prompt, cap]
        k = draw.randrange(len(recorded))
        tokens, seconds = recorded[k]
        rates.record(cap, tokens, sum(seconds))
        chosen.append(cap)
        adaptive.append(recorded[k])
        for fixed in caps:
            recorded = utterances[prompt, fixed]
            same[fixed].append(recorded[k])
            other[fixed].append(recorded[(k + 1 + draw.randrange(len(recorded) - 1)) % len(recorded)])
    rate, other, same = _rates({"adaptive": adaptive})["adaptive"], _rates(other), _rates(same)
    return {"caps": chosen, "over_best": rate / max(v for cap, v in other.items() if cap > 0),
            "over_best_paired": rate / max(v for cap, v in same.items() if cap > 0),
            "over_plain": rate / other[0] if 0 in other else float("nan")}


def _rates(utterances: dict) -> dict:
    """Tokens per second of wall-clock over each key's utterances [(tokens, step seconds), ...]."""
    return {key: sum(run[0] for run in runs) / sum(sum(run[1]) for run in runs) for key, runs in utterances.items()}


def _spread(ratios: list[float]) -> dict:
    ordered = sorted(ratios)
    return {"geomean": math.exp(sum(map(math.log, ordered)) / len(ordered)),
            "p05": ordered[int(0.05 * (len(ordered) - 1))],
            "within_5pct": sum(r >= WITHIN for r in ordered) / len(ordered)}


def format_row(name: str, result: dict) -> str:
    a, p, o = result["adaptive_over_best"], result["adaptive_over_best_paired"], result["adaptive_over_plain"]
    fixed = " ".join(f"{cap}:{v:.3f}" for cap, v in result["fixed_over_best"].items())
    caps = " ".join(f"{cap}:{v:.2f}" for cap, v in result["caps"].items())
    return (f"{name:32} adaptive/best {a['geomean']:.3f} (p05 {a['p05']:.3f}, within 5% in "
            f"{a['within_5pct']:.0%}) paired {p['geomean']:.3f}  /plain {o['geomean']:.3f} | fixed/best {fixed} | "
            f"its caps {caps}")


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    names = list(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2), 4.5))
    ax.boxplot([results[n]["separate"] for n in names], whis=(5, 95), showfliers=False)
    ax.set_xticks(range(1, len(names) + 1), names, rotation=30, ha="right", fontsize=7)
    ax.axhline(WITHIN, color="firebrick", linestyle="--", label="within 5% of the best fixed cap")
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set(ylabel="adaptive / best fixed cap (tokens per second)",
           title=f'The adaptive budget replayed, {results[names[0]]["replays"]} runs each (whiskers: 5-95%)')
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


@click.group()
def main() -> None:
    """Record decode steps under every cap, and replay the adaptive budget on them."""


@main.command("record")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--store", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--prompts", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--policy", required=True, help="exact-greedy, exact-sampling, filtered, tolerance or similarity.")
@click.option("--stores", default="speaker", show_default=True, type=click.Choice(["speaker", "general"]))
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(2))
@click.option("--max-new-tokens", default=400, show_default=True, type=click.IntRange(1))
@limit_option()
@threads_option
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(DTYPES),
              help="Precision the model runs in.")
@click.option("--device", default="cpu", show_default=True, help="Where the model runs: cpu, cuda, cuda:1, ...")
@click.option("--out", "out_file", required=True, type=click.Path(dir_okay=False), help="The recording (JSON).")
@fail_cleanly
def record_command(checkpoint, store, prompts, policy, stores, repeats, max_new_tokens, limit, threads, dtype, device,
                   out_file):
    """Decode every prompt under every cap in RECORDED_CAPS, keeping each step's tokens and seconds."""
    recording = record(checkpoint, store, prompts, policy=policy, stores=stores, repeats=repeats, limit=limit,
                       max_new_tokens=max_new_tokens, threads=threads, device=device, dtype=dtype)
    Path(out_file).parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(Path(out_file)) as f:
        json.dump(recording, f)
    click.echo(f"wrote {out_file}: {len(recording['runs'])} utterances")


@main.command("replay")
@click.argument("recordings", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--replays", default=200, show_default=True, type=click.IntRange(1))
@click.option("--cycles", default=1, show_default=True, type=click.IntRange(1),
              help="Run over the recorded prompts this many times (a longer run than the recording).")
@out_option("runs/replay")
@fail_cleanly
def replay_command(recordings, replays, cycles, out_dir):
    """Replay the adaptive budget on each recording; writes replay.json and replay.png under --out."""
    results = {}
    for path in recordings:
        try:
            recording = json.loads(Path(path).read_text())
            where = [recording.get(key) for key in ("device", "dtype")
                     if recording.get(key) not in (None, "cpu", "float32")]  # the defaults go unsaid
            name = "/".join([recording["policy"], recording["stores"], f"{recording['threads']}t", *where])
            name = name if name not in results else f"{name} ({Path(path).stem})"
            results[name] = replay(recording, replays, cycles=cycles)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise click.ClickException(f"{path}: not a recording from `auto_replay record` ({e})") from None
        except BenchError as e:
            raise click.ClickException(f"{path}: {e}") from None
        click.echo(format_row(name, results[name]))
    click.echo(write_results(out_dir, "replay", results, plot))


if __name__ == "__main__":
    main()

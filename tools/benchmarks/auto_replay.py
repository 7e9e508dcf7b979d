"""Replay the "auto" node budget on recorded decode steps: how close it comes to the best fixed cap, over
hundreds of runs instead of one.

    python -m echospec.tools.benchmarks.auto_replay record tools/sample/model --store runs/voices \\
        --prompts tools/sample/prompts.jsonl --policy filtered --stores speaker --threads 2 \\
        --out runs/replay/filtered-speaker-2.json
    python -m echospec.tools.benchmarks.auto_replay replay runs/replay/*.json --out runs/replay

Why: one `echospec bench` run gives "auto" 120 utterances, and on a shared CPU one utterance's time per token
moves 15-20% from one run of it to the next (the same prompt, cap and tokens, seconds apart). So one run cannot
say whether "auto" comes within 5% of the best fixed cap: the next run's answer differs.

`record` decodes every prompt under every cap "auto" chooses among (`decoder.cost.ARMS`), `--repeats` times each,
in a fresh random order per prompt (in `--dtype` on `--device`, as `echospec bench` runs), and keeps what the
budget sees of each step: the tokens it emitted and its seconds. `replay` then runs the budget's own `ArmRates`
over the prompts in their recorded order, many times; a lossless policy's stints count the compared caps' steps
over a window of their tokens, as live ones do, from the other caps' recordings of the prompt (the same tokens).
Each utterance's stint is one recording of the cap "auto" chose (drawn at random), and every fixed cap is scored
on another recording of the same prompt, as the bench's separate runs are; "paired" scores them on the same
recording instead, which leaves only "auto"'s choices. Per recording it reports "auto"'s speed over the best
fixed cap (geometric mean over the replays, its 5th percentile, the share of replays within 5%), over plain
steps, and the share of utterances at each cap; `replay.png` shows the spread.

What it leaves out: a live run's cold start, and the other work a live run does between "auto"'s utterances
(a bench's other systems, a server's other stages). On the sample at 1 thread that work gave plain steps a slow
tail which a recording of caps alone does not have, so the replay flattered a rate that left slow steps out
(the README's "Results"): judge a change to `ArmRates` live as well.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter, defaultdict
from pathlib import Path

import click

from ...datastore.files import atomic_file
from ...decoder.cost import ARMS, ArmRates, FixedBudget, pick_window, steps_within
from ..bench.harness import DTYPES, POLICIES, BenchError, pyplot, save_figure, write_results
from ..commands import fail_cleanly, limit_option, out_option, threads_option

WITHIN = 0.95  # the bar: within 5% of the best fixed cap


class StepLog(FixedBudget):
    """A fixed cap that keeps what each step emitted and took (what "auto" would have counted)."""

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
    """Decode each prompt under every cap in ARMS, `repeats` times in a shuffled order, keeping each step's
    tokens and seconds, with `threads` torch threads, on `device` in `dtype` (as `echospec bench` runs).
    `stores`: "speaker" (the prompt's speaker's store) or "general"."""
    from tqdm import tqdm

    from ...decoder import SpeculativeSession
    from ..bench.load import decode_inputs
    from ..bench.harness import make_policy

    if stores not in ("speaker", "general"):
        raise BenchError(f"--stores must be speaker or general, got {stores!r}")
    if policy not in POLICIES:
        raise BenchError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    model, _, _, retriever, speech, prompts, relaxed = decode_inputs(checkpoint, store, prompts, limit, threads,
                                                                     device, dtype)

    def decode(prompt, index: int, cap: int) -> dict:
        session = SpeculativeSession(model, retriever, make_policy(policy, index, relaxed), speech=speech,
                                     speaker=prompt.speaker if stores == "speaker" else None,
                                     max_new_tokens=max_new_tokens, max_nodes=cap)
        session.budget = log = StepLog(cap)
        session.prefill(**prompt.inputs())
        while not session.finished:
            session.step()
        return {"prompt": prompt.id, "cap": cap, "tokens": log.tokens, "seconds": log.seconds}

    for cap in ARMS:  # untimed: first calls compile and allocate
        decode(prompts[0], 0, cap)
    order, runs = random.Random(seed), []
    for index, prompt in enumerate(tqdm(prompts, desc=f"record {policy}/{stores}", unit="prompt",
                                        disable=not progress)):
        caps = list(ARMS) * repeats
        order.shuffle(caps)
        runs += [decode(prompt, index, cap) for cap in caps]
    return {"policy": policy, "stores": stores, "threads": threads, "device": device, "dtype": dtype,
            "arms": list(ARMS), "repeats": repeats, "checkpoint": str(checkpoint), "runs": runs}


def replay(recording: dict, replays: int = 200, make_rates=ArmRates, seed: int = 0) -> dict:
    """Run `make_rates(seed=...)` (default: "auto"'s ArmRates) over the recording's prompts in order, `replays`
    times; "auto" against every fixed cap, scored on another recording of each prompt and on the same one."""
    utterances = defaultdict(list)  # (prompt, cap) -> [(tokens, seconds), ...]: one entry per recorded utterance
    for run in recording["runs"]:
        utterances[run["prompt"], run["cap"]].append((sum(run["tokens"]), run["seconds"], run["tokens"]))
    prompts = list(dict.fromkeys(run["prompt"] for run in recording["runs"]))
    caps = sorted({cap for _, cap in utterances})
    if min(len(u) for u in utterances.values()) < 2 or len(utterances) < len(prompts) * len(caps):
        raise BenchError("a replay needs every prompt recorded at least twice under every cap (--repeats 2)")
    rates = [make_rates(seed=seed + r) for r in range(replays)]
    if set(rates[0].arms) - set(caps):
        raise BenchError(f"the recording has no utterances under caps {sorted(set(rates[0].arms) - set(caps))}")
    lossless = recording["policy"].startswith("exact")  # its caps are counted on the same tokens, as live
    runs = [_replay_once(utterances, prompts, caps, run_rates, random.Random(seed + r), lossless)
            for r, run_rates in enumerate(rates)]
    fixed = _rates({cap: [u for (_, c), recorded in utterances.items() if c == cap for u in recorded] for cap in caps})
    best = max(rate for cap, rate in fixed.items() if cap > 0)
    shares = Counter(cap for run in runs for cap in run["caps"])
    return {"policy": recording["policy"], "stores": recording["stores"], "threads": recording["threads"],
            "prompts": len(prompts), "replays": replays,
            "fixed_over_best": {str(cap): rate / best for cap, rate in fixed.items()},
            "auto_over_best": _spread([run["over_best"] for run in runs]),
            "auto_over_best_paired": _spread([run["over_best_paired"] for run in runs]),
            "auto_over_plain": _spread([run["over_plain"] for run in runs]),
            "caps": {str(cap): shares[cap] / sum(shares.values()) for cap in caps},
            "separate": [run["over_best"] for run in runs]}


def _replay_once(utterances: dict, prompts: list, caps: list, rates, draw: random.Random, lossless: bool) -> dict:
    """One run of `rates` over `prompts`: each stint one recording of the cap chosen, each fixed cap of `caps`
    scored on another recording of the prompt (`other`) and on the same one (`same`). A `lossless` policy's
    stints count the compared caps' steps over a window of the tokens, which its recordings under every cap share."""
    chosen, auto, other, same = [], [], defaultdict(list), defaultdict(list)
    for prompt in prompts:
        arm = rates.choose()
        recorded = utterances[prompt, rates.arms[arm]]
        k = draw.randrange(len(recorded))
        tokens, seconds, steps = recorded[k]
        window, window_tokens = _window(utterances, prompt, k, steps, rates, draw) if lossless else ({}, 0)
        rates.record(arm, tokens, seconds, window, window_tokens)
        chosen.append(rates.arms[arm])
        auto.append(recorded[k])
        for cap in caps:
            recorded = utterances[prompt, cap]
            same[cap].append(recorded[k])
            other[cap].append(recorded[(k + 1 + draw.randrange(len(recorded) - 1)) % len(recorded)])
    rate, other, same = _rates({"auto": auto})["auto"], _rates(other), _rates(same)
    return {"caps": chosen, "over_best": rate / max(v for cap, v in other.items() if cap > 0),
            "over_best_paired": rate / max(v for cap, v in same.items() if cap > 0),
            "over_plain": rate / other[0] if 0 in other else float("nan")}


def _window(utterances: dict, prompt: str, k: int, steps: list[int], rates, draw: random.Random):
    """As a live stint counts them: the compared caps' steps over WINDOW tokens from one of the stint's steps
    (here the steps each cap's recording `k` of the prompt started there), and the window's tokens."""
    def starts(tokens: list[int]) -> list[int]:
        return list(itertools.accumulate(tokens, initial=0))[:-1]

    start, stop = pick_window(starts(steps), sum(steps), draw)
    counted = {arm: steps_within(starts(utterances[prompt, rates.arms[arm]][k][2]), start, stop)
               for arm in rates.compared()}
    return counted, stop - start


def _rates(utterances: dict) -> dict:
    """Tokens per second of wall-clock over each key's utterances [(tokens, step seconds, step tokens), ...]."""
    return {key: sum(run[0] for run in runs) / sum(sum(run[1]) for run in runs) for key, runs in utterances.items()}


def _spread(ratios: list[float]) -> dict:
    ordered = sorted(ratios)
    return {"geomean": math.exp(sum(map(math.log, ordered)) / len(ordered)),
            "p05": ordered[int(0.05 * (len(ordered) - 1))],
            "within_5pct": sum(r >= WITHIN for r in ordered) / len(ordered)}


def format_row(name: str, result: dict) -> str:
    a, p, o = result["auto_over_best"], result["auto_over_best_paired"], result["auto_over_plain"]
    fixed = " ".join(f"{cap}:{v:.3f}" for cap, v in result["fixed_over_best"].items())
    caps = " ".join(f"{cap}:{v:.2f}" for cap, v in result["caps"].items())
    return (f"{name:32} auto/best {a['geomean']:.3f} (p05 {a['p05']:.3f}, within 5% in {a['within_5pct']:.0%}) "
            f"paired {p['geomean']:.3f}  /plain {o['geomean']:.3f} | fixed/best {fixed} | auto's caps {caps}")


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    names = list(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2), 4.5))
    ax.boxplot([results[n]["separate"] for n in names], whis=(5, 95), showfliers=False)
    ax.set_xticks(range(1, len(names) + 1), names, rotation=30, ha="right", fontsize=7)
    ax.axhline(WITHIN, color="firebrick", linestyle="--", label="within 5% of the best fixed cap")
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set(ylabel='"auto" / best fixed cap (tokens per second)',
           title=f'"auto" replayed, {results[names[0]]["replays"]} runs each (whiskers: 5-95%)')
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


@click.group()
def main() -> None:
    """Record decode steps under every cap, and replay "auto" on them."""


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
    """Decode every prompt under every cap "auto" chooses among, keeping each step's tokens and seconds."""
    recording = record(checkpoint, store, prompts, policy=policy, stores=stores, repeats=repeats, limit=limit,
                       max_new_tokens=max_new_tokens, threads=threads, device=device, dtype=dtype)
    Path(out_file).parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(Path(out_file)) as f:
        json.dump(recording, f)
    click.echo(f"wrote {out_file}: {len(recording['runs'])} utterances")


@main.command("replay")
@click.argument("recordings", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--replays", default=200, show_default=True, type=click.IntRange(1))
@out_option("runs/replay")
@fail_cleanly
def replay_command(recordings, replays, out_dir):
    """Replay "auto" on each recording; writes replay.json and replay.png under --out."""
    results = {}
    for path in recordings:
        try:
            recording = json.loads(Path(path).read_text())
            where = [recording.get(key) for key in ("device", "dtype")
                     if recording.get(key) not in (None, "cpu", "float32")]  # the defaults go unsaid
            name = "/".join([recording["policy"], recording["stores"], f"{recording['threads']}t", *where])
            name = name if name not in results else f"{name} ({Path(path).stem})"
            results[name] = replay(recording, replays)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise click.ClickException(f"{path}: not a recording from `auto_replay record` ({e})") from None
        except BenchError as e:
            raise click.ClickException(f"{path}: {e}") from None
        click.echo(format_row(name, results[name]))
    click.echo(write_results(out_dir, "replay", results, plot))


if __name__ == "__main__":
    main()

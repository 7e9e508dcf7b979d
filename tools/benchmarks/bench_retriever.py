"""Retriever benchmark: echospec side by side with SuffixDecoding (as vLLM calls it) and REST's algorithm.

One process run, one corpus, one held-out split, the same contexts for every system:

- build: tokens per second (echospec builds run in a child process so their peak RSS is their own);
- bytes per corpus token (echospec's exact stores on disk; its FAISS store separately; REST's token array +
  suffix array; SuffixDecoding keeps its tree in memory only, so its resident growth is reported instead);
- propose latency p50/p99/min/max in microseconds over >= 10,000 contexts cut from held-out utterances, the
  systems interleaved batch by batch (in a fresh random order every batch) after a warm-up of each;
- oracle acceptance: walk every held-out utterance; at each step propose from the context so far, accept the
  longest tree path equal to the true next tokens plus the one bonus token a verifier always yields, advance.
  Reported as tokens per step (= tokens per target forward) with a 95% bootstrap interval over utterances.

Peers:
- SuffixDecoding: `arctic_inference.suffix_decoding.SuffixDecodingCache` driven as vLLM's
  SuffixDecodingProposer drives it (start_request / add_active_response / speculate on the last
  max_tree_depth tokens), with the training corpus fed in as the cached responses of past requests.
  "vLLM defaults": max_tree_depth 24, num_speculative_tokens 24, max_spec_factor 1.0, min_token_prob 0.1,
  linear drafts. "tuned": the same tree; the setting of SUFFIX_GRID (linear or tree drafts, spec factor,
  min token prob) with the best oracle acceptance on separate tuning utterances among those whose p50 stays
  within 30 µs, the budget the issue sets for echospec. Unlike vLLM's default of 10,000 cached
  requests, the cache holds the whole training corpus (max_cached_requests=-1), as echospec's store does.
- REST: tools/benchmarks/support/rest_reference.py (longest exact suffix match 16..2, continuations ranked by count,
  64 nodes).

    python -m echospec.tools.benchmarks.bench_retriever --tokens 10000000 --out bench/retriever
    python -m echospec.tools.benchmarks.bench_retriever --corpus corpus.jsonl --out bench/retriever
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from ...datastore.files import atomic_file
from ...retriever.tree import matched_depth
from ..bench.harness import pin_threads, pyplot, save_figure
from ..bench.machine import installed_version, machine
from ..commands import out_option
from ..corpus.synth_corpus import SynthConfig, generate, write_jsonl
from .support.proposers import Proposer, RetrieverProposer, RestProposer, SuffixProposer, feed_suffix_cache
from .support.rest_reference import RestReference

THREADS = 1  # every process of the run, the build children included

BATCH = 50  # calls per system before switching; the order is reshuffled every batch (see measure_latency)
SUFFIX_DEPTH = 24  # vLLM's suffix_decoding_max_tree_depth (also its default num_speculative_tokens)
SUFFIX_DEFAULTS = dict(max_spec_tokens=24, max_spec_factor=1.0, min_token_prob=0.1, use_tree_spec=False)
SUFFIX_GRID = [SUFFIX_DEFAULTS] + [
    dict(max_spec_tokens=24, max_spec_factor=f, min_token_prob=p, use_tree_spec=False)
    for f in (1.0, 2.0, 4.0) for p in (0.1, 0.0) if (f, p) != (1.0, 0.1)
] + [dict(max_spec_tokens=16, max_spec_factor=f, min_token_prob=p, use_tree_spec=True)
     for f in (1.0, 2.0, 4.0) for p in (0.1, 0.05, 0.0)]
TUNE_BUDGET_US = 30.0  # "tuned" = best oracle acceptance within the p50 budget the issue sets for echospec


# --- corpus and split ---------------------------------------------------------------------------------------


@dataclass
class Split:
    train_path: Path
    train: list[np.ndarray]
    held: list[np.ndarray]  # int64; the test set
    held_speakers: list[str]
    tune: list[np.ndarray]  # held out too, only for choosing SuffixDecoding's tuned setting
    n_train_tokens: int
    vocab: int  # 1 + the largest id anywhere in the corpus, so held-out ids are in the stores' range


def load_jsonl(path: Path) -> tuple[list[dict], list[np.ndarray]]:
    records, tokens = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                tokens.append(np.asarray(record["tokens"], np.int64))
            except (ValueError, KeyError, TypeError) as e:
                raise click.ClickException(f"{path}:{number}: not an utterance ({e})")
            if tokens[-1].ndim != 1 or (len(tokens[-1]) and tokens[-1].min() < 0):
                raise click.ClickException(f"{path}:{number}: tokens must be a list of non-negative ids")
            records.append(record)
    if not records:
        raise click.ClickException(f"{path}: no utterances")
    return records, tokens


def split_corpus(path: Path, out: Path, n_held: int, n_tune: int, seed: int) -> Split:
    """Hold out `n_held` test and `n_tune` tuning utterances of speakers that keep utterances in training."""
    records, tokens = load_jsonl(path)
    speakers = np.array([str(r.get("speaker")) for r in records])
    names, counts = np.unique(speakers, return_counts=True)
    eligible = np.flatnonzero(np.isin(speakers, names[counts >= 3]) & (np.array([len(t) for t in tokens]) >= 20))
    chosen = np.random.default_rng(seed).choice(eligible, min(n_held + n_tune, len(eligible)), replace=False)
    held, tune = np.sort(chosen[:n_held]), np.sort(chosen[n_held:])
    is_held = np.zeros(len(records), bool)
    is_held[chosen] = True
    train_path = out / "train.jsonl"
    with open(train_path, "w") as f:
        for record, h in zip(records, is_held):
            if not h:
                f.write(json.dumps(record) + "\n")
    train = [t for t, h in zip(tokens, is_held) if not h]
    return Split(train_path, train, [tokens[i] for i in held], [str(speakers[i]) for i in held],
                 [tokens[i] for i in tune], sum(len(t) for t in train), 1 + max(int(t.max()) for t in tokens if len(t)))


# --- measurements helpers -----------------------------------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def mapped_rss_mb(directory: Path) -> float:
    """Resident size of the file mappings under `directory` (memory-mapped store pages touched so far)."""
    total, inside = 0, False
    prefix = str(directory.resolve())
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not line.startswith(("Rss", "Size")):
                inside = len(head) >= 6 and head[5].startswith(prefix)
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total / 1024


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


_BUILD_CHILD = """
import json, resource, sys, time
from echospec.datastore import build
t = time.perf_counter()
build(sys.argv[1], sys.argv[2], per_speaker=sys.argv[3] == "1", faiss=sys.argv[4] == "1", vocab_size=int(sys.argv[5]),
      force=True, progress=False)
print(json.dumps({"seconds": time.perf_counter() - t,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def build_echospec(train: Path, store: Path, per_speaker: bool, faiss: bool, vocab: int) -> dict:
    """Build a datastore in a child process (same pinned threads); its time and peak RSS."""
    done = subprocess.run([sys.executable, "-c", _BUILD_CHILD, str(train), str(store), str(int(per_speaker)),
                           str(int(faiss)), str(vocab)], capture_output=True, text=True, env=os.environ)
    if done.returncode != 0:
        raise click.ClickException(f"echospec build failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- measurements -------------------------------------------------------------------------------------------


def latency_contexts(held: list[np.ndarray], calls: int) -> list[tuple[int, int]]:
    """(utterance, position) pairs, utterance-major. Every second position when that gives `calls` contexts:
    SuffixDecoding then updates its request by 2 tokens a call, about what one verified step accepts."""
    total = sum(len(h) - 1 for h in held)
    stride = 2 if total >= 2 * calls else 1
    return [(u, pos) for u, h in enumerate(held) for pos in range(1, len(h), stride)]


def measure_latency(systems: list[Proposer], contexts, warmup: int, rounds: int) -> dict[str, list[dict]]:
    """Per system, per round: propose and per-step (update + propose) latency in µs over all contexts.

    Systems alternate every BATCH calls, in a fresh random order each batch: CPU contention from other
    processes then lands on all of them alike, and so does the cold cache a system meets after another
    one's working set (SuffixDecoding's tree is gigabytes) — a fixed order would always give the same
    system the same predecessor. Each round is a full pass over the contexts.
    """
    rng = np.random.default_rng(0)
    # Warm up on contexts spread over every utterance, so each speaker store is mapped before timing.
    spread = contexts[:: max(1, len(contexts) // max(warmup, 1))] if warmup else []
    for system in systems:
        for u, pos in spread:
            system.step(u, pos)
        system.finish()
    result = {s.name: [] for s in systems}
    for _ in range(rounds):
        propose = {s.name: [] for s in systems}
        per_step = {s.name: [] for s in systems}
        for start in range(0, len(contexts), BATCH):
            batch = contexts[start : start + BATCH]
            for i in rng.permutation(len(systems)):
                system = systems[i]
                p, q = propose[system.name], per_step[system.name]
                for u, pos in batch:
                    elapsed, update = system.step(u, pos)[:2]
                    p.append(elapsed)
                    q.append(elapsed + update)
        for system in systems:
            system.finish()
            result[system.name].append({"propose": np.asarray(propose[system.name]) / 1000.0,
                                        "per_step": np.asarray(per_step[system.name]) / 1000.0})
    return result


def oracle_walk(system: Proposer, held: list[np.ndarray]) -> dict:
    per_utt_tokens, per_utt_steps, accepted_drafts, sizes, times = [], [], [], [], []
    for u, utterance in enumerate(held):
        pos, steps = 1, 0
        while pos < len(utterance):
            elapsed, _, tokens, parents = system.step(u, pos)
            times.append(elapsed)
            a = matched_depth(tokens, parents, utterance[pos:])
            accepted_drafts.append(a)
            sizes.append(len(tokens))
            pos += min(a + 1, len(utterance) - pos)
            steps += 1
        per_utt_tokens.append(len(utterance) - 1)
        per_utt_steps.append(steps)
        system.finish()
    tokens, steps = np.asarray(per_utt_tokens, float), np.asarray(per_utt_steps, float)
    rng = np.random.default_rng(0)
    draws = rng.integers(0, len(tokens), (1000, len(tokens)))
    boot = tokens[draws].sum(1) / steps[draws].sum(1)
    return {
        "tokens_per_step": float(tokens.sum() / steps.sum()),
        "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
        "mean_accepted_drafts": float(np.mean(accepted_drafts)),
        "mean_tree_nodes": float(np.mean(sizes)),
        "steps": int(steps.sum()),
        "walk_p50_us": float(np.percentile(times, 50)) / 1000,
    }


def tune_suffix(cache, tune: list[np.ndarray]) -> tuple[dict, list[dict]]:
    """Walk the tuning utterances with every SUFFIX_GRID setting; the tuned one is the best oracle acceptance
    whose p50 (timed during the walk) stays within TUNE_BUDGET_US."""
    rows = []
    for options in SUFFIX_GRID:
        walk = oracle_walk(SuffixProposer("grid", cache, tune, options, {}), tune)
        rows.append({"options": options, "tokens_per_step": walk["tokens_per_step"], "p50_us": walk["walk_p50_us"],
                     "mean_tree_nodes": walk["mean_tree_nodes"]})
    within = [r for r in rows if r["p50_us"] <= TUNE_BUDGET_US] or rows[:1]
    return max(within, key=lambda r: r["tokens_per_step"])["options"], rows


def summarise(rounds: list[dict]) -> dict:
    """Median over rounds of each round's p50/p99 (min and max over rounds beside them)."""
    out = {"calls": int(sum(len(r["propose"]) for r in rounds)), "rounds": len(rounds)}
    for kind in ("propose", "per_step"):
        p50 = [float(np.percentile(r[kind], 50)) for r in rounds]
        p99 = [float(np.percentile(r[kind], 99)) for r in rounds]
        prefix = "" if kind == "propose" else "step_"
        out.update({f"{prefix}p50_us": float(np.median(p50)), f"{prefix}p99_us": float(np.median(p99)),
                    f"{prefix}p50_range_us": [min(p50), max(p50)], f"{prefix}p99_range_us": [min(p99), max(p99)]})
    out["min_us"] = float(min(r["propose"].min() for r in rounds))
    out["max_us"] = float(max(r["propose"].max() for r in rounds))
    return out


# --- report -------------------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    rows = result["systems"]
    ref = next((r for r in rows if r["name"] == "SuffixDecoding vLLM defaults"), None)
    lines = [
        "| system | nodes | build M tok/s | bytes/token | RSS held MB | propose p50 µs | propose p99 µs "
        "| per-step p50 µs | p50 vs SD-default | oracle tokens/step [95% CI] | accepted/step | tree nodes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lat, orc, b = r["latency"], r["oracle"], r["build"]
        ratio = f"{lat['p50_us'] / ref['latency']['p50_us']:.2f}×" if ref else "–"
        bpt = f"{b['bytes_per_token']:.2f}" if b.get("bytes_per_token") is not None else "in memory"
        tps = f"{b['tokens_per_s'] / 1e6:.2f}" if b.get("tokens_per_s") else "–"
        held = f"{b['rss_held_mb']:.0f}" if b.get("rss_held_mb") is not None else "mmap"
        lines.append(
            f"| {r['name']} | {r['nodes']} | {tps} | {bpt} | {held} "
            f"| {lat['p50_us']:.1f} ({lat['p50_range_us'][0]:.1f}–{lat['p50_range_us'][1]:.1f}) "
            f"| {lat['p99_us']:.1f} ({lat['p99_range_us'][0]:.0f}–{lat['p99_range_us'][1]:.0f}) "
            f"| {lat['step_p50_us']:.1f} | {ratio} | {orc['tokens_per_step']:.3f} "
            f"[{orc['ci95'][0]:.3f}, {orc['ci95'][1]:.3f}] | {orc['mean_accepted_drafts']:.3f} "
            f"| {orc['mean_tree_nodes']:.1f} |")
    lines += ["", "Build: corpus tokens per second from JSONL to a finished datastore; echospec rows build the general "
              "and per-speaker exact stores, the FAISS row the general exact store plus FAISS (general-only build "
              "below). Bytes/token: the general exact store on disk (FAISS row: the FAISS store alone)."]
    lines += ["", "Latency: median over rounds of each round's percentile (range over rounds in brackets); "
              "per-step adds SuffixDecoding's add_active_response, the per-request update vLLM runs every step "
              "(echospec and REST keep no per-request state)."]
    lines += ["", f"Corpus: {result['corpus']}", f"Machine: {json.dumps(result['machine'])}",
              f"Command: `{result['command']}`", ""]
    lines += [f"- {k}: {v}" for k, v in result["extra"].items()]
    lines += ["", "SuffixDecoding tuning grid (tuning utterances, not the test set; tuned = best within "
              f"{TUNE_BUDGET_US:.0f} µs p50):", "", "| options | tokens/step | p50 µs | tree nodes |", "|---|---|---|---|"]
    lines += [f"| {json.dumps(g['options'])} | {g['tokens_per_step']:.3f} | {g['p50_us']:.1f} | "
              f"{g['mean_tree_nodes']:.1f} |" for g in result["suffix_grid"]]
    lines += ["", "Targets:"] + [f"- {'PASS' if ok else 'MISS'}: {what}" for what, ok in result["targets"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    colours = {"echospec": "tab:blue", "SuffixDecoding": "tab:orange", "REST (reference)": "tab:green"}
    fig, ax = plt.subplots(figsize=(9, 5.5))
    markers = "osD^v<>pPXh*"
    for i, r in enumerate(result["systems"]):
        lat, orc = r["latency"], r["oracle"]
        c = colours.get(r["family"], "tab:gray")
        ax.plot([lat["p50_us"], lat["p99_us"]], [orc["tokens_per_step"]] * 2, color=c, alpha=0.3, lw=2)
        ax.plot(lat["p50_us"], orc["tokens_per_step"], markers[i % len(markers)], color=c, label=r["name"])
    ax.legend(fontsize=7, loc="lower right")
    ax.axvline(30, color="gray", ls="--", lw=1)
    ax.text(30, ax.get_ylim()[0], " 30 µs target", fontsize=7, color="gray", va="bottom")
    ax.set_xscale("log")
    ax.set_xlabel("propose latency, µs (dot: p50, line to p99)")
    ax.set_ylabel("oracle tokens per step (incl. bonus token)")
    ax.set_title("Retriever latency vs oracle acceptance\n" + result["corpus"], fontsize=9)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    save_figure(fig, path, dpi=130)


def targets(rows: list[dict], n_store_tokens: int) -> list[tuple[str, bool]]:
    by = {r["name"]: r for r in rows}
    es = [r for r in rows if r["family"] == "echospec"]
    sd = [r for r in rows if r["family"] == "SuffixDecoding"]
    general16 = by.get("echospec general n16")
    checks = []
    for r in es:
        lat = r["latency"]
        checks.append((f"{r['name']}: p50 {lat['p50_us']:.1f} µs ≤ 30 and p99 {lat['p99_us']:.1f} µs ≤ 150 "
                       f"({n_store_tokens / 1e6:.2f}M-token store)", lat["p50_us"] <= 30 and lat["p99_us"] <= 150))
    for peer in sd:
        acc, lat = peer["oracle"]["tokens_per_step"], peer["latency"]
        for kind, key in (("propose", "p50_us"), ("per-step", "step_p50_us")):
            better = [r["name"] for r in es if r["oracle"]["tokens_per_step"] >= acc and r["latency"][key] < lat[key]]
            checks.append((f"{kind}: an echospec setting with oracle acceptance ≥ {peer['name']}'s ({acc:.3f}) "
                           f"is faster than its p50 {lat[key]:.1f} µs: {', '.join(better) or 'none'}", bool(better)))
    if general16:
        b = general16["build"]
        checks.append((f"build of the general exact store {b['general_only_tokens_per_s'] / 1e6:.2f} M tokens/s ≥ 1M",
                       b["general_only_tokens_per_s"] >= 1e6))
        checks.append((f"build of general + per-speaker exact stores (every token indexed twice) "
                       f"{b['tokens_per_s'] / 1e6:.2f} M corpus tokens/s ≥ 1M", b["tokens_per_s"] >= 1e6))
        checks.append((f"general exact store {b['bytes_per_token']:.2f} bytes/token ≤ 8", b["bytes_per_token"] <= 8))
    return checks


# --- main ---------------------------------------------------------------------------------------------------


@click.command()
@click.option("--corpus", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSONL corpus ({id, speaker, tokens}); default: generate one")
@click.option("--tokens", "n_tokens", type=click.IntRange(min=10_000), default=10_000_000, show_default=True,
              help="size of the generated corpus (ignored with --corpus)")
@out_option(None)
@click.option("--held-out", "n_held", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--calls", type=click.IntRange(min=100), default=10_000, show_default=True,
              help="latency contexts per system (at least)")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="latency passes over the contexts (medians over rounds are reported)")
@click.option("--warmup", type=click.IntRange(min=0), default=500, show_default=True)
@click.option("--tune-utterances", "n_tune", type=click.IntRange(min=1), default=40, show_default=True,
              help="extra held-out utterances for choosing SuffixDecoding's tuned setting")
@click.option("--faiss/--no-faiss", default=True, show_default=True, help="also build and query a FAISS store")
@click.option("--seed", type=int, default=0, show_default=True)
def main(corpus, n_tokens, out_dir, n_held, calls, rounds, warmup, n_tune, faiss, seed):
    """Benchmark echospec's retriever against SuffixDecoding and REST on one corpus, in one process."""
    from ...retriever import Retriever

    pin_threads(THREADS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()
    command = "python -m echospec.tools.benchmarks.bench_retriever " + " ".join(sys.argv[1:])
    if corpus is None:
        corpus = out / "corpus.jsonl"
        # Generous by the held-out share, so the training stores still hold at least n_tokens.
        generated = generate(SynthConfig(n_tokens=n_tokens + (n_held + n_tune) * 375, seed=seed))
        write_jsonl(generated, corpus)
        del generated
    split = split_corpus(corpus, out, n_held, n_tune, seed)
    n = split.n_train_tokens
    click.echo(f"corpus {corpus}: {n} training tokens, {len(split.held)} held-out utterances")
    extra = {}

    store, faiss_store = out / "store", out / "store_faiss"
    general_only = build_echospec(split.train_path, out / "store_general", per_speaker=False, faiss=False,
                                  vocab=split.vocab)
    extra["echospec build (general exact store only)"] = (
        f"{general_only['seconds']:.1f} s = {n / general_only['seconds'] / 1e6:.2f} M tokens/s, "
        f"child peak RSS {general_only['peak_rss_mb']:.0f} MB")
    built = build_echospec(split.train_path, store, per_speaker=True, faiss=False, vocab=split.vocab)
    general_bytes = disk_bytes(store / "general")
    speaker_bytes = disk_bytes(store / "speakers")
    es_build = {"tokens_per_s": n / built["seconds"], "seconds": built["seconds"],
                "bytes_per_token": general_bytes / n, "child_peak_rss_mb": built["peak_rss_mb"],
                "general_only_tokens_per_s": n / general_only["seconds"]}
    extra["echospec build (general + per-speaker exact stores)"] = (
        f"{built['seconds']:.1f} s, child peak RSS {built['peak_rss_mb']:.0f} MB; general store "
        f"{general_bytes / n:.2f} B/token, per-speaker stores {speaker_bytes / n:.2f} B/token, "
        f"catalog {disk_bytes(store / 'catalog.sqlite') / 1e6:.1f} MB")
    if faiss:
        fb = build_echospec(split.train_path, faiss_store, per_speaker=False, faiss=True, vocab=split.vocab)
        faiss_build = {"tokens_per_s": n / fb["seconds"], "seconds": fb["seconds"],
                       "bytes_per_token": disk_bytes(faiss_store / "faiss") / n}
        extra["echospec build (general exact + FAISS)"] = (
            f"{fb['seconds']:.1f} s, FAISS store {disk_bytes(faiss_store / 'faiss') / n:.2f} B/token "
            f"({disk_bytes(faiss_store / 'faiss') / 1e6:.1f} MB), child peak RSS {fb['peak_rss_mb']:.0f} MB")
    click.echo("echospec stores built")

    retriever = Retriever(store, use_faiss=False)
    held_speakers = [s if s in retriever.speakers else None for s in split.held_speakers]
    systems: list[Proposer] = []
    for nodes in (16, 32, 64):
        systems.append(RetrieverProposer(f"echospec general n{nodes}", retriever, split.held, None, nodes, es_build))
    for nodes in (16, 32, 64):
        systems.append(RetrieverProposer(f"echospec speaker n{nodes}", retriever, split.held, held_speakers, nodes,
                                        es_build))
    if faiss:
        with_faiss = Retriever(faiss_store, use_faiss=True)
        systems.append(RetrieverProposer("echospec general+FAISS n16", with_faiss, split.held, None, 16, faiss_build))

    t = time.perf_counter()
    before = rss_mb()
    rest = RestReference(split.train)
    seconds = time.perf_counter() - t
    rest_build = {"tokens_per_s": n / seconds, "seconds": seconds, "bytes_per_token": rest.nbytes / n,
                  "rss_held_mb": rss_mb() - before}
    systems.append(RestProposer("REST reference (64 nodes)", rest, split.held, rest_build))
    click.echo(f"REST reference built in {seconds:.1f} s")

    t = time.perf_counter()
    before = rss_mb()
    cache = feed_suffix_cache(split.train, SUFFIX_DEPTH)
    seconds = time.perf_counter() - t
    sd_build = {"tokens_per_s": n / seconds, "seconds": seconds, "bytes_per_token": None,
                "rss_held_mb": rss_mb() - before}
    click.echo(f"SuffixDecodingCache fed in {seconds:.1f} s")
    tuned, grid = tune_suffix(cache, split.tune)
    extra["SuffixDecoding tuned setting"] = json.dumps(tuned)
    systems.append(SuffixProposer("SuffixDecoding vLLM defaults", cache, split.held, SUFFIX_DEFAULTS, sd_build))
    systems.append(SuffixProposer("SuffixDecoding tuned", cache, split.held, tuned, sd_build))

    contexts = latency_contexts(split.held, calls)
    latencies = measure_latency(systems, contexts, warmup, rounds)
    click.echo("latency measured")
    rows = []
    for system in systems:
        oracle = oracle_walk(system, split.held)
        rows.append({"name": system.name, "family": system.family, "nodes": system.nodes, "build": system.build,
                     "latency": summarise(latencies[system.name]), "oracle": oracle})
        click.echo(f"{system.name}: p50 {rows[-1]['latency']['p50_us']:.1f} µs, "
                   f"oracle {oracle['tokens_per_step']:.3f} tokens/step")
    extra["echospec resident store pages after all queries (mmap)"] = (
        f"{mapped_rss_mb(store):.0f} MB (general + speaker stores), {mapped_rss_mb(faiss_store):.0f} MB (FAISS datastore)")
    extra["process peak RSS"] = f"{peak_rss_mb():.0f} MB"

    result = {"corpus": f"{corpus.name}: {n} training tokens, {len(split.held)} held-out utterances, "
                        f"{len(contexts)} latency contexts x {rounds} rounds", "command": command,
              "machine": machine(threads=THREADS, arctic_inference=installed_version("arctic-inference"),
                                 load_average_at_start=list(load_at_start)),
              "systems": rows, "extra": extra, "suffix_grid": grid, "targets": targets(rows, n)}
    with atomic_file(out / "results.json") as f:
        json.dump(result, f, indent=2)
    with atomic_file(out / "results.md") as f:
        f.write(markdown(result))
    plot(result, out / "latency_vs_acceptance.png")
    click.echo(markdown(result))


if __name__ == "__main__":
    main()

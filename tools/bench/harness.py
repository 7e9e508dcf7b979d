"""The benchmark harness: what every speed comparison under tools/ does the same way (what it promises:
docs/benchmarking.md).

- Systems are `System`s whose `run(prompt, seed)` returns a `Run`: the tokens, target forwards, seconds and
  the tree sizes of one decode. `hf_generate_run` times Hugging Face `generate` (the greedy and prompt-lookup
  baselines) and `echospec_run` times echospec's `generate`, both counting target forwards the same way.
- `warm_up` runs every system once before timing (lazy initialisation, numba compilation, page faults);
  `balanced_order` gives the order of a round (a Williams design): drift on a noisy machine hits all alike,
  and every system follows every other equally often, so what one leaves behind hits all alike too.
- The relaxed policies' knobs, where given (else the registry's defaults): `RelaxedSettings`, `make_policy`.
- `measure_cost_curve`: the model's forward time against tree size on this machine.
- `copying_grouped_heads`: sessions made within run tree forwards as transformers does by default (`decoder.gqa`).
- `pin_threads` pins a run's thread pools (and its child processes'); `save_figure` writes a plot atomically.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Callable

from ...datastore.files import atomic_file
from ...decoder import registry

POLICIES = tuple(registry.RULES)
DTYPES = ("float32", "bfloat16", "float16")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class BenchError(ValueError):
    """A prompts file, checkpoint or option the benchmark cannot use."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: model ids, or embeddings (a tensor [1, T, H] or [T, H]) with the store-local ids of their
    speech (the retriever's context, which embeddings cannot give)."""

    id: str
    speaker: str | None
    input_ids: list[int] | None
    reference: list[int] | None = None
    inputs_embeds: object = None
    prompt_speech: list[int] | None = None
    text: str | None = None  # what the prompt asks to be said, where known: what WER is scored against

    def inputs(self) -> dict:
        """The prompt as keyword arguments of echospec's `generate`."""
        if self.input_ids is not None:
            return {"input_ids": self.input_ids}
        return {"inputs_embeds": self.inputs_embeds, "prompt_speech": self.prompt_speech}


@dataclass(frozen=True)
class Run:
    """One decode: model ids generated, target forwards, seconds, accepted tree nodes per step, and the tree
    size each step verified (None where a system's candidates are not visible, as in HF prompt lookup)."""

    tokens: list[int]
    forwards: int
    seconds: float
    accepted: list[int]
    tree_sizes: list[int] | None
    logits: list | None = None  # with record_logits: the logits row behind each token emitted
    budget: dict | None = None  # "auto" (an adaptive budget): each cap's measured rate at the end of the utterance
    caps: list[int] | None = None  # "auto": the cap each step ran
    forward_seconds: float | None = None  # echospec's: the target's forwards (to a GPU's synchronisation)
    accept_seconds: float | None = None  # echospec's: the policy's walks (its batched pass and decisions)

    @property
    def time_per_token(self) -> float:
        return self.seconds / max(len(self.tokens), 1)


@dataclass
class System:
    """One way of decoding, and what its speed and output are judged against. `bench` names its systems (and
    their baselines) with spec.SystemName; a developer benchmark may use a plain label."""

    name: object  # a SystemName, or a label
    run: Callable[[Prompt, int], Run]
    baseline: object = ""  # the system (name) this one's speed-up is measured against (default: itself)
    lossless_of: object = None  # a lossless system must reproduce this one (greedy) or match it in distribution
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.baseline = self.baseline or self.name


def balanced_order(items: list, round_: int) -> list:
    """`items` in round `round_`'s order of a Williams design: over len(items) rounds (twice as many for an
    odd count) each item runs once in each place and right after every other item equally often.

    A step on a CPU runs up to 14% slower right after other work (a tree forward, Hugging Face's
    `generate`); a cyclic order (A B C, B C A, ...) has each system follow the same one nearly always,
    which moved fixed 8 nodes between 0.95x and 1.07x of autoregressive sampling on the sample."""
    n = len(items)
    first, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: every difference between neighbours once
    while low <= high:
        first.append(low)
        low += 1
        if low <= high:
            first.append(high)
            high -= 1
    order = [(k + round_) % n for k in first]
    if n % 2 and (round_ // n) % 2:
        order.reverse()  # an odd count needs the reversed rows too
    return [items[k] for k in order]


def warm_up(systems: list[System], prompt: Prompt, seed: int) -> None:
    """Run each system once, untimed: first calls pay for lazy initialisation and numba compilation."""
    for system in systems:
        system.run(prompt, seed)


class ForwardCounter:
    """Counts the target model's forwards (a pre-hook), so HF's and echospec's systems are counted alike."""

    def __init__(self, model):
        self.count = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, *_) -> None:
        self.count += 1


def hf_generate_run(model, counter: ForwardCounter, **generate_options) -> Callable[[Prompt, int], Run]:
    """Hugging Face greedy `generate` (with `prompt_lookup_num_tokens`: prompt lookup decoding), timed."""
    import torch

    def run(prompt: Prompt, seed: int) -> Run:
        ids = torch.tensor([prompt.input_ids], device=model.device)
        counter.count = 0
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **generate_options)
        seconds = time.perf_counter() - start
        # each step after the prefill verifies no tree; prompt lookup's candidate lengths are not seen
        lookup = "prompt_lookup_num_tokens" in generate_options
        return Run(out[0, ids.shape[1]:].tolist(), counter.count, seconds, [],
                   None if lookup else [0] * (counter.count - 1))
    return run


def echospec_run(model, retriever, policy: Callable[[int], object], speech, *, speaker: bool = True,
                 record_logits: bool = False, **generate_options) -> Callable[[Prompt, int], Run]:
    """echospec's `generate` with `policy(seed)` and `retriever` (None: autoregressive), timed; `speaker`
    passes the prompt's speaker to the retriever (its speaker store), else only the general store is asked.
    `record_logits` keeps the logits row behind each emitted token (see `divergence`), untimed."""
    from ...decoder import AdaptiveBudget, CapRates, generate
    from .divergence import record_logits as recording

    # max_nodes "auto": an adaptive budget; none given: generate's own default (a fixed NODES), as the library's
    auto = retriever is not None and generate_options.get("max_nodes") == "auto"
    if generate_options.get("max_nodes") == "auto":
        del generate_options["max_nodes"]
    rates = CapRates() if auto else None  # "auto": one adaptive budget's rates over this system's utterances

    def run(prompt: Prompt, seed: int) -> Run:
        chosen = policy(seed)
        record = recording(chosen) if record_logits else None
        budget = {"budget": AdaptiveBudget(rates)} if auto else {}
        result = generate(model, retriever, policy=chosen, speech=speech,
                          speaker=prompt.speaker if speaker else None, **prompt.inputs(), **generate_options, **budget)
        stats = result.stats
        seconds = stats.wall_seconds - (record.seconds if record else 0.0)
        return Run(result.tokens, stats.target_forwards, seconds, stats.accepted_lengths, stats.node_budgets,
                   record.rows if record else None, stats.budget, stats.node_caps if auto else None,
                   stats.forward_seconds, stats.accept_seconds)
    return run


@dataclass(frozen=True)
class RelaxedSettings:
    """The relaxed policies' knobs a run sets (decoder.registry.KNOBS); None leaves the registry's default for the
    tree path. `similarity` is the old spelling of `threshold`, still accepted."""

    tau: float | None = None  # Filtered: accept drafts within the target's top tau (below 1: a share of the mass)
    beta: float | None = None  # Tolerance: accept x when r < q(x) + beta
    threshold: float | None = None  # SimilarityGroups and GroupRejection: cosine threshold of a token's group
    similarity: InitVar[float | None] = None

    def __post_init__(self, similarity):
        if similarity is not None:
            object.__setattr__(self, "threshold", similarity)

    def knobs(self, policy: str) -> dict:
        """The keyword arguments of `policy` that this run sets."""
        knob = registry.rule(policy).knob
        value = None if knob is None else getattr(self, knob.name)
        return {} if value is None else {knob.name: value}


def make_policy(name: str, seed: int, relaxed: RelaxedSettings, sampler=None):
    """The policy called `name` (one of POLICIES), sampling with `sampler` (default RAS) from `seed` where it
    samples, with the knobs `relaxed` sets (decoder.registry.make_policy)."""
    from ...decoder import RAS

    return registry.make_policy(name, sampler or RAS(), seed=seed, **relaxed.knobs(name))


def measure_cost_curve(model, speech, input_ids: list[int] | None, sizes=None, repeats: int = 5, *,
                       inputs_embeds=None, **session_options):
    """This machine's forward time against tree size for `model` after the prompt (`input_ids` or
    `inputs_embeds`), relative to a one-token step (a CostCurve); sizes default to CURVE_SIZES (tools/bench/cost.py).
    `session_options` (head, speech_embedding) go to the SpeculativeSession."""
    from ...decoder import ExactGreedy, SpeculativeSession
    from .cost import CURVE_SIZES, session_cost_curve

    session = SpeculativeSession(model, None, ExactGreedy(), speech=speech, max_new_tokens=1, **session_options)
    session.prefill(input_ids=input_ids, inputs_embeds=inputs_embeds)
    return session_cost_curve(session, CURVE_SIZES if sizes is None else sizes, repeats=repeats)


@contextmanager
def copying_grouped_heads():
    """Sessions made within leave tree forwards to transformers' default, which copies the KV cache per query
    head (TRANSFORMERS_SDPA_FORCE_GQA=0; see `decoder.gqa`): what echospec's way is measured against."""
    from ...decoder.gqa import SWITCH

    before = os.environ.get(SWITCH)
    os.environ[SWITCH] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = before


def pin_threads(threads: int) -> None:
    """Pin this run's thread pools to `threads`, and those of the processes it starts (through the
    environment they inherit). Call it from a command's main, never at import."""
    for variable in THREAD_VARIABLES:
        os.environ[variable] = str(threads)
    if "numba" in sys.modules:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    if "faiss" in sys.modules:
        sys.modules["faiss"].omp_set_num_threads(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Write a matplotlib figure as PNG to a temporary file and rename it over `path`; close the figure."""
    import matplotlib.pyplot as plt

    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=dpi)
    plt.close(fig)


def write_results(out_dir, stem: str, results, plot) -> str:
    """Write `results` as `out_dir/stem.json` and draw them with `plot(results, out_dir/stem.png)`, each to a
    temporary file renamed into place; returns the line a command prints."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / f"{stem}.json") as f:
        json.dump(results, f, indent=1)
    plot(results, out / f"{stem}.png")
    return f"wrote {out / f'{stem}.json'} and {out / f'{stem}.png'}"


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (benchmarks run on machines without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cost_curve(ax, curve: dict, label: str | None = None) -> None:
    """The verify-cost curve (a CostCurve.to_dict()) on `ax`: forward time over a one-token step, by tree size."""
    ax.plot(curve["sizes"], curve["relative"], marker="o", label=label)
    ax.set(xlabel="tree nodes verified", ylabel="forward time / one-token step", title="Verify-cost curve")

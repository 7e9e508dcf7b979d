"""What a bench is asked: `Inputs` (what the loader loads), `Scoring` (how utterances are scored) and `BenchSpec`
(what to run: policies, stores, budgets, sweeps, rounds; with the other two), built alike by `echospec bench` and
by Python callers and passed whole; `SystemName`, the one way a system's name is printed and parsed.

    from echospec.tools.bench import BenchSpec, Inputs, bench
    report = bench(BenchSpec(Inputs("tools/sample/model", "runs/demo/store", "tools/sample/prompts.jsonl", limit=4),
                             policies=("exact-greedy",), stores=("speaker",)))
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ...retriever.tree import MAX_DEPTH
from .harness import POLICIES, RelaxedSettings

Setting = tuple[str, float]  # a knob and its value: ("tau", 40), ("beta", 0.2)
_BUDGET = re.compile(r"n(\d+)d(\d+)")


@dataclass(frozen=True)
class SystemName:
    """A system of a bench: its policy (or a baseline's name: "autoregressive", "ar-sampling"), the store it
    drafts from, the knob settings it runs with beside the bench's, and a node budget and depth of its own (a
    sweep's). Printed `policy[/store][/nNdD][/knob=value,...]`, e.g. `filtered/speaker/tau=40`; `parse` reads it
    back."""

    policy: str
    store: str | None = None
    settings: tuple[Setting, ...] = ()
    budget: tuple[int, int] | None = None  # (max_nodes, max_depth)

    def __str__(self) -> str:
        parts = [self.policy, *([self.store] if self.store else [])]
        parts += [f"n{self.budget[0]}d{self.budget[1]}"] if self.budget else []
        parts += [",".join(f"{knob}={value}" for knob, value in self.settings)] if self.settings else []
        return "/".join(parts)

    @classmethod
    def parse(cls, text: str) -> SystemName:
        """The name `str` prints; ValueError on a knob that is not knob=number."""
        policy, *rest = str(text).split("/")
        store, settings, budget = None, (), None
        for part in rest:
            if "=" in part:
                settings = tuple(_setting(text, item) for item in part.split(","))
            elif (found := _BUDGET.fullmatch(part)) is not None:
                budget = (int(found.group(1)), int(found.group(2)))
            else:
                store = part
        return cls(policy, store, settings, budget)

    def with_budget(self, nodes: int, depth: int) -> SystemName:
        return SystemName(self.policy, self.store, self.settings, (nodes, depth))


def _setting(name: str, item: str) -> Setting:
    knob, _, value = item.partition("=")
    try:
        return knob, int(value) if value.isdigit() else float(value)
    except ValueError:
        raise ValueError(f"{name}: a knob is key=number, got {item!r}") from None


@dataclass(frozen=True)
class Inputs:
    """What the loader loads (load.decode_inputs): the model, store and prompts, and where the model runs.

    `checkpoint`: an echospec TTS checkpoint folder, any Hugging Face causal LM folder, or (from Python) a loaded
    model, with `head` and `speech_embedding` for a model with its own speech head and table, as `generate` takes
    them. Speech ids: `speech` (a SpeechVocab, e.g. a preset's), else `speech_offset`, `vocab_size`, `stop_ids`,
    else the checkpoint's or the store's. `prompts`: see load.load_prompts; the first `limit` are decoded.
    `token_rate` (speech tokens a second; default the checkpoint's or 25) scales the LM real-time factor.
    `device` and `dtype` ("float32", "bfloat16", "float16") are where and in what precision every system runs,
    with `threads` torch threads."""

    checkpoint: object
    store: str | Path
    prompts: object
    limit: int | None = None
    speech: object = None
    speech_offset: int | None = None
    vocab_size: int | None = None
    stop_ids: tuple[int, ...] = ()
    head: object = None
    speech_embedding: object = None
    token_rate: float | None = None
    threads: int = 1
    device: str = "cpu"
    dtype: str = "float32"

    @property
    def attach(self) -> dict:
        """The model's own head and table, as `generate` takes them."""
        return {"head": self.head, "speech_embedding": self.speech_embedding}


@dataclass(frozen=True)
class Scoring:
    """How utterances are scored beyond log-likelihood: `tokenizer` (tokenizer.npz) for log-mel distortion; on
    audio (`audio`; None: where a vocoder is at hand, `vocoder` or the tokenizer's stand-in, and the quality extra
    is installed) through `vocoder`, for WER (`asr`), SIM (`speaker_encoder`) and MOS (`mos`) in `workers`
    processes after decoding; `audio_dir` keeps the WAVs as audio_dir/<system>/<prompt id>.wav."""

    tokenizer: str | Path | None = None
    audio: bool | None = None
    vocoder: object = None
    asr: str | None = None
    speaker_encoder: str | None = None
    mos: str | None = None
    audio_dir: str | Path | None = None
    workers: int = 2


@dataclass(frozen=True)
class BenchSpec:
    """One bench: what it loads (`inputs`), what it runs and how it scores (`scoring`).

    Every policy runs on every store, with `sampler` (a Sampler or RAS, or a name in
    echospec.decoder.presets.SAMPLERS; default RAS) where it samples and the knobs `relaxed` sets (else each
    class's own). `max_nodes` is every system's node budget but the sweeps': a cap, "auto" (an AdaptiveBudget per
    system), or None for `generate`'s own default (echospec.decoder.NODES); `sweep_nodes` x `sweep_depths` adds
    one system per budget for each of `sweep_policies` (default exact-sampling if benchmarked, else the first
    policy) on the first store. `sweeps` ({"tau": (10, 20), "beta": ..., "threshold": ...}) adds one system per
    setting of the policies each knob sets (decoder.registry) on the first store, and the frontier. Every prompt is
    decoded `rounds` times, each utterance with seed `seed` + its index; `out_dir` receives the report."""

    inputs: Inputs
    policies: tuple[str, ...] = POLICIES
    stores: tuple[str, ...] = ("speaker", "general")
    sampler: object = None
    relaxed: RelaxedSettings = RelaxedSettings()
    max_nodes: int | str | None = None
    max_depth: int = MAX_DEPTH
    sweep_nodes: tuple[int, ...] = ()
    sweep_depths: tuple[int, ...] = ()
    sweep_policies: tuple[str, ...] = ()
    sweeps: dict = field(default_factory=dict)
    rounds: int = 1
    max_new_tokens: int = 400
    seed: int = 0
    scoring: Scoring = Scoring()
    out_dir: str | Path | None = None
    progress: bool = True

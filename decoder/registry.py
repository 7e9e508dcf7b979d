"""One registry of echospec's acceptance policies: each policy's name, its class, its knob (one name everywhere:
option, `echospec bench --tau/--beta/--threshold`, `--sweep`, vLLM `extra_args`, docs), the knob's bounds, and
its default per path: "tree" (the Hugging Face tree verification of `generate`) and "chain" (one chain per
request inside vLLM). `make_policy` builds a policy from a name and options; every caller uses it.

    from echospec.decoder import RAS
    from echospec.decoder.registry import make_policy
    policy = make_policy("tolerance", RAS(), seed=0, beta=0.2)        # the tree path's defaults for the rest
    chained = make_policy("filtered", path="chain")                   # vLLM's defaults

Imports nothing heavy at load (the classes are imported on first build), so vLLM's plugin may read it early.
A default is one number per rule per path (`RULES`); the classes' own constructor defaults are the tree path's.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass, field
from importlib import import_module

PATHS = ("tree", "chain")


@dataclass(frozen=True)
class Knob:
    """A relaxed rule's one tuning option: its name, what a value means, its bounds (`low` <= value <= `high`,
    `low` excluded where `low_open`) and the spellings it had before (accepted, with a DeprecationWarning)."""

    name: str
    means: str
    low: float
    high: float
    low_open: bool = False
    aliases: tuple[str, ...] = ()

    def check(self, policy: str, value) -> float | int:
        """`value` as a number inside the bounds; ValueError in one line otherwise."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{policy}'s {self.name} must be a number, got {value!r}")
        below = value <= self.low if self.low_open else value < self.low
        if below or value > self.high or math.isnan(value):
            raise ValueError(f"{policy}'s {self.name} must lie in {'(' if self.low_open else '['}{self.low:g}, "
                             f"{self.high:g}], got {value!r}")
        return value

    def parse(self, text: str) -> float | int:
        """A value as written on a command line: an integer where it is one, else a float."""
        text = text.strip()
        try:
            return int(text) if text.lstrip("-").isdigit() else float(text)
        except ValueError:
            raise ValueError(f"{self.name} takes numbers, got {text!r}") from None


TAU = Knob("tau", "Filtered: a draft passes within the target's top tau ids (a count, >= 1), or, below 1, within the "
           "likeliest ids holding that share of the target's probability (means the same on any vocabulary)",
           0.0, 1e9, low_open=True)
BETA = Knob("beta", "Tolerance: a draft x passes when r < q(x) + beta, r ~ U(0, 1); 0 is exact sampling", 0.0, 1.0)
THRESHOLD = Knob("threshold", "SimilarityGroups and GroupRejection: a token's group is every token whose embedding "
                 "has cosine >= threshold with it", -1.0, 1.0, aliases=("similarity",))


@dataclass(frozen=True)
class Registered:
    """A policy's entry: its class (in decoder.policies), its knob (None: exact, nothing to tune) and the knob's
    default per path."""

    name: str
    class_name: str
    knob: Knob | None = None
    defaults: dict = field(default_factory=dict)  # path -> the knob's default there


RULES = {rule.name: rule for rule in (
    Registered("exact-greedy", "ExactGreedy"),
    Registered("exact-sampling", "ExactSampling"),
    Registered("filtered", "Filtered", TAU, {"tree": 160, "chain": 160}),
    Registered("tolerance", "Tolerance", BETA, {"tree": 0.2, "chain": 0.1}),
    Registered("similarity", "SimilarityGroups", THRESHOLD, {"tree": 0.6, "chain": 0.6}),
    Registered("pcg", "GroupRejection", THRESHOLD, {"tree": 0.6, "chain": 0.6}),
)}
"""Every policy by the name callers use. The defaults are conservative, not certified: on the sample the paired
rule refused every setting (60 prompts cannot bound a WER change to 2 points), so each is the fastest swept setting
whose log-likelihood change (the measure that resolves there) stayed within +-5% on all 120 prompts, or Filtered's
closest where none did; on chains Tolerance takes the beta that stayed inside on the previous sample's vLLM chains
(on today's none stays inside at batch 1 and 8). The figures are in docs/results.md ("The relaxed defaults", "vLLM
side by side"); calibrate on your model with `echospec bench --sweep`."""
RELAXED = tuple(name for name, rule in RULES.items() if rule.knob is not None)
KNOBS = {rule.knob.name: rule.knob for rule in RULES.values() if rule.knob is not None}


def rule(name: str) -> Registered:
    """The registered policy `name`; ValueError naming the choices."""
    if name not in RULES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(RULES)}")
    return RULES[name]


def default(name: str, path: str = "tree"):
    """The default of policy `name`'s knob on `path` (the classes' constructor defaults are the tree path's)."""
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; choose from {', '.join(PATHS)}")
    return RULES[name].defaults[path]


def knob(name: str) -> Knob:
    """The knob called `name` (an old spelling warns, DeprecationWarning); ValueError naming the knobs."""
    for found in KNOBS.values():
        if name in found.aliases:
            warnings.warn(f"knob {name!r} is now {found.name!r}", DeprecationWarning, stacklevel=2)
            return found
    if name not in KNOBS:
        raise ValueError(f"unknown knob {name!r}; choose from {', '.join(KNOBS)} ("
                         + ", ".join(f"{k}: {' and '.join(policies_of(k))}" for k in KNOBS) + ")")
    return KNOBS[name]


def policies_of(knob: str) -> tuple[str, ...]:
    """The policies a knob tunes."""
    return tuple(name for name, r in RULES.items() if r.knob is not None and r.knob.name == knob)


def options(name: str, given: dict, path: str = "tree") -> dict:
    """Policy `name`'s keyword options: `given` with deprecated spellings renamed, checked against the class's
    options and the knob's bounds, the knob's default on `path` filled in. ValueError in one line."""
    registered, given = rule(name), dict(given)
    knob = registered.knob
    for alias in knob.aliases if knob else ():
        if alias in given:
            warnings.warn(f"{name}: option {alias!r} is now {knob.name!r}", DeprecationWarning, stacklevel=3)
            given[knob.name] = given.pop(alias)
    accepted = keyword_options(name)
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for policy {name!r}; its options: "
                         f"{', '.join(accepted) or 'none'}")
    if knob is None:
        return given
    value = given.get(knob.name)
    given[knob.name] = default(name, path) if value is None else knob.check(name, value)
    return given


def keyword_options(name: str) -> dict:
    """Policy `name`'s keyword options (but `seed`) with the class's defaults."""
    parameters = inspect.signature(policy_class(name).__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY and p.name != "seed"}


def policy_class(name: str):
    return getattr(import_module(".policies", __package__), rule(name).class_name)


def make_policy(name: str, sampler=None, *, seed=None, path: str = "tree", **given):
    """The policy called `name` (one of RULES), sampling with `sampler` (None: the class's own) from `seed`, its
    knob at `given`'s value or `path`'s default. ValueError in one line on a bad name, option or value."""
    chosen = options(name, given, path)
    cls = policy_class(name)
    takes_sampler = "sampler" in inspect.signature(cls.__init__).parameters  # all but ExactGreedy
    return cls(*(() if sampler is None or not takes_sampler else (sampler,)), seed=seed, **chosen)


# ---- the calibration file: `echospec bench --sweep ...` writes it, `generate`, `synthesize` and vLLM read it ----

SETTINGS_FORMAT = "echospec-relaxed-settings/1"


def relaxed_settings_record(chosen: dict, *, model: str, store: str, prompts: str, path: str = "tree",
                            **measured) -> dict:
    """The calibration file's content: `chosen` ({policy: {knob: value}}), what it was measured on (model, store,
    prompts, path) and anything more the measurement says (`measured`: the rule, the prompts of each half, ...)."""
    for name, given in chosen.items():
        options(name, given, path)
    return {"format": SETTINGS_FORMAT, "model": str(model), "store": str(store), "prompts": str(prompts),
            "path": path, "policies": chosen, **measured}


def load_relaxed_settings(source, *, model=None, path: str = "tree") -> dict[str, dict]:
    """{policy: options} from a calibration file (`source`: its path, or its content as a dict), each checked
    against the registry; pass them to `make_policy`. Warns when `model` (a name or folder) or `path` is not what
    it was measured on; ValueError in one line on a malformed or out-of-bounds file.

        settings = load_relaxed_settings("runs/calibrate/relaxed_settings.json")
        policy = make_policy("tolerance", seed=0, **settings.get("tolerance", {}))
    """
    import json

    record = source
    if not isinstance(source, dict):
        try:
            with open(source, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"relaxed settings {source}: cannot be read ({e})") from None
    where = source if not isinstance(source, dict) else "relaxed settings"
    if not isinstance(record, dict) or record.get("format") != SETTINGS_FORMAT or \
            not isinstance(record.get("policies"), dict):
        raise ValueError(f"{where}: not a relaxed-settings file (expected format {SETTINGS_FORMAT!r} and a "
                         f"'policies' object)")
    chosen = {}
    for name, given in record["policies"].items():
        if not isinstance(given, dict):
            raise ValueError(f"{where}: policy {name!r} must map to its options, got {given!r}")
        try:
            chosen[name] = options(name, given, path)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if model is not None and not same_model(model, record.get("model")):
        warnings.warn(f"{where} was measured on model {record.get('model')!r}, not {str(model)!r}: its settings may "
                      f"not hold there; calibrate on this model with `echospec bench --sweep`", stacklevel=2)
    if record.get("path", "tree") != path:
        warnings.warn(f"{where} was measured on the {record.get('path')} path, used on the {path} path: its "
                      f"settings may not hold there", stacklevel=2)
    return chosen


def same_model(a, b) -> bool:
    """Whether two model names or folders name one model (folders compared resolved)."""
    from pathlib import Path

    def key(x):
        return str(Path(x).resolve()) if x is not None and Path(x).exists() else str(x)

    return key(a) == key(b)

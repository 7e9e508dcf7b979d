"""echospec's relaxed acceptance inside vLLM, per request: a vLLM general plugin (the `echospec` entry point of
`vllm.general_plugins` in pyproject.toml), loaded by vLLM in each of its processes.

    from vllm import SamplingParams
    params = SamplingParams(temperature=0.8, top_p=0.8, extra_args={"echospec": {"policy": "filtered", "tau": 40}})
    # or the setting a calibration file chose: {"policy": "tolerance", "settings": "runs/cal/relaxed_settings.json"}
    # vllm serve: "vllm_xargs": {"echospec": "{\"policy\": \"filtered\", \"tau\": 40}"} (its values are flat: a JSON
    # string of the same object)

Policies: "filtered" (tau, win_size, tau_r), "tolerance" (beta), "similarity" and "pcg" (threshold), built by
echospec.decoder.registry with its defaults for chains (the path "chain"), the options of Filtered, Tolerance,
SimilarityGroups and GroupRejection, whose rule functions (decoder/policies.py) decide here too: one
implementation for both paths. A request without the option is left to vLLM's own sampler, untouched: the patched runner calls vLLM's `_sample` for the whole batch and then
rewrites only the rows of requests that asked. Those rows are sampled here from scratch, position by position along
the request's draft chain: the target's logits get vLLM's penalties, allowed ids, min_tokens, temperature, top-k and
top-p (vLLM's own functions), then the rule accepts drafts or emits its token, from the request's own generator
(`seed`, else one of its own), so vLLM's CPU rejection sampler, which emits drafted ids as if sampled
(docs/vllm.md), never decides them.

Written for vLLM 0.32 (VERSIONS). On another version, or where a patched function's signature differs, the plugin
warns once and leaves vLLM as it was; requests that ask for echospec then fail with a message saying so.
Registration imports only torch and vLLM: vLLM's CPU backend must not meet numba in the process at start, so the
rules (decoder.policies: torch and transformers only) are imported on the first request that asks for them.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
from importlib import import_module
from typing import Callable, NamedTuple

import torch

from . import registry

log = logging.getLogger("echospec.vllm")

OPTION = "echospec"
VERSIONS = ((0, 32), (0, 33))
"""vLLM versions the patch was written and tested for: from 0.32 up to, not including, 0.33."""
POLICIES = registry.RELAXED
"""A request's "policy": a relaxed rule of echospec.decoder.registry, at the registry's defaults for chains."""
UNSUPPORTED = ("logprobs", "bad_words", "logit_bias", "min_p")
"""SamplingParams that relaxed rows do not apply (vLLM applies them outside what its rejection sampler sees)."""
PATCHED = {
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample": ("self", "logits", "spec_decode_metadata"),
    "vllm.v1.engine.input_processor:InputProcessor._validate_params": ("self", "params", "supported_tasks"),
}
USED = {
    "vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p": ("logits", "k", "p"),
    "vllm.v1.sample.ops.penalties:apply_all_penalties": ("logits", "prompt_token_ids", "presence_penalties",
                                                         "frequency_penalties", "repetition_penalties",
                                                         "output_token_ids"),
}
FIELDS = {
    "vllm.v1.spec_decode.metadata:SpecDecodeMetadata": ("draft_token_ids", "num_draft_tokens", "cu_num_draft_tokens",
                                                        "cu_num_sampled_tokens"),
    "vllm.v1.sample.metadata:SamplingMetadata": ("temperature", "top_p", "top_k", "no_penalties", "prompt_token_ids",
                                                 "frequency_penalties", "presence_penalties", "repetition_penalties",
                                                 "allowed_token_ids_mask"),
    "vllm.v1.outputs:SamplerOutput": ("sampled_token_ids", "logprobs_tensors"),
}
"""What the plugin patches and what it calls or reads, with the parameters and fields it expects."""

_originals: dict[str, Callable] = {}
_warned: set[str] = set()


def register() -> None:
    """vLLM's entry point: patch this process's vLLM if it is a version and shape the plugin knows."""
    import vllm
    install(vllm.__version__)


def install(version: str, patched: dict = PATCHED, used: dict = USED, fields: dict = FIELDS) -> bool:
    """Patch vLLM (once per process); False, with one warning, when `version` or a signature is not the expected
    one, leaving vLLM untouched."""
    if _originals:
        return True
    problem = mismatch(version, {**patched, **used}, fields)
    if problem:
        if problem not in _warned:
            _warned.add(problem)
            log.warning("echospec's vLLM plugin is off, vLLM is left as it was: %s; requests asking for "
                        "extra_args['echospec'] will be refused", problem)
        return False
    runner_class, sample = _resolve("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample")
    processor_class, validate = _resolve("vllm.v1.engine.input_processor:InputProcessor._validate_params")
    _originals.update(sample=sample, validate=validate)
    runner_class._sample = _sample
    processor_class._validate_params = _validate_params
    return True


def uninstall() -> None:
    """Put vLLM's own functions back (for tests)."""
    if _originals:
        _resolve("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample")[0]._sample = _originals["sample"]
        _resolve("vllm.v1.engine.input_processor:InputProcessor._validate_params")[0]._validate_params = \
            _originals["validate"]
        _originals.clear()


def installed() -> bool:
    return bool(_originals)


def mismatch(version: str, signatures: dict, fields: dict) -> str | None:
    """Why the plugin must not patch this vLLM, or None."""
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        major_minor = ()
    low, high = VERSIONS
    if not low <= major_minor < high:
        return f"vLLM {version} is not in the range it was written for ({'.'.join(map(str, low))} to below " \
               f"{'.'.join(map(str, high))})"
    for target, expected in signatures.items():
        try:
            owner, function = _resolve(target)
        except (ImportError, AttributeError) as e:
            return f"{target} is missing ({e})"
        if tuple(inspect.signature(function).parameters) != tuple(expected):
            return f"{target}{inspect.signature(function)} is not the signature it was written for {expected}"
    for target, names in fields.items():
        try:
            cls = _resolve(target)[1]
        except (ImportError, AttributeError) as e:
            return f"{target} is missing ({e})"
        missing = set(names) - {f.name for f in dataclasses.fields(cls)}
        if missing:
            return f"{target} has no field(s) {sorted(missing)}"
    return None


def _resolve(target: str):
    """("module:Class.attr" or "module:function") -> (the owner, the attribute)."""
    module, _, path = target.partition(":")
    owner = import_module(module)
    *classes, name = path.split(".")
    for cls in classes:
        owner = getattr(owner, cls)
    return owner, getattr(owner, name)


# ---- a request's option --------------------------------------------------------------------------------------

class Rule(NamedTuple):
    """A request's relaxed acceptance: the policy's name and every option, defaults filled in."""

    policy: str
    options: dict


def read_rule(extra_args: dict | None) -> Rule | None:
    """The Rule that a request's extra_args ask for (None when they do not); ValueError says what is wrong."""
    if not extra_args or OPTION not in extra_args:
        return None
    asked = extra_args[OPTION]
    if isinstance(asked, str):
        try:
            asked = json.loads(asked)
        except json.JSONDecodeError as e:
            raise ValueError(f"extra_args['echospec'] is a string but not JSON: {e}") from None
    if not isinstance(asked, dict) or "policy" not in asked:
        raise ValueError(f'extra_args["echospec"] must be an object with a "policy" ({", ".join(POLICIES)}) and '
                         f"its options, got {asked!r}")
    name, given = asked["policy"], {k: v for k, v in asked.items() if k not in ("policy", "settings")}
    if name not in POLICIES:
        raise ValueError(f"unknown echospec policy {name!r}; choose from {', '.join(POLICIES)}")
    if "settings" in asked:  # a calibration file (its path or its content); the request's own options win
        given = registry.load_relaxed_settings(asked["settings"], path="chain").get(name, {}) | given
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"echospec option {key!r} must be a number, got {value!r}")
    registry.make_policy(name, path="chain", **given)  # the registry's and the class's own checks
    defaults = {k: v for k, v in registry.keyword_options(name).items() if k != "embeddings"}
    return Rule(name, defaults | registry.options(name, given, path="chain"))


def check_request(params) -> None:
    """ValueError when a request's SamplingParams ask for echospec in a way it cannot honour."""
    if read_rule(params.extra_args) is None:
        return
    if not installed():
        raise ValueError("extra_args['echospec'] asks for echospec's acceptance, but its vLLM plugin is off on this "
                         "vLLM (see the warning logged at start)")
    for name in UNSUPPORTED:
        if getattr(params, name, None) not in (None, 0, 0.0, [], {}):
            raise ValueError(f"echospec's relaxed acceptance does not apply {name}; leave it unset with "
                             f"extra_args['echospec']")


def _validate_params(self, params, supported_tasks):
    """vLLM's request check, then echospec's: a bad echospec option fails that request with a clear message."""
    result = _originals["validate"](self, params, supported_tasks)
    if getattr(params, "extra_args", None):
        from vllm.exceptions import VLLMValidationError
        try:
            check_request(params)
            if read_rule(params.extra_args) and getattr(self.vllm_config, "use_v2_model_runner", False):
                raise ValueError("echospec's relaxed acceptance runs on vLLM's V1 model runner, not the V2 one")
        except ValueError as e:
            raise VLLMValidationError(str(e), parameter="extra_args") from None
    return result


# ---- the worker: relaxed rows sampled along their chains ------------------------------------------------------

class RelaxedState:
    """What the patched runner keeps between steps: each relaxed request's policy (its rule, options and generator),
    and the token groups of each similarity threshold (from the model's LM head)."""

    def __init__(self):
        self.requests: dict[str, object] = {}
        self.groups: dict[float, object] = {}

    def request(self, req_id: str, params, model):
        """The request's policy (made on its first step), or None when it did not ask for echospec."""
        if req_id not in self.requests:
            rule = read_rule(params.extra_args)
            if rule is None:
                return None
            generator = torch.Generator()
            seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            policy = registry.policy_class(rule.policy)(seed=generator.manual_seed(seed), **rule.options)
            if "threshold" in rule.options:  # SimilarityGroups and GroupRejection: the model's groups, shared
                policy.groups = self.token_groups(model, rule.options["threshold"])
            self.requests[req_id] = policy
        return self.requests[req_id]

    def forget_all_but(self, req_ids) -> None:
        for req_id in set(self.requests) - set(req_ids):
            del self.requests[req_id]

    def token_groups(self, model, threshold: float):
        if threshold not in self.groups:
            from .policies import TokenGroups
            table = model.lm_head.weight
            self.groups[threshold] = TokenGroups(lambda ids: table[ids.to(table.device)].float().cpu(), threshold)
        return self.groups[threshold]


def _sample(self, logits, spec_decode_metadata):
    """vLLM's `_sample` for the whole batch (unless every row asked for echospec); then the rows of requests with
    extra_args['echospec'] sampled here, along their draft chains, and written over vLLM's."""
    if spec_decode_metadata is None:  # no row has drafts this step: vLLM's plain sampler is the rule's own draw
        return _originals["sample"](self, logits, spec_decode_metadata)
    batch = self.input_batch
    state = self.__dict__.setdefault("_echospec", RelaxedState())
    state.forget_all_but(self.requests)
    rows = {}
    for row, req_id in enumerate(batch.req_ids[:batch.num_reqs]):
        request = self.requests[req_id]
        policy = state.request(req_id, request.sampling_params, self.get_model()) \
            if request.sampling_params else None
        if policy is not None:
            rows[row] = (request, policy)
    if not rows:
        return _originals["sample"](self, logits, spec_decode_metadata)
    if len(rows) < batch.num_reqs:
        output = _originals["sample"](self, logits, spec_decode_metadata)
    else:  # every row is relaxed: vLLM's rejection sampler has nothing to decide
        from vllm.v1.outputs import SamplerOutput
        batch.update_async_output_token_ids()
        output = SamplerOutput(sampled_token_ids=torch.full((batch.num_reqs, spec_decode_metadata.max_spec_len + 1),
                                                            -1, dtype=torch.int32, device=logits.device),
                               logprobs_tensors=None)
    discard = self.discard_request_mask.np
    chains = [Chain(row, request, policy, spec_decode_metadata) for row, (request, policy) in rows.items()
              if not discard[row]]  # a discarded row is a partial prefill: its token is thrown away
    for chain, (scores, q) in zip(chains, target_distributions(batch.sampling_metadata, logits, chains)):
        tokens = chain_tokens(chain.policy, scores, q, chain.drafts, chain.root)
        output.sampled_token_ids[chain.row] = -1
        output.sampled_token_ids[chain.row, :len(tokens)] = torch.tensor(tokens,
                                                                           dtype=output.sampled_token_ids.dtype)
    return output


class Chain:
    """One relaxed row this step: its drafts, the rows of `logits` it owns (one per chain position), its policy and
    the sampler's view at its first position (the request's output; its min_tokens as the stops' block)."""

    def __init__(self, row: int, request, policy, spec):
        from .sampling import NodeState

        self.row, self.policy, self.params = row, policy, request.sampling_params
        n = spec.num_draft_tokens[row]
        self.end = int(spec.cu_num_sampled_tokens[row])
        self.start = self.end - n - 1
        first = int(spec.cu_num_draft_tokens[row]) - n
        self.drafts = spec.draft_token_ids[first:first + n].tolist()
        self.output = list(request.output_token_ids)
        stops = tuple(sorted(self.params.all_stop_token_ids))
        self.root = NodeState(self.output, len(self.output), stops, stops, self.params.min_tokens)


def chain_tree(scores: torch.Tensor, drafts: list[int], root):
    """A draft chain as the tree it is: one child per node."""
    from .verified import VerifiedTree

    return VerifiedTree(scores, drafts, list(range(-1, len(drafts) - 1)), root)


def target_distributions(metadata, logits: torch.Tensor, chains: list[Chain]) -> list[tuple[torch.Tensor, ...]]:
    """Per chain (scores, q) on the logits' device, one row per chain position: the logits with vLLM's penalties
    (over the request's output and the drafts before each position), allowed ids and min_tokens (the sampler's own
    mask, decoder.sampling.Positions) applied — what Filtered ranks — and the distribution vLLM samples from there
    (temperature, top-k, top-p; one-hot at the argmax when greedy). All chains' positions at once, as vLLM's own
    sampler does them."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    if not chains:
        return []
    sizes = [c.end - c.start for c in chains]
    owner = torch.repeat_interleave(torch.tensor([c.row for c in chains]), torch.tensor(sizes)).to(logits.device)
    scores = logits[torch.cat([torch.arange(c.start, c.end) for c in chains]).to(logits.device)].float()
    if not metadata.no_penalties:
        scores = apply_all_penalties(scores, metadata.prompt_token_ids[owner], metadata.presence_penalties[owner],
                                     metadata.frequency_penalties[owner], metadata.repetition_penalties[owner],
                                     [c.output + c.drafts[:j] for c in chains for j in range(c.end - c.start)])
    if metadata.allowed_token_ids_mask is not None:
        scores.masked_fill_(metadata.allowed_token_ids_mask[owner], float("-inf"))
    scores = torch.cat([chain_tree(part, c.drafts, c.root).positions.mask(part)
                        for c, part in zip(chains, scores.split(sizes))])
    temperature = torch.tensor([c.params.temperature for c in chains]).repeat_interleave(torch.tensor(sizes))
    greedy = temperature < 1e-5  # vLLM's greedy
    warped = scores / torch.where(greedy, 1.0, temperature).to(scores.device)[:, None]
    warped = apply_top_k_top_p(warped, None if metadata.top_k is None else metadata.top_k[owner],
                               None if metadata.top_p is None else metadata.top_p[owner])
    q = torch.softmax(warped, dim=-1)
    if bool(greedy.any()):
        onehot = torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).float()
        q = torch.where(greedy.to(q.device)[:, None], onehot, q)
    return list(zip(scores.split(sizes), q.split(sizes)))


def chain_tokens(policy, scores: torch.Tensor, q: torch.Tensor, drafts: list[int], root) -> list[int]:
    """The tokens `policy` emits along one draft chain (scores and q one row per position, root the view at its
    first): the tree walk itself, on a tree with one child per node. A rejected draft ends the chain with the
    rule's token, an accepted stop ends it, and past the last draft the target's own draw follows."""
    from .verified import Rows

    tree = chain_tree(scores, drafts, root)
    path, bonus = policy.walk(tree, Rows(tree, policy.generator, q=q, scores=scores))
    return [drafts[i] for i in path] + ([] if bonus is None else [bonus])

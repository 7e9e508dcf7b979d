"""`generate`: retrieval-based speculative decoding of one utterance, and the Hugging Face `custom_generate` hook."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .cost import CostCurve
from .errors import DecoderInputError
from .policies import ExactGreedy, ExactSampling, Policy
from .sampling import Sampler
from .session import GenerationStats, SpeculativeSession
from .vocab import SpeechVocab


HF_CUSTOM_GENERATE_DIR = str(Path(__file__).parent / "hf_custom_generate")
"""A local `custom_generate` folder for `model.generate(custom_generate=..., trust_remote_code=True)`."""


@dataclass
class GenerationResult:
    tokens: list[int]  # model ids generated (a final stop token included, as Hugging Face does)
    stats: GenerationStats
    speech: SpeechVocab

    @property
    def speech_tokens(self) -> list[int]:
        """The generated speech tokens as store-local ids (stop and other non-speech ids dropped)."""
        return self.speech.to_local(self.tokens)


def generate(model, retriever=None, policy: Policy | None = None, *, input_ids=None, inputs_embeds=None,
             speech: SpeechVocab | None = None, speech_embedding=None, speaker=None, prompt_speech=None,
             max_new_tokens: int = 2048, min_new_tokens: int = 0, max_nodes: int | str = "auto", max_depth: int = 8,
             token_rate: float = 25.0, retriever_timeout: float = 0.1, seed: int | torch.Generator | None = None,
             cost_curve: CostCurve | None = None, streamer=None) -> GenerationResult:
    """Generate one utterance (batch size 1) with `retriever`'s trees verified by `model`.

    The prompt is `input_ids` or `inputs_embeds`; generated tokens are fed back through the model's own
    embeddings, or through `speech_embedding` (a table or callable mapping model ids to input
    embeddings, as CosyVoice 2 does). `speech` maps model ids to the store's ids and names the stop
    tokens (default: the whole vocabulary, stops = the model's eos). `policy` decides acceptance
    (default ExactGreedy); `seed` reseeds a sampling policy. `max_nodes` is the per-step tree budget or
    "auto" (cost-aware). With `retriever=None` this is plain autoregressive decoding with the same policy.
    `streamer` (optional) gets each step's new tokens via `streamer.put(list_of_ids)`.
    """
    if seed is not None:
        policy = policy or ExactGreedy()
        policy.reseed(seed)
    session = SpeculativeSession(
        model, retriever, policy, speech=speech, speech_embedding=speech_embedding, speaker=speaker,
        prompt_speech=prompt_speech, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
        max_nodes=max_nodes, max_depth=max_depth, token_rate=token_rate, retriever_timeout=retriever_timeout,
        cost_curve=cost_curve)
    start = time.perf_counter()
    emitted = session.prefill(input_ids=input_ids, inputs_embeds=inputs_embeds)
    while True:
        if streamer is not None and emitted:
            streamer.put(emitted)
        if session.finished:
            break
        emitted = session.step()
    session.stats.wall_seconds = time.perf_counter() - start
    return GenerationResult(list(session.generated), session.stats, session.speech)


def policy_from_generation_config(config) -> Policy:
    """ExactGreedy, or ExactSampling with the config's temperature / top-k / top-p / min-p / repetition penalty."""
    if not config.do_sample:
        return ExactGreedy()
    return ExactSampling(Sampler(temperature=config.temperature or 1.0, top_k=config.top_k or 0,
                                 top_p=config.top_p if config.top_p is not None else 1.0, min_p=config.min_p or 0.0,
                                 repetition_penalty=config.repetition_penalty or 1.0))


def hf_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, *,
                retriever=None, policy: Policy | None = None, speech: SpeechVocab | None = None,
                speech_embedding=None, speaker=None, prompt_speech=None, max_nodes: int | str = "auto",
                max_depth: int = 8, token_rate: float = 25.0, retriever_timeout: float = 0.1,
                seed: int | None = None, **model_kwargs) -> torch.LongTensor:
    """Hugging Face's `custom_generate` entry point: `model.generate(ids, custom_generate=hf_generate, retriever=r)`.

    Lengths, stop ids and (when `policy` is not given) greedy-versus-sampling settings come from the
    generation config. Custom `logits_processor`s are not applied: pass a `policy` instead. Returns the
    prompt ids followed by the new ids (only the new ids for an `inputs_embeds` prompt), like `generate`.
    """
    inputs_embeds = model_kwargs.get("inputs_embeds")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise DecoderInputError("padded prompts are not supported: echospec decodes batch size 1 without padding")
    prompt_length = 0 if inputs_embeds is not None else input_ids.shape[1]
    max_new = generation_config.max_new_tokens or generation_config.max_length - prompt_length
    min_new = generation_config.min_new_tokens or max(0, (generation_config.min_length or 0) - prompt_length)
    eos = generation_config.eos_token_id
    stops = () if eos is None else tuple([eos] if isinstance(eos, int) else eos)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    result = generate(
        model, retriever, input_ids=None if inputs_embeds is not None else input_ids, inputs_embeds=inputs_embeds,
        policy=policy or policy_from_generation_config(generation_config),
        speech=speech or SpeechVocab(0, vocab_size, stops), speech_embedding=speech_embedding, speaker=speaker,
        prompt_speech=prompt_speech, max_new_tokens=max_new, min_new_tokens=min_new, max_nodes=max_nodes,
        max_depth=max_depth, token_rate=token_rate, retriever_timeout=retriever_timeout, seed=seed)
    new = torch.tensor([result.tokens], dtype=torch.long, device=input_ids.device)
    return torch.cat([input_ids, new], dim=1)

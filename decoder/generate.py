"""`generate`: retrieval-based speculative decoding of one utterance, and the Hugging Face `custom_generate` hook."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..retriever.tree import MAX_DEPTH
from .budget import NodeBudget
from .errors import DecoderInputError
from .policies import ExactGreedy, ExactSampling, Policy
from .sampling import Sampler
from .session import SpeculativeSession
from .stats import GenerationStats
from .vocab import SpeechVocab, eos_ids


HF_CUSTOM_GENERATE_DIR = str(Path(__file__).parent / "hf_custom_generate")
"""A local `custom_generate` folder for `model.generate(custom_generate=..., trust_remote_code=True)`."""


@dataclass
class GenerationResult:
    tokens: list[int]  # model ids generated (a final stop token included, as Hugging Face does)
    stats: GenerationStats
    speech: SpeechVocab

    @property
    def speech_tokens(self) -> list[int]:
        """The generated speech tokens as store-local ids, stop and other non-speech ids dropped: what a TTS
        pipeline hands its vocoder or flow model (CosyVoice's loop never yields its stop token either)."""
        return self.speech.to_local(self.tokens)


def generate(model, retriever=None, policy: Policy | None = None, *, input_ids=None, inputs_embeds=None,
             seed: int | torch.Generator | None = None, streamer=None, **options) -> GenerationResult:
    """Generate one utterance (batch size 1) with `retriever`'s trees verified by `model`.

    The prompt is `input_ids` or `inputs_embeds`. `options` are SpeculativeSession's: `head` (a model's own
    speech head over the backbone's hidden states), `speech` (the model's speech ids and stop ids; default:
    the whole vocabulary, stops = the model's eos), `speech_embedding` (a table or callable embedding
    generated tokens, when they have their own table), `prompt_speech` (store-local ids of the prompt's
    speech: the retriever's context when the prompt is embeddings), `speaker`, `max_new_tokens`,
    `min_new_tokens`, `min_length_stop_ids`, `max_nodes` (the most tree nodes a step verifies; default
    `budget.NODES`) or `budget` (a NodeBudget, e.g. `AdaptiveBudget(rates)`), `max_depth`, `token_rate`,
    `retriever_timeout`. `policy` decides acceptance (default ExactGreedy); `seed` reseeds a sampling policy.
    At the default budget the tokens depend only on the model, the store, the inputs, the policy and the seed.
    With `retriever=None` this is plain autoregressive decoding with the same policy. `streamer` (optional) gets
    each step's new model ids via `streamer.put(list_of_ids)`; `stream` yields speech tokens instead.
    """
    session = _session(model, retriever, policy, seed, options)
    for emitted in session.run(input_ids=input_ids, inputs_embeds=inputs_embeds):
        if streamer is not None:
            streamer.put(emitted)
    return GenerationResult(list(session.generated), session.stats, session.speech)


def stream(model, retriever=None, policy: Policy | None = None, *, input_ids=None, inputs_embeds=None,
           seed: int | torch.Generator | None = None, **options) -> Iterator[list[int]]:
    """`generate`, yielding the speech tokens as they are accepted: lists of store-local ids, without the stop
    token — what a TTS pipeline hands its vocoder or flow model chunk by chunk while the LM runs. For the
    stats afterwards, make a SpeculativeSession and iterate its `stream()`."""
    session = _session(model, retriever, policy, seed, options)
    yield from session.stream(input_ids=input_ids, inputs_embeds=inputs_embeds)


def _session(model, retriever, policy, seed, options) -> SpeculativeSession:
    if seed is not None:
        policy = policy or ExactGreedy()
        policy.reseed(seed)
    return SpeculativeSession(model, retriever, policy, **options)


def policy_from_generation_config(config) -> Policy:
    """ExactGreedy, or ExactSampling with the config's temperature / top-k / top-p / min-p / repetition penalty."""
    if not config.do_sample:
        return ExactGreedy()
    return ExactSampling(Sampler(temperature=config.temperature or 1.0, top_k=config.top_k or 0,
                                 top_p=config.top_p if config.top_p is not None else 1.0, min_p=config.min_p or 0.0,
                                 repetition_penalty=config.repetition_penalty or 1.0))


def hf_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, *,
                retriever=None, policy: Policy | None = None, speech: SpeechVocab | None = None,
                speech_embedding=None, speaker=None, prompt_speech=None, max_nodes: int | None = None,
                budget: NodeBudget | None = None, max_depth: int = MAX_DEPTH, token_rate: float = 25.0,
                retriever_timeout: float = 0.1, seed: int | None = None, **model_kwargs) -> torch.LongTensor:
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
    stops = eos_ids(generation_config)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    result = generate(
        model, retriever, input_ids=None if inputs_embeds is not None else input_ids, inputs_embeds=inputs_embeds,
        policy=policy or policy_from_generation_config(generation_config),
        speech=speech or SpeechVocab(0, vocab_size, stops), speech_embedding=speech_embedding, speaker=speaker,
        prompt_speech=prompt_speech, max_new_tokens=max_new, min_new_tokens=min_new, max_nodes=max_nodes,
        budget=budget, max_depth=max_depth, token_rate=token_rate, retriever_timeout=retriever_timeout, seed=seed)
    new = torch.tensor([result.tokens], dtype=torch.long, device=input_ids.device)
    return torch.cat([input_ids, new], dim=1)

"""Presets for the speech-token TTS models people run: CosyVoice 2 and 3, LLaSA, Orpheus, Spark-TTS, OuteTTS.

A preset says what echospec needs to know about a model and what its own inference code does, read from
that code (each preset cites the files): where its speech ids lie and which ids stop it (`speech`, a
SpeechVocab, codebook interleave included), its sampling defaults (`sampler`, for ExactSampling or a relaxed
policy), its minimum and maximum length rule (`limits`, and `min_length_stop_ids`: which stop ids are masked
before the minimum length), the marker ids a dumped corpus may hold (`drop_ids`), how fast its tokens play
(`token_rate`) and how its prompt is built (`prompt`). Nothing here changes a model.

    from echospec.decoder import ExactSampling, generate, presets
    cosy = presets.COSYVOICE2
    prompt = cosy.prompt(llm, text_ids, prompt_text_ids, prompt_speech)   # inputs_embeds + prompt_speech
    result = generate(llm.llm.model, retriever, ExactSampling(cosy.sampler), head=llm.llm_decoder,
                      speech_embedding=llm.speech_embedding, **prompt, **cosy.options(text_length=len(text_ids)))
    flow_input = result.speech_tokens            # speech ids only: never the stop token

    datastore.build(corpus, store, **cosy.build_options())   # echospec build ... --vocab-size 6561 ...

CosyVoice 2/3, LLaSA and Orpheus fix their ids in code, so their presets are constants. Spark-TTS and
OuteTTS name their tokens (`<|bicodec_semantic_N|>`, `<|c1_N|>`) and the ids are whatever the checkpoint's
tokenizer gives them, so `spark_tts(tokenizer)` and `outetts(tokenizer)` read them from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .errors import DecoderInputError
from .sampling import RAS, Sampler
from .vocab import SpeechVocab


@dataclass(frozen=True)
class Preset:
    """One model's layout, stop, sampling, length and prompt rules; see the module's docstring."""

    name: str
    source: str  # the upstream files these values come from
    speech: SpeechVocab
    sampler: Sampler | RAS  # the model's own sampling defaults
    token_rate: float  # speech tokens per second of audio
    min_length_stop_ids: tuple[int, ...] | None = None  # masked before the minimum length (None: every stop id)
    min_per_text_token: float = 0.0  # minimum new tokens per text token
    max_per_text_token: float | None = None  # maximum new tokens per text token
    max_new_tokens: int | None = None  # most new tokens
    max_length: int | None = None  # most prompt + new tokens
    drop_ids: tuple[int, ...] = ()  # marker ids a corpus dumped from training sequences may hold
    prompt_builder: Callable[..., dict] | None = field(default=None, repr=False, compare=False)

    def limits(self, text_length: int | None = None, prompt_length: int = 0) -> tuple[int, int]:
        """(min_new_tokens, max_new_tokens) by the model's own rule; `text_length` counts the text tokens
        to speak (without a prompt's transcript), `prompt_length` the prompt's tokens."""
        if self.max_per_text_token is not None:
            if not text_length or text_length <= 0:
                raise DecoderInputError(f"{self.name}'s length rule needs text_length (the text tokens to speak)")
            return int(text_length * self.min_per_text_token), int(text_length * self.max_per_text_token)
        if self.max_length is not None:
            if prompt_length >= self.max_length:
                raise DecoderInputError(f"{self.name} takes at most {self.max_length} tokens; "
                                        f"the prompt has {prompt_length}")
            return 0, self.max_length - prompt_length
        return 0, int(self.max_new_tokens)

    def options(self, text_length: int | None = None, prompt_length: int = 0) -> dict:
        """Keyword arguments for generate, stream and SpeculativeSession: speech ids, stops, lengths, rate."""
        min_new, max_new = self.limits(text_length, prompt_length)
        return {"speech": self.speech, "min_length_stop_ids": self.min_length_stop_ids, "min_new_tokens": min_new,
                "max_new_tokens": max_new, "token_rate": self.token_rate}

    def build_options(self) -> dict:
        """Keyword arguments for `echospec.datastore.build` (the command's --speech-offset, --vocab-size,
        --stop-id, --codebooks and --drop-id)."""
        return {"speech_offset": self.speech.offset, "vocab_size": self.speech.size,
                "stop_ids": self.speech.stop_ids, "codebooks": self.speech.codebooks, "drop_ids": self.drop_ids}

    def prompt(self, *args, **kwargs) -> dict:
        """The model's prompt as generate's keyword arguments: {"input_ids"}, or {"inputs_embeds",
        "prompt_speech"} for CosyVoice (its prompt is embeddings, so the retriever's context is passed)."""
        return self.prompt_builder(self, *args, **kwargs)


# ---- CosyVoice 2 and 3 ----------------------------------------------------------------------------------
# FunAudioLLM/CosyVoice cosyvoice/llm/llm.py: Qwen2LM (CosyVoice 2) and CosyVoice3LM run a Qwen2 backbone
# (`llm.llm.model`, a Qwen2ForCausalLM whose own text head is never used) on embeddings, embed generated
# speech with `speech_embedding` and score it with `llm_decoder`. CosyVoice 2: llm_decoder has
# speech_token_size + 3 outputs, all three extra ids stop (`stop_token_ids`); sos and task_id are rows 0 and 1
# of `llm_embedding`. CosyVoice 3: speech_token_size + 200 outputs, no bias, all 200 extra ids stop; sos, eos
# and task_id are speech_embedding rows speech_token_size + 0, + 1 and + 2.
# Minimum length (`sampling_ids`, since upstream's "simply code" commit): while fewer than min_len tokens are
# decoded, only weighted_scores[speech_token_size] is set to -inf, so the other stop ids may end speech early.
# Before, any id >= speech_token_size drawn too early was thrown away and drawn again. In CosyVoice 3 the
# masked id is its sos (speech_token_size + 0), not its eos (+ 1): upstream's code, followed as it is.
# Lengths (`inference`): min_len = 2x and max_len = 20x the text tokens, the prompt's transcript not counted.
# Sampling (examples/libritts/cosyvoice{2,3}/conf/*.yaml): ras_sampling top_p 0.8, top_k 25, win_size 10,
# tau_r 0.1. Token rate (the same yaml's token_frame_rate): 25 speech tokens a second.

COSYVOICE_SOURCE = ("FunAudioLLM/CosyVoice cosyvoice/llm/llm.py (Qwen2LM, CosyVoice3LM: inference, sampling_ids), "
                    "cosyvoice/utils/common.py (ras_sampling), examples/libritts/cosyvoice{2,3}/conf/*.yaml")


def _cosyvoice_prompt(preset: Preset, llm, text: Sequence[int], prompt_text: Sequence[int] = (),
                      prompt_speech: Sequence[int] = ()) -> dict:
    """[sos] + embedded (prompt_text + text) + [task_id] + embedded prompt_speech, as CosyVoice's inference
    builds `lm_input`; text ids are the Qwen2 tokenizer's, prompt_speech the prompt audio's speech tokens."""
    size = preset.speech.size
    version3 = len(preset.speech.stop_ids) > 3
    if version3 and 151646 not in [*prompt_text, *text]:
        raise DecoderInputError("CosyVoice 3 needs <|endofprompt|> (151646) in the text or the prompt text")
    device = llm.speech_embedding.weight.device
    ids = lambda values: torch.tensor([[int(t) for t in values]], dtype=torch.long, device=device)  # noqa: E731
    with torch.no_grad():
        rows = llm.speech_embedding.weight if version3 else llm.llm_embedding.weight
        sos, task = (rows[size][None, None], rows[size + 2][None, None]) if version3 else (
            rows[0][None, None], rows[1][None, None])
        text_embeds = llm.llm.model.model.embed_tokens(ids([*prompt_text, *text]))
        speech = llm.speech_embedding(ids(prompt_speech))
        inputs = torch.cat([sos, text_embeds, task, speech], dim=1)
    return {"inputs_embeds": inputs, "prompt_speech": [int(t) for t in prompt_speech]}


def cosyvoice2(speech_token_size: int = 6561) -> Preset:
    size = speech_token_size
    return Preset("CosyVoice 2", COSYVOICE_SOURCE, SpeechVocab(0, size, tuple(size + i for i in range(3))),
                  RAS(top_p=0.8, top_k=25, win_size=10, tau_r=0.1), token_rate=25.0, min_length_stop_ids=(size,),
                  min_per_text_token=2.0, max_per_text_token=20.0, prompt_builder=_cosyvoice_prompt)


def cosyvoice3(speech_token_size: int = 6561) -> Preset:
    size = speech_token_size
    return Preset("CosyVoice 3", COSYVOICE_SOURCE, SpeechVocab(0, size, tuple(size + i for i in range(200))),
                  RAS(top_p=0.8, top_k=25, win_size=10, tau_r=0.1), token_rate=25.0, min_length_stop_ids=(size,),
                  min_per_text_token=2.0, max_per_text_token=20.0, prompt_builder=_cosyvoice_prompt)


COSYVOICE2 = cosyvoice2()
COSYVOICE3 = cosyvoice3()


# ---- LLaSA ----------------------------------------------------------------------------------------------
# zhenye234/LLaSA_training train_tts.py: Llama 3.2's 128256 ids, then 8 markers (128256
# <|TEXT_GENERATION_START|> ... 128260 <|SPEECH_GENERATION_START|>, 128261 <|SPEECH_GENERATION_END|>, ...),
# then the 65536 X-codec2 ids <|s_0|>.. from 128264 (50 a second). finetune/online_finetune/lora_infer_example.py:
# a chat whose user turn is "Convert the text to speech:<|TEXT_UNDERSTANDING_START|>{text}
# <|TEXT_UNDERSTANDING_END|>" and whose assistant turn starts "<|SPEECH_GENERATION_START|>" (then the prompt
# audio's speech tokens when cloning), continued; generate(max_length=2048, eos_token_id=128261,
# do_sample=True, top_p=1, temperature=0.8, repetition_penalty=1.2).

def _llasa_prompt(preset: Preset, tokenizer, text: str, prompt_text: str = "",
                  prompt_speech: Sequence[int] = ()) -> dict:
    chat = [{"role": "user", "content": "Convert the text to speech:<|TEXT_UNDERSTANDING_START|>"
                                        f"{prompt_text}{text}<|TEXT_UNDERSTANDING_END|>"},
            {"role": "assistant", "content": "<|SPEECH_GENERATION_START|>"}]
    ids = tokenizer.apply_chat_template(chat, tokenize=True, continue_final_message=True)
    ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
    ids = ids[0] if ids and isinstance(ids[0], (list, tuple)) else ids
    return {"input_ids": [int(t) for t in ids] + preset.speech.to_model(prompt_speech)}


LLASA = Preset("LLaSA", "zhenye234/LLaSA_training train_tts.py, finetune/online_finetune/lora_infer_example.py",
               SpeechVocab(128264, 65536, (128261,)),
               Sampler(temperature=0.8, top_p=1.0, repetition_penalty=1.2), token_rate=50.0,
               max_length=2048, drop_ids=(128260,), prompt_builder=_llasa_prompt)


# ---- Orpheus --------------------------------------------------------------------------------------------
# canopyai/Orpheus-TTS orpheus_tts_pypi/orpheus_tts/engine_class.py (_format_prompt, generate_tokens_sync) and
# decoder.py (turn_token_into_id, convert_to_audio): <custom_token_N> is id 128256 + N; a SNAC frame is 7
# tokens, position p of the frame carrying code c as <custom_token_{10 + 4096 p + c}>, i.e. id
# 128266 + 4096 p + c: 7 interleaved codebooks of 4096. Prompt: 128259 (start of human), the tokenized
# "{voice}: {text}", then 128009 (end of text), 128260 (end of human), 128261 (start of AI), 128257 (start
# of speech). Sampling: temperature 0.6, top_p 0.8, repetition_penalty 1.3, max_tokens 1200. Speech ends with
# 128258 (end of speech: realtime_streaming_example/main.py; the package's own default stop id, 49158, is
# not an id of the 3B checkpoints' vocabulary). A frame lasts 512 * 4 / 24000 s: 82 tokens a second.
# Training sequences wrap speech in 128261 128257 ... 128258 128262: the markers a dumped corpus holds.

def _orpheus_prompt(preset: Preset, tokenizer, text: str, voice: str | None = None) -> dict:
    words = tokenizer(f"{voice}: {text}" if voice else text)["input_ids"]
    return {"input_ids": [128259, *[int(t) for t in words], 128009, 128260, 128261, 128257]}


ORPHEUS = Preset("Orpheus", "canopyai/Orpheus-TTS orpheus_tts_pypi/orpheus_tts/engine_class.py, decoder.py, "
                 "realtime_streaming_example/main.py",
                 SpeechVocab(128266, 7 * 4096, (128258,), codebooks=7),
                 Sampler(temperature=0.6, top_p=0.8, repetition_penalty=1.3), token_rate=24000 / 2048 * 7,
                 max_new_tokens=1200, drop_ids=(128257, 128261, 128262), prompt_builder=_orpheus_prompt)


# ---- Spark-TTS ------------------------------------------------------------------------------------------
# SparkAudio/Spark-TTS cli/SparkTTS.py: a Qwen2.5 LM whose tokenizer adds <|bicodec_global_N|> (4096, the
# speaker) and <|bicodec_semantic_N|> (8192, 50 a second) tokens and markers. Voice cloning prompt
# (process_prompt): <|task_tts|><|start_content|>{prompt_text}{text}<|end_content|><|start_global_token|>
# {32 global tokens}<|end_global_token|>, then, with a prompt transcript, <|start_semantic_token|>{the prompt
# audio's semantic tokens}. generate(max_new_tokens=3000, do_sample=True, top_k=50, top_p=0.95,
# temperature=0.8); speech ends at the generation config's eos, <|im_end|>. Retrieval works on the semantic
# tokens; training sequences wrap them in <|start_semantic_token|> .. <|end_semantic_token|>.

def _spark_prompt(preset: Preset, tokenizer, text: str, global_tokens: Sequence[int], prompt_text: str | None = None,
                  prompt_speech: Sequence[int] = ()) -> dict:
    parts = ["<|task_tts|><|start_content|>", prompt_text or "", text, "<|end_content|><|start_global_token|>",
             "".join(f"<|bicodec_global_{int(g)}|>" for g in global_tokens), "<|end_global_token|>"]
    if prompt_text is not None:
        parts += ["<|start_semantic_token|>", "".join(f"<|bicodec_semantic_{int(s)}|>" for s in prompt_speech)]
    return {"input_ids": [int(t) for t in tokenizer("".join(parts))["input_ids"]]}


def spark_tts(tokenizer) -> Preset:
    """Spark-TTS with the ids of `tokenizer` (the checkpoint's LLM/ tokenizer)."""
    vocab = _token_ids(tokenizer, "Spark-TTS")
    first = _contiguous(vocab, "<|bicodec_semantic_{}|>", 8192, "Spark-TTS")
    return Preset("Spark-TTS", "SparkAudio/Spark-TTS cli/SparkTTS.py (process_prompt, inference)",
                  SpeechVocab(first, 8192, (vocab["<|im_end|>"],)),
                  Sampler(temperature=0.8, top_k=50, top_p=0.95), token_rate=50.0, max_new_tokens=3000,
                  drop_ids=(vocab["<|start_semantic_token|>"], vocab["<|end_semantic_token|>"]),
                  prompt_builder=_spark_prompt)


# ---- OuteTTS 1.0 ----------------------------------------------------------------------------------------
# edwko/OuteTTS outetts/version/v3/tokens.py and prompt_processor.py: a DAC codec's two codebooks as
# <|c1_0|>..<|c1_1024|> and <|c2_0|>..<|c2_1024|> (75 frames a second), c1 and c2 alternating within each
# word, words wrapped in <|word_start|> ... <|word_end|> with time and feature tokens. Completion prompt
# without a speaker: "<|im_start|>\n<|text_start|>{text}<|text_end|>\n<|audio_start|>\n", tokenized without
# special tokens (version/interface.py); a speaker prompt adds the speaker's words, built by outetts'
# PromptProcessor.get_completion_prompt (pass its ids as input_ids: their c1/c2 tokens become the retriever's
# context). Training prompts end "<|audio_end|>\n<|im_end|>": speech ends at <|audio_end|> (llama.cpp-style
# runtimes stop there) or the eos <|im_end|>. Sampling (models/config.py SamplerConfig, models/hf_model.py):
# temperature 0.4, repetition_penalty 1.1 over the last 64 tokens, top_k 40, top_p 0.9, min_p 0.05;
# max_length 8192. The codebooks are adjacent in the Llama and Qwen3 checkpoints' tokenizers (checked here).

def _outetts_prompt(preset: Preset, tokenizer, text: str) -> dict:
    prompt = f"<|im_start|>\n<|text_start|>{text}<|text_end|>\n<|audio_start|>\n"
    return {"input_ids": [int(t) for t in tokenizer(prompt, add_special_tokens=False)["input_ids"]]}


def outetts(tokenizer) -> Preset:
    """OuteTTS 1.0 with the ids of `tokenizer` (the checkpoint's)."""
    vocab = _token_ids(tokenizer, "OuteTTS")
    first = _contiguous(vocab, "<|c1_{}|>", 1025, "OuteTTS")
    if _contiguous(vocab, "<|c2_{}|>", 1025, "OuteTTS") != first + 1025:
        raise DecoderInputError("OuteTTS: <|c2_0|> does not follow <|c1_1024|> in this tokenizer")
    return Preset("OuteTTS 1.0", "edwko/OuteTTS outetts/version/v3/tokens.py, prompt_processor.py, "
                  "version/interface.py, models/config.py, models/hf_model.py",
                  SpeechVocab(first, 2050, (vocab["<|audio_end|>"], vocab["<|im_end|>"]), codebooks=2),
                  Sampler(temperature=0.4, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                          repetition_window=64),
                  token_rate=150.0, max_length=8192, prompt_builder=_outetts_prompt)


def _token_ids(tokenizer, model: str) -> dict[str, int]:
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else dict(tokenizer)
    return _Vocabulary(vocab, model)


class _Vocabulary(dict):
    """A tokenizer's token -> id map whose missing tokens say which model's tokenizer lacks them."""

    def __init__(self, vocab: Mapping[str, int], model: str):
        super().__init__(vocab)
        self.model = model

    def __missing__(self, token: str) -> int:
        raise DecoderInputError(f"{self.model}: the tokenizer has no {token} token (is it {self.model}'s?)")


def _contiguous(vocab: Mapping[str, int], pattern: str, count: int, model: str) -> int:
    """The id of pattern.format(0), checking that pattern.format(i) is that id + i for every i < count."""
    first = vocab[pattern.format(0)]
    wrong = next((i for i in range(count) if vocab.get(pattern.format(i)) != first + i), None)
    if wrong is not None:
        raise DecoderInputError(f"{model}: {pattern.format(wrong)} is not id {first + wrong}; echospec needs the "
                                f"{count} speech tokens on consecutive ids")
    return first

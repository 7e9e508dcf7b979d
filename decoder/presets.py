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
    flow_input = cosy.flow_input(result.speech_tokens)   # speech ids only, never the stop token; CosyVoice 3
                                                         # drops long silences as its pipeline does

    datastore.build(corpus, store, **cosy.build_options())   # echospec build ... --vocab-size 6561 ...

Each preset follows its model's own inference code, cited with file and line at the commit read. CosyVoice
decodes differently under vLLM (`CosyVoice2(..., load_vllm=True)`): `cosyvoice2(engine="vllm")`.
CosyVoice 2/3, LLaSA and Orpheus fix their ids in code, so their presets are constants. Spark-TTS and
OuteTTS name their tokens (`<|bicodec_semantic_N|>`, `<|c1_N|>`) and the ids are whatever the checkpoint's
tokenizer gives them, so `spark_tts(tokenizer)` and `outetts(tokenizer)` read them from it.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

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
    silent_tokens: tuple[int, ...] = ()  # local ids whose long runs never reach the vocoder / flow model
    max_silent_run: int = 5  # how many of a run of silent tokens it keeps
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

    def flow_input(self, speech_tokens: Sequence[int]) -> list[int]:
        """What the model's pipeline hands its flow model or vocoder of the speech tokens (store-local ids,
        e.g. `result.speech_tokens`): all of them, but a run of more than `max_silent_run` silent tokens
        keeps only its first ones (CosyVoice 3). The LM's own history keeps every token."""
        return [token for chunk in self.flow_stream([speech_tokens]) for token in chunk]

    def flow_stream(self, chunks: Iterable[Sequence[int]]) -> Iterator[list[int]]:
        """`flow_input` over a stream of chunks (e.g. `stream(...)`), a silent run counted across chunks."""
        silent, run = set(self.silent_tokens), 0
        for chunk in chunks:
            kept = []
            for token in chunk:
                run = run + 1 if token in silent else 0
                if run <= self.max_silent_run:
                    kept.append(int(token))
            if kept:
                yield kept

    def prompt(self, *args, **kwargs) -> dict:
        """The model's prompt as generate's keyword arguments: {"input_ids"}, or {"inputs_embeds",
        "prompt_speech"} for CosyVoice (its prompt is embeddings, so the retriever's context is passed)."""
        return self.prompt_builder(self, *args, **kwargs)


# ---- CosyVoice 2 and 3 ----------------------------------------------------------------------------------
# FunAudioLLM/CosyVoice (read at ace7c47, 2026-03-16) cosyvoice/llm/llm.py: Qwen2LM (CosyVoice 2) and
# CosyVoice3LM run a Qwen2 backbone (`llm.llm.model`, a Qwen2ForCausalLM whose own text head is never used) on
# embeddings, embed generated speech with `speech_embedding` and score it with `llm_decoder`. CosyVoice 2:
# llm_decoder has speech_token_size + 3 outputs, all three extra ids stop (`stop_token_ids`, L297); sos and
# task_id are rows 0 and 1 of `llm_embedding`. CosyVoice 3: speech_token_size + 200 outputs, no bias, all 200
# extra ids stop (L703); sos, eos and task_id are speech_embedding rows speech_token_size + 0, + 1 and + 2.
# Lengths (`inference`, L497-498): min_len = 2x and max_len = 20x the text tokens, the prompt's transcript not
# counted. Token rate (examples/libritts/cosyvoice{2,3}/conf/*.yaml token_frame_rate): 25 a second.
# Two decode branches (`inference_wrapper`, L505-549):
# - Hugging Face (the default, engine="hf"): ras_sampling (cosyvoice/utils/common.py L138; the yaml's top_p
#   0.8, top_k 25, win_size 10, tau_r 0.1); before min_len `sampling_ids` (L150-160) sets only
#   weighted_scores[speech_token_size] to -inf, so the other stop ids may end speech early. In CosyVoice 3
#   the masked id is its sos (speech_token_size + 0), not its eos (+ 1): upstream's code, followed as it is.
# - vLLM (`CosyVoice2(..., load_vllm=True)`, engine="vllm"): SamplingParams(top_k=sampling (25: `inference`'s
#   default; cli/model.py passes none), stop_token_ids=stop_token_ids, min_tokens=min_len, max_tokens=max_len)
#   (L508-511), every other parameter vLLM's default: temperature 1, top_p 1, min_p 0, no penalties. Plain
#   top-k 25 sampling, and min_tokens masks every stop id before min_len (export_cosyvoice2_vllm in
#   cosyvoice/utils/file_utils.py L92 deletes the eos ids from the exported config, so the stop ids are
#   all vLLM masks). The exported model runs in bfloat16.
# Flow input (cosyvoice/cli/model.py `llm_job`, L102-127): a run of "silent" tokens (CosyVoice 3: the FSQ
# silence and breath ids [1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323], CosyVoice3Model L422-423;
# CosyVoice 2: none, L275) keeps its first 5 tokens, the rest never reach the flow model: `flow_input`.

COSYVOICE_SOURCE = ("FunAudioLLM/CosyVoice cosyvoice/llm/llm.py (Qwen2LM, CosyVoice3LM: inference, "
                    "inference_wrapper, sampling_ids), cosyvoice/utils/common.py (ras_sampling), "
                    "cosyvoice/cli/model.py (llm_job), examples/libritts/cosyvoice{2,3}/conf/*.yaml")
COSYVOICE3_SILENT_TOKENS = (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)
COSYVOICE3_END_OF_PROMPT = 151646  # <|endofprompt|>, which CosyVoice 3's text or prompt text must hold
COSYVOICE_ENGINES = ("hf", "vllm")
COSYVOICE_SAMPLER = RAS(top_p=0.8, top_k=25, win_size=10, tau_r=0.1)
COSYVOICE_VLLM_SAMPLER = Sampler(top_k=25)  # vLLM's defaults: temperature 1, top_p 1, min_p 0, no penalties


def _cosyvoice_prompt(preset: Preset, llm, text: Sequence[int], prompt_text: Sequence[int] = (),
                      prompt_speech: Sequence[int] = (), *, version: int) -> dict:
    """[sos] + embedded (prompt_text + text) + [task_id] + embedded prompt_speech, as CosyVoice `version`'s
    inference builds `lm_input`; text ids are the Qwen2 tokenizer's, prompt_speech the prompt audio's speech
    tokens."""
    size = preset.speech.size
    version3 = version == 3
    if version3 and COSYVOICE3_END_OF_PROMPT not in [*prompt_text, *text]:
        raise DecoderInputError(f"CosyVoice 3 needs <|endofprompt|> ({COSYVOICE3_END_OF_PROMPT}) in the text or "
                                "the prompt text")
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


def _cosyvoice(version: int, speech_token_size: int, extra: int, engine: str, silent: tuple[int, ...]) -> Preset:
    name = f"CosyVoice {version}"
    if engine not in COSYVOICE_ENGINES:
        raise DecoderInputError(f"{name}: engine must be one of {COSYVOICE_ENGINES}, got {engine!r}")
    size = speech_token_size
    vllm = engine == "vllm"
    sampler = COSYVOICE_VLLM_SAMPLER if vllm else COSYVOICE_SAMPLER
    return Preset(name + (" (vLLM)" if vllm else ""), COSYVOICE_SOURCE,
                  SpeechVocab(0, size, tuple(size + i for i in range(extra))), sampler, token_rate=25.0,
                  min_length_stop_ids=None if vllm else (size,), min_per_text_token=2.0, max_per_text_token=20.0,
                  silent_tokens=silent, prompt_builder=partial(_cosyvoice_prompt, version=version))


def cosyvoice2(speech_token_size: int = 6561, engine: str = "hf") -> Preset:
    """CosyVoice 2 decoding as CosyVoice does with Hugging Face (engine="hf") or vLLM (engine="vllm")."""
    return _cosyvoice(2, speech_token_size, 3, engine, ())


def cosyvoice3(speech_token_size: int = 6561, engine: str = "hf") -> Preset:
    """CosyVoice 3 decoding as CosyVoice does with Hugging Face (engine="hf") or vLLM (engine="vllm")."""
    return _cosyvoice(3, speech_token_size, 200, engine, COSYVOICE3_SILENT_TOKENS)


COSYVOICE2 = cosyvoice2()
COSYVOICE3 = cosyvoice3()


# ---- LLaSA ----------------------------------------------------------------------------------------------
# zhenye234/LLaSA_training (read at ef5c260, 2025-04-08) train_tts.py: Llama 3.2's 128256 ids, then 8 markers
# (128256 <|TEXT_GENERATION_START|> ... 128260 <|SPEECH_GENERATION_START|>, 128261 <|SPEECH_GENERATION_END|>,
# ...), then the 65536 X-codec2 ids <|s_0|>.. from 128264 (50 a second).
# finetune/online_finetune/lora_infer_example.py L46-75: a chat whose user turn is "Convert the text to
# speech:<|TEXT_UNDERSTANDING_START|>{text}<|TEXT_UNDERSTANDING_END|>" and whose assistant turn starts
# "<|SPEECH_GENERATION_START|>" (then the prompt audio's speech tokens when cloning), continued;
# generate(max_length=2048, eos_token_id=128261, do_sample=True, top_p=1, temperature=0.8,
# repetition_penalty=1.2). top_k is not passed, so Hugging Face's default applies: 50 (transformers
# generation/configuration_utils.py: GenerationConfig's `top_k` default in 4.x, `_get_default_generation_params`
# in 5.x), unless a checkpoint's generation_config.json sets another.

LLASA_SAMPLER = Sampler(temperature=0.8, top_k=50, top_p=1.0, repetition_penalty=1.2)


def _llasa_prompt(preset: Preset, tokenizer, text: str, prompt_text: str = "",
                  prompt_speech: Sequence[int] = ()) -> dict:
    chat = [{"role": "user", "content": "Convert the text to speech:<|TEXT_UNDERSTANDING_START|>"
                                        f"{prompt_text}{text}<|TEXT_UNDERSTANDING_END|>"},
            {"role": "assistant", "content": "<|SPEECH_GENERATION_START|>"}]
    ids = tokenizer.apply_chat_template(chat, tokenize=True, continue_final_message=True)
    ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
    ids = ids[0] if ids and isinstance(ids[0], (list, tuple)) else ids
    return {"input_ids": [int(t) for t in ids] + preset.speech.to_model(prompt_speech)}


LLASA = Preset("LLaSA", "zhenye234/LLaSA_training train_tts.py, finetune/online_finetune/lora_infer_example.py "
               "L46-75; transformers generation/configuration_utils.py (top_k 50)",
               SpeechVocab(128264, 65536, (128261,)),
               LLASA_SAMPLER, token_rate=50.0,
               max_length=2048, drop_ids=(128260,), prompt_builder=_llasa_prompt)


# ---- Orpheus --------------------------------------------------------------------------------------------
# canopyai/Orpheus-TTS (read at 835ac7c, 2025-05-05) orpheus_tts_pypi/orpheus_tts/engine_class.py and
# decoder.py (turn_token_into_id, convert_to_audio): <custom_token_N> is id 128256 + N; a SNAC frame is 7
# tokens, position p of the frame carrying code c as <custom_token_{10 + 4096 p + c}>, i.e. id
# 128266 + 4096 p + c: 7 interleaved codebooks of 4096.
# Prompt (`_format_prompt`, L79-86): 128259 (start of human), the tokenizer's ids of "{voice}: {text}" (a Llama
# 3 tokenizer puts <|begin_of_text|> first), 128009 (end of text), 128260 (end of human), 128261 (start of
# AI), 128257 (start of speech), decoded to a string; `generate_tokens_sync` (L98-112) hands vLLM that string,
# which vLLM tokenizes again with the tokenizer's special tokens (vllm/inputs/preprocess.py `_tokenize_prompt`:
# `tokenizer.encode(prompt)`), so a second <|begin_of_text|> comes first: 128000 128259 128000 ... 128257.
# The preset does the same round trip with the tokenizer it is given.
# Sampling (L98, L101-107): temperature 0.6, top_p 0.8, repetition_penalty 1.3, max_tokens 1200, vLLM's
# default top_k (none). Speech ends with 128258 (end of speech: realtime_streaming_example/main.py L43; the
# package's own default stop id, 49158, is not an id of the 3B checkpoints' vocabulary). A frame lasts
# 512 * 4 / 24000 s: 82 tokens a second. Training sequences wrap speech in 128261 128257 ... 128258 128262:
# the markers a dumped corpus holds.

ORPHEUS_SAMPLER = Sampler(temperature=0.6, top_p=0.8, repetition_penalty=1.3)


def _orpheus_prompt(preset: Preset, tokenizer, text: str, voice: str | None = None) -> dict:
    words = tokenizer(f"{voice}: {text}" if voice else text)["input_ids"]
    ids = [128259, *[int(t) for t in words], 128009, 128260, 128261, 128257]
    return {"input_ids": [int(t) for t in tokenizer.encode(tokenizer.decode(ids))]}


ORPHEUS = Preset("Orpheus", "canopyai/Orpheus-TTS orpheus_tts_pypi/orpheus_tts/engine_class.py L72-112, "
                 "decoder.py, realtime_streaming_example/main.py L43; vllm/inputs/preprocess.py (_tokenize_prompt)",
                 SpeechVocab(128266, 7 * 4096, (128258,), codebooks=7),
                 ORPHEUS_SAMPLER, token_rate=24000 / 2048 * 7,
                 max_new_tokens=1200, drop_ids=(128257, 128261, 128262), prompt_builder=_orpheus_prompt)


# ---- Spark-TTS ------------------------------------------------------------------------------------------
# SparkAudio/Spark-TTS (read at 2f1ea90, 2025-04-09) cli/SparkTTS.py: a Qwen2.5 LM whose tokenizer adds
# <|bicodec_global_N|> (4096, the speaker) and <|bicodec_semantic_N|> (8192, 50 a second) tokens and markers.
# Voice cloning (`process_prompt`, L53-108): <|task_tts|><|start_content|>{prompt_text}{text}<|end_content|>
# <|start_global_token|>{the prompt audio's 32 global tokens}<|end_global_token|>, then, with a prompt
# transcript, <|start_semantic_token|>{the prompt audio's semantic tokens}. Voice creation
# (`process_prompt_control`, L110-155; sparktts/utils/token_parser.py GENDER_MAP, LEVELS_MAP):
# <|task_controllable_tts|><|start_content|>{text}<|end_content|><|start_style_label|><|gender_G|>
# <|pitch_label_P|><|speed_label_S|><|end_style_label|>, G 0 female / 1 male, P and S 0..4 for very_low, low,
# moderate, high, very_high; the model then writes the 32 global tokens itself (`inference` L222-228 reads
# them from the output) before the semantic ones. `inference` (L157-204): the prompt string tokenized as is,
# generate(max_new_tokens=3000, do_sample=True, top_k=50, top_p=0.95, temperature=0.8) with the checkpoint's
# own eos, and Spark-TTS's TensorRT-LLM server stops at the tokenizer's (runtime/triton_trtllm/model_repo/
# spark_tts/1/model.py L169 `end_id = tokenizer.eos_token_id`): <|im_end|>, 151645, in Spark-TTS-0.5B (its
# LLM/config.json and tokenizer_config.json as ports of it quote them; the checkpoint is not read here). The
# preset takes the stop id from the tokenizer's eos_token.
# Retrieval works on the semantic tokens; training sequences wrap them in <|start_semantic_token|> ..
# <|end_semantic_token|>.

SPARK_TTS_SAMPLER = Sampler(temperature=0.8, top_k=50, top_p=0.95)
SPARK_GENDERS = {"female": 0, "male": 1}
SPARK_LEVELS = {"very_low": 0, "low": 1, "moderate": 2, "high": 3, "very_high": 4}


def _spark_prompt(preset: Preset, tokenizer, text: str, global_tokens: Sequence[int] | None = None,
                  prompt_text: str | None = None, prompt_speech: Sequence[int] = (), gender: str | None = None,
                  pitch: str | None = None, speed: str | None = None) -> dict:
    """Voice cloning (`global_tokens`, optionally `prompt_text` and `prompt_speech`) or, with `gender`,
    voice creation (`gender`, `pitch`, `speed`), as Spark-TTS's `inference` chooses."""
    if gender is not None:
        parts = ["<|task_controllable_tts|><|start_content|>", text, "<|end_content|><|start_style_label|>",
                 _spark_style(gender, pitch, speed), "<|end_style_label|>"]
    elif global_tokens is None:
        raise DecoderInputError("Spark-TTS needs the prompt audio's global_tokens (voice cloning) or gender, "
                                "pitch and speed (voice creation)")
    else:
        parts = ["<|task_tts|><|start_content|>", prompt_text or "", text, "<|end_content|><|start_global_token|>",
                 "".join(f"<|bicodec_global_{int(g)}|>" for g in global_tokens), "<|end_global_token|>"]
        if prompt_text is not None:
            parts += ["<|start_semantic_token|>", "".join(f"<|bicodec_semantic_{int(s)}|>" for s in prompt_speech)]
    return {"input_ids": [int(t) for t in tokenizer("".join(parts))["input_ids"]]}


def _spark_style(gender: str, pitch: str | None, speed: str | None) -> str:
    if gender not in SPARK_GENDERS:
        raise DecoderInputError(f"Spark-TTS: gender must be one of {sorted(SPARK_GENDERS)}, got {gender!r}")
    for name, level in (("pitch", pitch), ("speed", speed)):
        if level not in SPARK_LEVELS:
            raise DecoderInputError(f"Spark-TTS: {name} must be one of {list(SPARK_LEVELS)}, got {level!r}")
    return (f"<|gender_{SPARK_GENDERS[gender]}|><|pitch_label_{SPARK_LEVELS[pitch]}|>"
            f"<|speed_label_{SPARK_LEVELS[speed]}|>")


def spark_tts(tokenizer) -> Preset:
    """Spark-TTS with the ids of `tokenizer` (the checkpoint's LLM/ tokenizer, or its token -> id map)."""
    vocab = _token_ids(tokenizer, "Spark-TTS")
    first = _contiguous(vocab, "<|bicodec_semantic_{}|>", 8192, "Spark-TTS")
    eos = getattr(tokenizer, "eos_token", None) or "<|im_end|>"  # a bare token map: the checkpoint's eos
    return Preset("Spark-TTS", "SparkAudio/Spark-TTS cli/SparkTTS.py L53-204 (process_prompt, "
                  "process_prompt_control, inference), sparktts/utils/token_parser.py, "
                  "runtime/triton_trtllm/model_repo/spark_tts/1/model.py L169",
                  SpeechVocab(first, 8192, (vocab[eos],)),
                  SPARK_TTS_SAMPLER, token_rate=50.0, max_new_tokens=3000,
                  drop_ids=(vocab["<|start_semantic_token|>"], vocab["<|end_semantic_token|>"]),
                  prompt_builder=_spark_prompt)


# ---- OuteTTS 1.0 ----------------------------------------------------------------------------------------
# edwko/OuteTTS (read at f5eac6e, 2026-03-23) outetts/version/v3/tokens.py and prompt_processor.py: a DAC
# codec's two codebooks as <|c1_0|>..<|c1_1024|> and <|c2_0|>..<|c2_1024|> (75 frames a second), c1 and c2
# alternating within each word, words wrapped in <|word_start|> ... <|word_end|> with time and feature tokens.
# Completion prompt (`get_completion_prompt`, L147-160): the text normalised (`text_normalizations`,
# L111-145: ftfy.fix_text, NFKC, quotes, dashes, control characters, spaces around punctuation), then
# "<|im_start|>\n<|text_start|>{text}<|text_end|>\n<|audio_start|>\n"; with a speaker (a dict as
# `create_speaker` / `load_speaker` / `load_default_speaker` give it: "text" and "words", each word's "word",
# "duration", "c1", "c2" and "features") the speaker's text comes first, joined by a separator
# (`merge_speaker_text`, L88-109, which also ends the speaker's last word with it), and the speaker's words
# follow the prompt (`create_codes`, L47-64), then "\n<|word_start|>". Tokenized without special tokens
# (version/interface.py `_prepare_prompt`, L42-47). The speaker's c1/c2 tokens become the retriever's context.
# Training prompts end "<|audio_end|>\n<|im_end|>": speech ends at <|audio_end|> (llama.cpp-style runtimes
# stop there) or the eos <|im_end|>. Sampling (models/config.py SamplerConfig L12-18, models/hf_model.py):
# temperature 0.4, repetition_penalty 1.1 over the last 64 tokens, top_k 40, top_p 0.9, min_p 0.05;
# max_length 8192 (GenerationConfig L32). The codebooks are adjacent in the Llama and Qwen3 checkpoints'
# tokenizers (checked here). Long texts: OuteTTS's default CHUNKED generation splits the text
# (utils/chunking.py) and prompts each chunk alike; the preset builds one chunk's prompt.

OUTETTS_SAMPLER = Sampler(temperature=0.4, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                          repetition_window=64)
OUTETTS_NORMALISATION = [  # prompt_processor.py L120-143, after ftfy.fix_text and NFKC, in order
    (r"…", "..."), (r"\.{2,}", "..."),
    (r"[“”„‟«»]", '"'), (r"[‘’‛‹›`´]", "'"),
    (r"[–—―−‐]", "-"), (r"-{2,}", "-"),
    (r"[\x00-\x1F\x7F-\x9F\u00AD\u200B-\u200D\uFEFF]", ""),
    (r"\s+", " "),
    (r"\s+([,.?!:;])", r"\1"), (r"([,.?!:;])(?=[^\s,.?!:;])", r"\1 "),
    (r"(\w)\s+'\s*(\w)", r"\1'\2"), (r"(\w)\s+'\s*([,.?!:;\s]|$)", r"\1'\2"),
    (r"(?i)(\w)\s*'\s*([tsdmreSNTDMRE])\b", r"\1'\2"),
    (r"([?!])\1+", r"\1"),
    (r"\s+", " "), (r'"', ""),
]


def outetts_normalise(text: str) -> str:
    """OuteTTS 1.0's text normalisation (prompt_processor.py `text_normalizations`); needs ftfy, as OuteTTS does."""
    try:
        import ftfy
    except ImportError:
        raise DecoderInputError("OuteTTS normalises text with ftfy, as OuteTTS itself does: pip install ftfy "
                                "(or pass normalise=False to insert the text as given)") from None
    text = unicodedata.normalize("NFKC", ftfy.fix_text(text))
    for pattern, replacement in OUTETTS_NORMALISATION:
        text = re.sub(pattern, replacement, text)
    return text.strip()


def outetts_prompt_text(text: str, speaker: Mapping | None = None, normalise: bool = True) -> str:
    """OuteTTS 1.0's completion prompt as a string (prompt_processor.py `get_completion_prompt`)."""
    text = outetts_normalise(text) if normalise else text
    codes = ""
    if speaker is not None:
        text, separator = _outetts_merge(text, speaker["text"])
        words = [dict(word) for word in speaker["words"]]  # upstream appends to the caller's dict; not here
        words[-1]["word"] += separator
        codes = "\n".join(_outetts_word(word) for word in words) + "\n<|word_start|>"
    return f"<|im_start|>\n<|text_start|>{text}<|text_end|>\n<|audio_start|>\n{codes}"


def _outetts_merge(text: str, speaker_text: str) -> tuple[str, str]:
    """The speaker's transcript, a separator unless it ends a sentence, the text (`merge_speaker_text`)."""
    speaker_text = speaker_text.strip()
    cjk = any("\u3040" <= c <= "\u30ff" or "\u4e00" <= c <= "\u9fff" for c in speaker_text)
    separator, ends = ("。", "。？！?!") if cjk else (". ", ".?!")
    joint = ""
    if speaker_text:
        joint = separator if speaker_text[-1] not in ends else ("" if cjk else " ")
    return speaker_text + joint + text.strip(), joint.strip()


def _outetts_word(word: Mapping) -> str:
    """One speaker word as `create_codes` writes it: text, time, features, then its c1/c2 pairs."""
    features = word.get("features", {})
    return ("<|word_start|>" + word["word"] + f"<|features|><|t_{word['duration']:.2f}|>"
            + "".join(f"<|{name}_{features.get(name, 0)}|>" for name in ("energy", "spectral_centroid", "pitch"))
            + "<|code|>" + "".join(f"<|c1_{a}|><|c2_{b}|>" for a, b in zip(word["c1"], word["c2"]))
            + "<|word_end|>")


def _outetts_prompt(preset: Preset, tokenizer, text: str, speaker: Mapping | None = None,
                    normalise: bool = True) -> dict:
    prompt = outetts_prompt_text(text, speaker, normalise)
    return {"input_ids": [int(t) for t in tokenizer(prompt, add_special_tokens=False)["input_ids"]]}


def outetts(tokenizer) -> Preset:
    """OuteTTS 1.0 with the ids of `tokenizer` (the checkpoint's)."""
    vocab = _token_ids(tokenizer, "OuteTTS")
    first = _contiguous(vocab, "<|c1_{}|>", 1025, "OuteTTS")
    if _contiguous(vocab, "<|c2_{}|>", 1025, "OuteTTS") != first + 1025:
        raise DecoderInputError("OuteTTS: <|c2_0|> does not follow <|c1_1024|> in this tokenizer")
    return Preset("OuteTTS 1.0", "edwko/OuteTTS outetts/version/v3/tokens.py, prompt_processor.py L47-160, "
                  "version/interface.py L42-51, models/config.py L12-32, models/hf_model.py",
                  SpeechVocab(first, 2050, (vocab["<|audio_end|>"], vocab["<|im_end|>"]), codebooks=2),
                  OUTETTS_SAMPLER,
                  token_rate=150.0, max_length=8192, prompt_builder=_outetts_prompt)


SAMPLERS = {"ras": COSYVOICE_SAMPLER, "cosyvoice": COSYVOICE_SAMPLER, "cosyvoice-vllm": COSYVOICE_VLLM_SAMPLER,
            "llasa": LLASA_SAMPLER, "orpheus": ORPHEUS_SAMPLER, "spark-tts": SPARK_TTS_SAMPLER,
            "outetts": OUTETTS_SAMPLER}
"""Each model's own sampling rule by name (`echospec bench --sampler NAME`); "ras" is CosyVoice's RAS."""


def sampler(name: str) -> Sampler | RAS:
    """The sampling rule SAMPLERS calls `name`."""
    if name not in SAMPLERS:
        raise DecoderInputError(f"no preset sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
    return SAMPLERS[name]


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

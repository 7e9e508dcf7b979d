"""Faithful tiny replicas of the TTS language models echospec claims, for tests.

Each has its upstream's module structure and vocabulary layout — the real vocabulary sizes and ids —
at hidden size 64 with 2 layers. Random weights give flat distributions, so each replica is shaped first:
a few dozen training steps on a repetitive synthetic speech corpus (a few phrases, repeated with small
changes, as speech repeats), after which the model continues those phrases and a datastore of the same
corpus proposes what it will say. Training scores only the ids the corpus uses, its stop ids and a few
hundred others drawn afresh each step, so a 190k-id head costs no more than a small one.

  CosyVoice 2/3   FunAudioLLM/CosyVoice cosyvoice/llm/llm.py: Qwen2LM / CosyVoice3LM around a Qwen2ForCausalLM
                  (`llm.llm.model`), with their own `speech_embedding` and `llm_decoder`; `cosyvoice_decode`
                  re-implements Qwen2LM.inference_wrapper's Hugging Face loop.
  LLaSA           zhenye234/LLaSA_training train_tts.py: Llama, 128256 + 8 markers + 65536 speech ids.
  Orpheus         canopyai/Orpheus-TTS engine_class.py / decoder.py: Llama, <custom_token_N> = 128256 + N,
                  7 interleaved SNAC codebooks of 4096 from 128266, 156940 ids.
  Spark-TTS       SparkAudio/Spark-TTS cli/SparkTTS.py: Qwen2 with BiCodec global/semantic tokens, 166000 ids
                  (ids as the Spark-TTS-0.5B tokenizer has them).
  OuteTTS 1.0     edwko/OuteTTS version/v3: Llama with <|c1_N|>, <|c2_N|> (2 x 1025) from 128256.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from echospec.decoder import compat

torch.set_num_threads(1)

HIDDEN = 64


def _config(cls, vocab: int, tie: bool = True):
    return cls(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=tie, attn_implementation="sdpa")


# ---- a repetitive synthetic speech corpus ----------------------------------------------------------------

def phrases(seed: int, codes: int, codebooks: int = 1, count: int = 6) -> list[np.ndarray]:
    """`count` phrases of frames of `codebooks` local ids: a frame's position p uses ids p * codes + code."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, codes, (int(rng.integers(3, 6)), codebooks)) + codes * np.arange(codebooks)).ravel()
            for _ in range(count)]


def utterances(seed: int, phrase_list: list[np.ndarray], n: int, length: int, codes: int, codebooks: int = 1,
               change: float = 0.03) -> list[list[int]]:
    """Utterances of `length` frames strung from the phrases, a few ids changed (within their codebook)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids: list[int] = []
        while len(ids) < length * codebooks:
            ids.extend(phrase_list[int(rng.integers(len(phrase_list)))].tolist())
        ids = np.array(ids[: length * codebooks])
        changed = rng.random(len(ids)) < change
        ids[changed] = (ids[changed] // codes) * codes + rng.integers(0, codes, int(changed.sum()))
        out.append(ids.tolist())
    return out


# ---- shaping ---------------------------------------------------------------------------------------------

def shape(hidden_fn, head_weight, head_bias, params, batches, targets_ids, steps: int = 60, lr: float = 3e-3,
          negatives: int = 256, seed: int = 0) -> None:
    """Train `params` so that `hidden_fn(batch) @ head_weight[ids].T` predicts each batch's next ids.

    `batches` is a list of (inputs, targets) with targets -100 where no loss is taken; only the rows of
    `targets_ids` and `negatives` random others are scored (the rest of a large head stays as it was).
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(params, lr=lr)
    vocab = head_weight.shape[0]
    used = torch.tensor(sorted(set(targets_ids)))
    for step in range(steps):
        inputs, targets = batches[step % len(batches)]
        ids = torch.unique(torch.cat([used, torch.randint(0, vocab, (negatives,), generator=generator)]))
        index = torch.full((vocab,), -100, dtype=torch.long)
        index[ids] = torch.arange(len(ids))
        logits = hidden_fn(inputs) @ head_weight[ids].T
        if head_bias is not None:
            logits = logits + head_bias[ids]
        mapped = torch.where(targets >= 0, index[targets.clamp(min=0)], targets)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, len(ids)), mapped.reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _batches(sequences: list[list[int]], loss_from: list[int], size: int = 8):
    """(inputs, targets) batches of equal-length groups; targets -100 before `loss_from[i]`."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out = []
    for start in range(0, len(order), size):
        group = order[start:start + size]
        width = min(len(sequences[i]) for i in group)
        seqs = torch.tensor([sequences[i][:width] for i in group])
        targets = seqs[:, 1:].clone()
        for row, i in enumerate(group):
            targets[row, : max(loss_from[i] - 1, 0)] = -100
        out.append((seqs[:, :-1], targets))
    return out


# ---- CosyVoice 2 and 3 ----------------------------------------------------------------------------------

class Qwen2Encoder(torch.nn.Module):
    """CosyVoice's wrapper of the Qwen2 backbone: `.model` is a Qwen2ForCausalLM."""

    def __init__(self, text_vocab: int):
        super().__init__()
        self.model = Qwen2ForCausalLM(_config(Qwen2Config, text_vocab)).eval()


class Qwen2LM(torch.nn.Module):
    """CosyVoice 2's LM: sos/task_id in `llm_embedding`, speech_token_size + 3 outputs (all 3 extra ids stop)."""

    extra = 3

    def __init__(self, speech_token_size: int = 6561, text_vocab: int = 151936):
        super().__init__()
        self.speech_token_size = speech_token_size
        self.sos, self.task_id = 0, 1
        self.llm_embedding = torch.nn.Embedding(2, HIDDEN)
        self.llm = Qwen2Encoder(text_vocab)
        self.llm_decoder = torch.nn.Linear(HIDDEN, speech_token_size + self.extra)
        self.speech_embedding = torch.nn.Embedding(speech_token_size + self.extra, HIDDEN)
        self.stop_token_ids = [speech_token_size + i for i in range(self.extra)]

    def sos_task(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.llm_embedding.weight[self.sos], self.llm_embedding.weight[self.task_id]


class CosyVoice3LM(Qwen2LM):
    """CosyVoice 3's LM: sos/eos/task_id are speech_embedding rows size+0/+1/+2; 200 extra outputs, no bias."""

    extra = 200

    def __init__(self, speech_token_size: int = 6561, text_vocab: int = 151936):
        torch.nn.Module.__init__(self)
        self.speech_token_size = speech_token_size
        self.sos, self.eos_token, self.task_id = speech_token_size, speech_token_size + 1, speech_token_size + 2
        self.llm = Qwen2Encoder(text_vocab)
        self.llm_decoder = torch.nn.Linear(HIDDEN, speech_token_size + self.extra, bias=False)
        self.speech_embedding = torch.nn.Embedding(speech_token_size + self.extra, HIDDEN)
        self.stop_token_ids = [speech_token_size + i for i in range(self.extra)]

    def sos_task(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.speech_embedding.weight[self.sos], self.speech_embedding.weight[self.task_id]


def cosyvoice_lm_input(llm, text, prompt_text, prompt_speech) -> torch.Tensor:
    """lm_input as CosyVoice's inference concatenates it: sos, text embeddings, task_id, prompt speech."""
    sos, task = llm.sos_task()
    with torch.no_grad():
        text_embeds = llm.llm.model.model.embed_tokens(torch.tensor([list(prompt_text) + list(text)]))[0]
        speech = llm.speech_embedding(torch.tensor(list(prompt_speech), dtype=torch.long))
        return torch.cat([sos[None], text_embeds, task[None], speech])[None]


def cosyvoice_decode(llm, lm_input, min_len: int, max_len: int, pick, masked=None) -> list[int]:
    """Qwen2LM.inference_wrapper's Hugging Face loop: the backbone with a KV cache on lm_input, then on each
    new token's speech_embedding row; llm_decoder on the last hidden state, log_softmax; before min_len only
    id speech_token_size is masked (sampling_ids); any stop id ends speech and is never yielded.
    `pick(logp, decoded)` chooses the token (argmax, CosyVoice's ras_sampling, vLLM's top-k draw); `masked`
    (default [speech_token_size]) are the ids masked before min_len: vLLM's min_tokens masks every stop id."""
    masked = [llm.speech_token_size] if masked is None else list(masked)
    out, cache = [], {}
    with torch.no_grad():
        for i in range(max_len):
            outs = llm.llm.model(inputs_embeds=lm_input, output_hidden_states=True, use_cache=True, **cache)
            cache = {compat.cache_argument(llm.llm.model): compat.output_cache(outs)}
            logp = llm.llm_decoder(outs.hidden_states[-1][:, -1]).log_softmax(dim=-1)[0]
            if i < min_len:
                logp[masked] = -float("inf")
            token = pick(logp, out)
            if token in llm.stop_token_ids:
                break
            out.append(token)
            lm_input = llm.speech_embedding.weight[token].reshape(1, 1, -1)
    return out


def argmax(logp, decoded) -> int:
    return int(torch.argmax(logp))


def cosyvoice_ras(generator: torch.Generator, top_p=0.8, top_k=25, win_size=10, tau_r=0.1):
    """ras_sampling as a draw (cosyvoice/utils/common.py): a draw from the nucleus (running sum below top_p,
    fewer than top_k, stable descending order); if it repeats win_size * tau_r times in the last win_size
    decoded tokens, a draw from the full softmax with that token masked."""
    def pick(logp, decoded) -> int:
        probs, order = logp.softmax(dim=0).sort(descending=True, stable=True)
        kept, total = [], torch.tensor(0.0)
        for p in probs:
            if not (total < top_p and len(kept) < top_k):
                break
            total = total + p
            kept.append(p)
        token = int(order[torch.multinomial(torch.stack(kept), 1, replacement=True, generator=generator)])
        if decoded[-win_size:].count(token) >= win_size * tau_r:
            scores = logp.clone()
            scores[token] = -float("inf")
            token = int(torch.multinomial(scores.softmax(dim=0), 1, replacement=True, generator=generator))
        return token
    return pick


def top_k_draw(generator: torch.Generator, top_k: int = 25):
    """vLLM's SamplingParams(top_k=25) with its other defaults (temperature 1, top_p 1) as a draw: the softmax
    of the top_k largest logits."""
    def pick(logp, decoded) -> int:
        values, ids = logp.topk(top_k)
        return int(ids[torch.multinomial(values.softmax(dim=0), 1, generator=generator)])
    return pick


@dataclass
class CosyVoiceReplica:
    llm: Qwen2LM
    corpus: list[list[int]]  # speech utterances (local ids = model ids)
    heldout: list[list[int]]


def cosyvoice(version: int = 2, speech_token_size: int = 6561, text_vocab: int = 151936, codes: int = 48,
              seed: int = 0, steps: int = 80) -> CosyVoiceReplica:
    """A CosyVoice 2 or 3 LM shaped on a corpus of `codes` distinct speech ids (speech ending in eos)."""
    torch.manual_seed(seed)
    llm = (Qwen2LM if version == 2 else CosyVoice3LM)(speech_token_size, text_vocab).eval()
    eos = speech_token_size if version == 2 else speech_token_size + 1
    chosen = np.random.default_rng(seed).choice(speech_token_size, min(codes, speech_token_size), replace=False)
    plist = phrases(seed, len(chosen))  # over indices into `chosen`
    corpus = [chosen[u].tolist() for u in utterances(seed + 1, plist, 40, 40, len(chosen))]
    heldout = [chosen[u].tolist() for u in utterances(seed + 2, plist, 8, 40, len(chosen))]
    sos, task = llm.sos_task()
    backbone = llm.llm.model.model

    def hidden(inputs):
        embeds = llm.speech_embedding(inputs)
        start = torch.stack([sos, task])[None].expand(len(inputs), -1, -1)
        return backbone(inputs_embeds=torch.cat([start, embeds], 1)).last_hidden_state[:, 2:]

    sequences = [u + [eos] for u in corpus]
    params = [p for n, p in llm.named_parameters() if "embed_tokens" not in n]
    shape(hidden, llm.llm_decoder.weight, llm.llm_decoder.bias, params, _batches(sequences, [0] * len(sequences)),
          [*chosen.tolist(), eos], steps=steps)
    return CosyVoiceReplica(llm.eval(), corpus, heldout)


# ---- the Hugging Face causal LMs and their tokenizers ----------------------------------------------------

def word_tokenizer(vocab: dict[str, int], chat_template: str | None = None, bos: str | None = None,
                   eos: str | None = None) -> PreTrainedTokenizerFast:
    """A real tokenizer over `vocab`: special tokens (<|...|>, <custom_token_N>), words, punctuation, spaces and
    newlines are tokens; anything else is <unk>; decoding joins the tokens back into the text. Stands in for the
    checkpoints' BPE tokenizers: with `bos`, encoding puts it first unless add_special_tokens=False (as Llama
    3's tokenizer does with <|begin_of_text|>); `eos` is the tokenizer's eos_token."""
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    pattern = Regex(r"<\|[^|]*\|>|<custom_token_\d+>|\w+|[^\w\s]| |\n")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern, behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token=bos, eos_token=eos)
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "tara", ":", ".", ",", "Convert", "text", "to", "speech",
         " ", "\n", "system", "user", "assistant"]


def _text_vocab(extra: dict[str, int]) -> dict[str, int]:
    vocab = {"<unk>": 0}
    vocab.update({word: 100 + i for i, word in enumerate(WORDS)})
    vocab.update(extra)
    return vocab


@dataclass
class HFReplica:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerFast
    corpus: list[list[int]]  # model ids of each utterance's speech, as the model emits it
    heldout: list[list[int]]
    stop_ids: tuple[int, ...]


def _shape_causal_lm(model, prompts: list[list[int]], corpus: list[list[int]], stops: list[int], steps: int,
                     seed: int) -> None:
    sequences = [p + u + stops[:1] for p, u in zip(prompts, corpus)]
    embed = model.get_input_embeddings()
    embed.weight.requires_grad_(False)  # the (tied) vocabulary stays as drawn: no dense 190k-row gradients
    params = [p for p in model.parameters() if p.requires_grad]
    used = sorted({t for u in corpus for t in u} | set(stops))
    shape(lambda ids: model.model(input_ids=ids).last_hidden_state, model.get_output_embeddings().weight,
          None, params, _batches(sequences, [len(p) for p in prompts]), used, steps=steps, seed=seed)
    embed.weight.requires_grad_(True)
    model.eval()


LLAMA3 = {"<|begin_of_text|>": 128000, "<|start_header_id|>": 128006, "<|end_header_id|>": 128007,
          "<|eot_id|>": 128009}
LLAMA_CHAT = ("<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
              "{{ m['content'] }}<|eot_id|>{% endfor %}")


def llasa(seed: int = 0, steps: int = 60) -> HFReplica:
    from echospec.decoder.presets import LLASA

    torch.manual_seed(seed)
    markers = ["TEXT_GENERATION_START", "TEXT_GENERATION_END", "TEXT_UNDERSTANDING_START", "TEXT_UNDERSTANDING_END",
               "SPEECH_GENERATION_START", "SPEECH_GENERATION_END", "SPEECH_UNDERSTANDING_START",
               "SPEECH_UNDERSTANDING_END"]
    vocab = _text_vocab(LLAMA3 | {f"<|{m}|>": 128256 + i for i, m in enumerate(markers)})
    tokenizer = word_tokenizer(vocab, LLAMA_CHAT)
    model = LlamaForCausalLM(_config(LlamaConfig, 128256 + 8 + 65536))
    plist = phrases(seed, 40)
    offset = LLASA.speech.offset + 1000  # somewhere inside the 65536 X-codec2 ids
    corpus = [[offset + t for t in u] for u in utterances(seed + 1, plist, 40, 40, 40)]
    heldout = [[offset + t for t in u] for u in utterances(seed + 2, plist, 8, 40, 40)]
    prompts = [LLASA.prompt(tokenizer, "the cat sat")["input_ids"] for _ in corpus]
    _shape_causal_lm(model, prompts, corpus, list(LLASA.speech.stop_ids), steps, seed)
    return HFReplica(model, tokenizer, corpus, heldout, LLASA.speech.stop_ids)


ORPHEUS_CUSTOM = {f"<custom_token_{n}>": 128256 + n for n in range(156940 - 128256)}


def orpheus(seed: int = 0, steps: int = 60, codes: int = 12) -> HFReplica:
    """Orpheus: frames of 7 tokens, position p from 128266 + 4096 p; `codes` codes in use per position."""
    from echospec.decoder.presets import ORPHEUS

    torch.manual_seed(seed)
    tokenizer = word_tokenizer(_text_vocab(LLAMA3 | ORPHEUS_CUSTOM), bos="<|begin_of_text|>")
    model = LlamaForCausalLM(_config(LlamaConfig, 156940))
    plist = phrases(seed, codes, codebooks=7)  # compact ids p * codes + code
    to_model = lambda u: [ORPHEUS.speech.offset + (t // codes) * 4096 + t % codes for t in u]  # noqa: E731
    corpus = [to_model(u) for u in utterances(seed + 1, plist, 40, 10, codes, codebooks=7)]
    heldout = [to_model(u) for u in utterances(seed + 2, plist, 8, 10, codes, codebooks=7)]
    prompts = [ORPHEUS.prompt(tokenizer, "the cat sat", voice="tara")["input_ids"] for _ in corpus]
    _shape_causal_lm(model, prompts, corpus, list(ORPHEUS.speech.stop_ids), steps, seed)
    return HFReplica(model, tokenizer, corpus, heldout, ORPHEUS.speech.stop_ids)


SPARK_IDS = {"<|im_end|>": 151645, "<|task_tts|>": 165137, "<|start_content|>": 165146, "<|end_content|>": 165152,
             "<|start_global_token|>": 165150, "<|end_global_token|>": 165156, "<|start_semantic_token|>": 165151,
             "<|end_semantic_token|>": 165157}
# voice creation's tokens (cli/SparkTTS.py process_prompt_control); their ids are the replica's own
SPARK_STYLE = ["<|task_controllable_tts|>", "<|start_style_label|>", "<|end_style_label|>", "<|gender_0|>",
               "<|gender_1|>", *(f"<|pitch_label_{i}|>" for i in range(5)), *(f"<|speed_label_{i}|>" for i in range(5))]
SPARK_GLOBAL, SPARK_SEMANTIC = 151665, 155761


def spark_tts(seed: int = 0, steps: int = 60) -> HFReplica:
    torch.manual_seed(seed)
    names = {f"<|bicodec_global_{i}|>": SPARK_GLOBAL + i for i in range(4096)}
    names |= {f"<|bicodec_semantic_{i}|>": SPARK_SEMANTIC + i for i in range(8192)}
    names |= {name: 165900 + i for i, name in enumerate(SPARK_STYLE)}
    tokenizer = word_tokenizer(_text_vocab(SPARK_IDS | names), eos="<|im_end|>")
    model = Qwen2ForCausalLM(_config(Qwen2Config, 166000))
    model.generation_config.eos_token_id = SPARK_IDS["<|im_end|>"]  # the checkpoint's own, as generate reads it
    plist = phrases(seed, 40)
    corpus = [[SPARK_SEMANTIC + 500 + t for t in u] for u in utterances(seed + 1, plist, 40, 40, 40)]
    heldout = [[SPARK_SEMANTIC + 500 + t for t in u] for u in utterances(seed + 2, plist, 8, 40, 40)]
    from echospec.decoder.presets import spark_tts as preset

    spark = preset(tokenizer)
    prompts = [spark.prompt(tokenizer, "the cat sat", global_tokens=range(32))["input_ids"] for _ in corpus]
    _shape_causal_lm(model, prompts, corpus, list(spark.speech.stop_ids), steps, seed)
    return HFReplica(model, tokenizer, corpus, heldout, spark.speech.stop_ids)


# the time and feature tokens of the speaker in tests (a real tokenizer has every value)
OUTETTS_FEATURES = ["<|t_0.20|>", "<|t_0.33|>", "<|energy_10|>", "<|spectral_centroid_15|>", "<|pitch_45|>",
                    "<|energy_0|>", "<|spectral_centroid_0|>", "<|pitch_0|>"]


def outetts(seed: int = 0, steps: int = 60, codes: int = 16) -> HFReplica:
    """OuteTTS 1.0 on Llama: c1 from 128256, c2 from 129281 (as the Llama checkpoint's tokenizer has them);
    its other special tokens follow (their exact ids are the replica's own)."""
    torch.manual_seed(seed)
    names = {f"<|c1_{i}|>": 128256 + i for i in range(1025)} | {f"<|c2_{i}|>": 129281 + i for i in range(1025)}
    specials = ["<|im_start|>", "<|im_end|>", "<|text_start|>", "<|text_end|>", "<|audio_start|>", "<|audio_end|>",
                "<|word_start|>", "<|word_end|>", "<|features|>", "<|code|>", *OUTETTS_FEATURES]
    names |= {name: 130306 + i for i, name in enumerate(specials)}
    tokenizer = word_tokenizer(_text_vocab(LLAMA3 | names))
    model = LlamaForCausalLM(_config(LlamaConfig, 130306 + 64))
    plist = phrases(seed, codes, codebooks=2)  # compact ids p * codes + code
    to_model = lambda u: [128256 + (t // codes) * 1025 + t % codes for t in u]  # noqa: E731
    corpus = [to_model(u) for u in utterances(seed + 1, plist, 40, 20, codes, codebooks=2)]
    heldout = [to_model(u) for u in utterances(seed + 2, plist, 8, 20, codes, codebooks=2)]
    from echospec.decoder.presets import outetts as preset

    oute = preset(tokenizer)
    prompts = [oute.prompt(tokenizer, "the cat sat")["input_ids"] for _ in corpus]
    _shape_causal_lm(model, prompts, corpus, list(oute.speech.stop_ids), steps, seed)
    return HFReplica(model, tokenizer, corpus, heldout, oute.speech.stop_ids)

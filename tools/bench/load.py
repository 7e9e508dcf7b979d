"""Loading what `bench` decodes with: the model (on its device, in its dtype), the retriever, the speech ids and
the prompts (`decode_inputs`, which the developer benchmarks use too), from a spec's `Inputs`; no policy knob."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..corpus.tts_prompt import META_FILE, TTSMeta, encode_prompt, load_sample_tts
from .harness import DTYPES, BenchError, Prompt
from .spec import Inputs


class Loaded(NamedTuple):
    """What a benchmark decodes with (see `decode_inputs`)."""

    model: object
    scorer: object  # the model in float32 to score log-likelihoods with (None unless `with_scorer`)
    meta: TTSMeta | None  # an echospec TTS checkpoint's, else None
    retriever: object
    speech: object  # the model's SpeechVocab
    prompts: list[Prompt]


def decode_inputs(inputs: Inputs, with_scorer: bool = False) -> Loaded:
    """The model (on `inputs.device`, in its dtype), retriever, speech ids and prompts of `inputs`, with its torch
    threads. `with_scorer` also keeps a float32 copy to score with (a second model in memory outside float32)."""
    import torch

    from ...retriever import Retriever

    torch.set_num_threads(inputs.threads)
    model, meta = load_model(inputs.checkpoint)
    device, dtype = inputs.device, inputs.dtype
    model, scorer = on_device(model, device, dtype) if with_scorer else (placed(model, device, dtype), None)
    retriever = Retriever(inputs.store)
    speech = inputs.speech or speech_vocab(meta, retriever.datastore, model, inputs.speech_offset, inputs.vocab_size,
                                           inputs.stop_ids)
    return Loaded(model, scorer, meta, retriever, speech, load_prompts(inputs.prompts, meta, inputs.limit))


def load_model(checkpoint):
    """(model, echospec TTS meta or None) of a checkpoint folder — an echospec TTS checkpoint or any Hugging Face
    causal LM — or of an already loaded model."""
    if not isinstance(checkpoint, (str, Path)):
        return checkpoint, None
    if (Path(checkpoint) / META_FILE).exists():
        return load_sample_tts(checkpoint)
    from ...decoder.compat import load_causal_lm

    try:
        return load_causal_lm(checkpoint, attn_implementation="sdpa"), None
    except (OSError, ValueError) as e:
        raise BenchError(f"{checkpoint}: not a Hugging Face causal LM checkpoint ({str(e).splitlines()[0]})") from None


def on_device(model, device: str, dtype: str):
    """(the model on `device` in `dtype`, a float32 copy to score log-likelihoods with: the model itself in
    float32)."""
    import copy

    model = placed(model, device, "float32")
    return (model, model) if dtype == "float32" else (placed(copy.deepcopy(model), device, dtype), model)


def placed(model, device: str, dtype: str):
    """The model on `device` in `dtype` (float32, bfloat16 or float16)."""
    import torch

    if dtype not in DTYPES:
        raise BenchError(f"unknown dtype {dtype!r}; choose {', '.join(DTYPES)}")
    try:
        return model.to(device=device, dtype=getattr(torch, dtype))
    except (RuntimeError, AssertionError) as e:
        raise BenchError(f"cannot put the model on {device!r}: {str(e).splitlines()[0]}") from None


def speech_vocab(meta: TTSMeta | None, datastore, model, speech_offset=None, vocab_size=None, stop_ids=()):
    """The model's speech ids: the options given, else an echospec checkpoint's, else the store's (its stop
    ids, else the model's eos); the codebook layout is the store's."""
    from ...decoder import SpeechVocab
    from ...decoder.vocab import eos_ids

    if meta is not None and speech_offset is None and vocab_size is None and not stop_ids:
        return SpeechVocab(meta.speech_offset, meta.speech_vocab_size, (meta.stop_id,))
    stops = tuple(stop_ids) or datastore.stop_ids or eos_ids(getattr(model, "generation_config", None))
    if not stops:
        raise BenchError("no stop id: give --stop-id (the build's), or build the store with it")
    return SpeechVocab(datastore.speech_offset if speech_offset is None else int(speech_offset),
                       datastore.vocab_size if vocab_size is None else int(vocab_size), stops, datastore.codebooks)


def load_prompts(prompts, meta: TTSMeta | None, limit: int | None = None) -> list[Prompt]:
    """Prompts from a JSONL file (or, from Python, a list of dicts of the same fields).

    Each gives `input_ids` (model ids); or `text` + `speaker` for an echospec TTS checkpoint; or
    `inputs_embeds` — a .pt/.npy file (relative to the JSONL file) holding [T, H] or [1, T, H], or from
    Python a tensor, an array or a callable returning one — with `prompt_speech` (the store-local ids of the
    prompt's speech). `speaker`, `id` and `reference_tokens` are optional.
    """
    if isinstance(prompts, (str, Path)):
        try:
            lines = Path(prompts).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise BenchError(f"cannot read prompts file {prompts}: {e.strerror}") from None
        rows, folder = [(f"{prompts}:{n}", line) for n, line in enumerate(lines, 1) if line.strip()], Path(prompts).parent
    else:
        rows, folder = [(f"prompt {n}", row) for n, row in enumerate(prompts, 1)], Path.cwd()
    out = []
    for where, row in rows[:limit]:
        try:
            row = json.loads(row) if isinstance(row, str) else dict(row)
            ids, embeds = None, None
            if "input_ids" in row:
                ids = [int(t) for t in row["input_ids"]]
            elif "inputs_embeds" in row:
                embeds = _embeddings(row["inputs_embeds"], folder)
            elif meta is not None:
                ids = encode_prompt(meta, row["text"], row["speaker"])
            else:
                raise BenchError("no input_ids or inputs_embeds, and the checkpoint has no echospec_tts.json to "
                                 "encode text")
            speech = row.get("prompt_speech")
            out.append(Prompt(str(row.get("id", len(out) + 1)), row.get("speaker"), ids, row.get("reference_tokens"),
                              embeds, None if speech is None else [int(t) for t in speech], row.get("text")))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, OSError) as e:
            raise BenchError(f"{where}: bad prompt ({e})") from None
    if not out:
        raise BenchError(f"{prompts if isinstance(prompts, (str, Path)) else 'prompts'} holds no prompts")
    return out


def _embeddings(value, folder: Path):
    """A prompt's embeddings as a float tensor: from a .pt/.npy path, an array or tensor, or a callable."""
    import torch

    if callable(value):
        value = value()
    if isinstance(value, (str, Path)):
        path = folder / value
        value = torch.load(path, weights_only=True) if path.suffix == ".pt" else np.load(path, allow_pickle=False)
    embeds = torch.as_tensor(value)
    if embeds.dim() not in (2, 3) or not embeds.is_floating_point():
        raise ValueError(f"inputs_embeds must be a float [T, H] or [1, T, H] array, got {embeds.dtype} "
                         f"{tuple(embeds.shape)}")
    return embeds


def native_bfloat16(device: str = "cpu") -> bool:
    """Whether `device` computes in bfloat16 natively: a CUDA GPU that says so, a CPU with AVX512-BF16 or AMX
    (elsewhere torch emulates bfloat16 on the CPU, slower than float32)."""
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags

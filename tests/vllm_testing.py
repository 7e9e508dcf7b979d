"""What the tests on a real vLLM share (tests/retriever/test_vllm.py, tests/decoder/test_vllm_acceptance.py): the
CosyVoice-layout replica, saved as a checkpoint vLLM loads, with a datastore of its speech.

  CosyVoice layout  a Qwen2 whose speech ids come first (0..6560, then the stop ids 6561-6563), as in
                    FunAudioLLM/CosyVoice cosyvoice/vllm/cosyvoice2.py's CosyVoice2ForCausalLM (a Qwen2Model
                    with a speech_token_size + 3 head); its sos, task id and text ids follow here as
                    token ids, where CosyVoice feeds them as prompt embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import replicas
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

COSY_SPEECH, COSY_STOPS = 6561, (6561, 6562, 6563)
COSY_SOS, COSY_TASK, COSY_TEXT = 6564, 6565, 6566  # then 200 text ids


def vllm_sized(cls, vocab: int):
    """replicas' config with 32-dim heads: vLLM's CPU attention kernels take no head_dim below 32."""
    config = replicas._config(cls, vocab)
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    config.head_dim = 32
    return config


def write_corpus(path, utterances: list[list[int]], speakers: list[str]) -> None:
    with open(path, "w") as f:
        for i, (tokens, speaker) in enumerate(zip(utterances, speakers)):
            f.write(json.dumps({"id": f"u{i}", "speaker": speaker, "tokens": tokens}) + "\n")


def cosyvoice_replica(root: Path) -> tuple[str, str, dict[str, list[list[int]]]]:
    """(checkpoint, store, held-out prompts by speaker) under `root`: two speakers with their own phrases, the
    model shaped on their corpus, which the store is built from."""
    from echospec.datastore import build

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(vllm_sized(Qwen2Config, COSY_TEXT + 200))
    corpus, speakers, prompts, heldout = [], [], [], {}
    for s, name in enumerate(("ann", "bob")):
        plist = replicas.phrases(10 + s, 40)
        utts = replicas.utterances(20 + s, plist, 24, 60, 40)
        corpus += utts
        speakers += [name] * len(utts)
        heldout[name] = replicas.utterances(30 + s, plist, 4, 60, 40)
    rng = np.random.default_rng(0)
    for tokens in corpus:
        text = (COSY_TEXT + rng.integers(0, 200, 6)).tolist()
        prompts.append([COSY_SOS, *text, COSY_TASK, *tokens[:20]])
    replicas._shape_causal_lm(model, prompts, [t[20:] for t in corpus], list(COSY_STOPS), 80, 0)
    model.save_pretrained(root / "model")
    write_corpus(root / "corpus.jsonl", corpus, speakers)
    build(root / "corpus.jsonl", root / "store", vocab_size=COSY_SPEECH, stop_ids=COSY_STOPS, faiss=False,
          progress=False)
    asks = {name: [[COSY_SOS, *(COSY_TEXT + rng.integers(0, 200, 6)).tolist(), COSY_TASK, *u[:24]] for u in utts]
            for name, utts in heldout.items()}
    return str(root / "model"), str(root / "store"), asks

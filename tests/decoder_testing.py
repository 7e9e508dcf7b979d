"""Shared pieces of the decoder tests: tiny random models built from configs, and small real proposers."""

from __future__ import annotations

import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from echospec.retriever import CandidateTree
from echospec.retriever.tree import MAX_DEPTH

torch.set_num_threads(1)


def tiny_model(family: str = "llama", attn: str = "sdpa", vocab: int = 64, seed: int = 0, sharpen: float = 1.0):
    """A 2-layer random causal LM; `sharpen` scales the LM head so its distributions are peakier."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, attn_implementation=attn,
                  tie_word_embeddings=False)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if family == "llama" else Qwen2ForCausalLM(Qwen2Config(**common)))
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model.eval()


def prompt_lookup_tree(context, max_nodes=16, max_depth=MAX_DEPTH, ngram_max=3) -> CandidateTree:
    """Prompt lookup as a tree: what followed earlier occurrences of the context's last 1..3 tokens."""
    context = list(map(int, context))
    sequences, weights = [], []
    for n in range(min(ngram_max, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n):
            if context[start:start + n] == tail and start + n < len(context):
                sequences.append(context[start + n:start + n + max_depth])
                weights.append(float(n))
    return CandidateTree.from_sequences(sequences, weights, max_nodes=max_nodes, max_depth=max_depth)


class PromptLookup:
    def propose(self, context, speaker=None, max_nodes=None, max_depth=None):
        return prompt_lookup_tree(context, max_nodes or 16, max_depth or MAX_DEPTH)


class Scripted:
    """Knows the reference continuation; proposes it at a chosen rank among wrong siblings, plus wrong paths."""

    def __init__(self, reference: list[int], prompt_speech: int, vocab: int, depth: int = 5, seed: int = 0,
                 right: bool = True):
        self.reference, self.skip, self.vocab, self.depth = reference, prompt_speech, vocab, depth
        self.rng = np.random.default_rng(seed)
        self.right = right

    def propose(self, context, speaker=None, max_nodes=None, max_depth=None):
        done = len(context) - self.skip
        truth = self.reference[done:done + self.depth]
        wrong = lambda k: [int(t) for t in self.rng.integers(0, self.vocab, k)]  # noqa: E731
        sequences = [wrong(self.depth), truth[:2] + wrong(3), wrong(2)]
        if self.right and truth:
            sequences.insert(int(self.rng.integers(0, len(sequences) + 1)), truth)
        weights = list(self.rng.random(len(sequences)) + 0.1)
        return CandidateTree.from_sequences(sequences, weights, max_nodes=max_nodes or 16, max_depth=max_depth or MAX_DEPTH)


class Wrong:
    """Proposes random paths: what a retriever with nothing relevant in its store does."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def propose(self, context, speaker=None, max_nodes=None, max_depth=None):
        sequences = self.rng.integers(0, self.vocab, (4, max_depth or MAX_DEPTH)).tolist()
        return CandidateTree.from_sequences(sequences, max_nodes=max_nodes or 16, max_depth=max_depth or MAX_DEPTH)


class Raising:
    def propose(self, *args, **kwargs):
        raise RuntimeError("retriever is down")


class Slow(PromptLookup):
    def propose(self, *args, **kwargs):
        time.sleep(0.02)
        return super().propose(*args, **kwargs)


def chi_square_p(observed: np.ndarray, expected: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness-of-fit p-value; cells expected below `min_expected` are pooled into one."""
    small = expected < min_expected
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    half = lambda x: torch.tensor(x / 2, dtype=torch.float64)  # noqa: E731
    return float(torch.special.gammaincc(half(dof), half(stat)))

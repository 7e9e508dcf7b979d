"""Attaching to the TTS models people run, on faithful replicas (tests/replicas.py) with the presets.

CosyVoice 2/3 (own head and speech table, embeddings prompt): ExactGreedy is CosyVoice's own KV-cache loop
with argmax, and ExactSampling with RAS draws from the distribution of that loop with CosyVoice's
ras_sampling. LLaSA, Orpheus, Spark-TTS, OuteTTS: ExactGreedy is `model.generate(do_sample=False)`.
"""

import json
from collections import Counter

import numpy as np
import pytest
import replicas
import torch

from echospec.datastore import build
from echospec.decoder import (DecoderInputError, ExactGreedy, ExactSampling, SpeculativeSession, SpeechVocab,
                              UnsupportedModelError, generate, presets, stream)
from echospec.retriever import Retriever


def make_store(tmp_path, name, corpus, preset, **kwargs):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"id": f"u{i}", "tokens": u}) + "\n" for i, u in enumerate(corpus)))
    build(path, tmp_path / name, per_speaker=False, progress=False, **preset.build_options(), **kwargs)
    return Retriever(tmp_path / name)


def two_sample_p(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """Chi-square test that two samples come from one distribution (cells expected below 5 pooled)."""
    cells = sorted(set(a) | set(b), key=str)
    table = np.array([[a[c] for c in cells], [b[c] for c in cells]], float)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    small = expected.min(0) < min_expected
    table = np.concatenate([table[:, ~small], table[:, small].sum(1, keepdims=True)], 1)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# ---- CosyVoice 2 and 3 ----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[2, 3])
def cosy(request, tmp_path_factory):
    replica = replicas.cosyvoice(request.param)
    preset = presets.COSYVOICE2 if request.param == 2 else presets.COSYVOICE3
    return replica, preset, make_store(tmp_path_factory.mktemp("cosy"), "cosy", replica.corpus, preset)


def cosy_text(preset, rng, n=5):
    text = rng.integers(1000, 5000, n).tolist()
    return text + [151646] if preset is presets.COSYVOICE3 else text  # CosyVoice 3 asks for <|endofprompt|>


def test_cosyvoice_exact_greedy_is_cosyvoices_own_loop(cosy):
    replica, preset, retriever = cosy
    llm = replica.llm
    rng = np.random.default_rng(0)
    tokens = forwards = 0
    for utterance in replica.heldout[:4]:
        text, prompt_text, prompt_speech = cosy_text(preset, rng), rng.integers(1000, 5000, 3).tolist(), utterance[:8]
        prompt = preset.prompt(llm, text, prompt_text, prompt_speech)
        lm_input = replicas.cosyvoice_lm_input(llm, text, prompt_text, prompt_speech)
        assert torch.equal(prompt["inputs_embeds"], lm_input) and prompt["prompt_speech"] == prompt_speech
        min_len, max_len = preset.limits(text_length=len(text))
        assert (min_len, max_len) == (2 * len(text), 20 * len(text))
        reference = replicas.cosyvoice_decode(llm, lm_input, min_len, max_len, replicas.argmax)
        # a pinned cap: "auto" runs whole utterances of plain steps among its first ones (its tries), which
        # would leave the stream nothing to chunk
        options = dict(head=llm.llm_decoder, speech_embedding=llm.speech_embedding, **prompt,
                       **preset.options(text_length=len(text)), max_nodes=8)
        result = generate(llm.llm.model, retriever, ExactGreedy(), **options)
        assert result.speech_tokens == reference
        assert result.tokens[:-1] == reference and result.tokens[-1] in preset.speech.stop_ids  # the stop is kept
        # the bare backbone (Qwen2Model) does as well, and the stream gives the same tokens chunk by chunk
        assert generate(llm.llm.model.model, retriever, ExactGreedy(), **options).tokens == result.tokens
        chunks = list(stream(llm.llm.model, retriever, ExactGreedy(), **options))
        assert sum(chunks, []) == reference and len(chunks) < len(reference)
        tokens, forwards = tokens + len(result.tokens), forwards + result.stats.target_forwards
    assert tokens / forwards > 1.5, tokens / forwards  # drafts were accepted, not just survived


def test_cosyvoice_minimum_length_masks_only_the_first_stop_id():
    # upstream sampling_ids masks weighted_scores[speech_token_size] alone before min_len: another stop id ends
    # speech at once. Made the model's favourite, it stops CosyVoice's loop and echospec's alike.
    replica = replicas.cosyvoice(2, speech_token_size=64, text_vocab=256, steps=5)
    llm, preset = replica.llm, presets.cosyvoice2(64)
    with torch.no_grad():
        llm.llm_decoder.bias[64 + 1] += 100.0
    prompt = preset.prompt(llm, [5, 6, 7], [], replica.heldout[0][:4])
    reference = replicas.cosyvoice_decode(llm, prompt["inputs_embeds"], 6, 60, replicas.argmax)
    options = dict(head=llm.llm_decoder, speech_embedding=llm.speech_embedding, **prompt,
                   **preset.options(text_length=3))
    result = generate(llm.llm.model, None, ExactGreedy(), **options)
    assert reference == result.speech_tokens == [] and result.tokens == [65]
    masked_all = generate(llm.llm.model, None, ExactGreedy(), **{**options, "min_length_stop_ids": None})
    assert len(masked_all.tokens) >= 6  # Hugging Face's rule (every stop id masked) would not stop there


def test_cosyvoice_exact_sampling_with_ras_is_cosyvoices_distribution(tmp_path):
    size = 6
    replica = replicas.cosyvoice(2, speech_token_size=size, text_vocab=256, codes=size, steps=40)
    llm, preset = replica.llm, presets.cosyvoice2(size)
    retriever = make_store(tmp_path, "small", replica.corpus, preset, faiss=False)
    prompt = preset.prompt(llm, [5, 6, 7], [9], replica.heldout[0][:6])
    min_len, max_len, draws = 1, 4, 600
    generator = torch.Generator().manual_seed(0)
    theirs = Counter(tuple(replicas.cosyvoice_decode(llm, prompt["inputs_embeds"], min_len, max_len,
                                                     replicas.cosyvoice_ras(generator))) for _ in range(draws))
    ours, accepted = Counter(), 0
    policy = ExactSampling(preset.sampler)
    for seed in range(draws):
        result = generate(llm.llm.model, retriever, policy, seed=seed, head=llm.llm_decoder,
                          speech_embedding=llm.speech_embedding, speech=preset.speech,
                          min_length_stop_ids=preset.min_length_stop_ids, min_new_tokens=min_len,
                          max_new_tokens=max_len, **prompt)
        ours[tuple(result.speech_tokens)] += 1
        accepted += sum(result.stats.accepted_lengths)
    assert len(theirs) > 5 and two_sample_p(ours, theirs) > 1e-3, (ours.most_common(8), theirs.most_common(8))
    assert accepted > draws / 4  # the trees were used


def test_a_head_and_table_that_do_not_fit_are_named():
    replica = replicas.cosyvoice(2, speech_token_size=64, text_vocab=256, steps=1)
    llm, preset = replica.llm, presets.cosyvoice2(64)
    prompt = preset.prompt(llm, [5, 6, 7], [], [1, 2])
    with pytest.raises(DecoderInputError, match="do not cover the speech ids 0..99"):
        generate(llm.llm.model, None, head=llm.llm_decoder, speech=SpeechVocab(0, 100, (100,)), **prompt)
    with pytest.raises(DecoderInputError, match="stop ids \\[70\\] are outside the head's 67"):
        generate(llm.llm.model, None, head=llm.llm_decoder, speech=SpeechVocab(0, 64, (70,)), **prompt)
    # the trap: the backbone alone runs its text head, whose ids the speech table cannot embed
    with pytest.raises(DecoderInputError, match="falls outside speech_embedding's 67 rows"):
        generate(llm.llm.model, None, speech=preset.speech, speech_embedding=llm.speech_embedding, max_new_tokens=5,
                 **prompt)
    with pytest.raises(UnsupportedModelError, match="head=..."):
        generate(llm.llm.model.model, None, speech=preset.speech, **prompt)
    with pytest.raises(DecoderInputError, match="not stop ids"):
        SpeculativeSession(llm.llm.model, None, head=llm.llm_decoder, speech=preset.speech, min_length_stop_ids=[3])


# ---- the Hugging Face causal LMs ------------------------------------------------------------------------

class Watched:
    """A retriever that records every proposed tree's nodes outside the codebook due at their position."""

    def __init__(self, retriever, codebooks, width):
        self.retriever, self.codebooks, self.width, self.nodes, self.bad = retriever, codebooks, width, 0, 0

    def propose(self, context, **kwargs):
        tree = self.retriever.propose(context, **kwargs)
        due = context[-1] // self.width + tree.depths
        self.nodes += len(tree)
        self.bad += int((tree.tokens // self.width != due % self.codebooks).sum())
        return tree


REPLICAS = {
    "llasa": (replicas.llasa, lambda tok: presets.LLASA, lambda p, tok: p.prompt(tok, "the cat sat")),
    "orpheus": (replicas.orpheus, lambda tok: presets.ORPHEUS,
                lambda p, tok: p.prompt(tok, "the cat sat", voice="tara")),
    "spark-tts": (replicas.spark_tts, presets.spark_tts,
                  lambda p, tok: p.prompt(tok, "the cat sat", global_tokens=range(32))),
    "outetts": (replicas.outetts, presets.outetts, lambda p, tok: p.prompt(tok, "the cat sat")),
}


@pytest.mark.slow  # 40-70 s a replica on a 2-core machine: the whole README test command runs it
@pytest.mark.parametrize("name", sorted(REPLICAS))
def test_exact_greedy_is_model_generate(name, tmp_path):
    make, preset_for, prompt_for = REPLICAS[name]
    replica = make()
    preset = preset_for(replica.tokenizer)
    assert preset.speech.stop_ids == replica.stop_ids
    store = make_store(tmp_path, name, replica.corpus, preset, faiss_options={"flat_max": 1 << 20})
    codebooks, width = preset.speech.codebooks, preset.speech.size // preset.speech.codebooks
    # FAISS answers every context here (faiss_below above n_max), beside the exact stores and prompt lookup
    retriever = Watched(Retriever(store.datastore, faiss_below=99) if codebooks > 1 else store, codebooks, width)
    tokens = forwards = 0
    for utterance in replica.heldout[:3]:
        ids = prompt_for(preset, replica.tokenizer)["input_ids"] + utterance[:2 * codebooks]  # prompt speech
        reference = replica.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=50,
                                           eos_token_id=list(preset.speech.stop_ids), pad_token_id=0,
                                           attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        options = {**preset.options(text_length=3, prompt_length=len(ids)), "max_new_tokens": 50}
        result = generate(replica.model, retriever, ExactGreedy(), input_ids=ids, **options)
        assert result.tokens == reference[0, len(ids):].tolist()
        tokens, forwards = tokens + len(result.tokens), forwards + result.stats.target_forwards
    assert tokens / forwards > 1.3, tokens / forwards
    assert retriever.nodes > 0 and retriever.bad == 0  # no source proposed an id impossible at its position


def test_presets_hold_their_models_rules():
    assert presets.COSYVOICE2.speech == SpeechVocab(0, 6561, (6561, 6562, 6563))
    assert presets.COSYVOICE3.speech.stop_ids == tuple(range(6561, 6761))
    assert presets.COSYVOICE2.min_length_stop_ids == presets.COSYVOICE3.min_length_stop_ids == (6561,)
    assert presets.COSYVOICE2.limits(text_length=10) == (20, 200)
    assert presets.LLASA.limits(prompt_length=48) == (0, 2000) and presets.ORPHEUS.limits() == (0, 1200)
    assert presets.ORPHEUS.speech == SpeechVocab(128266, 28672, (128258,), codebooks=7)
    assert presets.ORPHEUS.speech.codebook(4096 * 3 + 5) == 3
    with pytest.raises(DecoderInputError, match="needs text_length"):
        presets.COSYVOICE2.options()
    options = presets.LLASA.build_options()
    assert options == {"speech_offset": 128264, "vocab_size": 65536, "stop_ids": (128261,), "codebooks": 1,
                       "drop_ids": (128260,)}
    with pytest.raises(DecoderInputError, match="no <\\|c1_0\\|> token"):
        presets.outetts({"<|im_end|>": 5})
    with pytest.raises(DecoderInputError, match="not id"):
        presets.spark_tts({f"<|bicodec_semantic_{i}|>": 10 + i + (i > 7) for i in range(8192)})

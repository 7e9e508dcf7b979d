"""The presets do what each model's own inference code does, checked on the replicas (tests/replicas.py).

Sampling: the distribution every step of the upstream `generate` call samples from (Hugging Face's processed
scores, its defaults included) is the preset sampler's. Prompts: the ids upstream's prompt code gives, written
out here by hand from that code. CosyVoice under vLLM: plain top-k 25 with every stop id masked before the
minimum length. CosyVoice 3's flow input: long silences cut as its pipeline cuts them.
"""

import numpy as np
import pytest
import replicas
import torch

from echospec.decoder import (DecoderInputError, ExactSampling, NodeState, Sampler, SpeechVocab, generate, presets)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def upstream_step_distributions(model, ids: list[int], steps: int, seed: int, **upstream):
    """Each step's distribution in the upstream call `model.generate(ids, **upstream)`: (tokens, probabilities)."""
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=steps, min_new_tokens=steps, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0, **upstream)
    return out.sequences[0, len(ids):].tolist(), [torch.softmax(s[0].float(), dim=-1) for s in out.scores]


def preset_step_distributions(model, sampler, ids: list[int], tokens: list[int], stop_ids) -> list[torch.Tensor]:
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:].float()
    return [sampler.distribution(logits[t], NodeState(ids + tokens[:t], t, tuple(stop_ids), tuple(stop_ids)))
            for t in range(len(tokens))]


def assert_same_distributions(ours, theirs):
    for t, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a > 0, b > 0), f"step {t}: {int((a > 0).sum())} ids possible, upstream {int((b > 0).sum())}"
        assert float((a - b).abs().max()) < 1e-5, t


@pytest.fixture(scope="module")
def flat_llasa():
    return replicas.llasa(steps=3)  # barely shaped: a flat distribution, where top-k 50 decides the support


def test_llasa_samples_as_upstream_generate_with_hf_default_top_k(flat_llasa):
    # finetune/online_finetune/lora_infer_example.py: generate(max_length=2048, eos_token_id=128261,
    # do_sample=True, top_p=1, temperature=0.8, repetition_penalty=1.2); top_k is Hugging Face's default
    replica, preset = flat_llasa, presets.LLASA
    ids = preset.prompt(replica.tokenizer, "the cat sat")["input_ids"] + replica.heldout[0][:4]
    tokens, theirs = upstream_step_distributions(replica.model, ids, 6, 0, eos_token_id=128261, do_sample=True,
                                                 top_p=1, temperature=0.8, repetition_penalty=1.2)
    stop = preset.speech.stop_ids
    assert_same_distributions(preset_step_distributions(replica.model, preset.sampler, ids, tokens, stop), theirs)
    without_top_k = Sampler(temperature=0.8, top_p=1.0, repetition_penalty=1.2)  # the preset as it was
    assert not torch.equal(preset_step_distributions(replica.model, without_top_k, ids, tokens, stop)[0] > 0,
                           theirs[0] > 0)


def test_spark_tts_samples_as_upstream_generate_and_stops_at_the_checkpoints_eos():
    replica = replicas.spark_tts(steps=3)
    preset = presets.spark_tts(replica.tokenizer)
    assert preset.speech.stop_ids == (replica.tokenizer.eos_token_id,) == (151645,)
    ids = preset.prompt(replica.tokenizer, "the cat sat", gender="male", pitch="low", speed="moderate")["input_ids"]
    # cli/SparkTTS.py inference: generate(**model_inputs, max_new_tokens=3000, do_sample=True, top_k=50,
    # top_p=0.95, temperature=0.8), eos from the checkpoint's generation config
    tokens, theirs = upstream_step_distributions(replica.model, ids, 6, 1, do_sample=True, top_k=50, top_p=0.95,
                                                 temperature=0.8)
    ours = preset_step_distributions(replica.model, preset.sampler, ids, tokens, preset.speech.stop_ids)
    assert_same_distributions(ours, theirs)


def test_spark_tts_prompts_for_cloning_and_for_voice_creation():
    tokenizer = replicas.word_tokenizer(replicas._text_vocab(
        replicas.SPARK_IDS | {name: 165900 + i for i, name in enumerate(replicas.SPARK_STYLE)}
        | {f"<|bicodec_global_{i}|>": replicas.SPARK_GLOBAL + i for i in range(4096)}
        | {f"<|bicodec_semantic_{i}|>": replicas.SPARK_SEMANTIC + i for i in range(8192)}), eos="<|im_end|>")
    preset = presets.spark_tts(tokenizer)
    vocab = tokenizer.get_vocab()
    ids = lambda *tokens: [vocab[t] for t in tokens]  # noqa: E731
    words = tokenizer("the cat sat", add_special_tokens=False)["input_ids"]
    # process_prompt_control: gender 0/1, levels very_low..very_high = 0..4
    created = preset.prompt(tokenizer, "the cat sat", gender="female", pitch="very_high", speed="low")["input_ids"]
    assert created == [*ids("<|task_controllable_tts|>", "<|start_content|>"), *words,
                       *ids("<|end_content|>", "<|start_style_label|>", "<|gender_0|>", "<|pitch_label_4|>",
                            "<|speed_label_1|>", "<|end_style_label|>")]
    cloned = preset.prompt(tokenizer, "the cat sat", global_tokens=[3, 4], prompt_text="hello ",
                           prompt_speech=[7])["input_ids"]
    assert cloned == [*ids("<|task_tts|>", "<|start_content|>", "hello", " "), *words,
                      *ids("<|end_content|>", "<|start_global_token|>", "<|bicodec_global_3|>", "<|bicodec_global_4|>",
                           "<|end_global_token|>", "<|start_semantic_token|>", "<|bicodec_semantic_7|>")]
    with pytest.raises(DecoderInputError, match="pitch must be one of"):
        preset.prompt(tokenizer, "hi", gender="male", pitch="loud", speed="low")
    with pytest.raises(DecoderInputError, match="gender must be one of"):
        preset.prompt(tokenizer, "hi", gender="robot", pitch="low", speed="low")
    with pytest.raises(DecoderInputError, match="global_tokens"):
        preset.prompt(tokenizer, "hi")


def test_orpheus_prompt_is_what_vllm_tokenizes_from_upstreams_string():
    # engine_class.py _format_prompt: [128259] + tokenizer("tara: ...") (its <|begin_of_text|> first) +
    # [128009, 128260, 128261, 128257], decoded to a string; vLLM encodes that string with special tokens,
    # putting another <|begin_of_text|> first
    vocab = replicas._text_vocab(replicas.LLAMA3 | replicas.ORPHEUS_CUSTOM)
    tokenizer = replicas.word_tokenizer(vocab, bos="<|begin_of_text|>")
    words = [vocab[w] for w in ["tara", ":", " ", "the", " ", "cat", " ", "sat"]]
    assert presets.ORPHEUS.prompt(tokenizer, "the cat sat", voice="tara")["input_ids"] == [
        128000, 128259, 128000, *words, 128009, 128260, 128261, 128257]
    assert presets.ORPHEUS.prompt(tokenizer, "the cat sat")["input_ids"][:3] == [128000, 128259, 128000]


SPEAKER = {"text": "hello world", "words": [
    {"word": "hello", "duration": 0.2, "c1": [1, 2], "c2": [3, 4],
     "features": {"energy": 10, "spectral_centroid": 15, "pitch": 45}},
    {"word": "world", "duration": 0.33, "c1": [5], "c2": [6], "features": {}}]}


def test_outetts_normalises_the_text_as_upstream():
    # prompt_processor.py text_normalizations, rule by rule (control characters, tabs and newlines too, go first)
    cases = {"Hello  “world” — it ’s fine…  ok !!": "Hello world - it's fine... ok!",
             "a,b.c": "a, b. c", "can 't": "can't", "x--y": "x-y", "«quoted»": "quoted", "why??": "why?",
             "tab\tand\u200bzero width": "tabandzero width", "ｆｕｌｌ": "full"}
    assert {text: presets.outetts_normalise(text) for text in cases} == cases
    assert presets.outetts_prompt_text("a,b") == "<|im_start|>\n<|text_start|>a, b<|text_end|>\n<|audio_start|>\n"
    assert presets.outetts_prompt_text("a,b", normalise=False).count("a,b") == 1


def test_outetts_speaker_prompt_and_its_speech_context():
    speaker = {**SPEAKER, "words": [dict(w) for w in SPEAKER["words"]]}
    text = presets.outetts_prompt_text("the cat sat", speaker)
    # get_completion_prompt: the speaker's text, ". " (it ends no sentence), the text; the last word gets "."
    assert text == ("<|im_start|>\n<|text_start|>hello world. the cat sat<|text_end|>\n<|audio_start|>\n"
                    "<|word_start|>hello<|features|><|t_0.20|><|energy_10|><|spectral_centroid_15|><|pitch_45|>"
                    "<|code|><|c1_1|><|c2_3|><|c1_2|><|c2_4|><|word_end|>\n"
                    "<|word_start|>world.<|features|><|t_0.33|><|energy_0|><|spectral_centroid_0|><|pitch_0|>"
                    "<|code|><|c1_5|><|c2_6|><|word_end|>\n<|word_start|>")
    assert speaker == SPEAKER  # upstream appends the separator to the caller's dict; the preset copies it
    assert presets.outetts_prompt_text("x", {**SPEAKER, "text": "hello world!"}).startswith(
        "<|im_start|>\n<|text_start|>hello world! x<|text_end|>")
    assert "。x" in presets.outetts_prompt_text("x", {**SPEAKER, "text": "你好"})
    replica_tokens = {f"<|c1_{i}|>": 128256 + i for i in range(1025)} | {f"<|c2_{i}|>": 129281 + i for i in range(1025)}
    names = ["<|im_start|>", "<|im_end|>", "<|text_start|>", "<|text_end|>", "<|audio_start|>", "<|audio_end|>",
             "<|word_start|>", "<|word_end|>", "<|features|>", "<|code|>", *replicas.OUTETTS_FEATURES]
    tokenizer = replicas.word_tokenizer(replicas._text_vocab(
        replicas.LLAMA3 | replica_tokens | {name: 130306 + i for i, name in enumerate(names)}))
    preset = presets.outetts(tokenizer)
    ids = preset.prompt(tokenizer, "the cat sat", speaker=SPEAKER)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert preset.speech.to_local(ids) == [1, 1025 + 3, 2, 1025 + 4, 5, 1025 + 6]  # c1/c2 interleaved


def test_outetts_without_ftfy_says_how_to_get_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ftfy", None)
    with pytest.raises(DecoderInputError, match="pip install ftfy"):
        presets.outetts_normalise("x")


# ---- CosyVoice ------------------------------------------------------------------------------------------

def test_cosyvoice_vllm_branch_masks_every_stop_id_and_samples_plain_top_k():
    # llm.py inference_wrapper under vLLM: SamplingParams(top_k=25, stop_token_ids=stop_token_ids,
    # min_tokens=min_len, max_tokens=max_len). A stop id other than speech_token_size, made the favourite,
    # ends speech at once on the Hugging Face branch; vLLM's min_tokens holds it off until min_len.
    size = 64
    replica = replicas.cosyvoice(2, speech_token_size=size, text_vocab=256, steps=5)
    llm = replica.llm
    with torch.no_grad():
        llm.llm_decoder.bias[size + 1] += 30.0
    hf, vllm = presets.cosyvoice2(size), presets.cosyvoice2(size, engine="vllm")
    assert vllm.sampler is presets.COSYVOICE_VLLM_SAMPLER and vllm.sampler.params["top_k"] == 25
    assert vllm.min_length_stop_ids is None and vllm.name == "CosyVoice 2 (vLLM)"
    prompt = vllm.prompt(llm, [5, 6, 7], [], replica.heldout[0][:4])
    min_len, max_len = vllm.limits(text_length=3)
    options = dict(head=llm.llm_decoder, speech_embedding=llm.speech_embedding, **prompt)
    generator = torch.Generator().manual_seed(0)
    for seed in range(3):
        reference = replicas.cosyvoice_decode(llm, prompt["inputs_embeds"], min_len, max_len,
                                              replicas.top_k_draw(generator), masked=vllm.speech.stop_ids)
        ours = generate(llm.llm.model, None, ExactSampling(vllm.sampler), seed=seed, **options,
                        **vllm.options(text_length=3))
        assert len(reference) == len(ours.speech_tokens) == min_len and ours.tokens[-1] == size + 1
        assert generate(llm.llm.model, None, ExactSampling(hf.sampler), seed=seed, **options,
                        **hf.options(text_length=3)).tokens == [size + 1]
    # one step's distribution: the softmax of the 25 largest logits
    with torch.no_grad():
        logits = torch.randn(size + 3, generator=torch.Generator().manual_seed(1))
    values, ids = logits.topk(25)
    expected = torch.zeros_like(logits)
    expected[ids] = values.softmax(dim=0)
    ours = vllm.sampler.distribution(logits, NodeState([], 0, vllm.speech.stop_ids))
    assert float((ours - expected).abs().max()) < 1e-6


def upstream_flow_filter(tokens, silent, max_run=5):
    """cosyvoice/cli/model.py llm_job's loop, token by token."""
    out, run = [], 0
    for i in tokens:
        if i in silent:
            run += 1
            if run > max_run:
                continue
        else:
            run = 0
        out.append(i)
    return out


def test_cosyvoice3_flow_input_drops_long_silences_as_its_pipeline():
    silent = presets.COSYVOICE3_SILENT_TOKENS
    assert presets.COSYVOICE3.flow_input([1, 2, 28, 29, 55, 248, 494, 7, 1, 1]) == [1, 2, 28, 29, 55, 7, 1, 1]
    rng = np.random.default_rng(0)
    for _ in range(50):
        tokens = rng.choice([*silent[:4], 100, 200], size=int(rng.integers(0, 60)), p=[.22] * 4 + [.06] * 2).tolist()
        expected = upstream_flow_filter(tokens, set(silent))
        assert presets.COSYVOICE3.flow_input(tokens) == expected
        cuts = sorted(rng.choice(len(tokens) + 1, size=min(3, len(tokens) + 1), replace=False).tolist())
        chunks = [tokens[a:b] for a, b in zip([0, *cuts], [*cuts, len(tokens)])]
        streamed = list(presets.COSYVOICE3.flow_stream(chunks))
        assert sum(streamed, []) == expected and all(streamed)  # a run counts across chunks; no empty chunk
        assert presets.COSYVOICE2.flow_input(tokens) == tokens  # CosyVoice 2 keeps every token


def test_preset_samplers_by_name():
    assert presets.sampler("llasa") is presets.LLASA.sampler and presets.sampler("ras") is presets.COSYVOICE2.sampler
    assert presets.sampler("cosyvoice-vllm") is presets.cosyvoice3(engine="vllm").sampler
    with pytest.raises(DecoderInputError, match="choose one of ras, cosyvoice"):
        presets.sampler("nope")
    with pytest.raises(DecoderInputError, match="engine must be one of"):
        presets.cosyvoice2(engine="trt")
    assert presets.COSYVOICE3.speech == SpeechVocab(0, 6561, tuple(range(6561, 6761)))

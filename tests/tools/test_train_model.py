"""The TTS model tool: prompt format, a few training steps on a tiny config, and the shipped checkpoint."""

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from echospec.tools.cli import main
from echospec.tools.corpus import SAMPLE_DIR, SAMPLE_MODEL_DIR
from echospec.tools.corpus.train_model import TrainConfig, TrainingDataError, lr_at, train_model
from echospec.tools.corpus.tts_prompt import (
    META_FILE,
    PromptError,
    TTSMeta,
    decode_speech,
    encode_prompt,
    encode_target,
    load_sample_tts,
)
from transformers import AutoModelForCausalLM

TINY = TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup=2, hidden=32, layers=2, heads=2, kv_heads=1, eval_every=3)
shipped = pytest.mark.skipif(not (SAMPLE_MODEL_DIR / META_FILE).is_file(), reason="the sample checkpoint is not in this checkout")


def write_corpus(folder, n=24, vocab=20, with_prompts=True):
    """A corpus where each speaker renders each word as a fixed token pattern (learnable, engine-free)."""
    folder.mkdir(parents=True, exist_ok=True)
    words = ["red", "green", "blue", "gold"]

    def row(i, speaker, text):
        base = 0 if speaker == "a" else 10
        tokens = [base + (len(w) * 3 + k) % 10 for w in text.split() for k in range(4)]
        return {"id": f"u{i}", "speaker": speaker, "text": text, "tokens": tokens}

    rows = [row(i, "ab"[i % 2], f"{words[i % 4]} {words[(i // 4) % 4]}") for i in range(n)]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if with_prompts:
        prompts = [{**row(100 + i, "ab"[i % 2], "Gold red"), "reference_tokens": row(0, "ab"[i % 2], "gold red")["tokens"]} for i in range(2)]
        (folder / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return rows


def test_vocabulary_layout_and_prompt_encoding(tmp_path):
    meta = TTSMeta.build("ab c", ["s2", "s1"], speech_vocab_size=5)
    assert meta.char_to_id == {" ": 2, "a": 3, "b": 4, "c": 5}
    assert meta.speaker_to_id == {"s1": 6, "s2": 7}
    assert (meta.task_id, meta.speech_offset, meta.stop_id, meta.vocab_size) == (8, 9, 14, 15)
    assert encode_prompt(meta, "  AB\n c ", "s2") == [1, 7, 3, 4, 2, 5, 8]
    assert encode_target(meta, [0, 4]) == [9, 13, 14]
    assert decode_speech(meta, [9, 13, 14, 10]) == [0, 4]
    with pytest.raises(PromptError, match="unknown speaker 's3'"):
        encode_prompt(meta, "ab", "s3")
    with pytest.raises(PromptError, match=r"\['z'\] are not in"):
        encode_prompt(meta, "abz", "s1")
    with pytest.raises(PromptError, match="empty text"):
        encode_prompt(meta, "  ", "s1")
    with pytest.raises(PromptError, match="outside 0..4"):
        encode_target(meta, [5])
    with pytest.raises(PromptError, match="not a speech token"):
        decode_speech(meta, [3])
    meta.save(tmp_path)
    assert TTSMeta.load(tmp_path) == meta
    assert json.loads((tmp_path / META_FILE).read_text())["stop_ids"] == [14]
    with pytest.raises(PromptError, match="not found"):
        TTSMeta.load(tmp_path / "nothing")
    (tmp_path / META_FILE).write_text("{")
    with pytest.raises(PromptError, match="not a valid"):
        TTSMeta.load(tmp_path)


def test_the_phoneme_front_end_reads_text_as_espeak_ipa():
    from echospec.tools.corpus.phonemes import to_phonemes
    from echospec.tools.corpus.tts_prompt import text_symbols

    assert to_phonemes("A gift of a flower.") == "ɐ ɡˈɪft əvə flˈaʊɚ."
    assert text_symbols("Ready?  Yes,\nnow!", "phonemes") == to_phonemes("ready? yes, now!")
    assert text_symbols("Ready?  Yes,\nnow!", "characters") == "ready? yes, now!"
    symbols = text_symbols("two words", "phonemes")
    meta = TTSMeta.build(symbols, ["s"], 4, front_end="phonemes")
    assert encode_prompt(meta, "Two  WORDS", "s")[2:-1] == [meta.char_to_id[c] for c in symbols]
    with pytest.raises(PromptError, match="front end 'bpe'"):
        TTSMeta.build("ab", ["s"], 4, front_end="bpe")


def test_learning_rate_anneals_by_steps_or_by_the_clock():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, max_minutes=1.0)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert lr_at(20, cfg, elapsed_s=60.0) == pytest.approx(0.1)  # wall budget spent: fully annealed


def test_a_few_steps_on_a_tiny_config_save_a_loadable_checkpoint(tmp_path):
    write_corpus(tmp_path / "c")
    report = train_model(tmp_path / "c", tmp_path / "m", TINY, progress=False)
    assert report["steps_done"] == 6 and not report["stopped_by_wall_budget"]
    assert report["heldout_utterances"] == 2 and len(report["eval_history"]) == 2
    assert math.isfinite(report["heldout_loss"]) and 0 <= report["heldout_accuracy"] <= 1
    assert {"reference_tokens", "generated_tokens", "stopped", "all_speech"} <= set(report["samples"][0])
    assert (tmp_path / "m" / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    meta = TTSMeta.load(tmp_path / "m")
    assert model.config.vocab_size == meta.vocab_size and meta.speech_vocab_size == 20
    assert model.generation_config.eos_token_id == meta.stop_id
    ids = torch.tensor([encode_prompt(meta, "red blue", "a")])
    assert model(ids).logits.shape == (1, ids.shape[1], meta.vocab_size)
    again = train_model(tmp_path / "c", tmp_path / "m2", TINY, progress=False)
    assert again["heldout_loss"] == report["heldout_loss"]  # deterministic for a seed


def test_training_learns_a_learnable_corpus(tmp_path):
    write_corpus(tmp_path / "c", n=32, with_prompts=False)
    cfg = TrainConfig(steps=120, batch_size=8, lr=1e-2, warmup=10, hidden=32, layers=2, heads=2, kv_heads=1, eval_every=1000)
    report = train_model(tmp_path / "c", tmp_path / "m", cfg, progress=False)
    assert report["heldout_loss"] < 0.5 * math.log(22)  # well under a uniform guess over speech + stop
    assert report["heldout_accuracy"] > 0.5
    assert all(s["all_speech"] for s in report["samples"])  # sampling after <tts> stays in the speech range


def test_bad_corpora_give_clear_errors(tmp_path):
    with pytest.raises(TrainingDataError, match="corpus.jsonl not found"):
        train_model(tmp_path, tmp_path / "m", TINY, progress=False)
    (tmp_path / "corpus.jsonl").write_text('{"id": "x", "speaker": "a", "text": "hi", "tokens": [1, 2]}\n{"text": "no tokens"}\n')
    with pytest.raises(TrainingDataError, match="corpus.jsonl:2"):
        train_model(tmp_path, tmp_path / "m", TINY, progress=False)
    with pytest.raises(ValueError, match="hidden divisible by heads"):
        train_model(tmp_path, tmp_path / "m", TrainConfig(hidden=30, heads=4), progress=False)
    result = CliRunner().invoke(main, ["train-model", str(tmp_path), str(tmp_path / "m"), "--steps", "2"])
    assert result.exit_code != 0 and "corpus.jsonl:2" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("device", ["nonsense", "cuda:99"])
def test_a_device_that_is_not_here_is_refused_in_one_line(tmp_path, device):
    write_corpus(tmp_path / "c")
    result = CliRunner().invoke(main, ["train-model", str(tmp_path / "c"), str(tmp_path / "m"), "--device", device])
    assert result.exit_code == 1 and f"--device {device!r}: not usable here" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "m").exists()


@shipped
def test_shipped_checkpoint_loads_and_encodes_the_shipped_prompts():
    model, meta = load_sample_tts()
    assert AutoModelForCausalLM.from_pretrained(SAMPLE_MODEL_DIR).config.vocab_size == meta.vocab_size
    assert sum(p.numel() for p in model.parameters()) <= 4_000_000
    with np.load(SAMPLE_DIR / "tokenizer.npz") as z:
        assert meta.speech_vocab_size == len(z["centroids"])
    corpus = [json.loads(line) for line in (SAMPLE_DIR / "corpus.jsonl").open()]
    prompts = [json.loads(line) for line in (SAMPLE_DIR / "prompts.jsonl").open()]
    assert set(meta.speakers) == {r["speaker"] for r in corpus}
    corpus_texts = {r["text"] for r in corpus}
    assert not {p["id"] for p in prompts} & {r["id"] for r in corpus}
    for p in prompts:
        assert (p["text"] in corpus_texts) == p["text_in_corpus"]
        ids = encode_prompt(meta, p["text"], p["speaker"])
        assert ids[0] == meta.bos_id and ids[1] == meta.speaker_to_id[p["speaker"]] and ids[-1] == meta.task_id
        assert all(0 <= t < meta.speech_vocab_size for t in p["reference_tokens"])
    with torch.no_grad():
        logits = model(torch.tensor([encode_prompt(meta, prompts[0]["text"], prompts[0]["speaker"])])).logits[0, -1]
    assert meta.speech_offset <= int(logits.argmax()) < meta.stop_id  # after <tts> comes speech

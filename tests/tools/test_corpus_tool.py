"""The corpus tool: mel features, the k-means tokenizer, the corpus plan, and real synthesis when engines exist."""

import json
import shutil
from collections import Counter

import numpy as np
import pytest
from click.testing import CliRunner
from echospec.tools.cli import main
from echospec.tools.corpus.make_corpus import (
    EngineMissingError,
    Speaker,
    check_engines,
    load_sentences,
    make_corpus,
    plan_corpus,
)
from echospec.tools.corpus.speech_tokenizer import (
    MelConfig,
    SpeechTokenizer,
    fit_decoder,
    log_mel,
    mel_filterbank,
    resample,
    train_tokenizer,
)

HAVE_ENGINES = shutil.which("espeak-ng") is not None and shutil.which("flite") is not None
needs_engines = pytest.mark.skipif(not HAVE_ENGINES, reason="espeak-ng and flite not installed (apt-get install espeak-ng flite)")
TWO_VOICES = [Speaker.parse("espeak-ng:en-us+m3"), Speaker.parse("flite:slt")]
TWO_SENTENCES = ["The cat sat on the warm mat.", "A small boat drifted out to sea."]


def test_mel_filterbank_covers_the_band_with_triangles():
    fb = mel_filterbank(MelConfig())
    assert fb.shape == (80, 513)
    assert (fb >= 0).all() and (fb.max(axis=1) > 0.5).all()  # every filter has a peak
    peaks = fb.argmax(axis=1)
    assert (np.diff(peaks) >= 0).all()  # centres rise with the filter index


def test_log_mel_gives_25_frames_per_second():
    cfg = MelConfig()
    assert cfg.frame_rate == 25.0
    wave = np.random.default_rng(0).standard_normal(16000 * 2).astype(np.float32)
    assert log_mel(wave, cfg).shape == (1 + 32000 // 640, 80)
    with pytest.raises(ValueError, match="non-empty mono"):
        log_mel(np.zeros((2, 10), np.float32), cfg)


def test_resample_keeps_a_tone_at_its_frequency():
    t = np.arange(22050) / 22050
    out = resample(np.sin(2 * np.pi * 440 * t), 22050, 16000)
    assert len(out) == 16000
    assert abs(np.abs(np.fft.rfft(out)).argmax() - 440) <= 1  # 1 s clip: bin index == Hz


def test_tokenizer_is_deterministic_and_round_trips(tmp_path):
    rng = np.random.default_rng(1)
    mels = [rng.standard_normal((200, 80)).astype(np.float32) * 3 + 1 for _ in range(3)]
    a, b = train_tokenizer(mels, 16, seed=7), train_tokenizer(mels, 16, seed=7)
    np.testing.assert_array_equal(a.centroids, b.centroids)
    a.save(tmp_path / "tok.npz")
    loaded = SpeechTokenizer.load(tmp_path / "tok.npz")
    assert loaded.vocab_size == 16 and loaded.cfg == MelConfig()
    np.testing.assert_array_equal(loaded.encode_logmel(mels[0]), a.encode_logmel(mels[0]))
    # a frame sitting exactly on a centroid maps back to it
    frames = loaded.tokens_to_logmel([3, 5])
    np.testing.assert_array_equal(loaded.encode_logmel(frames), [3, 5])
    with pytest.raises(ValueError, match="must lie in"):
        loaded.tokens_to_logmel([16])
    with pytest.raises(ValueError, match="too few"):
        train_tokenizer(mels[:1], 100)
    (tmp_path / "bad.npz").write_bytes(b"nope")
    with pytest.raises(ValueError, match="not a speech tokenizer"):
        SpeechTokenizer.load(tmp_path / "bad.npz")


def test_the_context_decoder_hears_neighbours_the_centroids_cannot(tmp_path):
    # frames whose value depends on the previous frame's cell: a centroid alone cannot tell them apart
    rng = np.random.default_rng(2)
    base = rng.standard_normal((8, 80)).astype(np.float32) * 4
    sequences = [rng.integers(0, 8, 300) for _ in range(4)]
    mels = [base[s] + 0.5 * np.roll(base[s], 1, axis=0) + 0.05 * rng.standard_normal((300, 80)).astype(np.float32)
            for s in sequences]
    tokenizer = train_tokenizer(mels[:3], 8, seed=0)
    tokens = [tokenizer.encode_logmel(m) for m in mels]
    decoded = fit_decoder(tokenizer, tokens[:3], mels[:3], context=1)
    held_out_error = {name: float(np.mean((t.tokens_to_logmel(tokens[3])[1:] - mels[3][1:]) ** 2))
                      for name, t in (("centroids", tokenizer), ("decoder", decoded))}
    assert held_out_error["decoder"] < 0.6 * held_out_error["centroids"], held_out_error
    decoded.save(tmp_path / "tok.npz")
    loaded = SpeechTokenizer.load(tmp_path / "tok.npz")
    assert loaded.decoder.shape == (3, 8, 80)
    np.testing.assert_allclose(loaded.tokens_to_logmel(tokens[3]), decoded.tokens_to_logmel(tokens[3]), atol=0.05)
    with pytest.raises(ValueError, match="decoder shape"):
        SpeechTokenizer(tokenizer.centroids, tokenizer.mean, tokenizer.std, tokenizer.cfg, np.zeros((2, 8, 80)))


def test_load_sentences_parses_fortune_files(tmp_path):
    path = tmp_path / "f"
    path.write_text("The early bird catches the worm, they say.\n\t\t-- Someone\n%\nQ: Why did the chicken cross?\nA: To get to the other side.\n%\nNo.\n%\nThe early bird catches the worm, they say.\n")
    assert load_sentences([path]) == ["The early bird catches the worm, they say.", "Why did the chicken cross?", "To get to the other side."]
    with pytest.raises(EngineMissingError, match="apt-get install fortunes"):
        load_sentences([tmp_path / "missing"])


def test_plan_repeats_like_real_traffic_and_holds_prompts_out():
    sentences = [f"sentence number {i} is here." for i in range(400)]
    speakers = [Speaker("espeak-ng", f"en+m{i}") for i in range(1, 5)]
    plan = plan_corpus(sentences, speakers, 100, 20, shared_sentences=30, seed=3)
    assert plan == plan_corpus(sentences, speakers, 100, 20, shared_sentences=30, seed=3)
    corpus = [u for u in plan if not u.held_out]
    prompts = [u for u in plan if u.held_out]
    assert len(corpus) == 400 and len(prompts) == 20
    texts_by_speaker = Counter((u.speaker, u.text) for u in corpus)
    assert max(texts_by_speaker.values()) >= 2  # a speaker repeats a sentence ...
    repeats = [u for u in corpus if texts_by_speaker[(u.speaker, u.text)] >= 2]
    assert len({(u.rate, u.pitch) for u in repeats}) > len(repeats) // 2  # ... with another rate/pitch
    speakers_per_text = Counter(t for _, t in {(u.speaker, u.text) for u in corpus})
    assert max(speakers_per_text.values()) == 4  # some sentences are said by every speaker
    corpus_texts = {u.text for u in corpus}
    assert all((u.text in corpus_texts) == u.text_in_corpus for u in prompts)
    assert sum(u.text_in_corpus for u in prompts) == 10
    assert all(0.85 <= u.rate <= 1.15 and 0.9 <= u.pitch <= 1.1 for u in plan)
    with pytest.raises(ValueError, match="too few"):
        plan_corpus(sentences[:5], speakers, 10, 20)


def test_missing_engine_names_the_apt_package(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(EngineMissingError, match="apt-get install flite"):
        check_engines([Speaker.parse("flite:slt")])
    result = CliRunner().invoke(main, ["make-corpus", "/tmp/never-written", "--speaker", "espeak-ng:en-us"])
    assert result.exit_code != 0
    assert "apt-get install espeak-ng" in result.output and "Traceback" not in result.output


def test_bad_speaker_spec_is_a_clear_cli_error(tmp_path):
    result = CliRunner().invoke(main, ["make-corpus", str(tmp_path / "c"), "--speaker", "festival:kal"])
    assert result.exit_code != 0 and "expected 'espeak-ng:VOICE" in result.output
    assert not (tmp_path / "c").exists()


@needs_engines
def test_unknown_voices_are_reported():
    with pytest.raises(EngineMissingError, match="flite has no voice"):
        check_engines([Speaker.parse("flite:nobody")])
    with pytest.raises(EngineMissingError, match="espeak-ng voice 'zz-nobody'"):
        check_engines([Speaker.parse("espeak-ng:zz-nobody")])


@needs_engines
def test_two_sentences_two_voices_end_to_end(tmp_path):
    kwargs = {"sentences": TWO_SENTENCES, "speakers": TWO_VOICES, "utterances_per_speaker": 2, "n_prompts": 0, "vocab_size": 8, "progress": False}
    manifest = make_corpus(tmp_path / "a", seed=5, **kwargs)
    rows = [json.loads(line) for line in (tmp_path / "a" / "corpus.jsonl").read_text().splitlines()]
    assert len(rows) == manifest["utterances"] == 4
    assert {r["speaker"] for r in rows} == {"espeak-en-us-m3", "flite-slt"}
    assert {r["text"] for r in rows} <= set(TWO_SENTENCES)
    for r in rows:
        assert set(r) == {"id", "speaker", "text", "tokens"}
        assert all(0 <= t < 8 for t in r["tokens"])
        assert 50 <= len(r["tokens"]) <= 300  # ~1-6 s of speech at 50 tokens/s
        assert len(set(r["tokens"])) >= 3  # speech, not one constant frame
    assert (tmp_path / "a" / "prompts.jsonl").read_text() == ""
    assert SpeechTokenizer.load(tmp_path / "a" / "tokenizer.npz").vocab_size == 8
    assert SpeechTokenizer.load(tmp_path / "a" / "tokenizer.npz").decoder.shape == (7, 8, 80)
    make_corpus(tmp_path / "b", seed=5, **kwargs)
    for name in ("corpus.jsonl", "tokenizer.npz"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), f"{name} differs for one seed"

"""Audio out and the scores on it: the stand-in vocoder, WER, SIM and MOS, bench --audio, synthesize."""

import json
import wave

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("faster_whisper", reason="the quality extra")

from echospec.tools.audio.scorers import (  # noqa: E402
    DNSMOSPredictor, Job, PocketSphinxASR, ResemblyzerEncoder, ScoreCache, Setup, WhisperASR, bundled_whisper_path,
    job_key, load_asr, normalise_words, score_all, scoring_pool, word_error_rate)
from echospec.tools.audio.vocoder import KMeansVocoder, read_wav, write_wav  # noqa: E402
from echospec.tools.cli import main  # noqa: E402
from echospec.tools.corpus import SAMPLE_MODEL_DIR, SAMPLE_PROMPTS, SAMPLE_TOKENIZER  # noqa: E402

PROMPTS = [json.loads(line) for line in SAMPLE_PROMPTS.read_text().splitlines()]


@pytest.fixture(scope="module")
def vocoder():
    return KMeansVocoder(SAMPLE_TOKENIZER)


@pytest.fixture(scope="module")
def whisper():
    return WhisperASR()


def test_whisper_hears_the_sample_s_reference_tokens_and_not_the_same_tokens_shuffled(vocoder, whisper):
    rng = np.random.default_rng(0)
    heard, shuffled = [], []
    for prompt in PROMPTS[:10]:
        tokens = prompt["reference_tokens"]
        heard.append(word_error_rate(prompt["text"], whisper(*vocoder(tokens))))
        shuffled.append(word_error_rate(prompt["text"], whisper(*vocoder(rng.permutation(tokens)))))
    assert np.mean(heard) < 0.65 and np.mean(shuffled) > 0.9, (heard, shuffled)  # 54% and 100% when written


def test_whisper_hears_a_clip_the_same_whatever_it_heard_before(vocoder, whisper):
    # babble (reference tokens cut in 12 and shuffled) is where faster-whisper's default temperature fallback
    # samples: 15 of 30 such clips changed their words from one call to the next before the fallback was turned off
    rng = np.random.default_rng(1)
    for prompt in PROMPTS[:6]:
        chunks = np.array_split(np.asarray(prompt["reference_tokens"]), 12)
        rng.shuffle(chunks)
        clip = vocoder(np.concatenate(chunks))
        first = whisper(*clip)
        assert whisper(*clip) == whisper(*clip) == first


def test_wer_compares_words_as_whisper_s_normaliser_writes_them():
    assert normalise_words("Mr. Smith paid twenty-five dollars, didn't he?") == "mister smith paid $25 did not he"
    assert word_error_rate("The colour is grey.", "the color is gray") == 0.0
    assert word_error_rate("It costs ten pounds.", "it costs 10 pounds") == 0.0
    assert word_error_rate("The cat sat down", "the cat") == 0.5
    assert normalise_words("one two three four") == "1234"  # Whisper's normaliser reads a run of numbers as one
    with pytest.raises(ValueError, match="no words"):
        word_error_rate("?!", "anything")


def test_asr_names_a_folder_pocketsphinx_or_a_callable(tmp_path):
    assert isinstance(load_asr(bundled_whisper_path()), WhisperASR)  # a faster-whisper folder, here the bundled one
    assert isinstance(load_asr("pocketsphinx"), PocketSphinxASR)
    assert load_asr("audio_testing:asr_failing_on_short_audio").__name__ == "asr_failing_on_short_audio"
    with pytest.raises(ValueError, match="no model.bin"):
        load_asr(tmp_path)
    result = CliRunner().invoke(main, ["bench", str(SAMPLE_MODEL_DIR), "--store", str(tmp_path), "--prompts",
                                       str(SAMPLE_PROMPTS), "--asr", str(tmp_path)])
    assert result.exit_code == 2 and "no model.bin" in result.output


def test_two_sentences_of_one_voice_are_closer_than_two_voices(vocoder):
    encoder = ResemblyzerEncoder()
    by_speaker = {}
    for prompt in PROMPTS:
        by_speaker.setdefault(prompt["speaker"], []).append(prompt)
    speakers = [s for s, ps in by_speaker.items() if len(ps) >= 2][:3]
    embed = {s: [encoder(*vocoder(p["reference_tokens"])) for p in by_speaker[s][:2]] for s in speakers}

    def cosine(a, b):
        return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))

    same = [cosine(*embed[s]) for s in speakers]
    across = [cosine(embed[a][0], embed[b][0]) for a in speakers for b in speakers if a < b]
    assert np.mean(same) > np.mean(across)
    assert min(same) > 0.5


def test_mos_is_the_same_twice_and_in_range(vocoder):
    mos = DNSMOSPredictor()
    waveform, rate = vocoder(PROMPTS[0]["reference_tokens"])
    first = mos(waveform, rate)
    assert first == mos(waveform, rate) and 1.0 <= first <= 5.0


def test_a_wav_lasts_its_tokens_over_the_token_rate(vocoder, tmp_path):
    for prompt in PROMPTS[:3]:
        tokens = prompt["reference_tokens"]
        path = write_wav(tmp_path / f"{prompt['id']}.wav", *vocoder(tokens))
        waveform, rate = read_wav(path)
        with wave.open(str(path)) as w:
            assert w.getnchannels() == 1 and w.getsampwidth() == 2 and w.getframerate() == 16000
        assert abs(len(waveform) / rate - len(tokens) / vocoder.token_rate) <= 1 / vocoder.token_rate
        assert 0.5 < np.abs(waveform).max() <= 1.0
    assert np.array_equal(vocoder(PROMPTS[0]["reference_tokens"])[0], vocoder(PROMPTS[0]["reference_tokens"])[0])
    with pytest.raises(ValueError, match="speech tokens must lie in"):
        vocoder([0, vocoder.tokenizer.vocab_size])


def test_a_scorer_failing_on_one_utterance_is_reported_for_it_and_the_rest_scored(tmp_path):
    setup = Setup(tokenizer=str(SAMPLE_TOKENIZER), asr="audio_testing:asr_failing_on_short_audio",
                  mos="audio_testing:constant_mos")
    short, long = [75] * 40, max((p["reference_tokens"] for p in PROMPTS), key=len)  # 0.8 s and 6.1 s
    jobs = [Job(job_key(setup, t, "a b", None), tuple(t), "a b") for t in (short, long)]
    cache = ScoreCache(tmp_path / "scores.jsonl")
    with scoring_pool(setup, 2) as pool:
        results = score_all(jobs, pool, cache, progress=False)
    failed, scored = results[jobs[0].key], results[jobs[1].key]
    assert failed["wer"] is None and "too short for this ASR" in failed["errors"]["asr"]
    assert failed["mos"] == 3.0 and failed["sim"] == 1.0  # the other scorers still ran
    assert scored["wer"] == 1.0 and not scored["errors"]
    assert set(ScoreCache(tmp_path / "scores.jsonl").results) == {jobs[0].key, jobs[1].key}  # resumable


def test_each_scoring_worker_runs_one_thread_in_every_blas_it_loaded():
    from threadpoolctl import threadpool_info

    with scoring_pool(Setup(tokenizer=str(SAMPLE_TOKENIZER)), 1) as pool:
        pools = pool.submit(threadpool_info).result()
    assert pools and {p["num_threads"] for p in pools} == {1}, pools


@pytest.mark.slow
def test_bench_audio_writes_one_wav_per_system_and_utterance(tmp_path):
    from echospec.datastore import build
    from echospec.tools.corpus import SAMPLE_CORPUS

    store = tmp_path / "store"
    build(SAMPLE_CORPUS, store, faiss=False, progress=False)
    out, audio = tmp_path / "bench", tmp_path / "audio"
    result = CliRunner().invoke(main, [
        "bench", str(SAMPLE_MODEL_DIR), "--store", str(store), "--prompts", str(SAMPLE_PROMPTS), "--tokenizer",
        str(SAMPLE_TOKENIZER), "--policy", "exact-sampling", "--stores", "general", "--sweep", "tau=20",
        "--limit", "2", "--max-new-tokens", "30", "--out", str(out), "--audio", str(audio)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    for name, rows in report["utterances"].items():
        assert sorted(p.name for p in (audio / name).glob("*.wav")) == sorted(f"{r['prompt']}.wav" for r in rows)
    assert len(list((audio / "reference").glob("*.wav"))) == 2
    systems = report["systems"]
    for name, entry in systems.items():
        assert {"wer", "sim", "mos"} <= set(entry) and entry["mos"]["utterances"] == 2, name
    lossless = systems["exact-sampling/general"]
    assert lossless["identical_to_baseline"] == 1.0
    assert all(lossless[f"{m}_change"]["mean"] == 0.0 for m in ("wer", "sim", "mos"))
    assert report["floor"]["wer"] is not None and "The paper's table" in result.output
    assert "filtered" in report["frontier"]["policies"] and (out / "frontier.png").stat().st_size > 10_000


@pytest.mark.parametrize("option, spec, message", [
    ("--vocoder", "nosuchmodule:decode", "cannot import nosuchmodule"),
    ("--vocoder", "json", "expected module:callable"),
    ("--asr", "json:no_such_function", "has no callable no_such_function"),
    ("--mos", "math:pi", "has no callable pi"),
])
def test_a_bad_scorer_or_vocoder_spec_is_a_usage_error(tmp_path, option, spec, message):
    result = CliRunner().invoke(main, ["bench", str(SAMPLE_MODEL_DIR), "--store", str(tmp_path), "--prompts",
                                       str(SAMPLE_PROMPTS), option, spec])
    assert result.exit_code == 2 and message in result.output and option in result.output
    assert "Traceback" not in result.output


def test_a_bad_sweep_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["bench", str(SAMPLE_MODEL_DIR), "--store", str(tmp_path), "--prompts",
                                       str(SAMPLE_PROMPTS), "--sweep", "gamma=1,2"])
    assert result.exit_code == 2 and "tau, beta, threshold" in result.output
    result = CliRunner().invoke(main, ["bench", str(SAMPLE_MODEL_DIR), "--store", str(tmp_path), "--prompts",
                                       str(SAMPLE_PROMPTS), "--sweep", "tau=ten"])
    assert result.exit_code == 2 and "tau takes numbers" in result.output


def test_synthesize_writes_the_wav_and_prints_its_speed(tmp_path):
    wav_path = tmp_path / "gift.wav"
    result = CliRunner().invoke(main, ["synthesize", "A gift of a flower will soon be made to you.", "--speaker",
                                       "flite-slt", "--wav", str(wav_path), "--max-new-tokens", "60"])
    assert result.exit_code == 0, result.output
    waveform, rate = read_wav(wav_path)
    assert "tokens/forward" in result.output and "ms/token" in result.output
    assert 0 < len(waveform) / rate <= 60 / 50 + 1 / 50  # the sample speaks 50 tokens a second
    result = CliRunner().invoke(main, ["synthesize", "hello", "--speaker", "flite-slt", "--wav", str(wav_path),
                                       "--vocoder", "nosuch:decode"])
    assert result.exit_code == 2 and "cannot import nosuch" in result.output
    result = CliRunner().invoke(main, ["synthesize", "hello", "--speaker", "nobody", "--wav", str(tmp_path / "x.wav")])
    assert result.exit_code == 1 and "unknown speaker" in result.output and not (tmp_path / "x.wav").exists()


def test_the_listening_page_puts_each_prompt_s_reference_and_systems_side_by_side(tmp_path):
    from echospec.tools.audio.listen import listen_page
    from echospec.tools.bench.harness import Prompt

    audio = tmp_path / "audio"
    for folder in ("reference", "ar-sampling", "filtered/speaker"):
        write_wav(audio / folder / "p1.wav", np.zeros(1600), 16000)
    row = {"prompt": "p1", "round": 0, "wer": 0.5, "sim": 0.9, "mos": 2.5, "time_per_token": 0.002,
           "transcript": "a <b>"}
    report = {"systems": {"ar-sampling": {}, "filtered/speaker": {}, "filtered/speaker/tau=20": {}},
              "utterances": {"ar-sampling": [row], "filtered/speaker": [row | {"audio_errors": {"asr": "boom"}}],
                             "filtered/speaker/tau=20": [row]},
              "floor": {"wer": {"mean": 0.9}, "prompts": {"p1": {"wer": 0.9, "mos": 2.6, "transcript": "x"}}}}
    page = listen_page(report, audio, tmp_path / "listen.html", [Prompt("p1", "v", [1], text="Say <this>.")])
    text = page.read_text()
    assert text.count("<audio controls") == 3 and "tau=20" not in text  # sweeps left out by default
    assert 'src="audio/filtered/speaker/p1.wav"' in text and "Say &lt;this&gt;." in text and "a &lt;b&gt;" in text
    assert "WER 50%, SIM 0.900, MOS 2.50, 2.00 ms/token" in text and "failed: asr: boom" in text
    assert "WER 90%, MOS 2.60" in text  # the reference's own scores

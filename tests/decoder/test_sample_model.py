"""The shipped sample checkpoint loads through the decoder's compatibility layer on every transformers release
echospec supports (tests/run_transformers_451.sh runs this on 4.51.3, CosyVoice's pin) and decodes losslessly."""

import json

import torch

from echospec.datastore import build
from echospec.decoder import SpeechVocab, generate
from echospec.retriever import Retriever
from echospec.tools.bench.load import load_model
from echospec.tools.corpus import SAMPLE_CORPUS, SAMPLE_MODEL_DIR, SAMPLE_PROMPTS
from echospec.tools.corpus.tts_prompt import encode_prompt, load_sample_tts


def test_the_shipped_sample_loads_and_its_greedy_output_is_autoregressive_decodings(tmp_path):
    build(SAMPLE_CORPUS, tmp_path / "store", per_speaker=False, faiss=False, progress=False)
    model, meta = load_sample_tts()
    # transformers 4.x took a `dtype` keyword into the config as a torch.dtype, which then could not be written
    assert model.dtype == torch.float32 and json.loads(model.config.to_json_string())["vocab_size"] >= meta.vocab_size
    assert load_sample_tts(dtype=torch.bfloat16)[0].dtype == torch.bfloat16
    bench_model, bench_meta = load_model(SAMPLE_MODEL_DIR)  # what `echospec bench` loads the checkpoint with
    assert bench_meta == meta and not bench_model.training
    speech = SpeechVocab(meta.speech_offset, meta.speech_vocab_size, (meta.stop_id,))
    text = json.loads(SAMPLE_PROMPTS.read_text().splitlines()[0])["text"]
    ids = encode_prompt(meta, text, "flite-slt")
    plain = generate(model, None, input_ids=ids, speech=speech, max_new_tokens=40)
    drafted = generate(model, Retriever(tmp_path / "store"), input_ids=ids, speech=speech, max_new_tokens=40)
    assert len(plain.tokens) > 10 and drafted.tokens == plain.tokens
    assert drafted.stats.target_forwards < plain.stats.target_forwards  # the store's drafts were accepted

"""The sample-model kit: speech tokenizer, corpus synthesis, the TTS prompt format and model training.

    speech_tokenizer  16 kHz audio -> log-mel frames -> k-means speech token ids (and back, for distortion)
    make_corpus       `echospec make-corpus`: a multi-speaker speech-token corpus spoken by espeak-ng and flite
    synth_corpus      a seeded generator of speech-like token corpora, for benchmarks and tests
    tts_prompt        the sample model's vocabulary and prompt format, and its loader
    train_model       `echospec train-model`: a small Llama TTS LM trained on a corpus folder (needs torch)

What they made ships in tools/sample/; the paths below name it.
"""

from pathlib import Path

SAMPLE_DIR = Path(__file__).resolve().parent.parent / "sample"
SAMPLE_CORPUS = SAMPLE_DIR / "corpus.jsonl"
SAMPLE_PROMPTS = SAMPLE_DIR / "prompts.jsonl"
SAMPLE_TOKENIZER = SAMPLE_DIR / "tokenizer.npz"
SAMPLE_MODEL_DIR = SAMPLE_DIR / "model"

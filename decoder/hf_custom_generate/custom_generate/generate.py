"""echospec as a Hugging Face `custom_generate` folder: `model.generate(..., custom_generate=HF_CUSTOM_GENERATE_DIR,
trust_remote_code=True, retriever=...)`. Transformers loads this file and calls `generate(model=..., **arguments)`."""

from echospec.decoder import hf_generate


def generate(model, **arguments):
    return model.generate(custom_generate=hf_generate, **arguments)

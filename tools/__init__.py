"""echospec.tools: everything around the library, one room per job; no core logic lives here.

    cli/         the `echospec` command: one module per command group, each a thin layer over a library call
    bench/       `echospec bench` and `echospec demo`, their quality measures, and the shared benchmark harness
    corpus/      the sample-model kit: speech tokenizer, corpus synthesis, TTS prompt format, model training
    benchmarks/  developer benchmarks, run from a checkout (`python -m echospec.tools.benchmarks.NAME`; not in
                 the wheel), on the shared harness
    sample/      the embedded sample those tools made: corpus, prompts, tokenizer, model (data only)
    commands.py  what every command above shares: one-line errors, missing-extra messages, common options
"""

"""Developer benchmarks: each runs the baseline and echospec side by side in one process, on the shared
harness (tools/bench/harness.py; what it promises: docs/benchmarking.md); the pieces they share but are not
benchmarks themselves live in `support/`
(baseline revisions, proposers, REST's reference, servers, vLLM engines and quality measures; its __init__
indexes them). They are not in the wheel: run them from a checkout (installed with
`pip install -e`) as `python -m echospec.tools.benchmarks.NAME --help`.

    acceptance_share    the acceptance walk's share of decode time per policy, on the sample (any tree's code)
    auto_replay         the adaptive node budget replayed on recorded decode steps against every fixed cap
    bench_ingest        reading a corpus: the batch readers against the per-utterance readers of a baseline
    bench_pages         proposals from a cold page cache: pages read and mapped, what a miss costs
    bench_retriever     the retriever against SuffixDecoding and REST on one corpus
    bench_service       propose over loopback HTTP beside the in-process retriever
    bench_shards        sharded builds against workers (local and Ray), proposals over 1, 4, 16 shards
    continuation_choice which occurrences a proposal reads its continuations from, and what it costs in acceptance
    cost_curves         verify-cost curves (forward time against tree size) by shape, dtype, threads, CPU trick
    gpu_check           one command for a GPU: curves of the sample and a 0.5B shape, the sample's bench there
    grouped_heads       tree decoding with grouped KV heads handed to SDPA uncopied against transformers' copy
    killed_ray_build    how long a Ray build's processes outlive its killed driver (not a speed benchmark)
    retriever_defaults  how the retriever's defaults were chosen (oracle acceptance; not a speed benchmark)
    search_pages        the stream pages a proposal's binary searches and continuations touch, replayed
    vllm_side_by_side   echospec as vLLM's drafter beside vLLM's own drafters

Every results file records its machine with tools/bench/machine.py's `machine()`. The scripts that replay a
proposal part by part (continuation_choice, search_pages, bench_pages) reach the compiled kernels only through
echospec.retriever.replay, the one seam tests/test_layout.py allows outside the retriever.
"""

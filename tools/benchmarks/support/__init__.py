"""What the developer benchmarks stand on, not benchmarks themselves (none has a command of its own to measure
with):

    baselines        bench_shards' builds and sorts side by side with a baseline revision's; bench_ingest's
                     baseline module
    proposers        the proposers bench_retriever compares (echospec's retriever, REST, SuffixDecoding), each
                     timed alone
    rest_reference   REST's retrieval algorithm written plainly: bench_retriever's reference peer
    service_servers  the servers bench_service measures: `echospec serve`, and the HTTP stack alone (the floor)
    vllm_engines     vLLM engines in worker processes, for vllm_side_by_side
    vllm_quality     vllm_side_by_side's quality measures: log-likelihood, log-mel DTW, SIM, WER, MOS on audio
"""

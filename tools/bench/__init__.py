"""`echospec bench` and `echospec demo`, the quality measures they report, and the shared benchmark harness.

    spec        what a bench is asked (BenchSpec: Inputs, Scoring) and SystemName, how its systems are named
    run         bench(): autoregressive, HF prompt lookup and echospec's policies side by side on a TTS
                checkpoint; its systems and its decode loop
    load        what bench decodes with: the model on its device and dtype, retriever, speech ids, prompts
    report      the summary, the table (bench.md), bench.json and the plot bench.png
    tour        demo(): the embedded default end to end (build stores from the sample, query one, bench)
    quality     log-mel DTW distortion and bootstrap intervals
    divergence  where a lossless system's output left its baseline's, and by how much its logits differed
    harness     what every speed comparison under tools/ shares: systems, rotation, warm-up, baselines, plots
"""

from .harness import POLICIES, BenchError, RelaxedSettings
from .report import format_table
from .run import bench
from .spec import BenchSpec, Inputs, Scoring, SystemName
from .tour import demo

__all__ = ["POLICIES", "BenchError", "BenchSpec", "Inputs", "RelaxedSettings", "Scoring", "SystemName", "bench",
           "demo", "format_table"]

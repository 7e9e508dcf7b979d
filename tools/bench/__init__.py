"""`echospec bench` and `echospec demo`, the quality measures they report, and the shared benchmark harness.

    compare   bench(): autoregressive, HF prompt lookup and echospec's policies side by side on a TTS checkpoint
    tour      demo(): the embedded default end to end (build stores from the sample, query one, bench)
    quality   log-mel DTW distortion and bootstrap intervals
    harness   what every speed comparison under tools/ shares: systems, rotation, warm-up, baselines, plots
"""

from .compare import POLICIES, BenchError, bench, format_table
from .tour import demo

__all__ = ["POLICIES", "BenchError", "bench", "demo", "format_table"]

"""GenerationStats: what one utterance's decoding counted and timed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """Counters and timings of one generation; derived rates are properties and appear in `to_dict()`."""

    new_tokens: int = 0
    target_forwards: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # per decode step: tree nodes accepted
    node_budgets: list[int] = field(default_factory=list)  # per decode step: tree nodes verified
    node_caps: list[int] = field(default_factory=list)  # per step that asked its budget: the cap it set
    wall_seconds: float = 0.0
    propose_seconds: float = 0.0
    forward_seconds: float = 0.0
    accept_seconds: float = 0.0  # the policy's walks: its batched pass over the rows and its decisions
    retriever_errors: int = 0
    retriever_timeouts: int = 0
    token_rate: float = 25.0  # speech tokens per second of audio
    budget: dict | None = None  # an adaptive budget's summary when the utterance ended (its caps' rates)

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def time_per_token(self) -> float:
        return self.wall_seconds / max(self.new_tokens, 1)

    @property
    def lm_rtf(self) -> float:
        """LM real-time factor: generation time over the duration of the audio generated."""
        return self.wall_seconds / max(self.new_tokens / self.token_rate, 1e-9)

    @property
    def propose_share(self) -> float:
        return self.propose_seconds / max(self.wall_seconds, 1e-9)

    @property
    def accept_share(self) -> float:
        return self.accept_seconds / max(self.wall_seconds, 1e-9)

    def to_dict(self) -> dict:
        derived = ("tokens_per_forward", "time_per_token", "lm_rtf", "propose_share", "accept_share")
        return asdict(self) | {name: getattr(self, name) for name in derived}

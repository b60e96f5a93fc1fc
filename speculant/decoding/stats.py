"""Generation statistics: one dataclass that the CLI's --stats, the server and the benchmark read."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class Stats:
    method: str = "ar"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of prompt_tokens, reused from a prompt cache (not prefilled)
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    target_forwards: int = 0  # the prefill included
    rounds: int = 0  # speculative decode rounds, one target forward each
    paused_rounds: int = 0  # plain rounds the governor chose (methods/governor.py), also one target forward each
    paused_seconds: float = 0.0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_in_rounds: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    accepted_length_histogram: list[int] = field(default_factory=list)  # [n] = rounds accepting n drafts

    def record_paused(self, seconds: float) -> None:
        self.paused_rounds += 1
        self.target_forwards += 1
        self.paused_seconds += seconds

    def record_round(self, n_drafted: int, n_accepted: int) -> None:
        self.rounds += 1
        self.target_forwards += 1
        self.drafted_tokens += n_drafted
        self.accepted_tokens += n_accepted
        self.emitted_in_rounds += n_accepted + 1
        h = self.accepted_length_histogram
        if len(h) <= n_accepted:
            h.extend([0] * (n_accepted + 1 - len(h)))
        h[n_accepted] += 1

    @property
    def decode_tokens_per_second(self) -> float:
        # The first token comes from the prefill; decode speed counts the tokens after it.
        return (self.generated_tokens - 1) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens emitted per speculative round (tau): 1.0 for plain decoding."""
        return self.emitted_in_rounds / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        del d["emitted_in_rounds"]
        d["decode_tokens_per_second"] = round(self.decode_tokens_per_second, 3)
        d["acceptance_rate"] = round(self.acceptance_rate, 4)
        d["mean_accepted_tokens"] = round(self.mean_accepted_tokens, 4)
        for k in ("prefill_seconds", "decode_seconds", "draft_seconds", "target_seconds", "paused_seconds"):
            d[k] = round(d[k], 4)
        return d

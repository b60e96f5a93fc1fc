"""The speculation governor: plain decoding while speculation is measured to lose.

Speculation pays only when a round's tokens beat its cost in target steps (tau > c + r). Where each
extra verified row costs a good part of a step (2 Zen 4 cores, Q4_K: `speculant bench speed` gives
4 tokens at 2.4x one), the 0.5B draft, prompt lookup and hybrid run at 0.75-0.93x `ar` on Spec-Bench
(`speculant bench methods --dataset specbench --count 2`, stop 21's note), while on HumanEval the same
methods win. Which case a generation is in shows only while it runs, so the governor measures it: a
two-armed bandit on wall time. It starts speculating, then probes plain rounds (k = 0: the target's
next token alone; the drafter is told what was emitted, as after any round), keeps the arm with more
tokens per second for `hold` rounds, probes the other arm again, and doubles `hold` while the choice
stands (up to `max_hold`), so a settled choice costs little exploration.

Exactness: the governor only picks k before a round, from what happened before it; verification
keeps what it keeps for any k. Greedy output is therefore unchanged, and every sampled position keeps
the target's distribution. But the clock moves the random stream: with a fixed seed, two runs could
draw differently. So `auto` governs only where the output cannot depend on the clock (greedy
decoding, and sampling without a seed); `on` governs always (a seeded run then need not repeat
exactly; its distribution is still the target's), `off` never.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SpeculantError
from .sampling import SamplingConfig

GOVERNOR_MODES = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    mode: str = "auto"
    # Rounds of the other arm in a probe, all timed: a draft model catching up on the tokens it skipped
    # is paid at every switch, so it counts against switching (leaving it out measured the same within
    # noise: draft 0.88x vs 0.87x `ar` on a Spec-Bench subset, in different runs; stop 22's note).
    probe: int = 6
    hold: int = 12  # rounds with the faster arm before probing the other again; doubles while it stays faster
    max_hold: int = 192

    def __post_init__(self) -> None:
        if self.mode not in GOVERNOR_MODES:
            raise SpeculantError(f"unknown governor mode {self.mode!r}; choose one of {', '.join(GOVERNOR_MODES)}")
        if self.probe < 1 or self.hold < self.probe or self.max_hold < self.hold:
            raise SpeculantError(f"governor rounds must satisfy 1 <= probe ({self.probe}) <= hold ({self.hold}) "
                                 f"<= max_hold ({self.max_hold})")

    def governs(self, sampling: SamplingConfig) -> bool:
        """Whether the governor may pick k for a generation with these sampling settings."""
        if self.mode == "auto":
            return sampling.greedy or sampling.seed is None
        return self.mode == "on"


@dataclass(slots=True)
class GovernorMemory:
    """What an engine's earlier generations learned: the arm found faster and the latest rate of each.
    A generation starts with that arm; without it, 12 speculative rounds come first, about a quarter
    of a 128-token answer. (Measured gain: none beyond noise on a Spec-Bench subset, stop 22's note.)"""

    best: bool | None = None
    rate: dict[bool, float] | None = None


class Governor:
    """One generation's arm choice. `speculate` is read before a round; `record` after it. With a
    `memory`, it starts from what earlier generations found and leaves what it finds there."""

    def __init__(self, cfg: GovernorConfig, active: bool, memory: GovernorMemory | None = None) -> None:
        self.cfg = cfg
        self.active = active
        self.memory = memory if memory is not None else GovernorMemory()
        self.best = True if self.memory.best is None else self.memory.best  # the arm believed faster
        self.speculate = self.best  # the arm of the current phase
        self.hold = cfg.hold
        self.left = cfg.hold  # rounds left in the current phase
        self.rate: dict[bool, float] = dict(self.memory.rate or {})  # arm -> tokens/s of its latest phase
        self._tokens = 0
        self._seconds = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        """A round of the current arm emitted `tokens` in `seconds` (drafting and verification)."""
        if not self.active:
            return
        self._tokens += tokens
        self._seconds += seconds
        self.left -= 1
        if self.left > 0:
            return
        if self._seconds > 0:
            self.rate[self.speculate] = self._tokens / self._seconds
        if self.speculate != self.best:  # a probe of the other arm ended
            other = self.rate.get(self.best)
            if other is not None and self.rate.get(self.speculate, 0.0) > other:
                self.best, self.hold = self.speculate, self.cfg.hold  # the probe won: switch, re-learn
            else:
                self.hold = min(2 * self.hold, self.cfg.max_hold)
            self._phase(self.best, self.hold)
            self.memory.best, self.memory.rate = self.best, dict(self.rate)
        else:
            self._phase(not self.best, self.cfg.probe)

    def _phase(self, arm: bool, rounds: int) -> None:
        self.speculate, self.left = arm, rounds
        self._tokens, self._seconds = 0, 0.0

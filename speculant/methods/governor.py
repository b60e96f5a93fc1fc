"""The speculation governor: plain decoding while speculation is measured to lose.

Speculation pays only when a round's tokens beat its cost in target steps (tau > c + r). Where each
extra verified row costs a good part of a step (`speculant bench speed`'s cost curve), the 0.5B draft,
prompt lookup and hybrid ran slower than `ar` on Spec-Bench (`speculant bench methods --dataset specbench`;
docs/measurements.md "Governor"), while on HumanEval the same methods win. Which case a generation is in shows only while it runs, so the governor measures it: a
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

from dataclasses import dataclass, field

from ..errors import SpeculantError
from ..exact.sampler import SamplingConfig

GOVERNOR_MODES = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    mode: str = "auto"
    # Rounds of the other arm in a probe, all timed: a draft model catching up on the tokens it skipped
    # is paid at every switch, so it counts against switching (leaving it out measured the same within
    # noise on a Spec-Bench subset).
    probe: int = 6
    hold: int = 12  # rounds with the faster arm before probing the other again; doubles while it stays faster
    # The schedule goes on across an engine's generations (GovernorMemory), so up to 768 rounds (6 answers of
    # 128 tokens) pass between probes of a settled choice. With 192, a probe came every ~1.5 answers, and
    # a probe of a draft model that sat idle pays its prompt prefill first, and on Spec-Bench that kept
    # `draft` below `ar` even with nearly all rounds plain (docs/measurements.md "Governor").
    max_hold: int = 768

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
    """An engine's schedule, carried from one generation to the next: the arm found faster, the latest
    rate of each, and the phase in progress (its arm, its `hold`, the rounds left, what it measured so far).
    A generation goes on where the last one stopped. Restarting each generation with `hold` = 12 probed the
    other arm after 12, 42 and 96 rounds of every 128-token answer, so a draft model that loses still
    drafted some 18 rounds per answer, and its prompt prefill (deferred until its first draft, see
    DraftModelDrafter.start) was paid in every generation."""

    best: bool = True  # the arm believed faster
    speculate: bool = True  # the arm of the current phase
    rate: dict[bool, float] = field(default_factory=dict)  # arm -> tokens/s of its latest phase
    hold: int | None = None  # None: a fresh schedule (the first Governor sets GovernorConfig.hold)
    left: int = 0  # rounds left in the current phase
    tokens: int = 0  # emitted in the current phase so far
    seconds: float = 0.0  # spent in the current phase so far


class Governor:
    """One generation's arm choice. `speculate` is read before a round; `record` after it. The state is
    `memory`'s: a generation goes on with the schedule earlier ones left there."""

    def __init__(self, cfg: GovernorConfig, active: bool, memory: GovernorMemory | None = None) -> None:
        self.cfg = cfg
        self.active = active
        self.memory = memory if memory is not None else GovernorMemory()
        if self.memory.hold is None:  # speculate first, for `hold` rounds
            self.memory.hold = self.memory.left = cfg.hold

    @property
    def speculate(self) -> bool:
        return self.memory.speculate

    def record(self, tokens: int, seconds: float) -> None:
        """A round of the current arm emitted `tokens` in `seconds` (drafting and verification)."""
        if not self.active:
            return
        m = self.memory
        m.tokens += tokens
        m.seconds += seconds
        m.left -= 1
        if m.left > 0:
            return
        if m.seconds > 0:
            m.rate[m.speculate] = m.tokens / m.seconds
        if m.speculate != m.best:  # a probe of the other arm ended
            other = m.rate.get(m.best)
            if other is not None and m.rate.get(m.speculate, 0.0) > other:
                m.best, m.hold = m.speculate, self.cfg.hold  # the probe won: switch, re-learn
            else:
                m.hold = min(2 * m.hold, self.cfg.max_hold)
            self._phase(m.best, m.hold)
        else:
            self._phase(not m.best, self.cfg.probe)

    def _phase(self, arm: bool, rounds: int) -> None:
        m = self.memory
        m.speculate, m.left = arm, rounds
        m.tokens, m.seconds = 0, 0.0

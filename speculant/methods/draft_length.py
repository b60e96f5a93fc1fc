"""How many tokens a chain drafter proposes per round.

- fixed: always `k`.
- heuristic (HF's): start at `k`, +2 after a fully accepted round, -1 otherwise, within [1, max_k].
- auto (the default): heuristic for the first `warmup` timed rounds, then every round the length with
  the most expected tokens per second, from what this generation measured.

Why measure: draft token j adds a token only if the target accepts it and every draft before it,
while it always costs a draft forward (nothing, for a lookup guess) and one more row of the
verification pass. Where extra rows are nearly free (AMX, GPUs) long drafts pay; where a pass of 7
rows costs 1.7 passes of 1 (2 cores of an AVX-512 CPU, the 1.5B Q4_K_M; `scripts/step_timing.py`) the
5th and 6th drafts cost more than they bring on HumanEval, while Spec-Bench math has favoured 6
(`speculant bench methods`; docs/measurements.md "Draft length"). No fixed k suits both, so `auto`
takes for the next round the k in [1, max_k] that maximizes

    E(k) / T(k),   E(k) = 1 + sum_{j <= k} prod_{i <= j} a_i,   T(k) = k * t_draft + t_verify(k + 1),

a_i = the share of i-th drafts accepted among the rounds that reached them (all drafts before them
accepted), t_draft = drafting seconds per drafted token, t_verify(r) = the mean seconds from the end
of drafting to the end of a round whose pass had r rows (lengths not measured yet: interpolated, or
extrapolated along the two longest measured). A block drafter (DFlash: one pass proposes a whole block,
`Drafter.block`) pays the same for any k, so there T(k) = t_round + t_verify(k + 1), t_round = drafting
seconds per round, and max_k defaults to the block's length: pricing its block per token made long drafts
look k times dearer than they are. Measured against the heuristic and a hand-picked max_k=4
(docs/measurements.md "Draft length"), it finds about what the hand-picked length gives, without the hand,
and drafts long where acceptance is high (HumanEval's most predictable prompts) or extra rows are cheap.

Exactness: the length is chosen before a round, from what earlier rounds did. But `auto` reads the
clock, so it measures only where the governor may (`timed`: greedy, or unseeded sampling); elsewhere
it stays heuristic and seeded runs repeat exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpeculantError
from ..models.transformer import ROW_WISE_MAX

# The target scores [pending, *drafts] in one pass. Passes of at most ROW_WISE_MAX tokens compute
# every row as a pass of one token would (row-wise attention, the integer block-format kernel), so greedy
# speculative output stays identical to `ar`; longer passes take the prefill path (batched attention,
# bf16 GEMMs), whose rounding differs. Hence at most ROW_WISE_MAX - 1 drafts per round.
MAX_DRAFT_TOKENS = ROW_WISE_MAX - 1
SCHEDULES = ("auto", "fixed", "heuristic")
DEFAULT_MAX_K = 6  # DraftLengthConfig's docstring
# a_1 as assumed before any round, with the weight of PRIOR_ROUNDS rounds; a_j (j > 1) starts from a_{j-1}
# with the same weight, so lengths not reached yet are neither ruled out nor taken on trust
FIRST_ACCEPTANCE = 0.8
PRIOR_ROUNDS = 4.0


@dataclass(frozen=True, slots=True)
class DraftLengthConfig:
    """How many tokens to draft per round (the module docstring).

    max_k None (unset) means DEFAULT_MAX_K (at least k) for drafters that pay per drafted token, and the
    block's length less one for a block drafter (`limit`). DEFAULT_MAX_K = 6 because verification stops being
    nearly free beyond ~4-6 tokens with 4-bit weights (`speculant bench speed`'s cost curve): on HumanEval
    max_k=6 beat 16 for draft and hybrid (`speculant bench methods`; docs/measurements.md "Draft length").
    """

    k: int = 4
    schedule: str = "auto"
    max_k: int | None = None
    warmup: int = 6  # auto: timed rounds on the heuristic schedule before the measured choice (one pass is noise)

    def __post_init__(self) -> None:
        if self.k < 1 or (self.max_k is not None and self.max_k < self.k):
            raise SpeculantError(f"draft tokens must satisfy 1 <= k ({self.k}) <= max ({self.max_k})")
        if (most := max(self.k, self.max_k or 0)) > MAX_DRAFT_TOKENS:
            raise SpeculantError(
                f"at most {MAX_DRAFT_TOKENS} draft tokens per round are supported (--max-draft-tokens/--draft-tokens, "
                f"got {most}): the target checks 1 + k tokens in one pass, and only passes of up to "
                f"{ROW_WISE_MAX} tokens give bit-for-bit the results of decoding one token at a time, which "
                "keeps greedy output identical to --method ar")
        if self.schedule not in SCHEDULES:
            raise SpeculantError(f"unknown draft-length schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.warmup < 1:
            raise SpeculantError(f"draft-length warmup must be >= 1 round, got {self.warmup}")

    def limit(self, block: int = 0) -> int:
        """The most drafts a round may propose: max_k if set; else the block's length less one for a block
        drafter of `block` rows, DEFAULT_MAX_K otherwise (never below k)."""
        if self.max_k is not None:
            return self.max_k
        return max(self.k, min(block - 1, MAX_DRAFT_TOKENS) if block else DEFAULT_MAX_K)


class DraftLength:
    """The draft length of one generation (state lives here, not in module globals): `update` after every
    round, `observe` after every speculative one."""

    def __init__(self, cfg: DraftLengthConfig, timed: bool = False, block: int = 0) -> None:
        self.cfg = cfg
        self.max_k = cfg.limit(block)
        self.per_round = block > 0  # drafting costs one pass per round, whatever k (Drafter.block)
        self.k = cfg.k
        self.measured = timed and cfg.schedule == "auto"
        # [j] for draft position j = 1..max_k: rounds that reached it (every draft before it accepted), and
        # of those, the rounds that accepted it
        self.reached = [0] * (self.max_k + 1)
        self.kept = [0] * (self.max_k + 1)
        self.verify: dict[int, tuple[float, int]] = {}  # pass rows -> (seconds, rounds)
        self.draft_seconds = 0.0
        self.drafted = 0  # drafted tokens (rounds, for a block drafter)

    def update(self, n_accepted: int, n_drafted: int) -> None:
        if self.cfg.schedule == "fixed" or n_drafted == 0:
            return
        for j in range(1, min(n_drafted, n_accepted + 1) + 1):
            self.reached[j] += 1
            self.kept[j] += j <= n_accepted
        self.k = min(self.k + 2, self.max_k) if n_accepted == n_drafted else max(self.k - 1, 1)

    def observe(self, n_drafted: int, draft_seconds: float, verify_seconds: float) -> None:
        """A speculative round drafted n_drafted tokens in draft_seconds; the target's pass over them (1 +
        n_drafted rows) and the round's bookkeeping took verify_seconds. Chooses the next round's k (auto)."""
        if not self.measured or n_drafted == 0:
            return
        s, n = self.verify.get(n_drafted + 1, (0.0, 0))
        self.verify[n_drafted + 1] = (s + verify_seconds, n + 1)
        self.draft_seconds += draft_seconds
        self.drafted += 1 if self.per_round else n_drafted
        if self.rounds >= self.cfg.warmup:
            self.k = self.best()

    @property
    def rounds(self) -> int:
        """Timed speculative rounds so far."""
        return sum(n for _, n in self.verify.values())

    def acceptance(self) -> list[float]:
        """a_j for j = 1..max_k (index 0 unused): measured, pulled towards a_{j-1} while rounds are few."""
        a, prev = [1.0], FIRST_ACCEPTANCE
        for j in range(1, self.max_k + 1):
            prev = (self.kept[j] + PRIOR_ROUNDS * prev) / (self.reached[j] + PRIOR_ROUNDS)
            a.append(prev)
        return a

    def verify_seconds(self, rows: int) -> float | None:
        """t_verify(rows): measured; between two measured lengths, interpolated; outside them, the nearest one
        measured, extrapolated past the longest along the two longest (never falling); None before any round."""
        return _estimate(self._means(), rows)

    def _means(self) -> dict[int, float]:
        return {r: s / n for r, (s, n) in self.verify.items()}  # pass rows -> mean seconds

    def best(self) -> int:
        """The k in [1, max_k] with the most expected tokens per second, E(k) / T(k) (module docstring)."""
        t_draft = self.draft_seconds / max(self.drafted, 1)  # per token, or per round for a block drafter
        mean = self._means()  # once a round, not once per k
        best, best_rate, tokens, p = self.k, 0.0, 1.0, 1.0
        for k, a in enumerate(self.acceptance()[1:], start=1):
            p *= a
            tokens += p
            t = _estimate(mean, k + 1)
            if t is None:
                continue
            t += t_draft if self.per_round else k * t_draft
            if t > 0 and tokens / t > best_rate:
                best, best_rate = k, tokens / t
        return best


def _estimate(mean: dict[int, float], rows: int) -> float | None:
    """The verification seconds of a pass of `rows` rows from the mean seconds of the lengths measured
    (DraftLength.verify_seconds)."""
    if rows in mean or not mean:
        return mean.get(rows)
    below = sorted(r for r in mean if r < rows)
    above = sorted(r for r in mean if r > rows)
    if not below:
        return mean[above[0]]
    if len(below) == 1 and not above:
        return mean[below[0]]
    r0, r1 = (below[-1], above[0]) if above else (below[-2], below[-1])
    return mean[r0] + max(0.0, (mean[r1] - mean[r0]) / (r1 - r0)) * (rows - r0)

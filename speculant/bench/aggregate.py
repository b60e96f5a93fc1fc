"""From per-generation records to per-method, per-category numbers, and the theory to compare them with.

Definitions (all sums run over the prompts of one group, one method):

- tokens/s: generated tokens / (prefill + decode seconds): end-to-end, what a user waits for. The
  prefill includes the drafter's own prefill (a draft model reads the prompt too).
- decode tokens/s: (generated tokens - 1) / decode seconds: the first token comes from the prefill.
- speedup: tokens/s of the method / tokens/s of the reference (`ar`) on the same prompts.
- acceptance: accepted drafts / drafted tokens. tau: tokens emitted per speculative round (1 for `ar`).
- paused: the share of decode rounds the governor ran plain (methods/governor.py); tau, k, c and r describe
  the speculative rounds alone.
- draft cost c: seconds of drafting per round / seconds of one `ar` target forward.
- Leviathan et al. (2023), with alpha = acceptance, k = drafted tokens per round, c_tok = drafting
  seconds per drafted token / `ar` target seconds per round and r = the method's target seconds per
  round / `ar`'s (the extra cost of scoring k+1 tokens): predicted decode speedup
  (1 - alpha^(k+1)) / ((1 - alpha) (k c_tok + r)).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from ..errors import SpeculantError
from ..decoding.stats import Stats

ALL = "all"


@dataclass(frozen=True, slots=True)
class Record:
    """One generation: a prompt run with one method (ours or a peer's)."""

    prompt_id: str
    category: str
    method: str
    prompt_tokens: int
    generated_tokens: int
    seconds: float  # wall time of the whole generation, prefill included
    prefill_seconds: float | None = None  # None for peers that do not split it
    decode_seconds: float | None = None
    rounds: int = 0
    paused_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    matches_reference: bool | None = None  # token ids equal to the reference method's
    first_mismatch: int | None = None  # index of the first differing token
    peer: bool = False  # a peer's run: never counted as an exactness failure
    cached_prompt_tokens: int = 0  # prompt tokens the conversation's prompt cache held (later turns)

    def __post_init__(self) -> None:
        if self.generated_tokens < 0 or self.seconds < 0:
            raise SpeculantError("a benchmark record needs tokens >= 0 and seconds >= 0")

    @classmethod
    def from_stats(cls, prompt_id: str, category: str, stats: Stats, *, matches_reference: bool | None = None,
                   first_mismatch: int | None = None, method: str | None = None) -> Record:
        return cls(prompt_id, category, method or stats.method, stats.prompt_tokens, stats.generated_tokens,
                   stats.prefill_seconds + stats.decode_seconds, stats.prefill_seconds, stats.decode_seconds,
                   stats.rounds, stats.paused_rounds, stats.drafted_tokens, stats.accepted_tokens,
                   stats.draft_seconds, stats.target_seconds, matches_reference, first_mismatch,
                   cached_prompt_tokens=stats.cached_prompt_tokens)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Aggregate:
    method: str
    category: str
    prompts: int
    generated_tokens: int
    seconds: float
    tokens_per_second: float
    decode_tokens_per_second: float | None
    speedup: float | None
    decode_speedup: float | None
    acceptance_rate: float | None
    tau: float | None
    draft_len: float | None  # k: drafted tokens per round
    draft_cost: float | None  # c per round
    verify_cost: float | None  # r
    predicted_speedup: float | None
    mismatches: int
    tau_model_speedup: float | None = None  # tau / (c + r): measured tokens per round over its cost
    paused: float | None = None  # share of decode rounds the governor ran plain

    def to_dict(self) -> dict[str, object]:
        return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def leviathan_speedup(alpha: float, k: float, c: float, r: float = 1.0) -> float:
    """Expected decode speedup over plain decoding: tokens per round over the round's relative cost."""
    if not 0.0 <= alpha <= 1.0:
        raise SpeculantError(f"acceptance rate must be in [0, 1], got {alpha}")
    if k < 0 or c < 0 or r <= 0:
        raise SpeculantError(f"need k >= 0, c >= 0, r > 0 (got k={k}, c={c}, r={r})")
    tokens = k + 1.0 if alpha == 1.0 else (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)
    return tokens / (k * c + r)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where a and b differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _div(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


@dataclass(slots=True)
class _Sums:
    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    split: bool = True  # every record has a prefill/decode split
    rounds: int = 0
    paused: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    mismatches: int = 0

    def add(self, r: Record) -> None:
        self.prompts += 1
        self.tokens += r.generated_tokens
        self.seconds += r.seconds
        if r.decode_seconds is None:
            self.split = False
        else:
            self.decode_tokens += max(r.generated_tokens - 1, 0)
            self.decode_seconds += r.decode_seconds
        self.rounds += r.rounds
        self.paused += r.paused_rounds
        self.drafted += r.drafted_tokens
        self.accepted += r.accepted_tokens
        self.draft_seconds += r.draft_seconds
        self.target_seconds += r.target_seconds
        self.mismatches += int(r.matches_reference is False and not r.peer)

    @property
    def tps(self) -> float:
        return _div(self.tokens, self.seconds) or 0.0

    @property
    def decode_tps(self) -> float | None:
        return _div(self.decode_tokens, self.decode_seconds) if self.split else None

    @property
    def target_per_round(self) -> float | None:
        return _div(self.target_seconds, self.rounds)


def aggregate(records: Iterable[Record], reference: str = "ar") -> list[Aggregate]:
    """One Aggregate per (category, method), categories in first-seen order, then `all` over everything
    (when there is more than one category)."""
    groups: dict[tuple[str, str], _Sums] = {}
    for r in records:
        for cat in (r.category, ALL):
            groups.setdefault((cat, r.method), _Sums()).add(r)
    if len({cat for cat, _ in groups}) == 2:  # one category: `all` would repeat it
        groups = {key: s for key, s in groups.items() if key[0] != ALL}
    out = []
    for (cat, method), s in groups.items():
        ref = groups.get((cat, reference))
        ref_round = ref.target_per_round if ref is not None else None
        speedup = _div(s.tps, ref.tps) if ref is not None else None
        decode_speedup = None
        if ref is not None and s.decode_tps is not None and ref.decode_tps:
            decode_speedup = s.decode_tps / ref.decode_tps
        speculative = s.drafted > 0
        alpha = _div(s.accepted, s.drafted) if speculative else None
        k = _div(s.drafted, s.rounds) if speculative else None
        draft_cost = verify_cost = predicted = None
        if speculative and ref_round:
            draft_cost = (s.draft_seconds / s.rounds) / ref_round
            verify_cost = (s.target_seconds / s.rounds) / ref_round
            c_tok = (s.draft_seconds / s.drafted) / ref_round
            if alpha is not None and k is not None and verify_cost > 0:
                predicted = leviathan_speedup(alpha, k, c_tok, verify_cost)
        tau = _div(s.accepted + s.rounds, s.rounds) if s.rounds else None
        tau_model = tau / (draft_cost + verify_cost) if tau and verify_cost else None
        out.append(Aggregate(method, cat, s.prompts, s.tokens, s.seconds, s.tps, s.decode_tps, speedup,
                             decode_speedup, alpha, tau, k, draft_cost, verify_cost, predicted, s.mismatches,
                             tau_model, _div(s.paused, s.paused + s.rounds) if speculative else None))
    order = {c: i for i, c in enumerate(dict.fromkeys(cat for cat, _ in groups))}
    order[ALL] = len(order) + 1
    return sorted(out, key=lambda a: order[a.category])

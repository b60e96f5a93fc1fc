"""The drafter protocol every speculative method implements.

A round of decoding: the engine holds the committed tokens and one `pending` token the target has
not scored yet. It asks the drafter to `propose` up to `k` tokens that follow, the target scores
[pending, *draft] in one forward, verification keeps a prefix of the draft plus one token, and the
engine calls `commit` with what was emitted so the drafter can rewind or advance its own state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from ..candidates import Dist
from ..models.transformer import ROW_WISE_MAX

# The target scores [pending, *drafts] in one pass. Passes of at most ROW_WISE_MAX tokens compute
# every row as a pass of one token would (row-wise attention, the integer block-format kernel), so greedy
# speculative output stays identical to `ar`; longer passes take the prefill path (batched attention,
# bf16 GEMMs), whose rounding differs. Hence at most ROW_WISE_MAX - 1 drafts per round.
MAX_DRAFT_TOKENS = ROW_WISE_MAX - 1


@dataclass(slots=True)
class Draft:
    tokens: Tensor  # [k] long, k >= 0
    q: Dist | None  # k rows: the distributions the tokens were drawn from; None = deterministic (one-hot)


class Drafter(Protocol):
    name: str

    def start(self, prompt: list[int]) -> None:
        """Begin a generation whose context is `prompt` (all of it committed, nothing pending)."""

    def propose(self, pending: int, k: int) -> Draft:
        """Up to k tokens predicted to follow the committed context + `pending`."""

    def commit(self, accepted: list[int], n_drafted: int) -> None:
        """`accepted` = [pending, *accepted drafts] became context; the new pending comes next."""


@dataclass(frozen=True, slots=True)
class DraftLengthConfig:
    """How many tokens to draft per round.

    - fixed: always `k`.
    - heuristic: HF's schedule; start at `k`, +2 after a fully accepted round, -1 otherwise,
      within [1, max_k].

    max_k = 6 because verification stops being nearly free beyond ~4-6 tokens with 4-bit weights
    (k=8 costs 1.8x k=1 on the 1.5B target): on HumanEval max_k=6 beat 16 for draft (1.28x vs
    1.20x) and hybrid (1.37x vs 1.33x) in one `speculant bench methods` run.
    """

    k: int = 4
    schedule: str = "heuristic"
    max_k: int = 6

    def __post_init__(self) -> None:
        from ..errors import SpeculantError

        if self.k < 1 or self.max_k < self.k:
            raise SpeculantError(f"draft tokens must satisfy 1 <= k ({self.k}) <= max ({self.max_k})")
        if self.max_k > MAX_DRAFT_TOKENS:
            raise SpeculantError(
                f"at most {MAX_DRAFT_TOKENS} draft tokens per round are supported (--max-draft-tokens/--draft-tokens, "
                f"got {self.max_k}): the target checks 1 + k tokens in one pass, and only passes of up to "
                f"{ROW_WISE_MAX} tokens give bit-for-bit the results of decoding one token at a time, which "
                "keeps greedy output identical to --method ar")
        if self.schedule not in ("fixed", "heuristic"):
            raise SpeculantError(f"unknown draft-length schedule {self.schedule!r}; choose fixed or heuristic")


class DraftLength:
    """The adaptive draft length of one generation (state lives here, not in module globals)."""

    def __init__(self, cfg: DraftLengthConfig) -> None:
        self.cfg = cfg
        self.k = cfg.k

    def update(self, n_accepted: int, n_drafted: int) -> None:
        if self.cfg.schedule == "fixed" or n_drafted == 0:
            return
        if n_accepted == n_drafted:
            self.k = min(self.k + 2, self.cfg.max_k)
        else:
            self.k = max(self.k - 1, 1)

"""Prompt lookup's guess, checked by the draft model in one forward, or sent to the target as is.

Every round, prompt lookup offers the continuation of the longest n-gram match (at least
`min_ngram` tokens) as a guess. A checked round has the draft model score [pending, *guess] in one
forward, keep the leading guess tokens that equal its own greedy choices and draft on from the
first disagreement (DraftModelDrafter.propose). In greedy decoding that proposes what the draft
model would have drafted token by token, for one forward instead of one per agreed token: on
HumanEval the draft's cost per round fell by about an eighth at the same tokens per round
(docs/measurements.md "Hybrid's check").

An unchecked round sends the guess straight to the target: no draft forward, but the guess is
only as good as the copy. Which pays depends on the text: HumanEval favours checking, copy-heavy
long inputs (Spec-Bench summarization, rag) do not (`bench methods --methods ar hybrid
hybrid:check=always`; docs/measurements.md "Hybrid's check"). With `check="auto"`, every round that has a guess also records what the
unchecked guess would have yielded (the length of its prefix that the target then emitted), and
guesses go unchecked while that yield per target step beats the checked rounds' tokens per
(draft + target) cost. The cost of a draft forward is counted in
target steps as the ratio of the two models' weight bytes (decoding streams the weights), so the
choice depends only on tokens, never on timings: seeded runs repeat exactly.

Exactness: whichever way a round goes is decided before it is verified, from the context alone.
Agreed or unchecked guess tokens are a deterministic function of the context, so their proposal
distribution is one-hot; the tokens the model samples carry its q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpeculantError
from .base import Draft, Drafter, DrafterInputs, MethodSpec
from .draft_model import DraftModelDrafter, build as build_draft
from .lookup import LookupDrafter


HYBRID_MIN_NGRAM = 2  # default shortest n-gram a hybrid round takes a lookup draft from (see LookupConfig)
# Default prompt tokens hybrid's draft model reads (DraftModelConfig.context; the window is the last 128 to
# 191): lookup still sees the whole prompt. A short window makes the draft's prefill of long prompts cheap, and
# 128 was faster than the whole prompt, 256 and 64 (`bench methods --methods ar hybrid hybrid:ctx=64
# hybrid:ctx=128`; docs/measurements.md "Hybrid's draft context").
HYBRID_DRAFT_CONTEXT = 128
CHECKS = ("auto", "always", "never")


@dataclass(frozen=True, slots=True)
class HybridConfig:
    # auto: per generation, whichever of checked and unchecked guesses yields more tokens per cost
    # (the module docstring); always: the draft model checks every guess; never: guesses go to the
    # target unchecked and the draft model drafts only where lookup has nothing.
    check: str = "auto"
    # Weight of the running means: each round's values count this much against the history, so the
    # choice follows the text as it changes (a code block inside a prose answer).
    decay: float = 0.8
    # Every `explore`-th guess round is checked even while unchecked ones lead, so the checked
    # side's numbers stay current.
    explore: int = 8

    def __post_init__(self) -> None:
        if self.check not in CHECKS:
            raise SpeculantError(f"unknown hybrid check mode {self.check!r}; choose one of {', '.join(CHECKS)}")
        if not 0.0 < self.decay < 1.0:
            raise SpeculantError(f"hybrid decay must be in (0, 1), got {self.decay}")
        if self.explore < 1:
            raise SpeculantError(f"hybrid explore interval must be >= 1, got {self.explore}")


class _Mean:
    """An exponentially weighted running mean that starts at the first value."""

    __slots__ = ("value", "decay")

    def __init__(self, decay: float) -> None:
        self.value: float | None = None
        self.decay = decay

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.decay * self.value + (1.0 - self.decay) * x


class HybridDrafter(Drafter):
    name = "hybrid"

    def __init__(self, lookup: LookupDrafter, model: DraftModelDrafter, cfg: HybridConfig | None = None,
                 draft_cost: float = 0.0) -> None:
        self.lookup = lookup
        self.model = model
        self.cfg = cfg or HybridConfig()
        self.draft_cost = draft_cost  # one draft forward, in target forwards (weight bytes ratio)
        self._reset()

    def start(self, prompt: list[int]) -> None:
        self.lookup.start(prompt)
        self.model.start(prompt)
        self._reset()

    def ready(self) -> None:
        self.model.ready()

    def finish(self, decoded: list[int]) -> None:
        self.model.finish(decoded)

    def _reset(self) -> None:
        d = self.cfg.decay
        self.unchecked_yield = _Mean(d)  # tokens per round an unchecked guess gives (measured or counterfactual)
        self.checked_rate = _Mean(d)  # tokens per cost of checked guess rounds
        self.guess: list[int] = []  # this round's lookup guess
        self.checked = False
        self.emitted: list[int] = []  # the last guess round's accepted drafts, waiting for the next pending
        self.guess_rounds = 0
        self.round_forwards = 0

    def propose(self, pending: int, k: int) -> Draft:
        self._settle(pending)
        self.guess = self.lookup.guess(pending, k)
        self.checked = bool(self.guess) and self._check()
        if self.guess and not self.checked:
            self.round_forwards = 0
            return Draft(torch.tensor(self.guess, dtype=torch.long, device=self.model.model.device), None)
        forwards = self.model.forwards
        draft = self.model.propose(pending, k, guess=self.guess)
        self.round_forwards = self.model.forwards - forwards
        return draft

    def _check(self) -> bool:
        mode = self.cfg.check
        if mode != "auto":
            return mode == "always"
        self.guess_rounds += 1
        u, c = self.unchecked_yield.value, self.checked_rate.value
        if u is None or c is None or self.guess_rounds % self.cfg.explore == 0:
            return True
        return u < c  # an unchecked round costs one target forward

    def _settle(self, pending: int) -> None:
        """Score the previous guess round now that its last token (`pending`) is known."""
        if not self.guess:
            return
        emitted = self.emitted + [pending]
        n = 0
        while n < len(self.guess) and n < len(emitted) and self.guess[n] == emitted[n]:
            n += 1
        self.unchecked_yield.add(1 + n)  # the matching prefix plus the target's own token
        if self.checked:
            self.checked_rate.add(len(emitted) / (1.0 + self.round_forwards * self.draft_cost))
        self.guess = []

    def commit(self, accepted: list[int], n_drafted: int) -> None:
        self.emitted = accepted[1:]
        self.lookup.commit(accepted, n_drafted)
        self.model.commit(accepted, n_drafted)  # after an unchecked round it feeds them next time


def build(c: DrafterInputs) -> HybridDrafter:
    lookup = LookupDrafter(c.method.lookup.resolved(HYBRID_MIN_NGRAM), c.target.device)
    return HybridDrafter(lookup, build_draft(c, HYBRID_DRAFT_CONTEXT), c.method.hybrid, c.draft_cost)


SPEC = MethodSpec("hybrid", "prompt lookup's guess checked by the draft model, else the draft model's own chain",
                  build=build, loads="draft")

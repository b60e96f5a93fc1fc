"""Prompt lookup decoding: drafts copied from earlier text, no draft model.

If the last n tokens (n = max_ngram .. min_ngram) occurred earlier in the prompt or the generated
text, the tokens that followed their most recent earlier occurrence are proposed. An index from
each n-gram to where its latest occurrence ended is updated as tokens arrive, so both updates and
lookups cost O(max_ngram) per token, independent of the context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpeculantError
from .base import Draft


@dataclass(frozen=True, slots=True)
class LookupConfig:
    max_ngram: int = 3
    # None: the method's default, 1 for `lookup` and 2 for `hybrid`. Hybrid's guesses are checked
    # by the draft model, so a short match costs little: on HumanEval (`bench methods`, 20 prompts)
    # 1 and 2 gave the same 1.46x; 2 keeps the guesses to text that repeats.
    min_ngram: int | None = None

    def __post_init__(self) -> None:
        if self.min_ngram is not None and not 1 <= self.min_ngram <= self.max_ngram:
            raise SpeculantError(f"lookup n-gram sizes need 1 <= min ({self.min_ngram}) <= max ({self.max_ngram})")
        if self.max_ngram < 1:
            raise SpeculantError(f"lookup n-gram size must be >= 1, got {self.max_ngram}")

    def resolved(self, default_min: int) -> "LookupConfig":
        """This config with `min_ngram` set (to `default_min`, at most max_ngram, where it was None)."""
        if self.min_ngram is not None:
            return self
        return LookupConfig(self.max_ngram, min(default_min, self.max_ngram))


class LookupDrafter:
    name = "lookup"

    def __init__(self, cfg: LookupConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg.resolved(1)
        self.device = device
        self.history: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> position right after its latest occurrence

    def start(self, prompt: list[int]) -> None:
        self.history = []
        self.index = {}
        for t in prompt:
            self._push(t)

    def _push(self, token: int) -> None:
        h = self.history
        h.append(token)
        # Register the n-grams ending just before this token: their continuation starts here.
        end = len(h) - 1
        for n in range(self.cfg.min_ngram, self.cfg.max_ngram + 1):
            if end - n >= 0:
                self.index[tuple(h[end - n : end])] = end

    def propose(self, pending: int, k: int) -> Draft:
        return Draft(torch.tensor(self.guess(pending, k), dtype=torch.long, device=self.device), None)

    def guess(self, pending: int, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching n-gram."""
        h = self.history
        h.append(pending)  # looked up as the suffix, removed again below (commit pushes it for good)
        out: list[int] = []
        if k > 0:
            for n in range(self.cfg.max_ngram, self.cfg.min_ngram - 1, -1):
                if len(h) < n:
                    continue
                start = self.index.get(tuple(h[-n:]))
                if start is not None:
                    out = h[start : start + k]
                    break
        h.pop()
        return out

    def commit(self, accepted: list[int], n_drafted: int) -> None:
        for t in accepted:
            self._push(t)

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
from .base import Draft, Drafter, MethodSpec


@dataclass(frozen=True, slots=True)
class LookupConfig:
    max_ngram: int = 3
    # None: the method's default, 1 for `lookup` and 2 for `hybrid`. Hybrid's guesses are checked
    # by the draft model, so a short match costs little: on HumanEval (`bench methods`) 1 and 2 were
    # as fast; 2 keeps the guesses to text that repeats.
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


class NgramIndex:
    """The context so far, and for each of its n-grams (min_ngram..max_ngram tokens) where its latest
    `keep` occurrences ended, updated token by token: a push and a lookup cost O(max_ngram) each,
    whatever the context length. Shared by `lookup` (keep 1) and `lookup_tree` (keep = branches)."""

    def __init__(self, cfg: LookupConfig, keep: int = 1) -> None:  # cfg resolved: min_ngram set
        self.min_n, self.max_n = cfg.min_ngram, cfg.max_ngram
        self.keep = keep
        self.history: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions right after its latest occurrences

    def reset(self, tokens: list[int]) -> None:
        self.history = []
        self.ends = {}
        for t in tokens:
            self.push(t)

    def push(self, token: int) -> None:
        h = self.history
        h.append(token)
        # Register the n-grams ending just before this token: their continuation starts here.
        end = len(h) - 1
        for n in range(self.min_n, self.max_n + 1):
            if end - n >= 0:
                seen = self.ends.setdefault(tuple(h[end - n : end]), [])
                seen.append(end)
                if len(seen) > self.keep:
                    del seen[0]

    def continuations(self, pending: int, length: int, limit: int) -> list[list[int]]:
        """Up to `limit` distinct non-empty continuations (at most `length` tokens) of the context +
        `pending`: the longest matching n-gram first, then its most recent occurrences first."""
        h = self.history
        h.append(pending)  # looked up as the suffix, removed again below (a commit pushes it for good)
        out: list[list[int]] = []
        try:
            for n in range(self.max_n, self.min_n - 1, -1):
                if len(h) < n:
                    continue
                for start in reversed(self.ends.get(tuple(h[-n:]), ())):
                    cont = h[start : start + length]
                    if cont and cont not in out:
                        out.append(cont)
                        if len(out) == limit:
                            return out
            return out
        finally:
            h.pop()


class LookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, cfg: LookupConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg.resolved(1)
        self.device = device
        self.ngrams = NgramIndex(self.cfg)

    @property
    def history(self) -> list[int]:
        return self.ngrams.history

    def start(self, prompt: list[int]) -> None:
        self.ngrams.reset(prompt)

    def propose(self, pending: int, k: int) -> Draft:
        return Draft(torch.tensor(self.guess(pending, k), dtype=torch.long, device=self.device), None)

    def guess(self, pending: int, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching n-gram."""
        found = self.ngrams.continuations(pending, k, 1) if k > 0 else []
        return found[0] if found else []

    def commit(self, accepted: list[int], n_drafted: int) -> None:
        for t in accepted:
            self.ngrams.push(t)


SPEC = MethodSpec("lookup", "prompt lookup: copies what followed the longest earlier match of the context",
                  build=lambda c: LookupDrafter(c.method.lookup, c.target.device))

"""Prompt lookup where the text repeats itself, the draft model everywhere else.

Lookup drafts cost nothing to make, the draft model's cost a forward of the draft per token; so a
round first asks the n-gram index and only runs the draft model when no n-gram of at least
`min_ngram` tokens matches. Exactness is kept because the choice depends on the context alone:
a lookup round's proposal is deterministic (one-hot q) and a model round's carries the draft's q.
The draft model does not see the tokens of lookup rounds when they are committed; it feeds them
in one forward at its next round (its `unfed` tokens).
"""

from __future__ import annotations

import torch

from .base import Draft
from .draft_model import DraftModelDrafter
from .lookup import LookupDrafter


HYBRID_MIN_NGRAM = 2  # default shortest n-gram a hybrid round takes a lookup draft from (see LookupConfig)


class HybridDrafter:
    name = "hybrid"

    def __init__(self, lookup: LookupDrafter, model: DraftModelDrafter) -> None:
        self.lookup = lookup
        self.model = model
        self.model_drafted = False  # whether the round in flight was drafted by the model

    def start(self, prompt: list[int]) -> None:
        self.lookup.start(prompt)
        self.model.start(prompt)

    def propose(self, pending: int, k: int, generator: torch.Generator | None) -> Draft:
        draft = self.lookup.propose(pending, k)
        self.model_drafted = draft.tokens.shape[0] == 0
        return self.model.propose(pending, k, generator) if self.model_drafted else draft

    def commit(self, accepted: list[int], n_drafted: int) -> None:
        self.lookup.commit(accepted, n_drafted)
        # After a lookup round the model fed nothing: n_drafted = 0 tells it to feed `accepted` later.
        self.model.commit(accepted, n_drafted if self.model_drafted else 0)

"""The drafter protocol every speculative method implements.

A round of decoding: the engine holds the committed tokens and one `pending` token the target has
not scored yet. It asks the drafter to `propose` up to `k` tokens that follow, the target scores
[pending, *draft] in one forward, verification keeps a prefix of the draft plus one token, and the
engine calls `commit` with what was emitted so the drafter can rewind or advance its own state.

Tree drafters return a `DraftTree` (speculant/tree.py) instead of a chain `Draft`: the target scores
every node in the same one pass (each node sees only its ancestors) and keeps the longest accepted
root-to-leaf path. Drafters that read the target's hidden states (Medusa, EAGLE) name the layers in
`taps`; the engine then asks the target's forwards for them and hands the drafter the rows of the
tokens that became context (`start(..., hidden=)`, `commit(..., hidden=)`). The Drafter docstrings
below give the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from ..candidates import Dist
from ..models.transformer import FINAL_HIDDEN
from ..tree import DraftTree
from .draft_length import MAX_DRAFT_TOKENS, DraftLength, DraftLengthConfig


@dataclass(slots=True)
class Draft:
    tokens: Tensor  # [k] long, k >= 0
    q: Dist | None  # k rows: the distributions the tokens were drawn from; None = deterministic (one-hot)


# Taps: layer ids 0..n_layers-1 = the residual stream after that block (EAGLE-3's low/mid/high
# features); FINAL_HIDDEN (-1) = the last block's residual after the model's final norm, the
# lm_head's input (Medusa's and EAGLE's "hidden state").
__all__ = ["FINAL_HIDDEN", "MAX_DRAFT_TOKENS", "Draft", "DraftLength", "DraftLengthConfig", "Drafter"]


class Drafter(Protocol):
    """A speculative method. `taps` (a class attribute; () when absent) names the target hidden states
    the drafter reads: layer ids, or FINAL_HIDDEN. With taps, `start` and `commit` get `hidden=`:
    {tap: [R, D] float32} rows of the target's forward for the R tokens that just became context, in
    order. Without taps the engine never passes `hidden=`, so chain drafters keep their signatures."""

    name: str

    def start(self, prompt: list[int]) -> None:
        """Begin a generation whose context is `prompt` (all of it committed, nothing pending).

        Tap drafters are called `start(prompt, hidden=h)`, h[tap] [R, D] for prompt[-R:]: R is
        len(prompt) unless a prompt cache reused a prefix (whose hidden states were never computed
        again); R >= 1. A drafter may defer work on the prompt to its first draft; then it has
        `ready()`, which the engine calls before it times a speculative round. A drafter with a prompt
        cache of its own has `finish(decoded)`, which the engine calls when a generation ends with the
        tokens after the prompt whose keys/values the target's cache kept (prefix.py)."""

    def propose(self, pending: int, k: int) -> Draft | DraftTree:
        """Up to k tokens predicted to follow the committed context + `pending`: a chain (`Draft`) or a
        tree of at most k nodes (`DraftTree`). k is the engine's budget of pass rows (the room left in
        the cache and in max_new_tokens, at most MAX_DRAFT_TOKENS); tree methods set their draft
        length to their node count with the fixed schedule."""

    def commit(self, accepted: list[int], n_drafted: int) -> None:
        """`accepted` = [pending, *accepted drafts] became context; the new pending comes next.

        n_drafted = tokens (nodes) proposed this round. After a `DraftTree` the engine adds
        `path=[node ids of the accepted drafts]` (len(accepted) - 1 of them, root first); tap drafters
        get `hidden=h`, h[tap] [len(accepted), D]: the rows of pending and the accepted path."""

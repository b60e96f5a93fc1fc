"""The drafter protocol every speculative method implements.

A round of decoding: the engine holds the committed tokens and one `pending` token the target has
not scored yet. It asks the drafter to `propose` up to `k` tokens that follow, the target scores
[pending, *draft] in one forward, verification keeps a prefix of the draft plus one token, and the
engine calls `commit` with what was emitted so the drafter can rewind or advance its own state.

Tree drafters return a `DraftTree` (speculant/exact/tree.py) instead of a chain `Draft`: the target scores
every node in the same one pass (each node sees only its ancestors) and keeps the longest accepted
root-to-leaf path. Drafters that read the target's hidden states (Medusa, EAGLE) name the layers in
`taps`; the engine then asks the target's forwards for them and hands the drafter the rows of the
tokens that became context (`start(..., hidden=)`, `commit(..., hidden=)`). The Drafter docstrings
below give the shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ..exact.distributions import Dist, draw
from ..models.formats import QLinear
from ..models.transformer import FINAL_HIDDEN, Transformer
from ..models.prompt_cache import KeptPrefix
from ..exact.sampler import Sampler, top_token
from ..exact.tree import DraftTree
from .draft_length import MAX_DRAFT_TOKENS, DraftLength, DraftLengthConfig



@dataclass(slots=True)
class Draft:
    tokens: Tensor  # [k] long, k >= 0
    q: Dist | None  # k rows: the distributions the tokens were drawn from; None = deterministic (one-hot)


# Taps: layer ids 0..n_layers-1 = the residual stream after that block (EAGLE-3's low/mid/high
# features); FINAL_HIDDEN (-1) = the last block's residual after the model's final norm, the
# lm_head's input (Medusa's and EAGLE's "hidden state").
__all__ = ["FINAL_HIDDEN", "MAX_DRAFT_TOKENS", "Draft", "DraftLength", "DraftLengthConfig", "Drafter", "DrafterInputs",
           "MethodSpec"]


class Drafter:
    """A speculative method's drafter: subclasses implement start, propose and commit; the rest has defaults.

    `taps` names the target hidden states the drafter reads: layer ids, or FINAL_HIDDEN (() = none). With
    taps, `start` and `commit` get `hidden=`: {tap: [R, D] float32} rows of the target's forward for the R
    tokens that just became context, in order. Without taps the engine never passes `hidden=`, so chain
    drafters keep their signatures. `nodes` (tree drafters) is the fixed node count of every round's
    tree; None = chains, whose length the draft-length policy sets. `block` > 0: a block drafter, whose one
    pass of `block` rows proposes up to block - 1 drafts at the same cost whatever k (DFlash), which the
    draft-length policy prices per round (methods/draft_length.py); 0: each draft costs its own work."""

    name: str = ""
    taps: tuple[int, ...] = ()
    nodes: int | None = None
    block: int = 0

    def start(self, prompt: list[int]) -> None:
        """Begin a generation whose context is `prompt` (all of it committed, nothing pending).

        Tap drafters are called `start(prompt, hidden=h)`, h[tap] [R, D] for prompt[-R:]: R is
        len(prompt) unless a prompt cache reused a prefix (whose hidden states were never computed
        again); R >= 1. A drafter may defer work on the prompt to its first draft; then it has
        `ready()`, which the engine calls before it times a speculative round. A drafter with a prompt
        cache of its own has `finish(decoded)`, which the engine calls when a generation ends with the
        tokens after the prompt whose keys/values the target's cache kept (models/prompt_cache.py)."""
        raise NotImplementedError

    def propose(self, pending: int, k: int) -> Draft | DraftTree:
        """Up to k tokens predicted to follow the committed context + `pending`: a chain (`Draft`) or a
        tree of at most k nodes (`DraftTree`). k is the engine's budget of pass rows (the room left in
        the cache and in max_new_tokens, at most MAX_DRAFT_TOKENS); tree methods set their draft
        length to their node count with the fixed schedule."""
        raise NotImplementedError

    def commit(self, accepted: list[int], n_drafted: int) -> None:
        """`accepted` = [pending, *accepted drafts] became context; the new pending comes next.

        n_drafted = tokens (nodes) proposed this round. After a `DraftTree` the engine adds
        `path=[node ids of the accepted drafts]` (len(accepted) - 1 of them, root first); tap drafters
        get `hidden=h`, h[tap] [len(accepted), D]: the rows of pending and the accepted path."""
        raise NotImplementedError

    def ready(self) -> None:
        """Run work deferred from `start` (a prompt prefill) now: before the first timed speculative round."""

    def finish(self, decoded: list[int]) -> None:
        """The generation ended; `decoded` = the tokens after the prompt that the target's cache kept."""


def next_draft(sampler: Sampler, logits: Tensor, prefix: list[int]) -> tuple[Tensor, Dist | None]:
    """A chain drafter's next token from its logits [1, V]: the greedy choice under greedy decoding (q None:
    one-hot), else a draw from the sampler's distribution, returned as its q (the penalties counting `prefix`,
    the tokens drafted before it)."""
    if sampler.generator is None:
        return top_token(sampler.adjust(logits, prefix)), None
    q = sampler.dist(logits, prefix)
    return draw(q, sampler.generator), q


@dataclass(slots=True)
class DrafterInputs:
    """What the engine hands a method's `build` for one generation."""

    method: Any  # the generation's MethodConfig (methods/config.py, which reads this registry: no import back)
    target: Transformer
    sampler: Sampler  # the generation's, shared with the target: draws and penalties count one context
    max_len: int  # cache slots the generation may use
    draft: Transformer | None = None  # the draft model (methods that load one)
    draft_head: QLinear | None = None  # its reduced-vocabulary output layer, None = its own
    draft_cost: float = 0.0  # a draft forward in target forwards (weight bytes)
    kept: KeptPrefix | None = None  # the draft model's prompt cache in a conversation
    target_kept: KeptPrefix | None = None  # the target's (a drafter that reads the target's cache)
    head: Any = None  # the loaded heads or published drafter (head methods)
    head_stats: dict = field(default_factory=dict)  # what training measured of the heads (rank hit rates)


@dataclass(frozen=True, slots=True)
class MethodSpec:
    """One decoding method as the registry (registry.py) lists it."""

    name: str
    summary: str  # one line for the CLI's help and the docs
    build: Callable[[DrafterInputs], Drafter] | None  # None: plain decoding
    # "draft": a draft model (--draft); "heads": heads or a published drafter, loaded once per engine by `load`
    loads: str = ""
    tree: bool = False  # verifies a tree of candidates per round
    # the 'name:key=value' keys it takes (methods/config.py): "chain" (draft length, lookup, draft model), "heads"
    # (a tree head's nodes/depth/topk and folder), "drafter" (a chain drafter's draft length and folder)
    options: str = "chain"
    # (target LoadedModel, MethodConfig) -> (the loaded heads or drafter, what training measured of it)
    load: Callable[[Any, Any], tuple[Any, dict]] | None = None
    # the target model -> why this method cannot run on it, or None (e.g. mtp on a model without an MTP layer)
    unfit: Callable[[Any], str | None] | None = None

    def why_not(self, model) -> str | None:
        """Why this method cannot run on target `model` (its Transformer), or None."""
        if self.tree and model.recurrent:  # a tree's nodes would each need their own path's recurrent state
            return "it drafts trees, which a model with linear-attention layers (Qwen3.5) cannot verify"
        return self.unfit(model) if self.unfit is not None else None

    def __post_init__(self) -> None:
        if (self.loads not in ("", "draft", "heads") or self.options not in ("chain", "heads", "drafter")
                or (self.loads == "heads") != (self.load is not None)):
            raise ValueError(f"method {self.name}: loads {self.loads!r} / options {self.options!r} unknown")

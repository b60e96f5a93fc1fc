"""Which cache slots each query row of a pass attends to: the pass's layout (row-wise or one SDPA mask), a tree
row's ancestors, a sliding-window layer's last `window` positions."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import SpeculantError


def tree_keys(mask: Tensor, start: int, device: torch.device) -> list[Tensor]:
    """The cache slots each row of a tree pass attends to (the committed ones, then its ancestors' rows,
    in order), from its [S, S] mask: one read of the mask and one copy to `device` for the whole pass."""
    m = mask.to("cpu", torch.bool)
    rows = [torch.cat([torch.arange(start), start + r.nonzero()[:, 0]]) for r in m]
    return list(torch.cat(rows).to(device).split([len(r) for r in rows]))


def window_keys(window: int, mask: Tensor | None, row_wise: bool, start: int,
                positions: Tensor) -> tuple[Tensor | None, list | None]:
    """(mask, keys) of a sliding-window layer for this pass: a key is seen by a query iff the causal or
    tree mask lets it and its position is within `window` of the query's (transformers' and llama.cpp's
    rule: q - k < window). Committed slot j holds position j. Row-wise: the slots each row attends to
    (slices for a causal pass, as full layers use; the same slots in the same order for a tree row as for
    the chain that ends at it); else the SDPA mask [1, 1, S, L+S] with the window applied. The full cache is
    kept, so a rejected draft never costs a key that a later position needs."""
    pos = positions.tolist()
    if row_wise and mask is None and pos == list(range(start, start + len(pos))):
        return None, [slice(max(0, p - window + 1), p + 1) for p in pos]
    slot_pos = torch.cat([torch.arange(start, device=positions.device), positions])
    if row_wise:
        if mask is None:
            keys = [torch.arange(start + i + 1, device=positions.device) for i in range(len(pos))]
        else:
            keys = tree_keys(mask, start, positions.device)
        return mask, [idx[slot_pos[idx] > p - window] for idx, p in zip(keys, pos)]
    near = positions[:, None] - slot_pos[None, :] < window  # [S, L+S]
    return mask & near[None, None], None


def pass_layout(S: int, start: int, end: int, positions: Tensor | None, mask: Tensor | None,
                device: torch.device, row_wise: bool) -> tuple[Tensor, Tensor | None, bool]:
    """(positions, mask, tree) of a pass of S tokens at cache slots start..end-1 on the route that
    `Transformer.route` chose: row-wise passes ("fused", "rows") keep a tree's [S, S] mask (or none); the
    others get the [1, 1, S, L+S] mask over every slot that SDPA takes."""
    if positions is None:
        positions = torch.arange(start, end, device=device)
    tree = mask is not None and tuple(mask.shape) == (S, S)
    if mask is not None and not tree and tuple(mask.shape) != (S, end):
        raise SpeculantError(f"attention mask must be [{S}, {S}] (over the pass) or [{S}, {end}] (over every "
                             f"slot), got {list(mask.shape)}")
    if not row_wise:
        if mask is None:  # causal over the cache: new token i sees slots [0, start + i]
            mask = torch.ones(S, end, dtype=torch.bool, device=device).tril_(start)
        elif tree:  # the committed slots, then the tree's own rows
            mask = torch.cat([mask.new_ones(S, start), mask], 1)
        mask = mask.to(torch.bool)[None, None]  # [1, 1, S, L+S]
    return positions, mask, tree

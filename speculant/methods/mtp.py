"""`--method mtp`: the target's own multi-token-prediction layer (Qwen3.5's `mtp.*`, models/qwen35_mtp.py) drafts a
chain, as llama.cpp's `--spec-type draft-mtp` does.

State: the MTP layer's KV cache holds one row per committed position p, built from (t_p, h_{p-1}) with the
target's hidden state h (FINAL_HIDDEN, tapped from every target forward; zeros before the first token). A row
waits until its token is known: `start` queues the prompt's rows, `commit` those of [pending, *accepted] (their
hidden states are the previous positions'), and the last hidden state waits for the next pending token.

A round (`propose`): the MTP cache drops last round's draft rows, one pass over the queued rows and (pending,
h_last) gives the first draft's logits; each further draft is one row (the token just drafted, the MTP's own
output h'). Drafts are drawn through the engine's sampler (greedy: its top token; sampling: drawn from q,
returned for verification), so the output is exactly the target's either way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..exact.distributions import Dist
from ..errors import SpeculantError
from ..models.transformer import FINAL_HIDDEN
from ..exact.sampler import Sampler
from .base import Draft, Drafter, MethodSpec, next_draft


class MTPDrafter(Drafter):
    name = "mtp"
    taps = (FINAL_HIDDEN,)

    def __init__(self, model, sampler: Sampler, max_len: int) -> None:
        mtp = getattr(model, "mtp", None)
        if mtp is None:
            raise SpeculantError("--method mtp needs a model that ships a multi-token-prediction layer (Qwen3.5's "
                                 "mtp.* tensors); this one has none: choose another method")
        self.model, self.mtp, self.sampler = model, mtp, sampler
        self.cache = mtp.new_cache(model, max_len + 1)
        self.fed = 0  # committed rows in the MTP cache
        self._tokens: list[int] = []  # queued rows' tokens, positions fed.. (their hidden: _hidden)
        self._hidden: list[Tensor] = []
        self._last: Tensor | None = None  # the newest target hidden state [1, D], whose next token is pending

    def start(self, prompt: list[int], hidden: dict[int, Tensor] | None = None) -> None:
        h = hidden[FINAL_HIDDEN].float()
        if h.shape[0] != len(prompt):
            raise SpeculantError("--method mtp needs the hidden states of the whole prompt (no reused prefix)")
        self.cache.rollback(0)
        self.fed = 0
        self._tokens = list(prompt)
        self._hidden = [torch.zeros_like(h[:1])] + list(h[:-1].split(1))
        self._last = h[-1:]

    def commit(self, accepted: list[int], n_drafted: int, hidden: dict[int, Tensor] | None = None) -> None:
        if self._last is not None:  # no round since the last commit: the pending token pairs with it now
            self._tokens.append(accepted[0])
            self._hidden.append(self._last)
        h = hidden[FINAL_HIDDEN].float()  # rows of [pending, *accepted drafts]
        self._tokens += accepted[1:]
        self._hidden += list(h[:-1].split(1))
        self._last = h[-1:]

    def propose(self, pending: int, k: int) -> Draft:
        sampler = self.sampler
        self.cache.rollback(self.fed)
        tokens = torch.tensor(self._tokens + [pending], device=self.model.device)
        hidden = torch.cat(self._hidden + [self._last])
        self._tokens, self._hidden, self._last = [], [], None
        k = max(0, min(k, self.cache.max_len - self.cache.length - tokens.shape[0]))
        h, logits = self.mtp(self.model, tokens, hidden, self.cache)
        self.fed = self.cache.length
        h, logits = h[-1:], logits[-1:]
        drafts: list[Tensor] = []
        qs: list[Dist] = []
        prefix: list[int] = []
        while len(drafts) < k:
            tok, q = next_draft(sampler, logits, prefix)  # [1]
            if q is not None:
                qs.append(q)
            drafts.append(tok)
            if sampler.penalized:
                prefix.append(int(tok))
            if len(drafts) < k:
                h, logits = self.mtp(self.model, tok.reshape(1), h, self.cache)
        draft = torch.cat(drafts) if drafts else torch.zeros(0, dtype=torch.long, device=self.model.device)
        return Draft(draft, Dist.cat(qs) if qs else None)


SPEC = MethodSpec("mtp", "the target's own multi-token-prediction layer (Qwen3.5's MTP) drafts a chain",
                  build=lambda c: MTPDrafter(c.target, c.sampler, c.max_len),
                  unfit=lambda model: None if model.mtp is not None else "the model ships no multi-token-prediction "
                  "layer (Qwen3.5's mtp.* tensors)")

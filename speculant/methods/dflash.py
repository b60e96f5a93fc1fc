"""DFlash drafting: a block of drafts from one non-causal pass of a small drafter over the target's features.

State: the drafter's keys/values of the context, one row per committed position, built from the target's
hidden states at the drafter's layers (heads/dflash.py). They arrive through taps: `start` gets the
prompt's rows, `commit` those of [pending, *accepted]: committed tokens only, so a partly accepted
round leaves nothing to roll back; rows wait until the next draft, which adds them in one pass.

A round (`propose`): the block [pending, MASK x (b-1)] at positions P..P+b-1 (P = pending's position)
in one pass; the drafts are the target's output layer over rows 1..k of it. The block is the drafter's
trained size b (fewer rows only where the context ends), whatever k the engine's draft-length policy
asks for: the rows are computed together, so k only says how many to propose. Greedy: the top token
of each row (after logit bias and penalties, row j counting drafts 1..j-1); sampling: each row's
distribution under the engine's sampler is q, a token drawn from it, so the chain is verified exactly
against the target's distribution (exact/verify_chain.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..exact.distributions import Dist, draw
from ..heads.dflash import DFlashModel
from .heads import load_dflash_drafter
from ..models.cache import KVCache
from ..models.rotary import tables
from ..models.transformer import Transformer
from ..exact.sampler import Sampler, top_token
from .base import Draft, Drafter, MethodSpec


class DFlashDrafter(Drafter):
    name = "dflash"

    def __init__(self, model: DFlashModel, target: Transformer, sampler: Sampler, max_len: int) -> None:
        cfg = model.cfg
        self.model, self.target, self.sampler = model, target, sampler
        self._order = cfg.taps(target.cfg.n_layers)  # the features' order in fc's input
        self.taps = tuple(dict.fromkeys(self._order))  # each layer tapped once
        self.block_size = self.block = cfg.block_size
        self.vocab = target.cfg.vocab_size
        n = target.cos.shape[0]  # the target's positions: the rotary rows a block may reach
        self.positions = n
        self.cache = KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, min(max_len, n) + cfg.block_size,
                             torch.float32, target.device)
        cos, sin = tables(cfg.rope_inv_freq, n)
        self.cos, self.sin = cos.to(target.device), sin.to(target.device)
        self.mask = torch.tensor([cfg.mask_token_id] * (cfg.block_size - 1), device=target.device)
        # the last layer's o_proj and MLP on the drafted rows alone, where that leaves their bits as they are
        self._trim = model.rows_invariant()
        self.pos0 = 0  # position of cache row 0 (a reused prompt prefix has no features)
        self._waiting: list[Tensor] = []  # feature rows [R, n*D] not in the cache yet

    def _features(self, hidden: dict[int, Tensor]) -> Tensor:
        return torch.cat([hidden[t] for t in self._order], -1).float()

    def start(self, prompt: list[int], hidden: dict[int, Tensor] | None = None) -> None:
        f = self._features(hidden)
        self.cache.rollback(0)
        self.pos0 = len(prompt) - f.shape[0]
        self._waiting = [f]

    def commit(self, accepted: list[int], n_drafted: int, *, hidden: dict[int, Tensor] | None = None,
               **_: object) -> None:
        self._waiting.append(self._features(hidden))

    def propose(self, pending: int, k: int) -> Draft:
        logits = self.block_logits(pending, k)
        if logits is None:
            return Draft(torch.zeros(0, dtype=torch.long, device=self.cos.device), None)
        return self._choose(logits, self.sampler)

    def block_logits(self, pending: int, k: int) -> Tensor | None:
        """The draft logits [k', V] of the block after the committed context + `pending` (k' = k, fewer where
        the context ends; None for none), the waiting context rows added to the cache first."""
        model = self.model
        with torch.inference_mode():
            if self._waiting:
                f = torch.cat(self._waiting)
                self._waiting = []
                p = self.pos0 + self.cache.length
                model.add_context(f, self.cache, self.cos[p : p + f.shape[0]], self.sin[p : p + f.shape[0]])
            P = self.pos0 + self.cache.length  # pending's position
            b = min(self.block_size, self.positions - P)
            k = min(k, b - 1)
            if k <= 0:
                return None
            ids = torch.cat([self.mask.new_tensor([pending]), self.mask[: b - 1]])
            x = self.target.embed(ids).float() * model.cfg.embed_scale
            keep = slice(1, k + 1)
            if self._trim:
                return self._logits(model.block(x, self.cache, self.cos[P : P + b], self.sin[P : P + b], keep))
            return self._logits(model.block(x, self.cache, self.cos[P : P + b], self.sin[P : P + b])[keep])

    def _logits(self, h: Tensor) -> Tensor:
        c = self.model.cfg
        logits = self.target.lm_head(h).float()[:, : self.vocab]
        if c.logit_scale != 1.0:
            logits = logits * c.logit_scale
        if c.softcap is not None:
            logits = torch.tanh(logits / c.softcap) * c.softcap
        return logits

    @staticmethod
    def _choose(logits: Tensor, sampler: Sampler) -> Draft:
        """One draft per row. Row j follows drafts 1..j-1: with penalties it counts them, so the rows go one
        by one (reading each draft is a host sync); without, all rows at once."""
        greedy = sampler.generator is None
        if not sampler.penalized:
            if greedy:
                return Draft(top_token(sampler.adjust(logits)), None)
            q = sampler.dist(logits)
            return Draft(draw(q, sampler.generator), q)  # one uniform per row, as drawing them one by one
        qs, toks, prefix = [], [], []
        for j in range(logits.shape[0]):
            if greedy:
                tok = top_token(sampler.adjust(logits[j : j + 1], prefix))
            else:
                qs.append(sampler.dist(logits[j : j + 1], prefix))
                tok = draw(qs[-1], sampler.generator)
            toks.append(tok)
            prefix.append(int(tok))
        return Draft(torch.cat(toks), Dist.cat(qs) if qs else None)


SPEC = MethodSpec("dflash", "a DFlash block drafter on the target's hidden states proposes a block in one pass "
                  "(--drafter)", build=lambda c: DFlashDrafter(c.head, c.target, c.sampler, c.max_len),
                  loads="heads", options="drafter", load=lambda t, m: (load_dflash_drafter(t, m.heads), {}))

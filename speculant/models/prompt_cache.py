"""The prompt cache: a model's KV cache kept from one generation to the next, reused exactly.

A chat that goes on sends a prompt that extends the previous one. Like llama.cpp's server, the
engine keeps the keys/values of the previous prompt and prefills only what differs. Unlike it,
the reuse is exact: output with the cache is token for token the output without it.

Why that needs care: the kernels' results depend on how a prompt is cut into forward passes (a
pass of 5 rows takes the row-wise attention kernel, one of 48 rows the masked one; the last bits
differ, and a greedy output can diverge a few dozen tokens later). So the engine always prefills
a prompt in the same passes, a function of the prompt's tokens alone (`pass_starts`): a pass
starts at every special token (chat templates open and close every message with one) and every
`PASS_MAX` tokens after the previous start. The cache reuses the previous prompt's keys/values up
to a pass start the two prompts share; a fresh prefill of the new prompt would have computed
exactly those rows in exactly those passes, so everything after them is computed as it would be
without the cache. The tokens a generation produced are not reused (decoding computed their
keys/values in other passes): in a chat they are the last answer, prefilled again with the new
user message.

Where the model's prompts take batch-invariant passes (`Transformer.batch_invariant_prompts`: the fused
route, x86 builds without AMX), every row comes out as decoding it token by token would, however the
passes are cut. Then the cache reuses any prefix the two prompts share, and the tokens the last
generation decoded count too (`keep_decoded`): the next turn of a chat prefills only its new message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import SpeculantError
from .cache import KVCache
from .transformer import Transformer

PASS_MAX = 384  # rows per prefill pass at most (the transformer's own prefill chunk on the CPU)


def pass_starts(ids: Sequence[int], specials: frozenset[int]) -> list[int]:
    """Where the prefill passes over `ids` start: 0, every special token, every PASS_MAX tokens after a start.

    Whether a pass starts at i depends on ids[:i + 1] only, so two prompts with a common prefix share
    the starts inside it.
    """
    starts = [0]
    for i in range(1, len(ids)):
        if ids[i] in specials or i - starts[-1] >= PASS_MAX:
            starts.append(i)
    return starts


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(slots=True)
class PrefillResult:
    logits: torch.Tensor | None  # [1, V] of the last token, if asked for
    reused: int  # leading tokens whose keys/values came from the cache
    hidden: dict[int, torch.Tensor] | None = None  # taps asked for: {tap: [len(ids) - reused, D]}


class KeptPrefix:
    """One model's KV cache and the prompt whose keys/values it holds in slots [0, len(tokens))."""

    def __init__(self, model: Transformer, specials: frozenset[int], reuse: bool = True) -> None:
        self.model = model
        self.specials = specials
        self.reuse = reuse  # False: never reuse (every prefill starts at slot 0, the same passes)
        self.cache: KVCache | None = None
        self.tokens: list[int] = []  # prefilled tokens still valid in the cache
        self.starts: set[int] = set()  # their pass starts, and the end of the last pass
        # A model with recurrent states (Qwen3.5's linear attention) cannot roll its cache back to a shared prefix
        # (the states after it are gone): its prompts are prefilled whole, every time.
        self.recurrent = model.recurrent

    def cache_for(self, max_len: int) -> KVCache:
        """The kept cache, grown (kept slots copied) if it holds fewer than `max_len` slots."""
        c = self.cache
        if c is None or c.max_len < max_len:
            new = self.model.new_cache(max_len)
            if self.recurrent:  # nothing is reused (prefill): the new cache starts empty
                self.forget()
            elif c is not None and self.tokens:
                n = min(len(self.tokens), c.length)
                new.k[:, :, :n] = c.k[:, :, :n]
                new.v[:, :, :n] = c.v[:, :, :n]
                new.length = n
            self.cache = c = new
        return c

    def prefill(self, ids: list[int], max_len: int, *, logits: bool, rows: int | None = None,
                taps: tuple[int, ...] = ()) -> PrefillResult:
        """Fill the cache with `ids` (the logits of the last one if `logits`), reusing what it holds.

        `taps` (Transformer.forward's): the hidden states of the tokens prefilled (not of those reused).

        `rows`: the model's embedding rows; larger ids (a target's padding ids fed to a smaller draft)
        read the last row, as DraftModelDrafter does.
        """
        cache = self.cache_for(max_len)
        limit = min(common_prefix(self.tokens, ids), cache.length, len(ids) - 1 if logits else len(ids)) \
            if self.reuse and not self.recurrent else 0
        if self.model.batch_invariant_prompts():  # any shared prefix; passes of PASS_MAX only so that an
            reused = limit  # interrupted prefill keeps some
            starts = list(range(reused, len(ids), PASS_MAX)) or [reused]
        else:
            starts = pass_starts(ids, self.specials)
            # The last pass start (or prompt end) at most `limit` that both prompts' passes share.
            reused = max((s for s in starts + [len(ids)] if s <= limit and s in self.starts), default=0)
        ends = starts[1:] + [len(ids)]
        cache.rollback(reused)
        self.tokens, self.starts = ids[:reused], {s for s in starts if s <= reused}
        device = self.model.device
        out = None
        hidden: dict[int, list[torch.Tensor]] = {t: [] for t in taps}
        for s, e in zip(starts, ends):
            if e <= reused:
                continue
            last = logits and e == len(ids)
            piece = ids[s:e] if rows is None else [min(t, rows - 1) for t in ids[s:e]]
            out = self.model(torch.tensor(piece, device=device), cache,
                             logit_rows=slice(-1, None) if last else slice(0, 0), taps=taps)
            for t in taps:
                hidden[t].append(out.taps[t])
            # Kept as each pass completes: an interrupted prefill leaves a valid (shorter) prefix.
            self.tokens = ids[:e]
            self.starts.update((s, e))
        return PrefillResult(out.logits if logits and out is not None else None, reused,
                             {t: torch.cat(h) for t, h in hidden.items()} if taps else None)

    def keep_decoded(self, tokens: list[int]) -> None:
        """Count `tokens`, decoded after the prefilled prompt, as kept: the cache holds their keys/values in
        the slots after it. Only where prompts take batch-invariant passes (the module docstring), so the
        rows are those a prefill would write; elsewhere decoding's rows differ and are not reused."""
        if (self.reuse and tokens and self.cache is not None and self.model.batch_invariant_prompts()
                and self.cache.length == len(self.tokens) + len(tokens)):
            self.tokens = self.tokens + tokens

    def forget(self) -> None:
        self.tokens, self.starts = [], set()


@dataclass(slots=True)
class PromptCache:
    """The kept prefixes of one conversation (or one server): the target's and the draft model's.

    One generation at a time may use it; pass it to `Engine.stream(..., cache=)`.
    """

    target: KeptPrefix
    draft: KeptPrefix | None = None

    def forget(self) -> None:
        self.target.forget()
        if self.draft is not None:
            self.draft.forget()


class PromptCachePool:
    """Up to `slots` prompt caches for interleaved conversations (a server's clients). A prompt takes the
    cache sharing the longest prefix with it where it continues that cache's conversation: the shared prefix
    is the whole prompt (the same prompt again) or at least half of what the cache holds (the prompt goes
    on from it). Else a new cache while there is room, else the least recently used one, whose holdings it
    replaces: a new conversation that shares only a system prompt with another does not evict that one's
    history while a slot is free. One generation at a time may use the pool."""

    def __init__(self, new: Callable[[], PromptCache], slots: int) -> None:
        if slots < 1:
            raise SpeculantError(f"prompt cache slots must be >= 1, got {slots}")
        self.new, self.slots = new, slots
        self.caches: list[PromptCache] = []  # most recently used first

    def take(self, ids: Sequence[int]) -> PromptCache:
        """The cache for a prompt of `ids` (it becomes the most recently used)."""
        best, most = None, 0
        for i, c in enumerate(self.caches):
            shared = common_prefix(c.target.tokens, ids)
            if shared > most and (shared == len(ids) or 2 * shared >= len(c.target.tokens)):
                best, most = i, shared
        if best is not None:
            cache = self.caches.pop(best)
        elif len(self.caches) < self.slots:
            cache = self.new()
        else:
            cache = self.caches.pop()
        self.caches.insert(0, cache)
        return cache

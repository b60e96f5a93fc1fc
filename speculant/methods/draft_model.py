"""A small draft model proposes tokens autoregressively (Leviathan et al. 2023; Chen et al. 2023).

The draft keeps its own KV cache in step with the target's context. It samples its proposals
with the same sampling settings as the target (so q and p are transformed alike) and returns the
distributions q it drew from. Drafting stops early when the draft's top probability drops below
`min_confidence` (HF's assistant_confidence_threshold, llama.cpp's p-min): a token the draft
itself doubts is likely rejected, and a target forward over it would be wasted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import SpeculantError
from ..models.formats import QLinear
from ..models.transformer import Transformer
from ..models.prompt_cache import KeptPrefix
from ..exact.distributions import Dist, draw
from ..exact.sampler import Sampler, top_token
from .base import Draft, Drafter, DrafterInputs, MethodSpec

CONTEXT_STEP = 64  # the draft's prompt window (DraftModelConfig.context) starts at multiples of this


@dataclass(frozen=True, slots=True)
class DraftModelConfig:
    # Stop drafting below this top probability (0 = never stop early). 0.5 was the best of 0.3-0.6 and of
    # no stop on HumanEval (`bench methods`; docs/measurements.md "Method defaults").
    min_confidence: float = 0.5
    # Draft only among the first `vocab` token ids (0 = all). BPE ids follow merge order, so low ids
    # are the frequent tokens; the draft's output projection shrinks with it (FR-Spec, Zhao et al.
    # 2025). Exactness is unaffected: q is simply zero outside the subset. 65536 cuts the Qwen2.5
    # draft's 151,936-row head by 57% and still covers 99.2% of the HumanEval solutions' tokens, which
    # made hybrid faster; 32768 lost too much acceptance (docs/measurements.md "Method defaults").
    # Vocabularies of 65536 tokens or fewer are unaffected.
    vocab: int = 65536
    # The draft model reads only the last `context` prompt tokens (0 = all of them; None = the
    # method's default: all for `draft`, HYBRID_DRAFT_CONTEXT for `hybrid`): its prefill of a long
    # prompt is paid before the first draft. Exactness is unaffected (the draft only proposes), but
    # acceptance falls where the output depends on the text left out, which hybrid's prompt lookup
    # covers and `draft` alone does not (Spec-Bench summarization; docs/measurements.md "Method defaults").
    context: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_confidence < 1.0:
            raise SpeculantError(f"draft min confidence must be in [0, 1), got {self.min_confidence}")
        if self.vocab < 0:
            raise SpeculantError(f"draft vocabulary must be >= 0 (0 = full), got {self.vocab}")
        if self.context is not None and self.context < 0:
            raise SpeculantError(f"draft context must be >= 0 tokens (0 = the whole prompt), got {self.context}")

    def resolved(self, default_context: int) -> "DraftModelConfig":
        """This config with `context` set (to `default_context` where it was None)."""
        if self.context is not None:
            return self
        return DraftModelConfig(self.min_confidence, self.vocab, default_context)


def window_start(n: int, context: int) -> int:
    """Where the draft's window of an n-token prompt starts (DraftModelConfig.context; 0 = all of it): the
    last `context` to `context + CONTEXT_STEP - 1` tokens. The window starts at a multiple of CONTEXT_STEP,
    so a conversation that goes on keeps its start (and its prompt cache) for a while, and the window is a
    function of the prompt alone (seeded runs repeat)."""
    return (n - context) // CONTEXT_STEP * CONTEXT_STEP if 0 < context < n else 0


def reduced_head(model: Transformer, cfg: DraftModelConfig) -> QLinear | None:
    """The draft's output projection over its reduced vocabulary, or None for the full one."""
    if 0 < cfg.vocab < model.cfg.vocab_size:
        return model.lm_head.first_rows(cfg.vocab)
    return None


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, model: Transformer, sampler: Sampler, cfg: DraftModelConfig, max_len: int,
                 target_vocab: int, head: QLinear | None = None, kept: KeptPrefix | None = None) -> None:
        self.model = model
        self.head = head
        # Vocabularies may differ by padding rows only (checked up front): the draft never proposes
        # an id the target lacks.
        self.target_vocab = target_vocab
        self.rows = model.cfg.vocab_size  # ids the draft can embed
        # The generation's sampler, shared with the target: q is p's pipeline over the draft's logits,
        # its penalties counting the context and the tokens drafted before each position.
        self.sampler = sampler
        self.cfg = cfg
        # The prompt cache of a conversation (its prefill reused across generations), or a fresh one.
        self.kept = kept if kept is not None else KeptPrefix(model, frozenset(), reuse=False)
        self.max_len = max_len
        self.cache = self.kept.cache_for(max_len)
        self.committed = 0  # cache slots holding committed context
        self.unfed: list[int] = []  # committed tokens not yet in the cache (at most the last accepted draft)
        self.forwards = 0  # draft forwards so far (hybrid weighs its rounds by them)
        self.waiting: list[int] | None = None  # before the first draft: the prompt window
        self.after: list[int] = []  # before the first draft: the tokens committed after the window
        self.last: int | None = None  # the window's last token (the cache's first unkept slot), once prefilled

    def start(self, prompt: list[int]) -> None:
        """Take the prompt; its prefill waits for the first draft. Where the governor runs plain rounds
        only (speculation measured slower in the engine's earlier generations), it is never paid: on
        Spec-Bench's long prompts it was up to a tenth of a plain generation's time (`bench methods`)."""
        self.waiting, self.after = list(prompt[window_start(len(prompt), self.cfg.context or 0) :]), []
        self.last = None

    def ready(self) -> None:
        """Run the deferred prefill now (the engine calls this before it times a speculative round: the
        prefill is the generation's, not the round's, and timed with the round it made the governor's
        first speculative phase look slow: HumanEval `draft` then ran nearly all its rounds plain)."""
        if self.waiting is not None:
            self._begin()

    def _begin(self) -> None:
        """The deferred prefill (the window but its last token); the rest is fed with the first draft."""
        prompt, self.waiting = self.waiting, None
        self.kept.prefill(prompt[:-1], self.max_len, logits=False, rows=self.rows)
        self.committed = self.cache.length
        self.unfed = prompt[-1:] + self.after
        self.last = prompt[-1]

    def propose(self, pending: int, k: int, guess: Sequence[int] = ()) -> Draft:
        """Up to k tokens after `pending`. A `guess` of what follows (prompt lookup's) is scored in the
        first forward: its leading tokens that equal the draft's own greedy choices are taken as
        drafts without a forward each, then the draft goes on from the first disagreement."""
        self.ready()
        device = self.model.device
        sampler = self.sampler
        greedy = sampler.generator is None
        threshold = self.cfg.min_confidence
        log_threshold = math.log(threshold) if threshold > 0 else -math.inf
        room = self.max_len - self.cache.length - len(self.unfed) - 1
        k = max(0, min(k, room))
        guess = list(guess[: max(0, k - 1)])  # the first forward leaves room for one token of its own
        feed = self._ids(self.unfed + [pending] + guess)
        tokens: list[torch.Tensor] = []
        qs: list[Dist] = []
        # the drafted tokens as ints, for the penalties of the positions after them (only when penalized:
        # reading a sampled token is a host sync)
        prefix: list[int] = []
        rows = len(guess) + 1
        while k > 0 and sum(t.shape[0] for t in tokens) < k:
            out = self.model(feed, self.cache, logit_rows=slice(-rows, None), head=self.head)
            self.forwards += 1
            logits = out.logits[-1:]
            if rows > 1:
                n = self._agreed(out.logits, guess)
                self.cache.rollback(self.cache.length - (len(guess) - n))  # unfed: the disagreeing guesses
                if n:
                    tokens.append(feed.new_tensor(guess[:n]))
                    if sampler.penalized:
                        prefix += guess[:n]
                    if not greedy:  # deterministic given the context: one-hot proposals
                        qs.append(Dist.one_hot(tokens[-1], self.target_vocab))
                logits = out.logits[n : n + 1]
                rows = 1
            # as the target's rows: ids past the target's vocabulary (padding rows) never proposed
            logits = logits[:, : self.target_vocab]  # [1, W]
            if greedy:
                logits = sampler.adjust(logits, prefix)[0]
                top, tok = logits.max(-1, keepdim=True)  # as sampling.top_token
                if threshold > 0 and float(top - logits.logsumexp(-1)) < log_threshold:  # top probability
                    break
            else:
                q = sampler.dist(logits, prefix)
                if threshold > 0 and float(q.p.amax()) < threshold:
                    break
                tok = draw(q, sampler.generator)  # [1]
                qs.append(q)
            tokens.append(tok)
            if sampler.penalized:
                prefix.append(int(tok))
            feed = tok
        # Cache now holds: committed, unfed, pending, and all drafts but (at least) the last.
        draft = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long, device=device)
        return Draft(draft, Dist.cat(qs) if qs else None)

    def finish(self, decoded: list[int]) -> None:
        """The generation ended; `decoded` are its tokens after the prompt that the target's cache holds. The
        committed context in the draft's cache (its window, then as many of them) counts as kept for the next
        prompt where the draft's prompts are batch-invariant (KeptPrefix.keep_decoded)."""
        if self.waiting is not None or self.last is None:  # the window was never prefilled
            return
        self.cache.rollback(self.committed)  # the drafts past the committed context
        context = [self.last] + decoded
        self.kept.keep_decoded(context[: self.committed - len(self.kept.tokens)])

    def _ids(self, ids: list[int]) -> torch.Tensor:
        """Token ids as the draft's input [len(ids)]. The target may emit an id of its padding rows (its
        embedding can be larger than the tokenizer and the draft's): the draft reads its last row
        instead. That only changes what the draft proposes, never what is emitted."""
        t = torch.tensor(ids, dtype=torch.long, device=self.model.device)
        return t.clamp_(max=self.rows - 1) if any(i >= self.rows for i in ids) else t

    def _agreed(self, logits: torch.Tensor, guess: list[int]) -> int:
        """How many leading guess tokens equal the draft's greedy choice (logits [len(guess) + 1, V]), after
        logit bias and penalties (row j follows guess[:j]): one host sync."""
        pred = top_token(self.sampler.adjust(logits[:-1, : self.target_vocab], guess[:-1]))
        same = pred == torch.tensor(guess, device=pred.device)
        return int(same.cumprod(0).sum())

    def commit(self, accepted: list[int], n_drafted: int) -> None:
        if self.waiting is not None:  # no draft yet: the prompt's prefill still waits
            self.after += accepted
            return
        # accepted = [pending, d_1..d_n]; the cache holds unfed + pending + d_1..d_{n_drafted-1}.
        n = len(accepted) - 1
        base = self.committed + len(self.unfed)  # slot of `pending`
        fed_drafts = max(n_drafted - 1, 0)
        if self.cache.length < base + 1:  # nothing was fed (no room to draft): feed it next round
            self.cache.rollback(self.committed)
            self.unfed = self.unfed + accepted
            return
        keep = min(n, fed_drafts)
        self.cache.rollback(base + 1 + keep)
        self.committed = self.cache.length
        self.unfed = accepted[1 + keep :]


def build(c: DrafterInputs, context: int = 0) -> DraftModelDrafter:
    """The draft model's drafter for one generation; `context` = the method's default prompt window."""
    assert c.draft is not None
    return DraftModelDrafter(c.draft, c.sampler, c.method.draft_model.resolved(context), c.max_len,
                             c.target.cfg.vocab_size, c.draft_head, c.kept)


SPEC = MethodSpec("draft", "a small draft model of the same tokenizer proposes tokens one by one", build=build,
                  loads="draft")

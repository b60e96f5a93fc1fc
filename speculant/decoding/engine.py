"""The engine: a target model, an optional drafter, and the one decoding loop they share.

The engine knows nothing of HTTP or the command line. `stream()` is the main entry: it yields
`Chunk`s of text as tokens are accepted and a final `Done` with the stats; `generate()` collects it.
Plain autoregressive decoding is the same loop with a drafter that proposes nothing.

One round: the drafter proposes k tokens after `pending` (the last emitted, not yet scored token);
the target scores [pending, *draft] in one forward; `verify` keeps n drafts plus one token; both
caches are rolled back to the committed length. The host syncs of a round: reading (n, tokens)
once after verification and, when sampling, the sampler's check that its candidates hold the cut
(exact/distributions.py). Target and drafter share one `Sampler` (exact/sampler.py), so p and q are the same
transform of their logits, penalties included.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .generation import Chunk, Done, GenerationConfig, Output
from ..errors import SpeculantError
from ..methods.governor import Governor, GovernorMemory
from ..methods.config import MODEL_METHODS, MethodConfig
from ..methods.base import MAX_DRAFT_TOKENS, Draft, DraftLength, Drafter, DrafterInputs
from ..methods.draft_model import reduced_head
from ..methods.registry import METHOD_SPECS
from ..methods.heads import heads_thread_invariant
from ..models import LoadedModel
from ..models.cache import KVCache
from ..models.transformer import Transformer
from ..models.prompt_cache import KeptPrefix, PromptCache
from ..threads import ThreadShare, configure_threads, threads_fixed
from ..exact.sampler import Sampler
from .stats import Stats
from ..exact.tree import DraftTree
from .tree_round import tree_round
from ..exact.verify_chain import verify_greedy, verify_sampled
from ..methods.draft_vocab import check_compatible


class Engine:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None,
                 method: MethodConfig | None = None, *, threads: int | None = None) -> None:
        # CPU threads as the CLI sets them: `threads`, else $SPECULANT_THREADS, else one per physical
        # core within the container's CPU quota (torch's own default counts every visible CPU).
        self.threads = configure_threads(threads)
        self.target = target
        self.draft = draft
        self.method = method or MethodConfig("hybrid" if draft is not None else "ar")
        self._draft_head = None  # the draft's reduced-vocabulary output layer, built once per engine
        self._draft_cost = 0.0
        spec = METHOD_SPECS[self.method.name]
        why = spec.why_not(target.model)
        if why is not None:
            fits = ", ".join(n for n, s in METHOD_SPECS.items() if s.why_not(target.model) is None)
            raise SpeculantError(f"--method {self.method.name} cannot run on this model: {why}; choose one of {fits}")
        if spec.loads == "draft":
            if draft is None:
                raise SpeculantError(f"--method {self.method.name} needs a draft model (--draft MODEL)")
            check_compatible(target, draft)
            if draft.model.device != target.model.device:
                raise SpeculantError(f"the draft model is on {draft.model.device} but the target on "
                                     f"{target.model.device}; load both on one device (--device)")
            self._draft_head = reduced_head(draft.model, self.method.draft_model)
            # A draft forward in target forwards: decoding streams the weights, so their bytes.
            head = self._draft_head or draft.model.lm_head
            self._draft_cost = ((draft.model.weight_bytes_per_token() - draft.model.lm_head.weight_bytes()
                                 + head.weight_bytes()) / target.model.weight_bytes_per_token())
        # what the governor learned in this engine's generations (one generation at a time per engine)
        self._governor_memory = GovernorMemory()
        self._head = None  # the draft head of a head method, loaded once per engine
        self._head_stats: dict = {}
        if spec.load is not None:
            self._head, self._head_stats = spec.load(target, self.method)
        # unless fixed, fewer threads while other processes keep the CPUs busy (threads.py), where no logits
        # depend on the thread count: the target's, the draft model's (its q and drafts) and a head's (its trees)
        adapt = (not threads_fixed(threads) and target.model.device.type == "cpu" and target.model.thread_invariant()
                 and (draft is None or spec.loads != "draft" or draft.model.thread_invariant())
                 and (self._head is None or heads_thread_invariant(self._head)))
        self._share = ThreadShare(self.threads) if adapt else None
        self.tokenizer = target.tokenizer
        self._specials = self.tokenizer.special_ids()  # where prefill passes start (prefix.pass_starts)

    def with_method(self, name: str) -> "Engine":
        """The same loaded models under another method (this engine's method options otherwise)."""
        from dataclasses import replace

        if name == self.method.name:
            return self
        return Engine(self.target, self.draft if name in MODEL_METHODS else None, replace(self.method, name=name),
                      threads=self.threads if self._share is None else None)

    def prompt_cache(self, reuse: bool = True) -> PromptCache:
        """A prompt cache for a conversation: pass it to every `stream()` of it (one at a time).

        With it, a prompt that extends an earlier one prefills only what follows their shared prefix;
        the output is the same as without it (models/prompt_cache.py says why). `reuse=False` keeps the caches
        allocated but prefills every prompt in full.
        """
        draft = None
        if self.method.name in MODEL_METHODS:
            assert self.draft is not None
            draft = KeptPrefix(self.draft.model, self._specials, reuse)
        return PromptCache(KeptPrefix(self.target.model, self._specials, reuse), draft)

    def encode_prompt(self, prompt: str | list[int], *, chat: bool = False, system: str | None = None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise SpeculantError("the prompt is empty; pass some text to continue")
            if chat:
                messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
                return self.encode_messages(messages)
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise SpeculantError("the prompt is empty; pass some text to continue")
        ctx = self.target.config.context_length
        if len(ids) >= ctx:
            raise SpeculantError(f"the prompt has {len(ids)} tokens but the model's context holds {ctx}; shorten it")
        self._check_ids(ids)
        return ids

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation ({"role", "content"} dicts) through the chat template, as prompt ids (checked as
        encode_prompt's): a chat's next turn, a benchmark's follow-up question."""
        return self.encode_prompt(self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special=False))

    def _check_ids(self, ids: list[int]) -> None:
        """Prompt ids must be tokens: rows of the embedding that the tokenizer also knows (a draft model has
        at least the tokenizer's rows: `check_compatible`)."""
        rows = self.target.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < rows), None)
        if bad is not None:
            raise SpeculantError(f"prompt token id {bad} is out of range: the model has {rows} token ids (0..{rows - 1})")
        known = self.tokenizer.vocab_size
        bad = next((t for t in ids if t >= known), None)
        if bad is not None:  # e.g. Qwen2.5: 151,665 tokens, 151,936 embedding rows
            raise SpeculantError(f"prompt token id {bad} is not a token: the tokenizer has {known} (0..{known - 1}); "
                                 f"ids {known}..{rows - 1} are unused padding rows of the embedding")

    def _drafter(self, sampler: Sampler, max_len: int, kept: KeptPrefix | None,
                 target_kept: KeptPrefix | None = None) -> Drafter | None:
        """The method's drafter for one generation (methods/registry.py), None for plain decoding."""
        build = METHOD_SPECS[self.method.name].build
        if build is None:
            return None
        return build(DrafterInputs(self.method, self.target.model, sampler, max_len,
                                   self.draft.model if self.draft is not None else None, self._draft_head,
                                   self._draft_cost, kept, target_kept, self._head, self._head_stats))

    def generate(self, prompt: str | list[int], gen: GenerationConfig | None = None, **kw: object) -> Done:
        for ev in self.stream(prompt, gen, **kw):
            if isinstance(ev, Done):
                return ev
        raise AssertionError("stream ended without Done")

    def stream(self, prompt: str | list[int], gen: GenerationConfig | None = None, *, chat: bool = False,
               system: str | None = None, cache: PromptCache | None = None) -> Iterator[Chunk | Done]:
        """Generate from `prompt`; `cache` (from `prompt_cache()`) reuses an earlier prompt's prefill.

        Closing the iterator early (a client that left) stops the generation at that round. The phases: set up
        (`_begin`), prefill the prompt and emit its first token, start the drafter, then rounds until the
        output is finished (`_chain_round` or `_tree_round`), and hand the caches on (`_end`).
        """
        gen = gen or GenerationConfig()
        ids = self.encode_prompt(prompt, chat=chat, system=system)
        r = self._begin(ids, gen, cache)
        stats, out, drafter, sampler = r.stats, r.out, r.drafter, r.sampler
        t0 = time.perf_counter()
        pre = r.kept.target.prefill(ids, r.max_len, logits=True, taps=r.taps)
        first = int(sampler.pick(pre.logits))
        sampler.push([first])
        stats.target_forwards = 1
        stats.cached_prompt_tokens = pre.reused
        stats.prefill_seconds = time.perf_counter() - t0
        yield from out.push([first])  # before the drafter's prefill: the time to the first token is the target's
        t_draft = time.perf_counter()
        if drafter is not None and not out.finished:
            drafter.start(ids, **({"hidden": pre.hidden} if r.taps else {}))
        t_decode = time.perf_counter()
        stats.prefill_seconds += t_decode - t_draft
        if self._share is not None:
            self._share.start()
        pending = first
        r.decoded.append(first)  # the tokens after the prompt: all but the last (pending) end up in the cache
        unready = True  # a drafter may defer its prompt's prefill to `ready` (draft_model.py)
        deferred = 0.0
        while not out.finished:
            room = r.max_len - r.cache.length - 1  # the forward below writes 1 + k slots
            if room < 0:
                out.finish("length")
                break
            paused = drafter is not None and not r.governor.speculate  # the governor's plain round
            speculating = drafter is not None and not paused
            k = min(r.nodes or r.policy.k, gen.max_new_tokens - out.count - 1, room) if speculating else 0
            if k > 0 and unready:
                # A deferred prompt prefill: the generation's prefill, neither a round's cost nor decoding
                # (HumanEval, hybrid: 14% of the decode seconds when it was counted there)
                t = time.perf_counter()
                drafter.ready()
                unready = False
                deferred = time.perf_counter() - t
            ta = time.perf_counter()
            draft = drafter.propose(pending, k) if drafter is not None and k > 0 else None
            tb = time.perf_counter()
            if isinstance(draft, DraftTree):
                new, kd, n = self._tree_round(r, pending, draft)
                policy = None  # trees keep their node count
            else:
                new, kd, n = self._chain_round(r, pending, draft)
                policy = r.policy
            self._finish_round(stats, r.governor, policy, paused, ta, tb, kd, n)
            yield from out.push(new, drafted=n, proposed=kd)
            pending = new[-1]
        stats.decode_seconds = time.perf_counter() - t_decode - deferred
        stats.prefill_seconds += deferred
        yield from self._end(r)

    def _begin(self, ids: list[int], gen: GenerationConfig, cache: PromptCache | None) -> "_Run":
        """One generation's state: its caches, sampler, drafter, governor, draft-length policy and output."""
        # tree drafters (exact/tree.py) declare their nodes per round, chains follow the draft-length policy
        k_max = 0 if self.method.name == "ar" else MAX_DRAFT_TOKENS
        max_len = min(self.target.config.context_length, len(ids) + gen.max_new_tokens + k_max + 2)
        kept = cache or self.prompt_cache(reuse=False)
        # target and drafter sample through one Sampler: its penalties count the same context
        sampler = Sampler(gen.sampling, self.target.config.vocab_size, self.target.model.device)
        sampler.start(ids)
        drafter = self._drafter(sampler, max_len, kept.draft, kept.target)
        # speculative or plain rounds, whichever is measured faster (methods/governor.py)
        governor = Governor(self.method.governor, drafter is not None and self.method.governor.governs(gen.sampling),
                            self._governor_memory)
        # the auto draft length reads the clock where the governor may (draft_length.py)
        policy = DraftLength(self.method.draft_length, timed=governor.active, block=drafter.block if drafter else 0)
        stops = frozenset() if gen.ignore_eos else frozenset(
            gen.stop_token_ids if gen.stop_token_ids is not None else self.tokenizer.eos_ids)
        # hidden states the drafter reads (methods/base.py): asked of every target forward, handed over
        taps: tuple[int, ...] = tuple(drafter.taps) if drafter is not None else ()
        return _Run(self.target.model, kept, kept.target.cache_for(max_len), max_len, sampler, drafter, governor,
                    policy, drafter.nodes if drafter is not None else None, taps,
                    Output(self.tokenizer, gen, stops), Stats(method=self.method.name, prompt_tokens=len(ids)))

    def _chain_round(self, r: "_Run", pending: int, draft: Draft | None) -> tuple[list[int], int, int]:
        """Score [pending, *draft] in one target pass, verify, keep what was accepted: (new tokens, drafted,
        accepted)."""
        sampler, cache = r.sampler, r.cache
        drafted = draft.tokens if draft is not None else torch.zeros(0, dtype=torch.long, device=r.model.device)
        kd = int(drafted.shape[0])
        base = cache.length
        fwd = r.model(torch.cat([drafted.new_tensor([pending]), drafted]), cache, taps=r.taps)
        logits = fwd.logits  # [kd+1, V]
        # row j follows the drafts before it: the penalties count them (reading them is a host sync)
        prefix = drafted.tolist() if sampler.penalized else ()
        if sampler.generator is None:
            tokens, n_acc = verify_greedy(drafted, sampler.adjust(logits, prefix))
        else:
            tokens, n_acc = verify_sampled(drafted, draft.q if draft is not None else None,
                                           sampler.dist(logits, prefix), sampler.generator)
        read = torch.cat([n_acc.reshape(1), tokens]).tolist()  # the round's one host sync
        n = read[0]
        new = read[1 : n + 2]
        sampler.push(new)
        r.decoded += new
        cache.rollback(base + 1 + n)
        if r.drafter is not None:
            hidden = {"hidden": {t: h[: n + 1] for t, h in fwd.taps.items()}} if r.taps else {}
            r.drafter.commit([pending] + new[:n], kd, **hidden)
            r.policy.update(n, kd)
        return new, kd, n

    def _tree_round(self, r: "_Run", pending: int, draft: DraftTree) -> tuple[list[int], int, int]:
        """Every node of the tree in one pass, the accepted path kept (decoding/tree_round.py)."""
        t = tree_round(r.model, r.cache, r.sampler, pending, draft, r.taps)
        new, kd, n = t.tokens, draft.size, len(t.tokens) - 1
        r.sampler.push(new)
        r.decoded += new
        r.drafter.commit([pending] + new[:n], kd, path=t.path, **({"hidden": t.hidden} if r.taps else {}))
        return new, kd, n

    def _end(self, r: "_Run") -> Iterator[Chunk | Done]:
        # a conversation's next prompt may reuse them (models/prompt_cache.py)
        r.kept.target.keep_decoded(r.decoded[:-1])
        if r.drafter is not None:
            r.drafter.finish(r.decoded[:-1])
        r.stats.generated_tokens = r.out.count
        yield from r.out.flush()
        yield Done(r.out.text, r.out.token_ids, r.out.reason, r.stats)

    def _finish_round(self, stats: Stats, governor: Governor, policy: DraftLength | None, paused: bool, ta: float,
                      tb: float, kd: int, n: int) -> None:
        now = time.perf_counter()
        governor.record(n + 1, now - ta)
        if self._share is not None:
            self._share.tick()  # after the round's clock: its rare /proc/stat read is no round's cost
        if paused:
            stats.record_paused(now - ta)
            return
        if policy is not None:
            policy.observe(kd, tb - ta, now - tb)
        stats.draft_seconds += tb - ta
        stats.target_seconds += now - tb
        stats.record_round(kd, n)


@dataclass(slots=True)
class _Run:
    """One generation's state, from `Engine._begin`."""

    model: Transformer
    kept: PromptCache
    cache: KVCache
    max_len: int
    sampler: Sampler
    drafter: Drafter | None
    governor: Governor
    policy: DraftLength
    nodes: int | None  # a tree drafter's nodes per round; None: chains, as long as the policy says
    taps: tuple[int, ...]
    out: Output
    stats: Stats
    decoded: list[int] = field(default_factory=list)

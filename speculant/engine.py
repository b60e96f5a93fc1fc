"""The engine: a target model, an optional drafter, and the one decoding loop they share.

The engine knows nothing of HTTP or the command line. `stream()` is the main entry: it yields
`Chunk`s of text as tokens are accepted and a final `Done` with the stats; `generate()` collects it.
Plain autoregressive decoding is the same loop with a drafter that proposes nothing.

One round: the drafter proposes k tokens after `pending` (the last emitted, not yet scored token);
the target scores [pending, *draft] in one forward; `verify` keeps n drafts plus one token; both
caches are rolled back to the committed length. The host syncs of a round: reading (n, tokens)
once after verification and, when sampling, the sampler's check that its candidates hold the cut
(candidates.py). Target and drafter share one `Sampler` (sampling.py), so p and q are the same
transform of their logits, penalties included.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .errors import SpeculantError
from .governor import Governor, GovernorMemory
from .method import HEAD_METHODS, MODEL_METHODS, MethodConfig
from .methods.base import MAX_DRAFT_TOKENS, DraftLength, Drafter
from .methods.draft_model import DraftModelDrafter, reduced_head
from .methods.draft_tree import DraftTreeDrafter
from .methods.hybrid import HYBRID_DRAFT_CONTEXT, HYBRID_MIN_NGRAM, HybridDrafter
from .methods.lookup import LookupDrafter
from .heads.runtime import heads_thread_invariant, load_heads
from .methods.eagle import EagleDrafter
from .methods.lookup_tree import LookupTreeDrafter
from .methods.medusa import MedusaDrafter
from .models import LoadedModel
from .prefix import KeptPrefix, PromptCache
from .runtime import ThreadShare, configure_threads, threads_fixed
from .sampling import Sampler, SamplingConfig
from .stats import Stats
from .tree import DraftTree
from .tree_round import tree_round
from .verify import verify_greedy, verify_sampled
from .vocab import check_compatible


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's end-of-turn tokens
    ignore_eos: bool = False  # benchmarks generate a fixed number of tokens

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise SpeculantError(f"max tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise SpeculantError("stop strings must be non-empty")


@dataclass(slots=True)
class Chunk:
    text: str
    token_ids: list[int]
    # The first `drafted` of token_ids were the drafter's, accepted by the target; the rest the target's
    # own. `drafted_chars` leading characters of `text` came while emitting those (a chat page colours them).
    drafted: int = 0
    drafted_chars: int = 0
    proposed: int = 0  # drafts the target checked in the round that emitted this chunk


@dataclass(slots=True)
class Done:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end token or stop string) | "length" (max tokens or context)
    stats: Stats


class Engine:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None,
                 method: MethodConfig | None = None, *, threads: int | None = None) -> None:
        # CPU threads as the CLI sets them: `threads`, else $SPECULANT_THREADS, else one per physical
        # core within the container's CPU quota (torch's own default counts every visible CPU).
        self.threads = configure_threads(threads)
        self.target = target
        self.draft = draft
        self.method = method or MethodConfig("hybrid" if draft is not None else "ar")
        if getattr(target.model, "recurrent", False) and self.method.name not in ("ar", "draft", "lookup", "hybrid", "mtp"):
            # a recurrent state follows one chain: a tree's nodes would each need their path's (models/qwen35.py)
            raise SpeculantError(f"--method {self.method.name} drafts trees, which a model with linear-attention "
                                 "layers (Qwen3.5) cannot verify; choose ar, draft, lookup, hybrid or mtp")
        self._draft_head = None  # the draft's reduced-vocabulary output layer, built once per engine
        self._draft_cost = 0.0
        if self.method.name in MODEL_METHODS:
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
        if self.method.name in HEAD_METHODS:
            self._head, self._head_stats = load_heads(target, self.method.name, self.method.heads)
        # unless fixed, fewer threads while other processes keep the CPUs busy (runtime.py), where no logits
        # depend on the thread count: the target's, the draft model's (its q and drafts) and a head's (its trees)
        adapt = (not threads_fixed(threads) and target.model.device.type == "cpu" and target.model.thread_invariant()
                 and (draft is None or self.method.name not in MODEL_METHODS or draft.model.thread_invariant())
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
        the output is the same as without it (prefix.py says why). `reuse=False` keeps the caches
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

    def _drafter(self, sampler: Sampler, max_len: int, kept: KeptPrefix | None) -> Drafter | None:
        m = self.method
        if m.name == "lookup":
            return LookupDrafter(m.lookup, self.target.model.device)
        if m.name == "lookup_tree":
            return LookupTreeDrafter(m.lookup_tree, m.lookup, self.target.model.device)
        if m.name == "mtp":  # the target's own MTP layer (Qwen3.5)
            from .methods.mtp import MTPDrafter

            return MTPDrafter(self.target.model, sampler, max_len)
        if m.name == "medusa":
            return MedusaDrafter(self._head, m.heads, self._head_stats.get("val", {}).get("ranks"))
        if m.name in HEAD_METHODS:
            return EagleDrafter(self._head, self.target.model, m.heads, max_len)
        if m.name in MODEL_METHODS:
            assert self.draft is not None
            dm = m.draft_model.resolved(HYBRID_DRAFT_CONTEXT if m.name == "hybrid" else 0)
            model = DraftModelDrafter(self.draft.model, sampler, dm, max_len,
                                      self.target.config.vocab_size, self._draft_head, kept)
            if m.name == "draft":
                return model
            if m.name == "draft_tree":
                return DraftTreeDrafter(model, m.draft_tree, m.draft_length.max_k)
            return HybridDrafter(LookupDrafter(m.lookup.resolved(HYBRID_MIN_NGRAM), self.target.model.device), model,
                                 m.hybrid, self._draft_cost)
        return None

    def generate(self, prompt: str | list[int], gen: GenerationConfig | None = None, **kw: object) -> Done:
        for ev in self.stream(prompt, gen, **kw):
            if isinstance(ev, Done):
                return ev
        raise AssertionError("stream ended without Done")

    def stream(self, prompt: str | list[int], gen: GenerationConfig | None = None, *, chat: bool = False,
               system: str | None = None, cache: PromptCache | None = None) -> Iterator[Chunk | Done]:
        """Generate from `prompt`; `cache` (from `prompt_cache()`) reuses an earlier prompt's prefill.

        Closing the iterator early (a client that left) stops the generation at that round.
        """
        gen = gen or GenerationConfig()
        ids = self.encode_prompt(prompt, chat=chat, system=system)
        model = self.target.model
        sampling = gen.sampling
        device = model.device
        # tree drafters (tree.py) declare their nodes per round, chains follow the draft-length policy
        k_max = 0 if self.method.name == "ar" else max(self.method.draft_length.max_k, MAX_DRAFT_TOKENS)
        max_len = min(self.target.config.context_length, len(ids) + gen.max_new_tokens + k_max + 2)
        kept = cache or self.prompt_cache(reuse=False)
        cache = kept.target.cache_for(max_len)
        # target and drafter sample through one Sampler: its penalties count the same context
        sampler = Sampler(sampling, self.target.config.vocab_size, device)
        sampler.start(ids)
        drafter = self._drafter(sampler, max_len, kept.draft)
        # speculative or plain rounds, whichever is measured faster (governor.py)
        governor = Governor(self.method.governor, drafter is not None and self.method.governor.governs(sampling),
                            self._governor_memory)
        # the auto draft length reads the clock where the governor may (draft_length.py)
        policy = DraftLength(self.method.draft_length, timed=governor.active)
        nodes = getattr(drafter, "nodes", None)
        stops = frozenset(gen.stop_token_ids if gen.stop_token_ids is not None else self.tokenizer.eos_ids)
        if gen.ignore_eos:
            stops = frozenset()
        out = _Output(self.tokenizer, gen, stops)
        stats = Stats(method=self.method.name, prompt_tokens=len(ids))

        # hidden states the drafter reads (methods/base.py): asked of every target forward, handed over
        taps: tuple[int, ...] = tuple(getattr(drafter, "taps", ())) if drafter is not None else ()
        t0 = time.perf_counter()
        pre = kept.target.prefill(ids, max_len, logits=True, taps=taps)
        logits = pre.logits  # [1, V]
        first = int(sampler.pick(logits))
        sampler.push([first])
        stats.target_forwards = 1
        stats.cached_prompt_tokens = pre.reused
        stats.prefill_seconds = time.perf_counter() - t0
        yield from out.push([first])  # before the drafter's prefill: the time to the first token is the target's
        t_draft = time.perf_counter()
        if drafter is not None and not out.finished:
            drafter.start(ids, **({"hidden": pre.hidden} if taps else {}))
        t_decode = time.perf_counter()
        stats.prefill_seconds += t_decode - t_draft
        if self._share is not None:
            self._share.start()
        pending = first
        decoded = [first]  # the tokens after the prompt: all but the last (pending) end up in the cache
        ready = getattr(drafter, "ready", None)  # drafters that defer their prompt's prefill (draft_model.py)
        deferred = 0.0
        while not out.finished:
            room = max_len - cache.length - 1  # the forward below writes 1 + k slots
            if room < 0:
                out.finish("length")
                break
            paused = drafter is not None and not governor.speculate  # the governor's plain round
            speculating = drafter is not None and not paused
            k = min(nodes or policy.k, gen.max_new_tokens - out.count - 1, room) if speculating else 0
            if k > 0 and ready is not None:
                # A deferred prompt prefill: the generation's prefill, neither a round's cost nor decoding
                # (HumanEval, hybrid: 14% of the decode seconds when it was counted there)
                t = time.perf_counter()
                ready()
                ready = None
                deferred = time.perf_counter() - t
            ta = time.perf_counter()
            draft = drafter.propose(pending, k) if drafter is not None and k > 0 else None
            tb = time.perf_counter()
            if isinstance(draft, DraftTree):  # every node in one pass, the accepted path kept (tree_round.py)
                r = tree_round(model, cache, sampler, pending, draft, taps)
                new, kd, n = r.tokens, draft.size, len(r.tokens) - 1
                sampler.push(new)
                decoded += new
                drafter.commit([pending] + new[:n], kd, path=r.path, **({"hidden": r.hidden} if taps else {}))
                self._finish_round(stats, governor, None, paused, ta, tb, kd, n)  # trees keep their node count
                yield from out.push(new, drafted=n, proposed=kd)
                pending = new[-1]
                continue
            drafted = draft.tokens if draft is not None else torch.zeros(0, dtype=torch.long, device=device)
            kd = int(drafted.shape[0])
            base = cache.length
            fwd = model(torch.cat([drafted.new_tensor([pending]), drafted]), cache, taps=taps)
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
            decoded += new
            cache.rollback(base + 1 + n)
            if drafter is not None:
                hidden = {"hidden": {t: h[: n + 1] for t, h in fwd.taps.items()}} if taps else {}
                drafter.commit([pending] + new[:n], kd, **hidden)
                policy.update(n, kd)
            self._finish_round(stats, governor, policy, paused, ta, tb, kd, n)
            yield from out.push(new, drafted=n, proposed=kd)
            pending = new[-1]
        stats.decode_seconds = time.perf_counter() - t_decode - deferred
        # a conversation's next prompt may reuse them (prefix.py)
        kept.target.keep_decoded(decoded[:-1])
        if hasattr(drafter, "finish"):
            drafter.finish(decoded[:-1])
        stats.prefill_seconds += deferred
        stats.generated_tokens = out.count
        yield from out.flush()
        yield Done(out.text, out.token_ids, out.reason, stats)

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


class _Output:
    """Turns accepted tokens into emitted text: stop tokens, max tokens, stop strings, streaming."""

    def __init__(self, tokenizer, gen: GenerationConfig, stops: frozenset[int]) -> None:
        self.detok = tokenizer.detokenizer()
        self.gen = gen
        self.stops = stops
        self.token_ids: list[int] = []
        self.text = ""  # emitted text
        self.held = ""  # text that might be the start of a stop string
        self.finished = False
        self.reason = "length"
        self.hold = max((len(s) for s in gen.stop_strings), default=0)
        self.string_hit = False

    @property
    def count(self) -> int:
        return len(self.token_ids)

    def finish(self, reason: str) -> None:
        self.finished, self.reason = True, reason

    def push(self, tokens: list[int], drafted: int = 0, proposed: int = 0) -> Iterator[Chunk]:
        emitted: list[int] = []
        piece = ""
        drafted_chars = None
        for i, t in enumerate(tokens):
            if i == drafted:
                drafted_chars = len(piece)
            if t in self.stops:
                self.finish("stop")
                break
            self.token_ids.append(t)
            emitted.append(t)
            new = self.detok.push(t)
            if self.gen.stop_strings:
                new, hit = self._scan(new)
                piece += new
                if hit:
                    self.string_hit = True
                    self.finish("stop")
                    break
            else:
                piece += new
            if self.count >= self.gen.max_new_tokens:
                self.finish("length")
                break
        if piece or emitted:
            self.text += piece
            n = min(drafted, len(emitted))
            yield Chunk(piece, emitted, n, len(piece) if drafted_chars is None else drafted_chars, proposed)

    def _scan(self, piece: str) -> tuple[str, bool]:
        """Return the text safe to emit and whether a stop string was hit (text cut before it)."""
        buf = self.held + piece
        cut = min((i for i in (buf.find(s) for s in self.gen.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return buf[:cut], True
        # Keep back the longest tail that could still grow into a stop string.
        keep = 0
        for n in range(1, min(self.hold, len(buf) + 1)):
            if any(s.startswith(buf[-n:]) for s in self.gen.stop_strings):
                keep = n
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> Iterator[Chunk]:
        if self.string_hit:  # the text ends before the stop string; nothing more to say
            return
        rest = self.detok.flush()
        if self.gen.stop_strings:
            rest, hit = self._scan(rest)
            if not hit:
                rest += self.held
            self.held = ""
        if rest:
            self.text += rest
            yield Chunk(rest, [])

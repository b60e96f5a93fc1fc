"""Distribution tests through the whole engine, shared by the method test files: the exact marginals and
joint distribution of target-only sampling (every continuation enumerated with the full-sort reference
sampler), many seeded runs of an engine counted per position and per prefix, and the chi-square of each
position and of the joint of the first tokens against them. Runs may generate more tokens than are
checked, so that the engine's budget (capped by the tokens left) lets deep trees and long chains through."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from scipy.stats import chisquare

import speculant.decoding.engine as engine_module
import speculant.decoding.tree_round as tree_module
from speculant.exact.distributions import Dist
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.exact.sampler import SamplingConfig
from test_sampling import reference_probs


def exact_paths(target, prompt: list[int], sampling: SamplingConfig, n_tokens: int) -> list[list[tuple]]:
    """Every continuation under target-only sampling: per position j, (prefix of j tokens, its probability,
    the next token's distribution [V]) for each prefix of nonzero probability."""
    m = target.model
    V = target.config.vocab_size
    levels = []
    frontier = [((), 1.0)]
    for _ in range(n_tokens):
        level, nxt = [], []
        for ctx, w in frontier:
            c = m.new_cache(len(prompt) + n_tokens)
            p = reference_probs(m(torch.tensor(prompt + list(ctx)), c, logit_rows=slice(-1, None)).logits[0], sampling,
                                prompt + list(ctx))
            level.append((ctx, w, p))
            nxt += [(ctx + (x,), w * float(p[x])) for x in range(V) if p[x] > 0]
        levels.append(level)
        frontier = nxt
    return levels


def exact_marginals(target, prompt: list[int], sampling: SamplingConfig, n_tokens: int) -> torch.Tensor:
    """P(x_j) [n_tokens, V] for j = 1..n_tokens under target-only sampling, by enumerating every continuation."""
    levels = exact_paths(target, prompt, sampling, n_tokens)
    return torch.stack([sum(w * p for _, w, p in level) for level in levels])


def exact_memo() -> Callable[..., torch.Tensor]:
    """`exact_marginals` computed once per (target key, prompt, sampler, tokens), for a module-scoped fixture:
    cases that share a target and a sampler enumerate it once. The key names the target's build (the caller's
    tiny_model arguments): `get(key, target, prompt, sampling, n_tokens)`."""
    memo: dict[tuple, torch.Tensor] = {}

    def get(key, target, prompt: list[int], sampling: SamplingConfig, n_tokens: int) -> torch.Tensor:
        k = (key, tuple(prompt), sampling, n_tokens)
        if k not in memo:
            memo[k] = exact_marginals(target, prompt, sampling, n_tokens)
        return memo[k]

    return get


def exact_joint(levels: list[list[tuple]], n: int) -> torch.Tensor:
    """P(x_1..x_n) flattened [V**n] (x_1 most significant) from `exact_paths`' levels."""
    V = levels[0][0][2].shape[0]
    joint = torch.zeros(V ** n)
    for ctx, w, p in levels[n - 1]:
        i = sum(x * V ** (n - 2 - j) for j, x in enumerate(ctx)) * V if n > 1 else 0
        joint[i : i + V] = w * p
    return joint


@dataclass(slots=True)
class Runs:
    """What `runs` seeded generations of n_tokens produced."""

    runs: int
    counts: torch.Tensor  # [n_tokens, V]: how often each token came at each position
    drafted: int = 0
    accepted: int = 0
    paused: int = 0  # plain rounds the governor chose
    grew: bool = False  # some round drafted more than one token
    joint: torch.Tensor | None = None  # [V**n] counts of the first n tokens (x_1 most significant)
    longest: int = 0  # the most drafts any round accepted

    def check_rounds(self, governed: bool) -> None:
        """Drafts were both accepted and rejected; the governor paused rounds only where it governs."""
        assert 0 < self.accepted < self.drafted, (self.accepted, self.drafted)
        assert (self.paused > self.runs // 5) if governed else self.paused == 0, self.paused

    def pvalues(self, exp: torch.Tensor) -> list[float]:
        """The chi-square p-value of each position against the marginals `exp` [n_tokens, V] (cells
        expecting more than 5 draws; those must hold nearly every draw)."""
        out = []
        for j in range(self.counts.shape[0]):
            keep = exp[j] * self.runs > 5
            obs, ex = self.counts[j][keep], exp[j][keep] * self.runs
            if obs.sum() < 0.995 * self.runs:  # draws where the target puts (next to) no mass: rejected
                out.append(0.0)
                continue
            out.append(float(chisquare(obs.numpy(), (ex * obs.sum() / ex.sum()).numpy()).pvalue))
        return out

    def joint_pvalue(self, exp: torch.Tensor) -> float:
        """The chi-square p-value of the first tokens' joint counts against `exact_joint` (cells expecting
        more than 5 draws; those must hold nearly every draw)."""
        keep = exp * self.runs > 5
        obs, ex = self.joint[keep], exp[keep] * self.runs
        if obs.sum() < 0.99 * self.runs:  # draws where the target puts (next to) no mass: rejected
            return 0.0
        return float(chisquare(obs.numpy(), (ex * obs.sum() / ex.sum()).numpy()).pvalue)


def sample_runs(engine_for: Callable[[int], Engine], prompt: list[int], sampling: SamplingConfig, n_tokens: int,
                vocab: int, runs: int, *, generate: int | None = None, joint: int = 0) -> Runs:
    """Run i generates `generate` (default n_tokens) tokens from `prompt` with engine_for(i) and `sampling`
    seeded 1000 + i; the first n_tokens are counted per position, the first `joint` as one outcome."""
    out = Runs(runs, torch.zeros(n_tokens, vocab), joint=torch.zeros(vocab ** joint) if joint else None)
    for i in range(runs):
        done = engine_for(i).generate(prompt, GenerationConfig(max_new_tokens=generate or n_tokens, ignore_eos=True,
                                                               sampling=replace(sampling, seed=1000 + i)))
        out.counts[torch.arange(n_tokens), torch.tensor(done.token_ids[:n_tokens])] += 1
        if joint:
            out.joint[sum(x * vocab ** (joint - 1 - j) for j, x in enumerate(done.token_ids[:joint]))] += 1
        out.longest = max(out.longest, len(done.stats.accepted_length_histogram) - 1)
        out.drafted += done.stats.drafted_tokens
        out.accepted += done.stats.accepted_tokens
        out.paused += done.stats.paused_rounds
        out.grew |= done.stats.drafted_tokens > done.stats.rounds
    return out


def biased_acceptance(monkeypatch) -> None:
    """The negative control: speculative rounds verify against p to the 8th power (renormalized), so accepted
    drafts and resampled tokens lean to the likeliest token; plain sampling (the first token) is untouched.
    (Squaring p was not always rejected in a few hundred runs: the tiny targets are flat.)"""

    def sharp(p: Dist) -> Dist:
        sq = p.p ** 8
        return Dist(p.ids, sq / sq.sum(-1, keepdim=True), p.vocab)

    chain, tree = engine_module.verify_sampled, tree_module.verify_tree_sampled
    monkeypatch.setattr(engine_module, "verify_sampled", lambda d, q, p, g: chain(d, q, sharp(p), g))
    monkeypatch.setattr(tree_module, "verify_tree_sampled", lambda t, p, g: tree(t, sharp(p), g))

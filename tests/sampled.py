"""Distribution tests through the whole engine, shared by the method test files: the exact marginals of
target-only sampling (every continuation enumerated with the full-sort reference sampler), many seeded
runs of an engine counted per position, and the chi-square of each position against the marginals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from scipy.stats import chisquare

from speculant.engine import Engine, GenerationConfig
from speculant.sampling import SamplingConfig
from test_sampling import reference_probs


def exact_marginals(target, prompt: list[int], sampling: SamplingConfig, n_tokens: int) -> torch.Tensor:
    """P(x_j) [n_tokens, V] for j = 1..n_tokens under target-only sampling, by enumerating every continuation."""
    m = target.model
    V = target.config.vocab_size
    marginals = torch.zeros(n_tokens, V)
    frontier = [((), 1.0)]
    for j in range(n_tokens):
        nxt = []
        for ctx, w in frontier:
            c = m.new_cache(len(prompt) + n_tokens)
            p = reference_probs(m(torch.tensor(prompt + list(ctx)), c, logit_rows=slice(-1, None)).logits[0], sampling,
                                prompt + list(ctx))
            marginals[j] += w * p
            nxt += [(ctx + (x,), w * float(p[x])) for x in range(V) if p[x] > 0]
        frontier = nxt
    return marginals


@dataclass(slots=True)
class Runs:
    """What `runs` seeded generations of n_tokens produced."""

    runs: int
    counts: torch.Tensor  # [n_tokens, V]: how often each token came at each position
    drafted: int = 0
    accepted: int = 0
    paused: int = 0  # plain rounds the governor chose
    grew: bool = False  # some round drafted more than one token

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
            assert obs.sum() >= 0.995 * self.runs, (j, self.counts[j], ex)
            out.append(float(chisquare(obs.numpy(), (ex * obs.sum() / ex.sum()).numpy()).pvalue))
        return out


def sample_runs(engine_for: Callable[[int], Engine], prompt: list[int], sampling: SamplingConfig, n_tokens: int,
                vocab: int, runs: int) -> Runs:
    """Run i generates n_tokens from `prompt` with engine_for(i) and `sampling` seeded 1000 + i."""
    out = Runs(runs, torch.zeros(n_tokens, vocab))
    for i in range(runs):
        done = engine_for(i).generate(prompt, GenerationConfig(max_new_tokens=n_tokens,
                                                               sampling=replace(sampling, seed=1000 + i)))
        out.counts[torch.arange(n_tokens), torch.tensor(done.token_ids)] += 1
        out.drafted += done.stats.drafted_tokens
        out.accepted += done.stats.accepted_tokens
        out.paused += done.stats.paused_rounds
        out.grew |= done.stats.drafted_tokens > done.stats.rounds
    return out

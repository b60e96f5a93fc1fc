"""Sampled output has the target's distribution through the whole engine with logit bias, penalties and min-p
applied to drafted positions, and with smaller KV caches (tests/chain_dist.py)."""

from dataclasses import replace

import pytest

from conftest import tiny_model
from speculant.exact.sampler import SamplingConfig
from chain_dist import FMT, V, check_chain_method
from sampled import exact_memo
from test_engine import PENALTIES

pytestmark = pytest.mark.heavy  # collected first (tests/conftest.py)

# Penalties over a 3-token window (the counts change inside every drafted run, k=3, and tokens leave the window
# as drafts enter it), logit bias and min-p, in one sampler: bias and penalties adjust every row's logits by its
# own drafted prefix, then min-p cuts each row's candidates. Each part moves the checked marginals by more than the
# runs resolve (test_each_part_of_the_sampler_moves_the_marginals), so none rides along unchecked.
SAMPLERS = replace(PENALTIES, min_p=0.25, logit_bias={2: 0.6, 0: -0.4})
PROMPT = [0, 1, 2, 3] * 2 + [0, 1]  # chain_dist's prompt (no window)


@pytest.fixture(scope="module")
def exact():
    return exact_memo()


@pytest.mark.parametrize("method, sampling", [
    *((m, SAMPLERS) for m in ("draft", "lookup", "hybrid", "hybrid-always", "hybrid-never")),
    ("hybrid-f16", SamplingConfig(1.0, top_p=0.9)),  # float16 KV caches (--kv-dtype f16), target and draft
    ("hybrid-q8", SamplingConfig(1.0, top_p=0.9)),  # q8_0 KV caches, target and draft (heads of 32 values)
])
def test_every_generated_position_has_the_targets_distribution(method, sampling, monkeypatch, exact):
    check_chain_method(method, sampling, monkeypatch, exact)


def test_each_part_of_the_sampler_moves_the_marginals(exact):
    """With min-p, the penalties or the bias changed or left out, the exact marginals of the cases above move by more
    than 0.03 of a position's mass somewhere (about 3.5 standard errors of 3000 runs): each part is checked, not
    only present."""
    target = tiny_model(V, seed=5, logit_scale=0.2, fmt=FMT)  # the cases' target
    got = exact((FMT, "f32"), target, PROMPT, SAMPLERS, 4)
    for other in (replace(SAMPLERS, min_p=0.0), replace(SAMPLERS, min_p=0.2),
                  replace(SAMPLERS, repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0),
                  replace(SAMPLERS, frequency_penalty=0.6), replace(SAMPLERS, repeat_penalty=1.2),
                  replace(SAMPLERS, repeat_last_n=4), replace(SAMPLERS, logit_bias={2: 0.5, 0: -0.4})):
        assert float((exact((FMT, "f32"), target, PROMPT, other, 4) - got).abs().max()) > 0.03, other

"""The gated delta rule's C kernel (kernels/delta.c) against its torch mirror (models/delta_rule.py), bit for bit,
and the chunked form a long prompt takes."""

import pytest
import torch

from speculant.models import delta_rule as dr


def _inputs(S, H, K, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(S, H, K, generator=g), dim=-1) for _ in range(2))
    return (torch.randn(H, K, V, generator=g), q * K**-0.5, k, torch.randn(S, H, V, generator=g),
            torch.rand(S, H, generator=g), torch.rand(S, H, generator=g) * 0.5 + 0.5)


@pytest.mark.parametrize("S,H,K,V", [(1, 4, 16, 16), (5, 4, 16, 16), (1, 3, 128, 128), (9, 2, 128, 128),
                                     (3, 2, 24, 40)])
def test_the_kernel_is_its_torch_mirror_bit_for_bit(S, H, K, V):
    if dr._kernel() is None:
        pytest.skip("the x86 kernels do not build here: torch's mirror is the only path")
    args = _inputs(S, H, K, V)
    want_states, want_out = dr.delta_rule_reference(*args)
    states, out = dr.delta_rule(*args)
    assert len(states) == S and all(torch.equal(a, b) for a, b in zip(states, want_states))
    assert torch.equal(out, want_out)
    assert want_out.abs().max() > 0.01  # outputs that say something


@pytest.mark.parametrize("route", ["native", "torch"])
def test_a_pass_is_its_tokens_one_at_a_time_and_chunks_keep_the_last_state(route, monkeypatch):
    if route == "torch":  # as where the x86 kernels do not build
        monkeypatch.setattr(dr, "_kernel", lambda: None)
    S = dr.CHUNK + 7
    state, q, k, v, beta, decay = _inputs(S, 2, 16, 16, seed=1)
    states, out = dr.delta_rule(state, q, k, v, beta, decay)
    s, outs = state, []
    for t in range(S):
        (s,), o = dr.delta_rule(s, q[t : t + 1], k[t : t + 1], v[t : t + 1], beta[t : t + 1], decay[t : t + 1])
        outs.append(o)
        assert torch.equal(s, states[t])
    assert torch.equal(torch.cat(outs), out)
    last, chunked = dr.delta_rule(state, q, k, v, beta, decay, every=False)
    assert len(last) == 1 and torch.equal(last[0], states[-1]) and torch.equal(chunked, out)


def test_the_torch_mirror_is_the_recurrence():
    """The mirror against the delta rule written plainly (transformers' recurrent form), to float32 rounding."""
    state, q, k, v, beta, decay = _inputs(4, 2, 16, 16, seed=2)
    states, out = dr.delta_rule_reference(state, q, k, v, beta, decay)
    s = state.double()
    for t in range(4):
        s = s * decay[t, :, None, None].double()
        mem = torch.einsum("hk,hkv->hv", k[t].double(), s)
        s = s + k[t].double()[:, :, None] * ((v[t].double() - mem) * beta[t, :, None].double())[:, None, :]
        assert torch.allclose(states[t].double(), s, atol=1e-5)
        assert torch.allclose(out[t].double(), torch.einsum("hk,hkv->hv", q[t].double(), s), atol=1e-5)

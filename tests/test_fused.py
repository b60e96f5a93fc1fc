"""The fused C blocks (speculant/kernels/blocks.c, models/fused.py) against the per-layer path they mirror, for
every architecture's switches (tests/tiny_archs.py: Qwen3's q/k norms, Gemma 3's norms after attention and MLP,
GeGLU, embedding scale, sliding-window layers with their own rotary base and another query scale, SmolLM3's
layers without a rotary): logits, taps and the KV cache bit for bit, for a prompt several windows long, decoding,
a verification pass and a tree of drafts. And the GeGLU row kernel (rows.c) against torch's tanh GELU."""

from __future__ import annotations

import pytest
import torch

from speculant.models import native
from speculant.models.build import build_transformer
from speculant.models.cache import kv_dtype as kv_dtype_of
from speculant.models.load_hf import HFSource
from speculant.models.row_ops import geglu
from speculant.models.transformer import FINAL_HIDDEN
from tiny_archs import prompt, save_arch

pytestmark = pytest.mark.skipif(not native.available(), reason="the x86 kernels need AVX2 and gcc")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return lambda name: save_arch(root / name, name)


def passes(model, kv: str, taps: tuple[int, ...]) -> list:
    """Every output of a prompt (chunks of short passes where the fused prefill route leads), a decode step,
    a 5-row verification pass and a tree at positions base + depth, and the cache after each."""
    model.kv_dtype = kv_dtype_of(kv)
    ids = torch.tensor(prompt(40, seed=5))
    cache = model.new_cache(96)
    outs = [model(ids[:31], cache, taps=taps), model(ids[31:], cache, taps=taps)]  # longer than the window of 8
    outs.append(model(torch.tensor([7]), cache, taps=taps))
    outs.append(model(torch.tensor([5, 17, 99, 3, 64]), cache, taps=taps))
    n = cache.length
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]],
                        dtype=torch.bool)
    outs.append(model(torch.tensor([9, 8, 7, 6, 5]), cache, positions=torch.tensor([n, n + 1, n + 2, n + 1, n + 2]),
                      mask=mask, taps=taps))
    result = []
    for o in outs:
        result += [o.logits] + [o.taps[t] for t in taps]
    return result + [cache.k[:, :, : cache.length].clone(), cache.v[:, :, : cache.length].clone()]


@pytest.mark.parametrize("kv", ("f32", "f16"))
@pytest.mark.parametrize("fmt", ("q8_0", "q4_k"))
@pytest.mark.parametrize("name", ("qwen3", "gemma3", "gemma3-scaled", "smollm3", "llama3.2"))
def test_fused_blocks_are_the_per_layer_path_bit_for_bit(folders, name, fmt, kv):
    model = build_transformer(HFSource(folders(name)), fmt, cache_dir=None, progress=False)
    assert model.fused_blocks() is not None  # every architecture takes the fused route now
    taps = (1, model.cfg.n_layers - 1, FINAL_HIDDEN)
    fused = passes(model, kv, taps)
    model._fused = False  # the per-layer path: the same C kernels, called from Python layer by layer
    per_layer = passes(model, kv, taps)
    assert len(fused) == len(per_layer)
    for i, (a, b) in enumerate(zip(fused, per_layer)):
        assert torch.equal(a, b), (name, i, float((a - b).abs().max()))


def test_geglu_kernel_is_torchs_tanh_gelu_within_float32_rounding():
    g = torch.Generator().manual_seed(0)
    gate = torch.cat([torch.randn(7, 64, generator=g) * 3, torch.linspace(-30, 30, 7 * 64).view(7, 64),
                      torch.tensor([[0.0, -0.0, 1e-30, -1e-30, 100.0, -100.0, 1e4, -1e4] * 8])])
    up = torch.randn(gate.shape, generator=g)
    h = torch.cat([gate, up], 1)
    got = geglu(h, 64)
    gelu = torch.nn.functional.gelu(gate.double(), approximate="tanh")
    err = (got.double() - gelu * up.double()).abs()
    # relative where gelu is not vanishing (torch's own float32 GELU, 1 + tanh, loses that below about -3),
    # else within float32 rounding of x * up
    near = gate > -5
    assert float((err / (gelu * up.double()).abs().clamp_min(1e-30))[near].max()) < 3e-6
    assert float((err / (gate.double().abs().clamp_min(1) * up.double().abs())).max()) < 1e-6
    assert torch.equal(got[-1, :2], torch.zeros(2))  # gelu(0) * up is 0
    rows = torch.cat([geglu(h[i : i + 1], 64) for i in range(h.shape[0])])  # a row alone: the same bits
    assert torch.equal(rows, got)

"""Tree passes: every node's logits and taps are bit-identical to its path scored as a chain and one
token at a time, on the fused C path, the per-layer C path and the torch fallback; the kept path
leaves the KV cache the chain would have.

Every format is batch-invariant in short passes (float32 runs them row by row through the M = 1
call, formats/base.py; the GGML formats' integer kernel is per row), so a node also equals its path
scored one token at a time, on every path."""

import pytest
import torch

from speculant.models.cache import KVCache, kv_dtype as kv_dtype_of
from speculant.models.row_ops import native_kernels
from speculant.models.transformer import FINAL_HIDDEN
from speculant.exact.tree import DraftTree

from conftest import tiny_model


def clone(c: KVCache) -> KVCache:
    n = KVCache(c.k.shape[0], c.k.shape[1], c.head_dim, c.max_len, c.k.dtype, c.k.device)
    n.k.copy_(c.k), n.v.copy_(c.v)
    n.length = c.length
    return n


def random_tree(n: int, vocab: int, g: torch.Generator) -> DraftTree:
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
    return DraftTree(torch.randint(0, vocab, (n,), generator=g), parents)


def check_tree(model, prompt_len: int, n_nodes: int, seed: int, taps=(0, FINAL_HIDDEN)):
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    cache = model.new_cache(128)
    model(torch.randint(0, V, (prompt_len,), generator=g), cache, logit_rows=slice(0, 0))
    base = cache.length
    pending = torch.randint(0, V, (1,), generator=g)
    tree = random_tree(n_nodes, V, g)
    tc = clone(cache)
    out = model(torch.cat([pending, tree.tokens]), tc, positions=tree.positions(base), mask=tree.ancestor_mask(),
                taps=taps)
    assert tc.length == base + 1 + n_nodes
    for i in [-1] + list(range(n_nodes)):
        path = tree.path(i)
        chain = clone(cache)
        ref = model(torch.cat([pending, tree.tokens[path]]), chain, taps=taps)
        row, last = i + 1, len(path)
        assert torch.equal(out.logits[row], ref.logits[last]), (i, path)
        for t in taps:
            assert torch.equal(out.taps[t][row], ref.taps[t][last]), (i, t)
        step = clone(cache)  # one token at a time
        for tok in torch.cat([pending, tree.tokens[path]]):
            one = model(tok[None], step)
        assert torch.equal(out.logits[row], one.logits[0])
    # keep the deepest path: the cache is the chain's
    leaf = max(range(n_nodes), key=lambda j: tree.depth[j])
    path = tree.path(leaf)
    tc.keep(base, torch.tensor([0] + [p + 1 for p in path]))
    chain = clone(cache)
    model(torch.cat([pending, tree.tokens[path]]), chain)
    assert tc.length == chain.length
    assert torch.equal(tc.k[:, :, : tc.length], chain.k[:, :, : tc.length])
    assert torch.equal(tc.v[:, :, : tc.length], chain.v[:, :, : tc.length])


def heads(kv: str, dim: int = 64) -> dict:
    """The tiny models' shape: heads of 16 values, or of 32 (twice the width) for q8_0's 32-value blocks."""
    return dict(dim=2 * dim if kv == "q8_0" else dim)


@pytest.mark.parametrize("fmt, kv", [("float32", "f32"), ("q8_0", "f32"), ("q4_1", "f32"), ("float32", "f16"),
                                     ("q8_0", "f16"), ("float32", "q8_0"), ("q8_0", "q8_0")])
@pytest.mark.parametrize("prompt_len", [5, 16, 21])
def test_tree_rows_equal_their_chains(fmt, kv, prompt_len):
    model = tiny_model(40, seed=3, heads=4, kv_heads=2, hidden=128, layers=3, fmt=fmt, kv_dtype=kv, **heads(kv)).model
    assert model.new_cache(8).k.dtype == kv_dtype_of(kv)
    if fmt != "float32" and native_kernels() is not None:
        assert model.fused_blocks() is not None  # the fused C path is the one under test
    check_tree(model, prompt_len, 14, seed=prompt_len)
    check_tree(model, prompt_len, 31, seed=prompt_len + 1)  # the largest short pass


@pytest.mark.parametrize("kv", ["f32", "f16", "q8_0"])
def test_tree_rows_without_the_fused_loop_and_without_c(native_kernels_as, kv):
    model = tiny_model(40, seed=4, heads=4, kv_heads=1, hidden=128, layers=2, fmt="q8_0", kv_dtype=kv,
                       **heads(kv)).model
    model._fused = False  # the per-layer path: attn_rows_masked in C, linears per layer
    check_tree(model, 11, 12, seed=0, taps=(1, FINAL_HIDDEN))
    native_kernels_as(None)  # torch only (no compiler / not x86)
    model = tiny_model(40, seed=4, heads=4, kv_heads=1, hidden=128, layers=2, kv_dtype=kv, **heads(kv)).model
    check_tree(model, 11, 12, seed=1)


def test_long_tree_passes_take_sdpa_and_bad_masks_are_clear_errors():
    model = tiny_model(40, seed=5, dim=64, heads=4, kv_heads=2, hidden=128).model
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(128)
    model(torch.randint(0, 40, (9,), generator=g), cache)
    tree = random_tree(39, 40, g)
    tokens = torch.cat([torch.tensor([1]), tree.tokens])
    a = model(tokens, clone(cache), positions=tree.positions(9), mask=tree.ancestor_mask()).logits
    full = torch.cat([torch.ones(40, 9, dtype=torch.bool), tree.ancestor_mask()], 1)
    b = model(tokens, clone(cache), positions=tree.positions(9), mask=full).logits
    assert torch.equal(a, b)
    leaf = max(range(39), key=lambda j: tree.depth[j])
    ref = model(torch.cat([torch.tensor([1]), tree.tokens[tree.path(leaf)]]), clone(cache)).logits[-1]
    torch.testing.assert_close(a[leaf + 1], ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(Exception, match="attention mask must be"):
        model(tokens[:4], clone(cache), mask=torch.ones(4, 5, dtype=torch.bool))


@pytest.mark.real
def test_real_smollm2_tree_rows_equal_their_chains(real_model_cache):
    model = real_model_cache("smollm2-135m-instruct", "gguf").model
    assert model.fused_blocks() is not None
    n_layers = model.cfg.n_layers
    check_tree(model, 37, 20, seed=0, taps=(2, n_layers // 2, n_layers - 1, FINAL_HIDDEN))

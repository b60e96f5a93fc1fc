"""Transformer + KV cache contracts on tiny random models (float32 and int8)."""

import pytest
import torch

from conftest import tiny_model
from speculant.errors import SpeculantError
from speculant.models.cache import q8_0_values


@pytest.mark.parametrize("fmt", ["float32", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_k_tokens_in_one_pass_equal_one_by_one(fmt, arch):
    m = tiny_model(64, arch=arch, fmt=fmt).model
    prompt, new = torch.tensor([1, 5, 9, 2, 7]), torch.tensor([3, 8, 11, 4])
    c1 = m.new_cache(32)
    m(prompt, c1)
    batched = m(new, c1).logits
    c2 = m.new_cache(32)
    m(prompt, c2)
    single = torch.cat([m(new[i : i + 1], c2).logits for i in range(len(new))])
    if fmt == "int8":  # batch-invariant by construction: bit-identical, so greedy speculation is exact
        assert torch.equal(batched, single)
    else:
        torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)
    assert c1.length == c2.length == 9


@pytest.mark.parametrize("arch,heads,kv_heads,dim,kv", [
    (*shape, kv) for shape in [("llama", 4, 2, 32), ("qwen2", 6, 2, 96), ("qwen2", 2, 2, 256)]
    for kv in ("f32", "f16", "q8_0") if kv != "q8_0" or shape[3] // shape[1] % 32 == 0])  # q8_0: heads of 32s
def test_native_kernels_match_torch_and_are_batch_invariant(arch, heads, kv_heads, dim, kv, native_kernels_as):
    from speculant.models.row_ops import native_kernels

    if native_kernels() is None:
        pytest.skip("the native kernels cannot be built here: the torch path is the only one")
    m = tiny_model(64, arch=arch, heads=heads, kv_heads=kv_heads, dim=dim, fmt="q8_0", kv_dtype=kv).model
    prompt = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(3))  # a batched prefill
    new = torch.tensor([3, 8, 11, 4, 60, 1, 2])

    def run(native: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        native_kernels_as(native_kernels.__wrapped__() if native else None)
        c = m.new_cache(64)
        m(prompt, c)
        batched = m(new, c).logits
        c.rollback(len(prompt))
        single = torch.cat([m(new[i : i + 1], c).logits for i in range(len(new))])
        return batched, single, c.k[:, :, : c.length].clone()

    nb, ns, nk = run(True)
    tb, ts, tk = run(False)
    assert torch.equal(nb, ns)  # rows are computed alike whatever their number: bit-identical
    if kv == "f32":  # and the same layer as torch's
        torch.testing.assert_close(nb, tb, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(nk, tk, atol=2e-5, rtol=2e-5)  # rotated keys written to the same slots
        return
    # float16: where C's and torch's float32 rotations differ in their last bit, a key can round to the next
    # float16 (2^-11 apart), or (q8_0) to the next step of its block (1/127 of its largest); the prompt's keys
    # are that close, and 8-bit activations (q8_0 weights) turn such differences into ~1% of the logits' range,
    # as in the long-prompt test below
    if kv == "q8_0":
        nk, tk = q8_0_values(nk), q8_0_values(tk)
        torch.testing.assert_close(nk[:, :, :40], tk[:, :, :40], atol=float(tk.abs().max()) / 127, rtol=0)
    else:
        torch.testing.assert_close(nk[:, :, :40].float(), tk[:, :, :40].float(), atol=1e-3, rtol=2**-10)
    torch.testing.assert_close(nb, tb, atol=0.02 * float(tb.abs().max()), rtol=0)


def test_native_rms_norm_and_swiglu_match_torch_row_by_row():
    import torch.nn.functional as F

    from speculant.models import row_ops

    if row_ops.native_kernels() is None:
        pytest.skip("the native kernels cannot be built here: the torch path is the only one")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 72, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0])[:, None]
    w = torch.randn(72, generator=g)
    h = torch.randn(5, 2 * 40, generator=g) * 6  # gates far into both tails of the sigmoid
    h[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    norm, act = row_ops.rms_norm(x, w, 1e-6), row_ops.swiglu(h, 40)
    torch.testing.assert_close(norm, F.rms_norm(x, (72,), w, 1e-6), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(act, F.silu(h[:, :40]) * h[:, 40:], atol=1e-6, rtol=1e-5)
    # each row alone gives the same bits as the row among others
    assert torch.equal(torch.cat([row_ops.rms_norm(x[i : i + 1], w, 1e-6) for i in range(5)]), norm)
    assert torch.equal(torch.cat([row_ops.swiglu(h[i : i + 1], 40) for i in range(5)]), act)


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_rollback_then_refeed_matches_never_going_further(fmt):
    m = tiny_model(64, fmt=fmt).model
    c = m.new_cache(32)
    m(torch.tensor([1, 2, 3, 4]), c)
    ref = m(torch.tensor([5, 6]), c).logits
    m(torch.tensor([9, 9, 9]), c)  # speculative tokens that get rejected
    c.rollback(6)
    m(torch.tensor([10]), c)
    c.rollback(4)
    again = m(torch.tensor([5, 6]), c).logits
    assert torch.equal(ref, again)


def test_explicit_mask_and_positions_reproduce_causal_default():
    m = tiny_model(64).model
    c = m.new_cache(32)
    m(torch.tensor([1, 2, 3]), c)
    base = c.length
    ref = m(torch.tensor([4, 5]), c).logits
    c.rollback(base)
    mask = torch.ones(2, base + 2, dtype=torch.bool).tril(base)
    out = m(torch.tensor([4, 5]), c, positions=torch.tensor([3, 4]), mask=mask).logits
    torch.testing.assert_close(ref, out, atol=1e-5, rtol=1e-5)


def test_tree_branches_see_only_their_ancestors_and_keep_commits_a_path():
    """Two sibling drafts scored in one pass (tree mask) equal scoring each alone; keep() commits one."""
    m = tiny_model(64).model
    c = m.new_cache(32)
    m(torch.tensor([1, 2, 3]), c)
    # tree: root token 4, children 7 and 9 (both at depth 1)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    tree = m(torch.tensor([4, 7, 9]), c, positions=torch.tensor([3, 4, 4]), mask=mask).logits
    c.keep(3, torch.tensor([0, 2]))  # commit root and the second child
    after = m(torch.tensor([6]), c).logits
    c2 = m.new_cache(32)
    m(torch.tensor([1, 2, 3]), c2)
    chain = m(torch.tensor([4, 9]), c2).logits
    torch.testing.assert_close(tree[[0, 2]], chain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, m(torch.tensor([6]), c2).logits, atol=1e-5, rtol=1e-5)


def test_taps_return_requested_layers_and_logit_rows():
    m = tiny_model(64, layers=3).model
    out = m(torch.tensor([1, 2, 3]), m.new_cache(8), taps=(0, 2), logit_rows=slice(-1, None))
    assert set(out.taps) == {0, 2} and out.taps[0].shape == (3, 32)
    assert out.logits.shape == (1, 64)


@pytest.mark.parametrize("fmt", ["float32", "q8_0"])
def test_long_prompts_go_through_in_chunks_that_match_separate_calls(fmt, monkeypatch, prefill_route):
    from speculant.models import transformer

    monkeypatch.setattr(transformer, "PREFILL_CHUNK", 40)  # 100 tokens: chunks of 40, 40 and 20
    prefill_route("gemm" if "gemm" in prefill_route(None) else None)  # the SDPA chunks (the fused route's: below)
    m = tiny_model(64, fmt=fmt, layers=3, context=256).model
    tokens = torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(4))
    c1, c2 = m.new_cache(128), m.new_cache(128)
    whole = m(tokens, c1, taps=(1,))
    parts = [m(tokens[s : s + 40], c2, taps=(1,)) for s in (0, 40, 80)]
    assert torch.equal(whole.logits, torch.cat([p.logits for p in parts]))
    assert torch.equal(whole.taps[1], torch.cat([p.taps[1] for p in parts]))
    assert c1.length == c2.length == 100 and torch.equal(c1.k, c2.k) and torch.equal(c1.v, c2.v)
    for rows in (slice(-1, None), slice(30, 50), torch.tensor([0, 39, 40, 99]), slice(0, 0)):
        c3 = m.new_cache(128)
        got = m(tokens, c3, logit_rows=rows).logits
        # the output layer over fewer rows may round differently (float32 GEMMs; GGML formats take
        # the integer kernel below 33 rows), so: the same rows, to that precision
        assert got.shape == whole.logits[rows].shape
        ref = whole.logits[rows]
        tol = 0.02 * float(whole.logits.abs().max()) if fmt == "q8_0" else 1e-4  # 8-bit activations vs bf16
        assert torch.allclose(got, ref, atol=tol)
    with pytest.raises(SpeculantError, match="context"):
        m(tokens, c1)  # 100 more do not fit: refused before any chunk runs
    assert c1.length == 100


@pytest.mark.parametrize("kv", ["f32", "q8_0"])
def test_prompts_through_the_fused_route_are_the_bits_of_decoding_them(kv, prefill_route):
    """Where the fused route leads the prefill routes (x86 builds without AMX), a prompt goes through as short
    passes of the fused blocks, whose rows are batch-invariant: the prompt's logits, taps and cache are those
    of feeding it one token at a time, however it is split."""
    from speculant.models.transformer import PREFILL_CHUNK, ROW_WISE_MAX

    routes = prefill_route("fused")
    m = tiny_model(64, fmt="q8_0", layers=3, context=256, dim=64, heads=2, kv_heads=1, kv_dtype=kv).model
    if routes[0] != "fused" or m.fused_blocks() is None:
        pytest.skip("the fused blocks need the x86 kernels")
    assert m.prefill_chunk() == ROW_WISE_MAX
    tokens = torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(5))
    c1, c2, c3 = m.new_cache(128), m.new_cache(128), m.new_cache(128)
    whole = m(tokens, c1, taps=(1,))
    ones = [m(tokens[i : i + 1], c2, taps=(1,)) for i in range(100)]
    assert torch.equal(whole.logits, torch.cat([o.logits for o in ones]))
    assert torch.equal(whole.taps[1], torch.cat([o.taps[1] for o in ones]))
    uneven = [m(tokens[a:b], c3).logits for a, b in ((0, 7), (7, 40), (40, 75), (75, 100))]
    assert torch.equal(whole.logits, torch.cat(uneven))
    assert c1.length == c2.length == c3.length == 100
    assert torch.equal(c1.k, c2.k) and torch.equal(c1.v, c2.v) and torch.equal(c1.k, c3.k)
    last = m(tokens, m.new_cache(128), logit_rows=slice(-1, None)).logits
    assert torch.equal(last, whole.logits[-1:])
    prefill_route("rows")  # another route leads: the SDPA chunks again
    assert m.prefill_chunk() == PREFILL_CHUNK
    f = tiny_model(64, fmt="float32").model  # no fused blocks: the SDPA chunks whatever the route
    prefill_route("fused")
    assert f.prefill_chunk() == PREFILL_CHUNK


def test_context_overflow_is_a_clear_error():
    m = tiny_model(16).model
    c = m.new_cache(4)
    with pytest.raises(SpeculantError, match="context full"):
        m(torch.tensor([1, 2, 3, 4, 5]), c)


def test_int8_tracks_float32():
    f = tiny_model(64, fmt="float32").model
    q = tiny_model(64, fmt="int8").model
    toks = torch.tensor([1, 7, 3, 9, 12, 40])
    a, b = f(toks, f.new_cache(8)).logits, q(toks, q.new_cache(8)).logits
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("fmt", ["float32", "q8_0"])
@pytest.mark.parametrize("kv, row_bytes, tol", [("f16", 64, (5e-3, 0.05)), ("q8_0", 34, (0.05, 0.1))])  # measured:
# f16 0.0016 / 0.036 of the logits' range, q8_0 0.035 / 0.062 (float32 / q8_0 weights; 0.022 / 0.061 before the
# q8_0 cache's rotation: random keys have no outlier channel for it to spread, and it mixes the blocks' errors)
def test_a_smaller_cache_saves_memory_and_tracks_float32(fmt, kv, row_bytes, tol):
    """--kv-dtype f16: 2 bytes a value; q8_0: 34 bytes a block of 32. The logits of a prompt and of decoding after
    it stay close to a float32 cache's (each key and value rounded once: relative error <= 2^-11 for f16, half a
    step of 1/127 of its block's largest for q8_0), yet not the same (it is in use). With 8-bit activations (q8_0
    weights) a random tiny model turns that into a few % of the logits' range (the real models' fidelity: README,
    "KV cache"). Heads of 32 values (q8_0's block)."""
    runs = {}
    for name in ("f32", kv):
        m = tiny_model(64, fmt=fmt, layers=3, dim=64, heads=2, kv_heads=1, kv_dtype=name).model
        c = m.new_cache(64)
        if name == kv:
            assert c.k[0, 0, 0].numel() * c.k.element_size() == c.v[0, 0, 0].numel() * c.v.element_size() == row_bytes
        prompt = m(torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(1)), c).logits
        steps = torch.cat([m(torch.tensor([t]), c).logits for t in (5, 9, 60, 2)])
        runs[name] = torch.cat([prompt, steps])
    scale = float(runs["f32"].abs().max())
    assert not torch.equal(runs[kv], runs["f32"])
    torch.testing.assert_close(runs[kv], runs["f32"], atol=tol[fmt != "float32"] * scale, rtol=0)


def test_a_bad_kv_dtype_is_a_clear_error():
    from speculant.models import load_model
    from speculant.models.cache import KVCache

    with pytest.raises(SpeculantError, match="unknown --kv-dtype 'q8'; choose one of f32, f16, q8_0"):
        load_model("no-such-model", kv_dtype="q8")  # refused before anything loads
    with pytest.raises(SpeculantError, match="holds f32, f16, q8_0, not torch.bfloat16"):
        KVCache(1, 1, 8, 4, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(SpeculantError, match="q8_0 needs heads of whole 32-value blocks; this model's heads have 8"):
        tiny_model(8, kv_dtype="q8_0").model.new_cache(4)

"""The short-pass attention kernel (speculant/kernels/attention.c) on its own: close to a float64
reference, and bit for bit the same whatever the rows that share the pass, the thread count, the
instruction set it was built for, or how its query heads are tiled (group sizes 1..8 cover every
remainder of its 3-head tiles; head sizes 8..128 every remainder of its 32-wide value chunks), with a
float32, a float16 (--kv-dtype f16: stored rounded to nearest even, read back exactly) and a q8_0 cache
(--kv-dtype q8_0: stored as models/cache.py's q8_0_rows, bit for bit, read back exactly as d * q)."""

import ctypes

import pytest
import torch

from speculant.models import native
from speculant.models.cache import KV_DTYPES, hadamard, q8_0_dequantized, q8_0_rows, q8_0_values
from speculant.models.fused import bind_tree_kernels

pytestmark = pytest.mark.skipif(not native.available(), reason="the x86 kernels need AVX2 and gcc")

SHAPES = [(12, 2, 128), (14, 2, 64), (9, 3, 64), (8, 8, 64), (8, 1, 80), (16, 2, 96), (4, 2, 8), (5, 1, 24),
          (7, 7, 32)]  # (query heads, key/value heads, head size): G = 6, 7, 3, 1, 8, 8, 2, 5, 1
KV = list(KV_DTYPES.values())  # f32, f16, q8_0 (its blocks' bytes as int8): the C type code is the place in it


def with_kv(shapes):
    """(H, Hkv, hd, cache dtype) for each shape and cache type that holds it (q8_0: whole 32-value blocks)."""
    return [(*sh, kv) for sh in shapes for kv in KV if kv != torch.int8 or sh[2] % 32 == 0]


def to_cache(x: torch.Tensor, kv: torch.dtype) -> torch.Tensor:
    return q8_0_rows(x) if kv == torch.int8 else x.to(kv)


def values(c: torch.Tensor) -> torch.Tensor:
    """A cache's values as float32 (exactly)."""
    return q8_0_values(c) if c.dtype == torch.int8 else c.float()


def attend(lib: ctypes.CDLL, qkv, kc, vc, cos, sin, start: int, H: int, Hkv: int, mask=None, threads: int = 2):
    """(out [S, H hd], k cache, v cache) after attn_rows_masked on copies of the inputs (caches of their dtype)."""
    qkv, kc, vc = qkv.clone(), kc.clone(), vc.clone()
    S, hd = qkv.shape[0], qkv.shape[1] // (H + 2 * Hkv)
    out = torch.empty(S, H * hd)
    m = None if mask is None else mask.to(torch.uint8).contiguous()
    rc = lib.attn_rows_masked(qkv.data_ptr(), S, H, Hkv, hd, cos.data_ptr(), sin.data_ptr(), kc.data_ptr(),
                              vc.data_ptr(), kc.shape[1], start, None if m is None else m.data_ptr(), out.data_ptr(),
                              KV.index(kc.dtype), threads)
    assert rc == 0
    return out, kc, vc


def reference(qkv, kc, vc, cos, sin, start: int, H: int, Hkv: int, mask=None, stored=None, pos=None, window=0,
              scale=None) -> torch.Tensor:
    """float64 rotate-half rope, then each row's softmax attention over its visible slots; `stored`: the
    (k, v) caches the kernel wrote, whose new rows (rounded to float16, or q8_0) are the keys and values then;
    window > 0: only keys at positions > the row's - window (committed slot j at position j, pass rows at pos)."""
    S, hd = qkv.shape[0], qkv.shape[1] // (H + 2 * Hkv)
    x = qkv.double().view(S, H + 2 * Hkv, hd)
    c, s = cos.double()[:, None], sin.double()[:, None]
    a, b = x[:, : H + Hkv, : hd // 2], x[:, : H + Hkv, hd // 2:]
    qk = torch.cat([a * c - b * s, b * c + a * s], -1)
    k = torch.cat([values(kc).double()[:, :start], qk[:, H:].transpose(0, 1)], 1)  # [Hkv, start + S, hd]
    v = torch.cat([values(vc).double()[:, :start], x[:, H + Hkv:].transpose(0, 1)], 1)
    if stored is not None:
        k, v = values(stored[0]).double()[:, : start + S], values(stored[1]).double()[:, : start + S]
    out = torch.empty(S, H, hd, dtype=torch.float64)
    slot_pos = torch.cat([torch.arange(start), torch.arange(start, start + S) if pos is None else pos])
    for r in range(S):
        seen = torch.arange(start + r + 1) if mask is None else \
            torch.cat([torch.arange(start), start + mask[r].nonzero()[:, 0]])
        if window:
            seen = seen[slot_pos[seen] > slot_pos[start + r] - window]
        for h in range(H):
            kh = h // (H // Hkv)
            w = (k[kh, seen] @ qk[r, h] * (hd**-0.5 if scale is None else scale)).softmax(0)
            out[r, h] = w @ v[kh, seen]
    return out.view(S, H * hd)


def inputs(H: int, Hkv: int, hd: int, start: int, S: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = start + S + 3
    return (torch.randn(S, (H + 2 * Hkv) * hd, generator=g), torch.randn(Hkv, n, hd, generator=g),
            torch.randn(Hkv, n, hd, generator=g), torch.randn(S, hd // 2, generator=g),
            torch.randn(S, hd // 2, generator=g))


def libraries() -> list[tuple[str, ctypes.CDLL]]:
    return [(isa, bind_tree_kernels(native.library(isa))) for isa in native.supported_isas()]


@pytest.mark.parametrize("H,Hkv,hd,kv", with_kv(SHAPES))
@pytest.mark.parametrize("start", [0, 13, 72])
def test_attention_matches_float64_and_every_build_and_thread_count(H, Hkv, hd, start, kv):
    S = 6
    qkv, kc, vc, cos, sin = inputs(H, Hkv, hd, start, S, seed=H * 1000 + hd + start)
    kc, vc = to_cache(kc, kv), to_cache(vc, kv)
    tril = torch.rand(S, S, generator=torch.Generator().manual_seed(start)) < 0.5
    tree = (tril.tril() | torch.eye(S, dtype=torch.bool))
    for mask in (None, tree):
        results = []
        for name, lib in libraries():
            for threads in (1, 2, 3):
                out, k, v = attend(lib, qkv, kc, vc, cos, sin, start, H, Hkv, mask, threads)
                results.append(((name, threads), out, k, v))
        stored = results[0][2:] if kv != torch.float32 else None
        ref = reference(qkv, kc, vc, cos, sin, start, H, Hkv, mask, stored)
        err = (results[0][1].double() - ref).abs().max() / ref.abs().max()
        assert err < 1e-5, float(err)
        first = results[0]
        for r in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(first[1:], r[1:])), (first[0], r[0], mask is None)


def test_a_float16_cache_stores_the_float32_rows_rounded_to_nearest_even():
    """The rows a pass writes to a float16 cache are those it writes to a float32 one, rounded as torch's
    .half() rounds them (so the C path and torch's cache.write store the same bits); other slots untouched."""
    H, Hkv, hd, start, S = 12, 2, 128, 40, 5
    qkv, kc, vc, cos, sin = inputs(H, Hkv, hd, start, S, seed=7)
    qkv = qkv * 3e4  # past float16's range: inf
    v0 = (H + Hkv) * hd  # row 0's first value vector: into float16's subnormals (below 2^-14)
    qkv[0, v0:v0 + hd] = torch.linspace(-3e-5, 3e-5, hd)
    for _, lib in libraries():
        _, k32, v32 = attend(lib, qkv, kc, vc, cos, sin, start, H, Hkv)
        _, k16, v16 = attend(lib, qkv, kc.half(), vc.half(), cos, sin, start, H, Hkv)
        new = slice(start, start + S)
        assert torch.equal(k16[:, new], k32[:, new].half()) and torch.equal(v16[:, new], v32[:, new].half())
        assert torch.equal(k16[:, :start], kc[:, :start].half()) and torch.equal(v16[:, start + S:], vc[:, start + S:].half())
        stored = v16[:, new].float()
        assert torch.isinf(stored).any()  # the overflow case was exercised, and gradual underflow:
        assert ((stored != 0) & (stored.abs() < 2**-14)).sum() > hd // 2


@pytest.mark.parametrize("H,Hkv,hd,kv", with_kv(SHAPES[:6]))
def test_a_rows_output_is_the_same_alone_or_with_others(H, Hkv, hd, kv):
    """Row r of a causal pass of S rows equals that token's pass alone after rows 0..r-1 (speculative
    verification reproduces one-token decoding), with contexts across the 8-key groups and 32-key blocks."""
    _, lib = libraries()[0]
    for start in (5, 31, 64):
        S = 9
        qkv, kc, vc, cos, sin = inputs(H, Hkv, hd, start, S, seed=start + hd)
        kc, vc = to_cache(kc, kv), to_cache(vc, kv)
        out, k_all, v_all = attend(lib, qkv, kc, vc, cos, sin, start, H, Hkv)
        kc1, vc1 = kc.clone(), vc.clone()
        for r in range(S):
            one, kc1, vc1 = attend(lib, qkv[r:r + 1].contiguous(), kc1, vc1, cos[r:r + 1].contiguous(),
                                   sin[r:r + 1].contiguous(), start + r, H, Hkv)
            assert torch.equal(one[0], out[r]), (start, r)
        assert torch.equal(kc1, k_all) and torch.equal(vc1, v_all)


def test_a_q8_0_cache_stores_the_float32_rows_as_torchs_quantizer_does():
    """The rows a pass writes to a q8_0 cache are q8_0_rows of those it writes to a float32 one, bit for bit (so the
    C path and torch's cache.write store the same bytes): the same Walsh-Hadamard butterflies, then the same blocks
    for scales across magnitudes, an all-zero block, halves that round to even, fp16-subnormal scales; other slots
    untouched. The special blocks are made in the rotated space: a value vector hadamard(y) / 128 rotates back to
    y exactly (small dyadic values: every butterfly sum is exact)."""
    H, Hkv, hd, start, S = 12, 2, 128, 40, 5
    qkv, kc, vc, cos, sin = inputs(H, Hkv, hd, start, S, seed=9)
    qkv = qkv * torch.logspace(-4, 3, S)[:, None]
    v0 = (H + Hkv) * hd  # the first value vector of a row
    y = torch.zeros(2, hd)  # row 0: block 0 all zero; block 1 amax 127, so d = 1 and halves are ties
    y[0, 32:64] = torch.tensor([127.0, -127.0] + [k + 0.5 for k in range(-15, 15)])
    y[0, 64:] = torch.arange(64.0) - 32
    y[0, 64], y[0, 96] = 127.0, -127.0  # blocks 2, 3: d = 1, integers kept exactly
    y[1] = (torch.arange(hd) % 201 - 100) * 2.0 ** -20  # row 1: every scale under fp16's normal range (d < 2^-14)
    qkv[:2, v0:v0 + hd] = hadamard(y) / hd
    assert torch.equal(hadamard(qkv[:2, v0:v0 + hd]), y)
    for _, lib in libraries():
        _, k32, v32 = attend(lib, qkv, kc, vc, cos, sin, start, H, Hkv)
        _, k8, v8 = attend(lib, qkv, q8_0_rows(kc), q8_0_rows(vc), cos, sin, start, H, Hkv)
        new = slice(start, start + S)
        assert torch.equal(k8[:, new], q8_0_rows(k32[:, new])) and torch.equal(v8[:, new], q8_0_rows(v32[:, new]))
        assert torch.equal(k8[:, :start], q8_0_rows(kc[:, :start])) and \
            torch.equal(v8[:, start + S:], q8_0_rows(vc[:, start + S:]))
        got = q8_0_dequantized(v8[0, start:start + 2])  # the blocks as stored, in the rotated space
        assert torch.equal(got[0, :32], torch.zeros(32))
        assert got[0, 34:64].tolist() == [float(round(k + 0.5)) for k in range(-15, 15)]  # Python rounds to even too
        assert torch.equal(got[0, 64:], y[0, 64:])
        scales = v8[0, start + 1].view(-1, 34)[:, :2].contiguous().view(torch.float16).float()
        assert (0 < scales).all() and (scales < 2.0 ** -14).all() and 0 < got[1].abs().max() < 2e-4
    err = (q8_0_values(v8[:, new]) - v32[:, new]).abs().max() / v32[:, new].abs().max()
    # a rotated value is within half a step (its block's amax / 254); rotated back, the steps of a row's blocks mix
    # (measured here: 0.0049 of the largest value)
    assert 0 < err < 1 / 100


def attend_ex(lib: ctypes.CDLL, qkv, kc, vc, cos, sin, start: int, H: int, Hkv: int, mask, pos, window: int,
              scale: float, threads: int = 2):
    """attend's (out, k cache, v cache) through attn_rows_ex: rows at positions `pos` (None: their slots), a
    sliding window (0: none) and a query scale (0: hd ** -0.5)."""
    qkv, kc, vc = qkv.clone(), kc.clone(), vc.clone()
    S, hd = qkv.shape[0], qkv.shape[1] // (H + 2 * Hkv)
    out = torch.empty(S, H * hd)
    m = None if mask is None else mask.to(torch.uint8).contiguous()
    p = None if pos is None else pos.to(torch.int64).contiguous()
    rc = lib.attn_rows_ex(qkv.data_ptr(), S, H, Hkv, hd, cos.data_ptr(), sin.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                          kc.shape[1], start, None if m is None else m.data_ptr(), None if p is None else p.data_ptr(),
                          window, scale, out.data_ptr(), KV.index(kc.dtype), threads)
    assert rc == 0
    return out, kc, vc


@pytest.mark.parametrize("H,Hkv,hd,kv", with_kv([(12, 2, 128), (8, 1, 80), (5, 1, 24)]))
@pytest.mark.parametrize("start,window", [(3, 11), (13, 11), (45, 11), (45, 2)])
def test_a_sliding_window_keeps_the_keys_within_it_and_tree_rows_equal_their_chains(H, Hkv, hd, kv, start, window):
    """A sliding-window layer (Gemma 3's local layers): each row sees the keys at positions within the window of
    its own, close to float64, the same bits on every build and thread count; a tree row (positions start + depth)
    gives the bits of its path scored as a causal chain, for windows that reach back past every committed slot, into
    them (across groups of 8) and not even to the last one (window 2 at depth 3)."""
    S, scale = 6, 0.07
    parents = [-1, 0, 1, 0, 3, 2]
    depth = [0] * S
    for i, par in enumerate(parents):
        depth[i] = 0 if par < 0 else depth[par] + 1
    mask = torch.eye(S, dtype=torch.bool)
    for i in range(S):
        j = parents[i]
        while j >= 0:
            mask[i, j], j = True, parents[j]
    pos = start + torch.tensor(depth)
    qkv, kc, vc, cos, sin = inputs(H, Hkv, hd, start, S, seed=start * 7 + hd)
    kc, vc = to_cache(kc, kv), to_cache(vc, kv)
    results = [attend_ex(lib, qkv, kc, vc, cos, sin, start, H, Hkv, mask, pos, window, scale, threads)
               for _, lib in libraries() for threads in (1, 2, 3)]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], r))
    out, k_tree, v_tree = results[0]
    ref = reference(qkv, kc, vc, cos, sin, start, H, Hkv, mask, (k_tree, v_tree) if kv != torch.float32 else None,
                    pos, window, scale)
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    lib = libraries()[0][1]
    for i in range(S):
        path = [j for j in range(S) if mask[i, j]]  # ancestors in order, then the row
        chain, _, _ = attend_ex(lib, qkv[path].contiguous(), kc, vc, cos[path].contiguous(), sin[path].contiguous(),
                                start, H, Hkv, None, None, window, scale)
        assert torch.equal(chain[-1], out[i]), (i, path)
        alone, _, _ = attend_ex(lib, qkv[path].contiguous(), kc, vc, cos[path].contiguous(), sin[path].contiguous(),
                                start, H, Hkv, None, start + torch.arange(len(path)), window, scale)
        assert torch.equal(alone, chain)  # positions given, equal to the slots: the same bits

"""The GGML block-format kernels (speculant/kernels/gq.c) against float64 references built with the
`gguf` package's dequantizers, bit-identity across row counts and across every build this CPU runs,
and the model built on them (models/formats/ggml*.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants

from speculant.errors import SpeculantError
from speculant.models import native
from speculant.models.formats.ggml import GGMLEmbedding, GGMLLinear
from speculant.models.formats.ggml_blocks import Part, row_bytes
from speculant.models.formats.ggml_tiles import PACKED_TYPES

TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# byte offsets of each type's fp16 scale fields (d, and dmin / m where the type has one)
_F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82),
               T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(t: T, n: int, k: int, seed: int) -> np.ndarray:
    """[n, row_bytes] uint8: random bits in every quant field, sane random fp16 scales (any bit pattern
    of the integer fields is a valid block)."""
    rng = np.random.default_rng(seed)
    if t in (T.F32, T.F16, T.BF16):
        w = rng.standard_normal((n, k)).astype(np.float32)
        return np.ascontiguousarray(quants.quantize(w, t)) if t == T.BF16 else \
            np.ascontiguousarray(w.astype(np.float16 if t == T.F16 else np.float32)).view(np.uint8)
    block, size = GGML_QUANT_SIZES[t]
    data = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[t]:
        scales = (rng.uniform(0.002, 0.02, size=(n, k // block)) * rng.choice([-1, 1], size=(n, k // block)))
        data[:, :, off:off + 2] = scales.astype(np.float16)[..., None].view(np.uint8).reshape(n, k // block, 2)
    return data.reshape(n, -1)


def dequant(t: T, data: np.ndarray, k: int) -> np.ndarray:
    return quants.dequantize(data, t).reshape(data.shape[0], k).astype(np.float32)


def q8_reference(x: torch.Tensor, t: T) -> torch.Tensor:
    """The activations as the kernel sees them: int8 per block of 32 (256 for K-quants), float32 scale
    absmax / 127, round to nearest even; returned dequantized in float64."""
    if t in (T.F32, T.F16, T.BF16):
        return x.double()
    blk = 256 if t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K) else 32
    xb = x.reshape(x.shape[0], -1, blk)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv).clamp(-127, 127)
    return (q.double() * d.double()).reshape(x.shape)


def matmul(lib, parts: list[Part], x: torch.Tensor, k: int, bias: torch.Tensor | None = None,
           pack: bool = True) -> torch.Tensor:
    # pack: parts of whole 16-row tiles repacked (gq_packed.h, gq_packed32.h), as from a file; else the file layout
    lin = GGMLLinear(parts, k, bias, pack=pack)
    y = torch.empty(x.shape[0], lin.out_features)
    rc = lib.gq_matmul(lin.table, len(parts), x.data_ptr(), x.shape[0], k,
                       None if bias is None else lin.bias.data_ptr(), y.data_ptr(), lin.out_features, 2)
    assert rc == 0
    return y


def builds() -> list[tuple[str, ctypes.CDLL]]:
    out = [(isa, native.library(isa)) for isa in native.supported_isas()]
    return out + [("portable", native.portable_library())]


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "file"])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_each_type_matches_a_float64_reference(t, pack):
    """32 rows of 512: the block types repacked into two tiles, or read in the file's layout."""
    N, K = 32, 512
    data = random_blocks(t, N, K, seed=int(t))
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    ref = q8_reference(x, t) @ torch.from_numpy(dequant(t, data, K)).double().T
    lin = GGMLLinear([Part(int(t), data)], K, pack=pack)
    assert (lin.tiles()[0] is not None) == (pack and t in PACKED_TYPES)
    for name, lib in builds():
        y = matmul(lib, [Part(int(t), data)], x, K, pack=pack).double()
        err = (y - ref).abs().max() / ref.abs().max()
        assert err < 2e-6, (name, float(err))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantized_rows_are_the_gguf_packages_bit_for_bit(t):
    K = 512
    data = random_blocks(t, 6, K, seed=100 + int(t))
    emb = GGMLEmbedding(Part(int(t), data), K)
    got = emb(torch.tensor([5, 0, 3])).numpy()
    want = dequant(t, data, K)[[5, 0, 3]]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_files_tensors_dequantize_as_the_gguf_package_does(tmp_path, monkeypatch):
    """Float32 and int8 conversions of a .gguf file dequantize its 2-D tensors with the kernels
    (ggml_blocks.dequantize): the gguf package's floats bit for bit, for every type and build; a 1-D tensor
    goes to the package. A tensor changed by one bit after the write is seen (the control)."""
    import gguf

    from speculant.gguf_file import GGUFFile
    from speculant.models.formats import ggml_blocks

    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for i, t in enumerate(TYPES):
        w.add_tensor(t.name, random_blocks(t, 5, 512, seed=40 + i), raw_dtype=t)
    w.add_tensor("vec", np.arange(7, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    assert len(f.tensors) == len(TYPES) + 1
    for name, lib in builds():
        monkeypatch.setattr(native, "gq_library", lambda lib=lib: lib)
        for t in f.tensors:
            got, want = ggml_blocks.dequantize(f, t), f.dequantize(t)
            assert got.shape == want.shape and got.dtype == want.dtype == np.float32, (name, t.name)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, t.name)
    q4k = f.by_name["Q4_K"]
    flipped = np.array(f.raw(q4k))
    flipped[20] ^= 1  # a quant bit of the first row
    assert not np.array_equal(quants.dequantize(flipped.reshape(5, -1), T.Q4_K).reshape(5, 512),
                              ggml_blocks.dequantize(f, q4k))


def dequant_range(lib, t: int, data: np.ndarray, k: int, bf16: bool) -> torch.Tensor:
    out = torch.empty(data.shape[0], k, dtype=torch.bfloat16 if bf16 else torch.float32)
    assert lib.gq_dequant_range(t, data.ctypes.data, data.shape[1], k, 0, data.shape[0], out.data_ptr(), int(bf16), 2) == 0
    return out


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("odd", [False, True], ids=["even", "odd"])
def test_prefill_bf16_weights_are_the_rounded_dequantized_ones(t, odd):
    """Long passes multiply weights the kernels write straight in bf16: on every build, bit for bit the
    gguf package's dequantization rounded by torch (nearest even). `odd`: rows of 9 blocks of 32 (the
    AVX-512 path decodes pairs and the last block alone) where the type has 32-blocks, and one row with an
    infinite fp16 scale (values inf, -inf and NaN: the rows the vector path leaves to the scalar one)."""
    fam32 = t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
    K = 288 if odd and fam32 else 512
    data = random_blocks(t, 7, K, seed=200 + int(t) + 50 * odd)
    if odd and t in _F16_FIELDS:
        off = _F16_FIELDS[t][0]
        data[3, off:off + 2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    with np.errstate(invalid="ignore"):
        f32 = torch.from_numpy(dequant(t, data, K))
    if odd and t in _F16_FIELDS:
        assert f32[3].isnan().any() or f32[3].isinf().any()
    nan = f32.isnan()  # a NaN's bf16 bits are not torch's (its sign and payload): NaN where it is NaN
    want = f32.to(torch.bfloat16)
    for name, lib in builds():
        assert torch.equal(dequant_range(lib, int(t), data, K, False).view(torch.int32), f32.view(torch.int32)), name
        got = dequant_range(lib, int(t), data, K, True)
        assert torch.equal(got.isnan(), nan), name
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), name


def test_bf16_rounding_is_torchs_on_ties_and_special_values():
    ties = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -130, 3.4e38, float("inf"), -0.0, 1e-45, 65504.0]
    vals = np.resize(np.array(ties, dtype=np.float32), 32)
    vals[-1] = np.float32(1.0) + np.float32(2 ** -8) + np.float32(2 ** -20)  # just above a tie: rounds up
    data = np.ascontiguousarray(vals[None]).view(np.uint8)
    want = torch.from_numpy(vals[None].copy()).to(torch.bfloat16)
    for name, lib in builds():
        assert torch.equal(dequant_range(lib, int(T.F32), data, 32, True).view(torch.int16), want.view(torch.int16)), name


def test_rows_are_bit_identical_alone_or_together_and_on_every_build():
    """What keeps speculative greedy output identical to plain decoding: row m's output does not depend
    on how many rows share the call, the thread count, or the instruction set it was built for."""
    K = 768
    parts = [Part(int(t), random_blocks(t, n, K, seed=7 + i)) for i, (t, n) in
             enumerate([(T.Q4_K, 19), (T.Q4_K, 32), (T.Q6_K, 8), (T.Q6_K, 16), (T.Q8_0, 5), (T.Q5_0, 3), (T.Q4_1, 2), (T.F16, 3), (T.Q3_K, 2),
                        (T.Q2_K, 2), (T.Q5_K, 2), (T.Q5_1, 2), (T.Q4_0, 2), (T.BF16, 2), (T.F32, 1),
                        # repacked 32-blocks and K-quants (whole tiles)
                        (T.Q4_0, 16), (T.Q4_1, 16), (T.Q5_0, 32), (T.Q5_1, 16), (T.Q8_0, 16), (T.Q3_K, 16),
                        (T.Q2_K, 32), (T.Q5_K, 16)])]
    x = torch.randn(32, K, generator=torch.Generator().manual_seed(3)) * 3
    bias = torch.randn(sum(p.rows for p in parts))
    results = []
    for name, lib in builds():
        full = matmul(lib, parts, x, K, bias)
        for m in range(1, 33):
            part = matmul(lib, parts, x[:m].contiguous(), K, bias)
            assert torch.equal(part, full[:m]), (name, m)
        single = torch.cat([matmul(lib, parts, x[i:i + 1].contiguous(), K, bias) for i in range(32)])
        assert torch.equal(single, full), name
        results.append((name, full))
    for name, y in results[1:]:
        assert torch.equal(y, results[0][1]), (name, results[0][0])


@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_the_largest_integer_sums_are_exact_on_every_build(t):
    """Every u at its largest (all quant bits set: Q4_K's 15, Q6_K's 63) and every activation at +-127: the
    sums the 256-bit builds keep in int16 before widening (gq_packed.h, PK_I16) at their bound, 1..8 rows a
    pass, repacked; every build bit-identical and within float rounding of the float64 reference."""
    K = 512
    data = random_blocks(t, 32, K, seed=5).reshape(32, K // 256, -1)
    if t == T.Q4_K:
        data[:, :, 16:144] = 0xFF  # qs: every nibble 15
        data[:, :, 4:16] = 0xFF  # 6-bit scales and mins at their largest
    else:
        data[:, :, 0:192] = 0xFF  # ql, qh: every u = 63
        data[:, :, 192:208] = 0x7F  # scales 127
    data = np.ascontiguousarray(data.reshape(32, -1))
    sign = torch.where(torch.arange(K) % 3 == 0, -1.0, 1.0)
    x = torch.stack([torch.ones(K), -torch.ones(K), sign, -sign, torch.ones(K), sign, -torch.ones(K), -sign])
    ref = q8_reference(x, t) @ torch.from_numpy(dequant(t, data, K)).double().T
    results = []
    for name, lib in builds():
        full = matmul(lib, [Part(int(t), data)], x, K)
        for m in range(1, 9):
            assert torch.equal(matmul(lib, [Part(int(t), data)], x[:m].contiguous(), K), full[:m]), (name, m)
        assert ((full.double() - ref).abs().max() / ref.abs().max()) < 2e-6, name
        results.append((name, full))
    for name, y in results[1:]:
        assert torch.equal(y, results[0][1]), (name, results[0][0])


def test_an_odd_count_of_32_blocks_is_exact_and_bit_identical_everywhere():
    """Rows of 9 blocks: the SIMD builds take the blocks in pairs and the last one alone."""
    K = 9 * 32
    types = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
    parts = [Part(int(t), random_blocks(t, 5, K, seed=40 + i)) for i, t in enumerate(types)]
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(4))
    results = []
    for name, lib in builds():
        full = matmul(lib, parts, x, K)
        for m in (1, 2, 5, 9):
            assert torch.equal(matmul(lib, parts, x[:m].contiguous(), K), full[:m]), (name, m)
        results.append((name, full))
    for name, y in results[1:]:
        assert torch.equal(y, results[0][1]), (name, results[0][0])
    for i, (t, p) in enumerate(zip(types, parts)):
        ref = q8_reference(x, t) @ torch.from_numpy(dequant(t, p.data, K)).double().T
        got = results[0][1][:, 5 * i:5 * i + 5].double()
        assert (got - ref).abs().max() / ref.abs().max() < 2e-6, t.name


@pytest.mark.parametrize("t", [T.Q5_0, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_a_reduced_head_reads_its_layers_tiles(t):
    """Layers repack on first use. first_rows of a layer not yet used (a draft's full output layer, of which
    only the reduced head runs) repacks its own rows and leaves the layer unpacked; of a layer in use, it
    views the layer's tiles. Both give the layer's first rows bit for bit; a cut inside a tile repacks nothing."""
    K = 512
    lin = GGMLLinear([Part(int(t), random_blocks(t, 64, K, seed=3))], K, pack=True)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(5))
    early = lin.first_rows(32)
    assert early.tiles()[0] is not None and lin._packed is None
    y = lin(x)
    head = lin.first_rows(32)
    assert head.tiles()[0] is not None and np.shares_memory(head.tiles()[0], lin.tiles()[0])
    assert torch.equal(head(x), y[:, :32]) and torch.equal(early(x), y[:, :32])
    odd = lin.first_rows(40)
    assert odd.tiles()[0] is None and odd.out_features == 40
    assert torch.allclose(odd(x), y[:, :40], rtol=1e-4, atol=1e-4)  # the file layout's canonical form


def test_permuted_parts_land_in_their_columns():
    K = 256
    a, b = random_blocks(T.Q4_K, 8, K, seed=1), random_blocks(T.Q8_0, 4, K, seed=2)
    perm = np.array([3, 1, 0, 2, 7, 6, 4, 5], dtype=np.int32)
    x = torch.randn(3, K)
    y = GGMLLinear([Part(int(T.Q4_K), a, perm), Part(int(T.Q8_0), b)], K)(x)
    plain = GGMLLinear([Part(int(T.Q4_K), a), Part(int(T.Q8_0), b)], K)(x)
    assert torch.equal(y[:, perm], plain[:, :8]) and torch.equal(y[:, 8:], plain[:, 8:])


def test_long_passes_multiply_the_same_weights():
    """Prefill (more than 32 rows) may take bf16 GEMMs: the result stays close to the integer kernel's."""
    K = 512
    lin = GGMLLinear([Part(int(T.Q4_K), random_blocks(T.Q4_K, 64, K, seed=5))], K)
    x = torch.randn(40, K)
    ref = x.double() @ lin.dequantized().double().T
    y = lin(x).double()
    assert ((y - ref).abs().max() / ref.abs().max()) < 2e-2


def test_the_bf16_route_multiplies_float_parts_in_float32():
    """Long passes of the bf16 route (AVX512-BF16 and AMX CPUs) round block types' weights to bf16, but F32 and F16
    parts keep the file's precision: an F32 GGUF's prompt logits were a few percent off on such CPUs."""
    K = 256
    w = torch.randn(48, K)
    parts = [Part(int(T.F32), w[:16].numpy().view(np.uint8).copy()),
             Part(int(T.F16), w[16:32].half().numpy().view(np.uint8).copy()),
             Part(int(T.Q8_0), quants.quantize(w[32:].numpy(), T.Q8_0))]
    lin = GGMLLinear(parts, K)
    x = torch.randn(40, K)
    ref = x.double() @ lin.dequantized().double().T
    got = lin._forward_dequantized(x).double()
    floats = (got[:, :32] - ref[:, :32]).abs().max() / ref[:, :32].abs().max()
    assert floats < 1e-6, floats  # float32 sums; bf16 activations alone would be ~4e-3
    q8 = (got[:, 32:] - ref[:, 32:]).abs().max() / ref[:, 32:].abs().max()
    assert 1e-5 < q8 < 2e-2, q8  # the block type still takes bf16


def test_float_weights_quantize_on_load_with_the_gguf_reference():
    w = torch.randn(16, 256)
    lin = GGMLLinear.from_float(w, None, "q8_0")
    assert np.array_equal(lin.parts[0].data, quants.quantize(w.numpy(), T.Q8_0))
    assert (lin.dequantized() - w).abs().max() < 0.02


def test_bad_sizes_and_types_are_clear_errors():
    with pytest.raises(SpeculantError, match="whole number"):
        row_bytes(int(T.Q4_K), 100)
    with pytest.raises(SpeculantError, match="does not hold rows"):
        GGMLLinear([Part(int(T.Q8_0), np.zeros((2, 30), np.uint8))], 32)
    from speculant.models.formats.ggml_blocks import check_type

    with pytest.raises(SpeculantError, match="blk.0.attn_q.weight is stored as IQ2_XXS"):
        check_type(int(T.IQ2_XXS), "blk.0.attn_q.weight")
    with pytest.raises(SpeculantError, match="unknown GGML type id 999"):
        check_type(999, "x")
    emb = GGMLEmbedding(Part(int(T.Q8_0), random_blocks(T.Q8_0, 4, 32, seed=1)), 32)
    with pytest.raises(SpeculantError, match="out of range"):
        emb(torch.tensor([4]))

"""The prompt-pass GEMM (speculant/kernels/gq_gemm.h) against float64 references built with
the `gguf` package's dequantizers, on every build this CPU runs, and the route a long pass takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from speculant.errors import SpeculantError
from speculant.models import native
from speculant.models.formats import ggml_routes
from speculant.models.formats.ggml import GGMLLinear
from speculant.models.formats.ggml_blocks import Part
from tests.test_gguf_kernels import builds, dequant, q8_reference, random_blocks

K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
BLOCKS_32 = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]


def gemm(lib, lin: GGMLLinear, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    y = torch.full((x.shape[0], lin.out_features), float("nan"))
    bias = None if lin.bias is None else lin.bias.data_ptr()
    rc = lib.gq_gemm(lin.table, len(lin.parts), x.data_ptr(), x.shape[0], lin.in_features, bias, y.data_ptr(),
                     lin.out_features, 2)
    return rc, y


@pytest.mark.parametrize("t", K_QUANTS + BLOCKS_32, ids=lambda t: t.name)
def test_gemm_matches_a_float64_reference_on_every_build(t):
    """Two parts (48 rows: a pair of 16-row tiles and a lone one; then 16 rows of the other family, permuted),
    a bias, 37 rows (not a multiple of the kernel's 4): every output within float rounding of
    dequant(W) @ q8(x) + bias, activations quantized per each part's block. Builds that do not multiply a type
    (the portable one: none; AVX2 without VNNI: Q8_0) answer -5 and write nothing."""
    K = 512
    other = T.Q5_0 if t in K_QUANTS else T.Q6_K
    a, b = random_blocks(t, 48, K, seed=int(t)), random_blocks(other, 16, K, seed=99)
    perm = np.random.default_rng(0).permutation(16).astype(np.int32)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(2))
    lin = GGMLLinear([Part(int(t), a), Part(int(other), b, perm)], K, bias, pack=True)
    x = torch.randn(37, K, generator=torch.Generator().manual_seed(1))
    ref = torch.empty(37, 64, dtype=torch.float64)
    ref[:, :48] = q8_reference(x, t) @ torch.from_numpy(dequant(t, a, K)).double().T
    ref[:, 48 + torch.from_numpy(perm).long()] = q8_reference(x, other) @ torch.from_numpy(dequant(other, b, K)).double().T
    ref += bias.double()
    for name, lib in builds():
        rc, y = gemm(lib, lin, x)
        if not (lib.gq_gemm_type(int(t)) and lib.gq_gemm_type(int(other))):  # only where the kernel cannot
            assert rc == -5 and torch.isnan(y).all(), name
            assert lib.gq_isa() == 0 or (lib.gq_isa() == 1 and T.Q8_0 in (t, other)), name
            continue
        assert rc == 0, name
        err = (y.double() - ref).abs().max() / ref.abs().max()
        assert err < 2e-6, (name, float(err))


@pytest.mark.parametrize("pack", [False, True], ids=["file", "packed"])
@pytest.mark.parametrize("K", [896, 96, 32])
def test_gemm_takes_rows_of_any_whole_number_of_32_blocks(K, pack):
    """K = 896 (the 0.5B's width: 3.5 superblocks) and K = 96 (a tail of 8 quads past the AVX-512 transposes)
    in Q5_0, 40 rows; from the file's blocks or the repacked tiles (K = 896 only: pairs of blocks)."""
    data = random_blocks(T.Q5_0, 32, K, seed=7)
    lin = GGMLLinear([Part(int(T.Q5_0), data)], K, pack=pack)
    assert (lin.tiles()[0] is not None) == (pack and K % 64 == 0)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(4))
    ref = q8_reference(x, T.Q5_0) @ torch.from_numpy(dequant(T.Q5_0, data, K)).double().T
    for name, lib in builds():
        rc, y = gemm(lib, lin, x)
        assert rc == (0 if lib.gq_isa() else -5), name
        if rc == 0:
            assert ((y.double() - ref).abs().max() / ref.abs().max()) < 2e-6, name


def test_gemm_refuses_what_it_does_not_multiply():
    K = 256
    x = torch.randn(40, K)
    for name, lib in builds():
        for parts in ([Part(int(T.F16), random_blocks(T.F16, 16, K, seed=1))],  # a float type
                      [Part(int(T.Q4_K), random_blocks(T.Q4_K, 24, K, seed=2))]):  # not whole 16-row tiles
            assert gemm(lib, GGMLLinear(parts, K), x)[0] == -5, name


def test_prefill_routes_follow_the_cpu_and_the_environment(prefill_route):
    route = prefill_route
    default = route(None)
    assert default[-1] == "rows" and len(set(default)) == len(default)
    assert route("rows")[0] == "rows" and route("int8")[0] == "rows"  # int8: the old name
    if "gemm" in default:  # the x86 builds: the fused blocks take prompts first unless AMX's bf16 leads
        assert route("gemm")[0] == "gemm" and route("fused")[0] == "fused"
        assert default[0] == ("bf16" if "amx_bf16" in native.cpu_flags() and native.bf16_native() else "fused")
    else:
        assert "fused" not in default
    with pytest.raises(SpeculantError, match="SPECULANT_PREFILL must be one of"):
        route("fast")


@pytest.mark.parametrize("t", [T.Q4_K, T.Q8_0, T.BF16], ids=lambda t: t.name)
def test_a_long_pass_takes_the_first_route_its_layer_allows(prefill_route, t):
    """40 rows: a Q4_K or Q8_0 layer goes through gq_gemm where it leads a layer's routes (after "fused", the
    whole model's), a BF16 one (gq_gemm does not multiply it) through the next route; all stay close to the
    float64 reference, and rows forced through gq_matmul are its short-pass results."""
    route = prefill_route
    K = 512
    lin = GGMLLinear([Part(int(t), random_blocks(t, 64, K, seed=5))], K)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(3))
    ref = q8_reference(x, t) @ lin.dequantized().double().T
    lead = next(r for r in route(None) if r in ggml_routes.LINEAR_ROUTES)
    y = lin(x)
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < 2e-2
    if lead == "gemm" and lin._lib.gq_gemm_type(int(t)):
        assert torch.equal(y, gemm(lin._lib, lin, x)[1])
    route("rows")
    assert torch.equal(lin(x), torch.cat([lin(x[:20]), lin(x[20:])]))

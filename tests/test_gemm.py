"""The prompt-pass GEMM for K-quants (speculant/kernels/gq_gemm.h) against float64 references built with
the `gguf` package's dequantizers, on every build this CPU runs, and the route a long pass takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from speculant.errors import SpeculantError
from speculant.models.formats import ggml
from speculant.models.formats.ggml import GGMLLinear, Part
from tests.test_gguf_kernels import builds, dequant, q8_reference, random_blocks

K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


def gemm(lib, lin: GGMLLinear, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    y = torch.full((x.shape[0], lin.out_features), float("nan"))
    bias = None if lin.bias is None else lin.bias.data_ptr()
    rc = lib.gq_gemm(lin.table, len(lin.parts), x.data_ptr(), x.shape[0], lin.in_features, bias, y.data_ptr(),
                     lin.out_features, 2)
    return rc, y


@pytest.mark.parametrize("t", K_QUANTS, ids=lambda t: t.name)
def test_gemm_matches_a_float64_reference_on_every_build(t):
    """Two parts (48 rows: a pair of 16-row tiles and a lone one; 16 rows permuted), a bias, 37 rows (not a
    multiple of the kernel's 4): every output within float rounding of dequant(W) @ q8(x) + bias. Builds
    without AVX512-VNNI answer -5 (the caller takes another route) and write nothing."""
    K = 512
    a, b = random_blocks(t, 48, K, seed=int(t)), random_blocks(T.Q6_K, 16, K, seed=99)
    perm = np.random.default_rng(0).permutation(16).astype(np.int32)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(2))
    lin = GGMLLinear([Part(int(t), a), Part(int(T.Q6_K), b, perm)], K, bias)
    x = torch.randn(37, K, generator=torch.Generator().manual_seed(1))
    w = torch.cat([torch.from_numpy(dequant(t, a, K)), torch.zeros(16, K)]).double()
    w[48 + torch.from_numpy(perm).long()] = torch.from_numpy(dequant(T.Q6_K, b, K)).double()
    ref = q8_reference(x, t) @ w.T + bias.double()
    ran = 0
    for name, lib in builds():
        rc, y = gemm(lib, lin, x)
        if lib.gq_isa() == 0:
            assert rc == -5 and torch.isnan(y).all(), name
            continue
        assert rc == 0, name
        err = (y.double() - ref).abs().max() / ref.abs().max()
        assert err < 2e-6, (name, float(err))
        ran += 1
    assert ran == len(builds()) - 1  # every x86 build but the portable one


def test_gemm_refuses_what_it_does_not_multiply():
    K = 256
    x = torch.randn(40, K)
    for name, lib in builds():
        for parts in ([Part(int(T.Q8_0), random_blocks(T.Q8_0, 16, K, seed=1))],  # not a K-quant
                      [Part(int(T.Q4_K), random_blocks(T.Q4_K, 24, K, seed=2))]):  # not whole 16-row tiles
            assert gemm(lib, GGMLLinear(parts, K), x)[0] == -5, name


@pytest.fixture
def route(monkeypatch):
    def set_route(value: str | None) -> tuple[str, ...]:
        if value is None:
            monkeypatch.delenv("SPECULANT_PREFILL", raising=False)
        else:
            monkeypatch.setenv("SPECULANT_PREFILL", value)
        ggml.prefill_routes.cache_clear()
        return ggml.prefill_routes()
    yield set_route
    monkeypatch.delenv("SPECULANT_PREFILL", raising=False)
    ggml.prefill_routes.cache_clear()


def test_prefill_routes_follow_the_cpu_and_the_environment(route):
    default = route(None)
    assert default[-1] == "rows" and len(set(default)) == len(default)
    assert route("rows")[0] == "rows" and route("int8")[0] == "rows"  # int8: the old name
    if "gemm" in default:
        assert route("gemm")[0] == "gemm"
    with pytest.raises(SpeculantError, match="SPECULANT_PREFILL must be one of"):
        route("fast")


@pytest.mark.parametrize("t", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_a_long_pass_takes_the_first_route_its_layer_allows(route, t):
    """40 rows: a K-quant layer goes through gq_gemm where it leads the routes, a Q8_0 one (gq_gemm does not
    multiply it) through the next route; both stay close to the float64 reference, and rows forced through
    gq_matmul are its short-pass results."""
    K = 512
    lin = GGMLLinear([Part(int(t), random_blocks(t, 64, K, seed=5))], K)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(3))
    ref = q8_reference(x, t) @ lin.dequantized().double().T
    routes = route(None)
    y = lin(x)
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < 2e-2
    if routes[0] == "gemm" and t == T.Q4_K:
        assert torch.equal(y, gemm(lin._lib, lin, x)[1])
    route("rows")
    assert torch.equal(lin(x), torch.cat([lin(x[:20]), lin(x[20:])]))

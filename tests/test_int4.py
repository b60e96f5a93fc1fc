"""int4 weights (speculant/models/int4.py + kernels/q4.c): accuracy, batch invariance, state round-trips."""

import pytest
import torch

from conftest import tiny_model
from speculant.errors import SpeculantError
from speculant.models.int4 import GROUP, Int4Linear, quantize_q4
from speculant.models.quant import linear_from_state, make_linear


def rnd(*shape, seed=0, std=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


def reference(lin: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """The same quantisation in plain torch: dequantised weights times per-32-group int8 activations."""
    M, K = x.shape
    xg = x.reshape(M, K // GROUP, GROUP)
    d = xg.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, 1.0 / d)
    xq = (torch.round(xg * inv) * d).reshape(M, K)
    y = xq.double() @ lin.dequantized().double().T
    if lin.bias is not None:
        y = y + lin.bias.double()
    return y


@pytest.mark.parametrize("N,K", [(8, 32), (40, 64), (13, 96), (72, 256)])
def test_matches_torch_reference_of_the_same_quantisation(N, K):
    lin = Int4Linear.from_float(rnd(N, K, seed=1), rnd(N, seed=2))
    x = rnd(5, K, seed=3)
    y = lin(x)
    assert y.shape == (5, N) and y.dtype == torch.float32
    ref = reference(lin, x)
    assert ((y.double() - ref).norm() / ref.norm()) < 1e-5
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_close_to_float_matmul():
    w, x = rnd(96, 512, seed=4), rnd(6, 512, seed=5)
    y, yf = Int4Linear.from_float(w, None)(x), x @ w.T
    # 16 levels per group of 32 gaussians: ~8% rms weight error is the floor for any 4-bit rounding
    assert (y - yf).norm() / yf.norm() < 0.10


def test_weight_rounding_error_is_small_and_scales_are_exact():
    w = rnd(64, 256, seed=6, std=1e-3)  # tiny weights: the power-of-two gscale keeps fp16 scales normal
    q, d16, gscale = quantize_q4(w)
    assert q.min() >= -8 and q.max() <= 7
    wd = q.float().reshape(64, -1, GROUP) * d16.float()[..., None] * gscale
    assert (wd.reshape(64, 256) - w).norm() / w.norm() < 0.10
    lin = Int4Linear.from_float(w, None)
    torch.testing.assert_close(lin.dequantized(), wd.reshape(64, 256), rtol=0, atol=0)


@pytest.mark.parametrize("N,K", [(24, 64), (19, 128), (256, 1536)])
def test_rows_are_batch_invariant(N, K):
    lin = Int4Linear.from_float(rnd(N, K, seed=7), rnd(N, seed=8))
    x = rnd(20, K, seed=9)
    x[3] *= 1000.0  # wildly different row scales must not leak into other rows
    x[5] = 0.0
    alone = [lin(x[i : i + 1])[0] for i in range(20)]
    for M in list(range(1, 17)) + [20]:
        y = lin(x[:M])
        for i in range(M):
            assert torch.equal(y[i], alone[i]), (M, i)


def test_thread_count_does_not_change_results():
    lin = Int4Linear.from_float(rnd(512, 256, seed=10), None)
    x = rnd(4, 256, seed=11)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        two = lin(x)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


def test_bias_is_added():
    w, b, x = rnd(16, 64, seed=12), rnd(16, seed=13), rnd(3, 64, seed=14)
    with_b, without = Int4Linear.from_float(w, b), Int4Linear.from_float(w, None)
    torch.testing.assert_close(with_b(x), without(x) + b, rtol=1e-6, atol=1e-5)


def test_state_round_trip_and_first_rows():
    w, b, x = rnd(45, 96, seed=15), rnd(45, seed=16), rnd(4, 96, seed=17)
    lin = make_linear(w, b, "int4")
    assert isinstance(lin, Int4Linear) and lin.weight_bytes() == 48 * 96 // 2 + 48 * 3 * 2
    again = linear_from_state(lin.state(), "int4")
    assert torch.equal(again(x), lin(x))
    head = lin.first_rows(21)
    assert (head.out_features, head.in_features) == (21, 96)
    assert torch.equal(head(x), lin(x)[:, :21])
    assert torch.equal(lin.first_rows(16)(x), lin(x)[:, :16])


def test_leading_dims_and_dtypes():
    lin = Int4Linear.from_float(rnd(8, 64, seed=18), None)
    x = rnd(2, 3, 64, seed=19)
    assert torch.equal(lin(x), lin(x.reshape(6, 64)).reshape(2, 3, 8))
    assert torch.equal(lin(x.double()), lin(x))
    assert lin(torch.empty(0, 64)).shape == (0, 8)


def test_input_size_not_multiple_of_32_is_a_clear_error():
    with pytest.raises(SpeculantError, match="multiples of 32"):
        Int4Linear.from_float(rnd(8, 48), None)
    with pytest.raises(SpeculantError, match="multiples of 32"):
        make_linear(rnd(8, 100), None, "int4")


def test_activation_importance_weighting_runs():
    w, act = rnd(16, 64, seed=20), rnd(64, seed=21).abs() + 0.1
    lin = Int4Linear.from_float(w, None, act_absmax=act)
    x = rnd(2, 64, seed=22)
    assert (lin(x) - x @ w.T).norm() / (x @ w.T).norm() < 0.15


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_k_tokens_in_one_pass_equal_one_by_one(arch):
    m = tiny_model(64, arch=arch, fmt="int4").model
    prompt, new = torch.tensor([1, 5, 9, 2, 7]), torch.tensor([3, 8, 11, 4])
    c1 = m.new_cache(32)
    m(prompt, c1)
    batched = m(new, c1).logits
    c2 = m.new_cache(32)
    m(prompt, c2)
    single = torch.cat([m(new[i : i + 1], c2).logits for i in range(len(new))])
    assert torch.equal(batched, single)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_blocks_equal_the_python_path_bit_for_bit(arch):
    """Short passes run all blocks in one C call (models/fused.py); logits and KV cache must be the
    Python path's exactly, also after copies and conversions that rebuild the fused loop."""
    import copy

    m = tiny_model(64, arch=arch, fmt="int4", layers=3).model
    assert m.fused_blocks() is not None
    prompt, new = torch.tensor([1, 5, 9, 2, 7]), torch.tensor([3, 8, 11, 4])

    def run(model, fused: bool):
        c = model.new_cache(32)
        model(prompt, c)  # prefill (S > 4 rows here, still a short pass: fused too)
        model._fused = False if not fused else model._fused  # False: the Python path
        out = torch.cat([model(new[:3], c).logits, model(new[3:], c).logits])
        return out, c.k[:, :, : c.length].clone(), c.v[:, :, : c.length].clone()

    ref = run(copy.deepcopy(m), fused=False)
    for model in (m, copy.deepcopy(m), m.to("cpu").float()):
        got = run(model, fused=True)
        assert model.fused_blocks() is not None
        assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("problem", ["cpu", "gcc"])
def test_missing_avx2_or_gcc_is_a_clear_error(problem, monkeypatch, tmp_path):
    from speculant.models import native

    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))  # no cached kernel: it would need building
    if problem == "cpu":
        monkeypatch.setattr(native, "cpu_ok", lambda: False)
    else:
        monkeypatch.setenv("SPECULANT_CC", "no-such-compiler-here")
    native.library.cache_clear()
    try:
        with pytest.raises(SpeculantError, match="use --dtype int8"):
            make_linear(rnd(8, 64), None, "int4")
    finally:
        native.library.cache_clear()


def test_every_kernel_build_this_cpu_runs_agrees_bit_for_bit():
    from speculant.models import int4, native

    isas = native.supported_isas()
    if len(isas) < 2:
        pytest.skip("this CPU runs only the AVX2 build of the int4 kernel")
    # 40 output rows = 5 blocks of 8: the 512-bit build takes two pairs and one odd block
    lin = Int4Linear.from_float(rnd(40, 256, seed=23), rnd(40, seed=24))
    for rows in (1, 7, 19):
        x = rnd(rows, 256, seed=25 + rows)
        x[rows // 2] *= 1e4
        outs = []
        for isa in isas:
            lin._fn = int4._library(isa).q4_matmul
            outs.append(lin(x))
        for isa, out in zip(isas[1:], outs[1:]):
            assert torch.equal(out, outs[0]), (isa, isas[0], rows)


def test_module_conversions_and_copies_keep_working():
    import copy

    lin = Int4Linear.from_float(rnd(16, 64, seed=26), rnd(16, seed=27))
    x = rnd(2, 64, seed=28)
    ref = lin(x)
    assert torch.equal(lin.to("cpu").float()(x), ref)
    assert torch.equal(copy.deepcopy(lin)(x), ref)


def _prefill_path(path: str, monkeypatch) -> None:
    """Make long passes take `path` ("amx" or "onednn"), or skip where this CPU lacks it."""
    from speculant.models import int4

    if not int4.bf16_prefill_available():
        pytest.skip("this CPU has no AVX512-BF16 (or SPECULANT_INT4_PREFILL=int8): long passes use the integer kernel")
    if path == "amx" and not int4.amx_prefill_available():
        pytest.skip("this CPU has no AMX (or SPECULANT_INT4_PREFILL=onednn): long passes use oneDNN")
    if path == "onednn":
        monkeypatch.setattr(int4, "amx_prefill_available", lambda: False)


@pytest.mark.parametrize("path", ["amx", "onednn"])
@pytest.mark.parametrize("N,K", [(40, 64), (13, 96), (300, 256), (136, 64)])
def test_long_passes_multiply_the_stored_weights_in_bf16(N, K, path, monkeypatch):
    from speculant.models import int4

    _prefill_path(path, monkeypatch)
    monkeypatch.setattr(int4, "_BF16_CHUNK_BYTES", 64 * K * 2)  # oneDNN: several chunks, a ragged last one
    lin = Int4Linear.from_float(rnd(N, K, seed=30), rnd(N, seed=31))
    x = rnd(int4.BF16_MIN_ROWS + 9, K, seed=32)
    y = lin(x)
    # The expanded weights are exactly the stored ones rounded to bf16; the GEMM accumulates in fp32.
    ref = (x.bfloat16().double() @ lin.dequantized().bfloat16().double().T + lin.bias.double())
    assert y.shape == (x.shape[0], N) and y.dtype == torch.float32
    # oneDNN rounds its outputs to bf16 (~2^-9); the AMX tiles keep fp32 sums
    assert ((y.double() - ref).norm() / ref.norm()) < (1e-2 if path == "onednn" else 1e-6)
    full = x.double() @ lin.dequantized().double().T + lin.bias.double()
    # and at least as close to the stored weights as the integer kernel's 8-bit activations
    integer = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])]).double()
    assert (y.double() - full).norm() <= (integer - full).norm() * 1.1


def test_amx_prefill_rows_do_not_depend_on_the_thread_count_or_padding(monkeypatch):
    """Rows go through the tiles 16 at a time (the last pass padded with zero rows), outputs 64 at a
    time (N = 136: two tasks, the second with one pair and one odd block); each output is summed by
    one thread in a fixed order."""
    _prefill_path("amx", monkeypatch)
    lin = Int4Linear.from_float(rnd(136, 128, seed=35), None)
    x = rnd(50, 128, seed=36)
    ref = lin(x)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lin(x), ref)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(lin(x[:33]), ref[:33])  # fewer rows: another padding of the last pass


def test_short_passes_never_take_the_bf16_path():
    from speculant.models import int4

    lin = Int4Linear.from_float(rnd(24, 64, seed=33), None)
    x = rnd(int4.BF16_MIN_ROWS, 64, seed=34)
    single = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(lin(x), single)  # bit-identical: the integer kernel at every size up to the bound

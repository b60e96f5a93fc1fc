"""Raw forward timings of a GGUF model in its own block types: prompt prefill tok/s, and decode/verify
passes, whole and split into the block-format matmuls and everything else (the timing loops are
`speculant bench speed`'s own).

Usage: .venv/bin/python scripts/step_timing.py MODEL   (e.g. qwen2.5-coder-1.5b-instruct)
Set SPECULANT_PREFILL=rows (or bf16, gemm) to time prompts through that route (models/formats/ggml_routes.py:
prefill_routes).
Last, the whole forward is timed once per build of the kernels this CPU runs (native.ISAS, and the
portable C build), in turns, so their ratio is measured side by side.
"""
import sys
import time

from speculant.bench.speed import cost_curve, prefill_tps
from speculant.models import load_model, native
from speculant.models.formats import GGMLLinear
from speculant.threads import configure_threads

REPEATS = 20

configure_threads()
name = sys.argv[1]
model = load_model(name, "gguf", progress=False).model
ids = list(range(1000, 2024))
for T in (256, 1024):
    print(f"{name}: prefill of {T} tokens {prefill_tps(model, ids[:T], 3):.1f} tok/s (median of 3)")

in_linears = [0.0]
plain = GGMLLinear.forward
rows = [0]  # the pass size being timed: cost_curve's prefill of the cache is not counted


def timed(self, x):
    t = time.perf_counter()
    y = plain(self, x)
    if x.shape[0] == rows[0]:
        in_linears[0] += time.perf_counter() - t
    return y


for S in (1, 4, 7):
    rows[0] = S
    total = cost_curve(model, ids[:256], (S,), REPEATS)[S]
    # the split needs the Python path between the kernels (the fused C loop of models/fused.py
    # calls them without passing through GGMLLinear.forward)
    model._fused = False
    python_path = cost_curve(model, ids[:256], (S,), REPEATS)[S]
    GGMLLinear.forward, in_linears[0] = timed, 0.0
    cost_curve(model, ids[:256], (S,), REPEATS)  # REPEATS + 1 forwards of S tokens (one warm-up)
    GGMLLinear.forward = plain
    model._fused = None  # rebuilt on the next short pass
    linear_ms = in_linears[0] / (REPEATS + 1) * 1e3
    print(f"{name}: {S} new tokens on a 256-token cache {total:.2f} ms per forward (median; "
          f"{python_path:.2f} ms with Python between the kernels, {linear_ms:.2f} ms of that in block-format linears)")


model._fused = False  # the builds are swapped per GGMLLinear, which the fused C loop does not go through
builds = native.supported_isas() + ["portable"]
libs = {isa: native.portable_library() if isa == "portable" else native.library(isa) for isa in builds}
linears = [m for m in model.modules() if isinstance(m, GGMLLinear)]
gemm = {lin: lin._gemm for lin in linears}
for S in (1, 4, 7):
    ms = {isa: [] for isa in builds}
    for _ in range(3):  # alternate the builds so that a noisy neighbour hits all of them alike
        for isa in builds:
            for lin in linears:
                lin._lib = libs[isa]
                # the portable build has no prompt GEMM (gq_gemm returns -5): the cache's prefill takes
                # the next route there
                lin._gemm = gemm[lin] and isa != "portable"
            ms[isa].append(cost_curve(model, ids[:256], (S,), REPEATS)[S])
    best = {isa: min(v) for isa, v in ms.items()}
    print(f"{name}: {S} new tokens, ms per forward by kernel build: "
          + ", ".join(f"{isa} {best[isa]:.2f} ({best[builds[-1]] / best[isa]:.2f}x)" for isa in builds))

"""Which kernels run GGML weights here, and how prompts multiply them: `ggml_available()` and `prefill_routes()`
(formats/ggml.py takes a layer's route from them; Transformer.prefill_chunk the prompt's)."""

from __future__ import annotations

import functools
import os

from ...errors import SpeculantError
from .. import native


def ggml_available() -> bool:
    """Whether the block-format kernels run here (a C compiler; any CPU)."""
    try:
        native.gq_library()
    except SpeculantError:
        return False
    return True


PREFILL_ROUTES = ("fused", "gemm", "bf16", "rows")
LINEAR_ROUTES = PREFILL_ROUTES[1:]  # the routes of one layer's long pass ("fused" is the whole model's)


@functools.cache
def prefill_routes() -> tuple[str, ...]:
    """How prompts may multiply GGML weights on this CPU, best first.

    "fused": the prompt as passes of SHORT_PASS_MAX rows through the fused block loop (blocks.c, x86 builds;
    Transformer.forward chunks it), the short passes' kernel and row-wise attention: faster than gq_gemm for
    short and long prompts alike on the x86 builds (scripts/prefill_routes.py; docs/measurements.md "Prefill
    routes").
    "gemm": gq_gemm (gq_gemm.h; the x86 builds, the block types gq_gemm_type accepts), the blocks as they are,
    one output per lane, for longer passes of one layer. "bf16": weights dequantized a chunk at a time into
    bf16 and multiplied by oneDNN (AVX512-BF16, or AMX, which outruns any int8 kernel here: there it comes
    first). "rows": gq_matmul, as short passes.
    $SPECULANT_PREFILL puts one first (int8 = rows, its old name) where this CPU runs it."""
    flags = native.cpu_flags()
    x86 = ggml_available() and native.gq_library().gq_isa() >= 1
    ok = {"fused": x86, "gemm": x86,
          "bf16": native.bf16_native(), "rows": True}  # torch capped below AVX-512 emulates it
    order = ["bf16", "fused", "gemm", "rows"] if "amx_bf16" in flags else ["fused", "gemm", "bf16", "rows"]
    want = os.environ.get("SPECULANT_PREFILL", "").lower().replace("int8", "rows")
    if want and want not in ok:
        raise SpeculantError(f"SPECULANT_PREFILL must be one of {', '.join(PREFILL_ROUTES)}; got {want!r}")
    if want:
        order.remove(want)
        order.insert(0, want)
    return tuple(r for r in order if ok[r])

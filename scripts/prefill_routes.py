"""Prompt prefill speed of each prefill route this CPU runs (models/formats/ggml_routes.py: prefill_routes),
side by side: the routes take turns on every prompt length, so a noisy neighbour or a change of memory
speed hits them alike. One forward of N tokens into an empty cache, logits of the last row only.

Usage: .venv/bin/python scripts/prefill_routes.py MODEL [MODEL ...] [--lengths 64 256 1024] [--repeats 5]
       [--isa avx2]   (another x86 build of the kernels than this CPU's best, e.g. to compare on one host)
"""
import argparse
import os
import statistics
import time

import torch

from speculant.models import load_model, native
from speculant.models.formats import ggml_routes
from speculant.threads import configure_threads

ap = argparse.ArgumentParser()
ap.add_argument("models", nargs="+")
ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 1024])
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--isa", choices=[n for n, _, _ in native.ISAS])
args = ap.parse_args()
if args.isa:  # every kernel user reads the build from $SPECULANT_ISA (native.forced_build)
    os.environ["SPECULANT_ISA"] = native.check_build(args.isa)
configure_threads()


def route(name: str | None) -> None:
    if name is None:
        os.environ.pop("SPECULANT_PREFILL", None)
    else:
        os.environ["SPECULANT_PREFILL"] = name
    ggml_routes.prefill_routes.cache_clear()


route(None)
routes = ggml_routes.prefill_routes()
base = "gemm" if "gemm" in routes else routes[0]  # the ratios' reference
print(f"kernels: {args.isa or native.supported_isas()[0]} build, threads {torch.get_num_threads()}, "
      f"routes here (default first): {', '.join(routes)}")
for name in args.models:
    model = load_model(name, progress=False, draft="0.5b" in name).model
    ms: dict[tuple[int, str], list[float]] = {}
    for r in routes:  # warm-up: repacks, first-use allocations
        route(r)
        model(torch.arange(100, 100 + max(args.lengths[0], 40)), model.new_cache(2 * max(args.lengths)),
              logit_rows=slice(-1, None))
    for _ in range(args.repeats):
        for n in args.lengths:
            for r in routes:
                route(r)
                cache = model.new_cache(n + 1)
                t = time.perf_counter()
                model(torch.arange(1000, 1000 + n), cache, logit_rows=slice(-1, None))
                ms.setdefault((n, r), []).append((time.perf_counter() - t) * 1e3)
    route(None)
    print(f"\n{name}: prefill tok/s by route (median of {args.repeats}; x: against {base})")
    print("tokens  " + "  ".join(f"{r:>14}" for r in routes))
    for n in args.lengths:
        tps = {r: n / statistics.median(ms[n, r]) * 1e3 for r in routes}
        print(f"{n:>6}  " + "  ".join(f"{tps[r]:>7.1f} {tps[r] / tps[base]:>5.2f}x" for r in routes))

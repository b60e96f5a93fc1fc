"""Two versions of the kernels side by side: the working tree's speculant/kernels/ against those of a git
revision (--base, default HEAD), built with the same flags for one build (--isa, default $SPECULANT_ISA or this
CPU's best), loaded into one process and timed in turns (A B A B ...), so a noisy neighbour or a change of
clock hits both alike. Prints each side's median and the median of the per-turn ratios new / base.

  layers: random N x K layers of --types, repacked as a model's, M = --rows rows a pass (--threads threads)
  model:  a GGUF model's forward of M = --rows new tokens on a cache of --cache tokens (the decode step at
          M = 1, a verification pass at M > 1: all logits), the fused block loop and every GGML linear on
          the side's library

Usage: .venv/bin/python scripts/kernel_ab.py [--base REV | --base-dir KERNELS_DIR] [--model qwen2.5-coder-1.5b-instruct]
       [--rows 1 4 8 16] [--types Q4_K Q6_K] [--n 4096] [--k 1536] [--repeats 15] [--inner 5] [--threads 1] [--isa avx2]
Checks first that both sides give the same bits (they must: the kernels' exactness contract, gq.c).
"""
import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository: tests/ has the random blocks
from speculant.models import load_model, native  # noqa: E402
from speculant.models.formats.ggml import GGMLLinear  # noqa: E402
from speculant.models.formats.ggml_blocks import Part  # noqa: E402
from speculant.models.fused import bind_tree_kernels  # noqa: E402
from speculant.threads import configure_threads  # noqa: E402
from tests.test_gguf_kernels import random_blocks  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--base", default="HEAD")
ap.add_argument("--base-dir", default=None, help="a kernels folder as the base instead of --base's (an uncommitted "
                                                  "variant)")
ap.add_argument("--isa", choices=[n for n, _, _ in native.ISAS])
ap.add_argument("--model", default=None)
ap.add_argument("--cache", type=int, default=256)
ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K"])
ap.add_argument("--n", type=int, default=4096)
ap.add_argument("--k", type=int, default=1536)
ap.add_argument("--threads", type=int, default=None)
ap.add_argument("--repeats", type=int, default=15, help="turns per side")
ap.add_argument("--inner", type=int, default=5, help="calls per turn, the fastest kept (a turn hit by a burst of "
                                                      "load then still counts)")
args = ap.parse_args()
isa = native.check_build(args.isa) if args.isa else (native.forced_build() or native.supported_isas()[0])
extra = next(flags for n, _, flags in native.ISAS if n == isa)
threads = configure_threads(args.threads)


def build(src: Path, name: str, out_dir: Path) -> ctypes.CDLL:
    out = out_dir / f"{name}.so"
    native._build(native._compiler(), native._FLAGS + extra, tuple(src / s.name for s in native.SOURCES), out)
    return bind_tree_kernels(native._bind(ctypes.CDLL(str(out)), True))


tmp = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
if args.base_dir:
    shutil.copytree(args.base_dir, tmp / "speculant" / "kernels")
else:
    subprocess.run(f"git -C {ROOT} archive {args.base} speculant/kernels | tar -x -C {tmp}", shell=True, check=True)
torch.get_num_threads()  # torch's libgomp first, as native.library does
libs = {"base": build(tmp / "speculant" / "kernels", "base", tmp), "new": build(ROOT / "speculant" / "kernels", "new", tmp)}
print(f"{isa} build, {threads} threads, base {args.base_dir or args.base} vs the working tree; load average {os.getloadavg()[0]:.2f}")


def ab(label: str, run) -> None:
    """run(lib) -> seconds; alternating sides, the order flipped every turn, each turn's fastest of --inner calls."""
    for side in libs.values():
        run(side)
    t = {k: [] for k in libs}
    ratios = []
    for i in range(args.repeats):
        for k in (("base", "new") if i % 2 == 0 else ("new", "base")):
            t[k].append(min(run(libs[k]) for _ in range(args.inner)))
        ratios.append(t["new"][-1] / t["base"][-1])
    b, n = (statistics.median(t[k]) * 1e3 for k in ("base", "new"))
    print(f"{label}: base {b:8.2f} ms  new {n:8.2f} ms  new/base {statistics.median(ratios):.3f} "
          f"(per-turn ratios {min(ratios):.3f}..{max(ratios):.3f})", flush=True)


if args.model is None:
    for name in args.types:
        t = T[name]
        lin = GGMLLinear([Part(int(t), random_blocks(t, args.n, args.k, seed=1))], args.k, pack=True)
        for m in args.rows:
            x = torch.randn(m, args.k, generator=torch.Generator().manual_seed(m))
            outs = []
            for lib in libs.values():
                lin._lib = lib
                outs.append(lin(x))
            assert torch.equal(*outs), f"{name} M={m}: the two sides differ"

            def run(lib, lin=lin, x=x):
                lin._lib = lib
                s = time.perf_counter()
                lin(x)
                return time.perf_counter() - s
            ab(f"{name} {args.n}x{args.k} M={m:2d}", run)
else:
    model = load_model(args.model, "gguf", progress=False).model
    linears = [m for m in model.modules() if isinstance(m, GGMLLinear)]
    ids = torch.arange(1000, 1000 + args.cache)
    cache = model.new_cache(args.cache + max(args.rows))
    model(ids, cache, logit_rows=slice(0, 0))
    base = cache.length

    def use(lib) -> None:
        for m in linears:
            m._lib = lib
        fused = model.fused_blocks()
        if fused:
            fused._fn = lib.gq_blocks_ex

    def forward(lib, m):
        use(lib)
        s = time.perf_counter()
        out = model(ids[:m], cache).logits
        dt = time.perf_counter() - s
        cache.rollback(base)
        return dt, out

    print(f"{args.model}: fused block loop {'on' if model.fused_blocks() else 'off'}, cache {args.cache} tokens")
    for m in args.rows:
        assert torch.equal(forward(libs["base"], m)[1], forward(libs["new"], m)[1]), f"M={m}: the two sides differ"
        ab(f"forward M={m:2d}", lambda lib, m=m: forward(lib, m)[0])

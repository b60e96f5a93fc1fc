"""What one more activation row costs in each block type's kernel: a random N x K layer of the type, repacked
into tiles as the models' layers are, multiplied by 1..8 rows on one thread; the cost per row as time per
64 weight products (one vpdpbusd's worth), in ns and in cycles at --ghz.

Usage: .venv/bin/python scripts/row_cost.py [--types Q4_K Q6_K Q4_0] [--n 4096] [--k 1536] [--ghz 3.67] [--rows 1 2 4 8]
(N x K of 4096 x 1536 stays in L3 on one thread, so the extra rows' compute is what the step measures.)
"""
import argparse
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/ has the random blocks
from speculant.models.formats.ggml import GGMLLinear  # noqa: E402
from speculant.models.formats.ggml_blocks import Part  # noqa: E402
from tests.test_gguf_kernels import random_blocks  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q5_K", "Q4_0", "Q5_0", "Q8_0"])
ap.add_argument("--n", type=int, default=4096)
ap.add_argument("--k", type=int, default=1536)
ap.add_argument("--ghz", type=float, default=3.67, help="the core clock, for the cycles column")
ap.add_argument("--repeats", type=int, default=200)
ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="row counts to time (1 and the last give the "
                "cost per extra row)")
args = ap.parse_args()
torch.set_num_threads(1)
dots = args.n * args.k / 64
rows = sorted(set([1] + args.rows))
print(f"{args.n} x {args.k}, 1 thread, best decile of {args.repeats} calls")
for name in args.types:
    t = T[name]
    lin = GGMLLinear([Part(int(t), random_blocks(t, args.n, args.k, seed=1))], args.k, pack=True)
    us = {}
    for m in rows:
        x = torch.randn(m, args.k)
        lin(x)
        ts = []
        for _ in range(args.repeats):
            s = time.perf_counter()
            lin(x)
            ts.append(time.perf_counter() - s)
        ts.sort()
        us[m] = ts[len(ts) // 10] * 1e6
    per_row = (us[rows[-1]] - us[1]) / (rows[-1] - 1) * 1e3 / dots  # ns per 64 products per extra row
    print(f"{name:>5}: " + "  ".join(f"M={m} {v:7.1f} us" for m, v in us.items())
          + f"  | per extra row {per_row:.3f} ns = {per_row * args.ghz:.2f} cycles per 64 products")

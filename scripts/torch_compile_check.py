"""torch.compile on CPU, measured: a decode step, eager vs torch.compile(model, dynamic=True), in one process.

Usage: .venv/bin/python scripts/torch_compile_check.py MODEL DTYPE   (e.g. smollm2-135m-instruct float32)
The block-format kernels are ctypes calls, which dynamo cannot trace: it breaks the graph at each of them.
"""
import sys
import time

import torch

from speculant.models import load_model
from speculant.threads import configure_threads
configure_threads()
name, dtype = sys.argv[1], sys.argv[2]
m = load_model(name, dtype, progress=False).model
cache = m.new_cache(512)
m(torch.arange(1000, 1256), cache, logit_rows=slice(-1, None))
tok = torch.tensor([1234])
def step(fwd):
    base = cache.length
    out = fwd(tok, cache)
    cache.rollback(base)
    return out
def bench(fwd, n=30):
    for _ in range(5): step(fwd)
    ts = []
    for _ in range(n):
        t = time.perf_counter(); step(fwd); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts)//2] * 1e3
eager = bench(m)
t = time.perf_counter()
compiled = torch.compile(m, dynamic=True)
step(compiled)
ct = time.perf_counter() - t
comp = bench(compiled)
print(f"{name} {dtype}: eager {eager:.2f} ms/step, compiled {comp:.2f} ms/step ({eager/comp:.2f}x), first compiled call {ct:.1f} s")

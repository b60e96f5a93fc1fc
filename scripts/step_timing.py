"""Raw forward timings of an int4 model: prompt prefill tok/s, and decode/verify steps split into int4 matmul and the rest.

Usage: .venv/bin/python scripts/step_timing.py MODEL   (e.g. qwen2.5-coder-1.5b-instruct)
Set SPECULANT_INT4_PREFILL=int8 to time prompts through the integer kernel instead of the bf16 GEMMs.
"""
import sys
import time

import torch

from speculant.models import load_model
from speculant.models.int4 import Int4Linear
from speculant.runtime import configure_threads

configure_threads()
name = sys.argv[1]
m = load_model(name, "int4", progress=False).model

for T in (256, 1024):
    ids = torch.arange(1000, 1000 + T)
    best = float("inf")
    for _ in range(3):
        cache = m.new_cache(T + 8)
        t = time.perf_counter()
        m(ids, cache, logit_rows=slice(-1, None))
        best = min(best, time.perf_counter() - t)
    print(f"{name}: prefill of {T} tokens {T / best:.1f} tok/s")

cache = m.new_cache(512)
m(torch.arange(1000, 1256), cache, logit_rows=slice(-1, None))
in_linears = [0.0]
plain = Int4Linear.forward


def timed(self, x):
    t = time.perf_counter()
    y = plain(self, x)
    in_linears[0] += time.perf_counter() - t
    return y


def step(S: int) -> None:
    base = cache.length
    m(torch.full((S,), 1234), cache)
    cache.rollback(base)


N = 20
for S in (1, 4, 7):
    for _ in range(3):
        step(S)
    t = time.perf_counter()
    for _ in range(N):
        step(S)
    total = (time.perf_counter() - t) / N * 1e3
    Int4Linear.forward, in_linears[0] = timed, 0.0
    for _ in range(N):
        step(S)
    Int4Linear.forward = plain
    print(f"{name}: {S} new tokens on a 256-token cache {total:.2f} ms per forward, {in_linears[0] / N * 1e3:.2f} ms of it in int4 linears")

"""Decode speed after a long prompt with each KV cache type, alternated in one process (same weights, same memory
minutes): what the cache type changes where the cache is a sizable part of what a step reads.

    .venv/bin/python scripts/kv_decode.py [--model qwen2.5-coder-1.5b-instruct] [--prompt 8000] [--rounds 4]
        [--kv-dtypes f16 q8_0]

Prefills one cache of each type with the same random prompt, then alternates rounds of 16 greedy one-token
forwards on each (rolled back after each round) and prints every round's tok/s.
"""

from __future__ import annotations

import argparse
import time

import torch

from speculant.models import load_model
from speculant.models.cache import KV_DTYPES, kv_dtype
from speculant.threads import configure_threads

STEPS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompt", type=int, default=8000, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kv-dtypes", nargs="+", choices=list(KV_DTYPES), default=["f16", "q8_0"])
    a = ap.parse_args()
    configure_threads()
    m = load_model(a.model, progress=False).model
    ids = torch.randint(100, 20000, (a.prompt,), generator=torch.Generator().manual_seed(0))
    caches = {}
    for name in a.kv_dtypes:
        m.kv_dtype = kv_dtype(name)
        c = caches[name] = m.new_cache(a.prompt + STEPS + 1)
        t = time.perf_counter()
        m(ids, c, logit_rows=slice(-1, None))
        print(f"{name}: prefill {a.prompt / (time.perf_counter() - t):.1f} tok/s", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(a.rounds):
        for name, c in caches.items():
            tok = torch.tensor([5])
            t = time.perf_counter()
            for _ in range(STEPS):
                tok = m(tok, c).logits[-1:].argmax(-1)
            rates[name].append(STEPS / (time.perf_counter() - t))
            c.rollback(a.prompt)
    for name, r in rates.items():
        print(f"{name}: decode tok/s by round {', '.join(f'{x:.1f}' for x in r)}", flush=True)


if __name__ == "__main__":
    main()

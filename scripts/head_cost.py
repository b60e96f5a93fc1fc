"""Cost of one draft-head step against one target decode step (the ratio that decides whether heads pay).

    python scripts/head_cost.py --model qwen2.5-coder-1.5b-instruct --method eagle3 [--heads NAME]

Times (median of 50): the target's one-token forward on a 256-token cache; the head's pass over 1 and
over `topk` rows (an EAGLE tree step), its output layer included; Medusa: all heads on one state.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from speculant.methods.heads import HeadsConfig, load_heads
from speculant.heads.layer import attend
from speculant.heads.modules import MedusaHeads
from speculant.models import load_model
from speculant.models.cache import KVCache
from speculant.threads import configure_threads


def median_ms(fn, n: int = 50) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--method", default="eagle3", choices=("medusa", "eagle2", "eagle3"))
    ap.add_argument("--heads", default=None)
    ap.add_argument("--topk", type=int, default=4)
    args = ap.parse_args()
    configure_threads(None)
    target = load_model(args.model, progress=False)
    m = target.model
    head, _ = load_heads(target, args.method, HeadsConfig(args.heads))
    cache = m.new_cache(512)
    m(torch.arange(256) % 1000, cache)

    def target_step():
        cache.rollback(256)
        m(torch.tensor([42]), cache)

    t_target = median_ms(target_step)
    print(f"target one-token forward: {t_target:.2f} ms")
    with torch.inference_mode():
        if isinstance(head, MedusaHeads):
            h = torch.randn(1, head.cfg.hidden)
            t = median_ms(lambda: head(h).topk(8, -1))
            print(f"medusa, {head.cfg.medusa_heads} heads: {t:.2f} ms = {t / t_target:.3f} target steps")
            return
        hc = head.cfg
        hcache = KVCache(1, hc.n_kv_heads, hc.head_dim, 512, torch.float32, m.device)
        for rows in (1, args.topk):
            emb = torch.randn(rows, hc.hidden)
            feat = torch.randn(rows, hc.hidden)

            def step():
                hcache.rollback(256)
                x, res = head.layer_input(emb, feat)
                out = attend(head.layer, x, res, hcache, torch.full((rows,), 256), None, m.cos, m.sin)
                head.logits(out).topk(args.topk, -1)

            t = median_ms(step)
            print(f"{args.method} step over {rows} row(s): {t:.2f} ms = {t / t_target:.3f} target steps")


if __name__ == "__main__":
    main()

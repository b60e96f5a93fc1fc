"""Time the short-pass attention kernel (speculant/kernels/attention.c) alone, as a forward calls it.

    .venv/bin/python scripts/attention_bench.py [--heads 12 --kv-heads 2 --head-dim 128 --layers 28]
        [--kv-dtypes f32 f16 q8_0]

Defaults: the 1.5B target's shape (Qwen2.5-Coder-1.5B); the 0.5B draft is --heads 14 --head-dim 64
--layers 24. For each pass of S rows after L cached slots it prints the milliseconds of one call per
layer, each layer with its own cache (streamed from memory, as in a forward) and, for comparison, all
calls on one layer's cache (cache-resident), with the multiply-adds per second per thread; with
--kv-dtypes f32 f16 q8_0: the cache types side by side (the repeats alternate between them).
Compare two trees side by side in alternation (memory speed drifts): run it from each.
"""

from __future__ import annotations

import argparse
import time

import torch

from speculant.models import native
from speculant.models.cache import KV_DTYPES, KVCache
from speculant.models.fused import bind_tree_kernels
from speculant.threads import configure_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--slots", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--kv-dtypes", nargs="+", choices=list(KV_DTYPES), default=["f32"])
    a = ap.parse_args()
    configure_threads()
    lib = bind_tree_kernels(native.library())
    H, Hkv, hd, n = a.heads, a.kv_heads, a.head_dim, a.layers
    max_len = max(a.slots) + max(a.rows)
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(n, Hkv, max_len, hd, generator=g), torch.randn(n, Hkv, max_len, hd, generator=g)
    caches = {}
    for name in a.kv_dtypes:  # each type's cache holding the same random keys and values, as KVCache.write stores them
        c = caches[name] = KVCache(n, Hkv, hd, max_len, KV_DTYPES[name], torch.device("cpu"))
        for layer in range(n):
            c.write(layer, 0, kc[layer], vc[layer])
    threads = torch.get_num_threads()
    print(f"H={H} Hkv={Hkv} hd={hd}, {n} layers, {threads} threads, ISA build {native.supported_isas()[0]}")
    for S in a.rows:
        cos, sin = torch.randn(S, hd // 2, generator=g), torch.randn(S, hd // 2, generator=g)
        qkv, out = torch.randn(S, (H + 2 * Hkv) * hd, generator=g), torch.empty(S, H * hd)
        for L in a.slots:
            ts: dict[tuple[str, str], list[float]] = {}
            for how in ("streamed", "resident"):
                for _ in range(a.repeats):
                    for name, c in caches.items():
                        t = time.perf_counter()
                        for layer in range(n):
                            i = layer if how == "streamed" else 0
                            lib.attn_rows_masked(qkv.data_ptr(), S, H, Hkv, hd, cos.data_ptr(), sin.data_ptr(),
                                                 c.k[i].data_ptr(), c.v[i].data_ptr(), max_len, L, None,
                                                 out.data_ptr(), c.c_type, threads)
                        ts.setdefault((name, how), []).append(time.perf_counter() - t)
            fma = n * H * hd * 2 * (S * L + S * (S + 1) / 2)
            for name in caches:
                st, rs = (sorted(ts[name, how])[a.repeats // 2] for how in ("streamed", "resident"))
                print(f"S={S} L={L} {name}: streamed {st * 1e3:.2f} ms, resident {rs * 1e3:.2f} ms "
                      f"({fma / rs / threads / 1e9:.1f} G fma/s a thread)")


if __name__ == "__main__":
    main()

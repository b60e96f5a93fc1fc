"""Time the short-pass attention kernel (speculant/kernels/attention.c) alone, as a forward calls it.

    .venv/bin/python scripts/attention_bench.py [--heads 12 --kv-heads 2 --head-dim 128 --layers 28]

Defaults: the 1.5B target's shape (Qwen2.5-Coder-1.5B); the 0.5B draft is --heads 14 --head-dim 64
--layers 24. For each pass of S rows after L cached slots it prints the milliseconds of one call per
layer, each layer with its own cache (streamed from memory, as in a forward) and, for comparison, all
calls on one layer's cache (cache-resident), with the multiply-adds per second per thread.
Compare two trees side by side in one sitting (memory speed drifts): run it from each.
"""

from __future__ import annotations

import argparse
import time

import torch

from speculant.models import native
from speculant.models.fused import bind_tree_kernels
from speculant.runtime import configure_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--slots", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    configure_threads()
    lib = bind_tree_kernels(native.library())
    H, Hkv, hd, n = a.heads, a.kv_heads, a.head_dim, a.layers
    max_len = max(a.slots) + max(a.rows)
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(n, Hkv, max_len, hd, generator=g), torch.randn(n, Hkv, max_len, hd, generator=g)
    threads = torch.get_num_threads()
    print(f"H={H} Hkv={Hkv} hd={hd}, {n} layers, {threads} threads, ISA build {native.supported_isas()[0]}")
    for S in a.rows:
        cos, sin = torch.randn(S, hd // 2, generator=g), torch.randn(S, hd // 2, generator=g)
        qkv, out = torch.randn(S, (H + 2 * Hkv) * hd, generator=g), torch.empty(S, H * hd)
        for L in a.slots:
            times = {}
            for how in ("streamed", "resident"):
                ts = []
                for _ in range(a.repeats):
                    t = time.perf_counter()
                    for layer in range(n):
                        i = layer if how == "streamed" else 0
                        lib.attn_rows_masked(qkv.data_ptr(), S, H, Hkv, hd, cos.data_ptr(), sin.data_ptr(),
                                             kc[i].data_ptr(), vc[i].data_ptr(), max_len, L, None, out.data_ptr(),
                                             threads)
                    ts.append(time.perf_counter() - t)
                times[how] = sorted(ts)[len(ts) // 2]
            fma = n * H * hd * 2 * (S * L + S * (S + 1) / 2)
            print(f"S={S} L={L}: streamed {times['streamed'] * 1e3:.2f} ms, resident {times['resident'] * 1e3:.2f} ms "
                  f"({fma / times['resident'] / threads / 1e9:.1f} G fma/s a thread)")


if __name__ == "__main__":
    main()

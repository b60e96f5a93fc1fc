"""The block-format linears of a model alone, grouped by role (every layer's qkv, o, gate_up, down, then the
output layer), each group timed over one pass of M rows per layer and read as GB/s of weights beside the
machine's `torch.sum` bandwidth measured right before: how close each kind of tensor streams to memory speed.

    .venv/bin/python scripts/linear_timing.py [--model qwen2.5-coder-1.5b-instruct] [--rows 1] [--rounds 3]

Memory speed on a shared host swings within minutes; to compare two builds of the kernels, run this from two
worktrees in alternation (PYTHONPATH=the worktree), as the prefetch notes in speculant/kernels/gq_packed.h were.
"""

from __future__ import annotations

import argparse
import time

import torch

from speculant.bench.speed import measure_bandwidth
from speculant.models import load_model
from speculant.threads import configure_threads

ROLES = ("qkv", "o", "gate_up", "down")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default=None, help="weight format (default: the model's default)")
    ap.add_argument("--rows", type=int, default=1, help="activation rows per pass (M)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="passes per timing (the fastest counts)")
    a = ap.parse_args()
    configure_threads()
    model = load_model(a.model, a.dtype, progress=False).model
    groups = {role: [getattr(b, role) for b in model.blocks] for role in ROLES}
    groups["output"] = [model.lm_head]
    xs = {role: torch.randn(a.rows, layers[0].in_features) for role, layers in groups.items()}
    for role, layers in groups.items():  # repacks the tiles, builds the kernels
        for layer in layers:
            layer(xs[role])

    def best(layers: list, x: torch.Tensor) -> float:
        times = []
        for _ in range(a.repeats):
            start = time.perf_counter()
            for layer in layers:
                layer(x)
            times.append(time.perf_counter() - start)
        return min(times)

    print(f"{a.model}, M = {a.rows}, {torch.get_num_threads()} threads: ms (GB/s) per group", flush=True)
    for _ in range(a.rounds):
        bw = measure_bandwidth()
        cells, total_bytes, total_s = [], 0, 0.0
        for role, layers in groups.items():
            nbytes = sum(layer.weight_bytes() for layer in layers)
            s = best(layers, xs[role])
            total_bytes, total_s = total_bytes + nbytes, total_s + s
            cells.append(f"{role} {s * 1e3:.2f} ({nbytes / s / 1e9:.1f})")
        print(f"torch.sum {bw:.1f} GB/s | " + " | ".join(cells) +
              f" | all {total_s * 1e3:.2f} ms ({total_bytes / total_s / 1e9:.1f} GB/s)", flush=True)


if __name__ == "__main__":
    main()

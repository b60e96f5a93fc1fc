"""Decode tok/s of speculant's `gguf` default and llama.cpp's `llama-bench` tg64, alternated in one process.

Memory speed on a shared host swings by 1.5x within minutes, so a decode comparison made of one run of each
(scripts/vs_llama_cpp.sh's before/after) can land in different minutes. Here each round runs llama-bench
(-p 0 -n 64 -r 3) and then two greedy 64-token decodes of ours (bench.speed.decode_tps, after a 256-token
prompt), the model loaded once.

    .venv/bin/python scripts/decode_vs_llama_cpp.py --llama-cpp-bin /work/peer/build/bin [--rounds 4] [--model M]
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

from speculant.bench.speed import bench_ids, decode_tps
from speculant.hub import resolve_model
from speculant.models import load_model
from speculant.runtime import configure_threads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp-bin", required=True, type=Path, help="folder holding llama-bench")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    threads = configure_threads(a.threads)
    lm = load_model(a.model, None, progress=False)
    ids = bench_ids(lm.tokenizer.encode, 256)
    cmd = [str(a.llama_cpp_bin / "llama-bench"), "-m", str(resolve_model(a.model)), "-t", str(threads), "-p", "0",
           "-n", "64", "-r", "3"]
    for r in range(a.rounds):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        theirs = re.findall(r"tg64 \|\s+([\d.]+)", out)
        ours = [decode_tps(lm.model, ids, 64)[0] for _ in range(2)]
        print(f"round {r + 1}: llama.cpp {theirs[0] if theirs else '?'} tok/s; speculant "
              f"{ours[0]:.1f} / {ours[1]:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()

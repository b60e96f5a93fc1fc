"""Decode tok/s of speculant's `gguf` default and llama.cpp's `llama-bench` tg64, alternated in one process.

Memory speed on a shared host swings widely within minutes, so a decode comparison made of one run of each
(scripts/vs_llama_cpp.sh's before/after) can land in different minutes. Here each round runs llama-bench
(-p 0 -n 64 -r 3: the mean of 3) and then two greedy 64-token decodes of ours (bench.speed.decode_tps, after a 256-token
prompt), the model loaded once, between two `torch.sum` reads of 1 GiB (bench.speed.measure_bandwidth). Each
engine's tok/s times the weight bytes a token reads (the file's, the same for both) is the bandwidth its
decode uses, printed as a fraction of the round's mean `torch.sum` bandwidth: how far from the memory wall each is.

    .venv/bin/python scripts/decode_vs_llama_cpp.py --llama-cpp-bin LLAMA_CPP/build/bin [--rounds 4] [--model M]

Both engines' AVX2 kernels on a CPU that has more: `LLAMA_CPP_ISA=avx2 bash scripts/build_llama_cpp.sh` prints
the folder of llama.cpp's AVX2 build, and SPECULANT_ISA=avx2 forces ours:

    SPECULANT_ISA=avx2 .venv/bin/python scripts/decode_vs_llama_cpp.py --llama-cpp-bin FOLDER/bin --threads 2
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

from speculant.bench.speed import bench_ids, decode_tps, measure_bandwidth
from speculant.hub import resolve_model
from speculant.models import load_model
from speculant.threads import configure_threads


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
    gb = lm.model.weight_bytes_per_token() / 1e9
    print(f"weights read per token: {gb:.3f} GB", flush=True)

    def use(tps: float, bw: float) -> str:
        return f"{tps:.1f} tok/s ({tps * gb:.1f} GB/s, {tps * gb / bw:.0%})"

    for r in range(a.rounds):
        bw = measure_bandwidth()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        found = re.findall(r"tg64 \|\s+([\d.]+)", out)
        if not found:
            raise SystemExit(f"no tg64 row in llama-bench's output:\n{out}")
        theirs = float(found[0])
        ours = [decode_tps(lm.model, ids, 64)[0] for _ in range(2)]
        bw = (bw + measure_bandwidth()) / 2
        print(f"round {r + 1}: torch.sum {bw:.1f} GB/s; llama.cpp {use(theirs, bw)}; speculant {use(ours[0], bw)} / "
              f"{use(ours[1], bw)}; ours / theirs {sum(ours) / len(ours) / theirs:.3f} (means)", flush=True)


if __name__ == "__main__":
    main()

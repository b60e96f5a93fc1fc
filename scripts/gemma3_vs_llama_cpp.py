"""Gemma 3 270M (or another GGUF) against llama.cpp on the same file: greedy agreement of 64 tokens on held-out
prompts, and decode tok/s of ours (`speculant generate --method ar` as the CLI runs it) beside llama-bench's tg64,
alternated in one sitting.

Both greedy continuations start from llama.cpp's own tokenization of each prompt (tests/llama_cpp_ref.py's
greedy_tokens: llama-simple's loop, f16 KV cache as ours by default), so they differ only where the two
implementations pick another token; "first diff" is the first position where they do (64: none).

    .venv/bin/python scripts/gemma3_vs_llama_cpp.py --llama-cpp-bin BIN [--model gemma3-270m] [--rounds 3]
    .venv/bin/python scripts/gemma3_vs_llama_cpp.py --ours-only   # our greedy ids alone, as JSON lines
    .venv/bin/python scripts/gemma3_vs_llama_cpp.py --ours-only --speed 3   # our decode tok/s alone, 3 runs

--ours-only needs no llama.cpp: its output, from two checkouts (PYTHONPATH), shows whether a change kept greedy
output identical, or (--speed) how their decode speeds compare when run in alternation.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from speculant.decoding.engine import Engine, GenerationConfig  # noqa: E402
from speculant.hub import resolve_model  # noqa: E402
from speculant.models import load_model  # noqa: E402
from speculant.threads import configure_threads  # noqa: E402

# held out: none of them is in a test or a calibration text
PROMPTS = (
    "The history of the Roman Empire",
    "Write a Python function that checks whether a number is prime.",
    "Photosynthesis is the process by which",
    "Here is a short poem about the sea:\n",
    "Q: What is the boiling point of water at sea level?\nA:",
)
N = 64


def ours(lm, prompt_ids: list[int]) -> tuple[list[int], float]:
    """Our greedy ids after prompt_ids, and the decode tok/s of that run (the CLI's --stats figure)."""
    out = Engine(lm).generate(prompt_ids, GenerationConfig(max_new_tokens=N, ignore_eos=True))
    return list(out.token_ids), out.stats.decode_tokens_per_second


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp-bin", type=Path, help="folder holding llama-bench and the greedy-ids tool")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--rounds", type=int, default=3, help="llama-bench / our decode alternations")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ours-only", action="store_true")
    ap.add_argument("--speed", type=int, default=0, help="with --ours-only: this many timed decodes of the first prompt")
    a = ap.parse_args()
    threads = configure_threads(a.threads)
    lm = load_model(a.model, None, progress=False)
    if a.ours_only and a.speed:
        ids = lm.tokenizer.encode(PROMPTS[0])
        print(" ".join(f"{ours(lm, ids)[1]:.1f}" for _ in range(a.speed)), "tok/s", flush=True)
        return
    if a.ours_only:
        for p in PROMPTS:
            ids = lm.tokenizer.encode(p)
            print(json.dumps({"prompt": p, "tokens": ours(lm, ids)[0]}), flush=True)
        return
    if a.llama_cpp_bin is None:
        raise SystemExit("--llama-cpp-bin is needed (or --ours-only)")
    from llama_cpp_ref import greedy_tokens

    path = resolve_model(a.model)
    agree = []
    for p in PROMPTS:
        ref = greedy_tokens(a.llama_cpp_bin, path, p, N)
        got, _ = ours(lm, ref.prompt)
        d = first_diff(got, ref.tokens)
        same = sum(x == y for x, y in zip(got, ref.tokens))
        agree.append(d)
        print(f"{p[:40]!r:44} prompt {len(ref.prompt)} ids; first diff at {d}/{N}; same ids {same}/{N}", flush=True)
    print(f"identical continuations: {sum(d == N for d in agree)}/{len(PROMPTS)}", flush=True)
    cmd = [str(a.llama_cpp_bin / "llama-bench"), "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(N),
           "-r", "3"]
    ids = lm.tokenizer.encode(PROMPTS[0])
    for r in range(a.rounds):
        t = time.time()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        found = re.findall(rf"tg{N} \|\s+([\d.]+) ± ([\d.]+)", out)
        if not found:
            raise SystemExit(f"no tg{N} row in llama-bench's output:\n{out}")
        mine = [ours(lm, ids)[1] for _ in range(2)]
        print(f"round {r + 1} ({time.time() - t:.0f} s): llama-bench tg{N} {found[0][0]} ± {found[0][1]} tok/s; "
              f"speculant ar {mine[0]:.1f} / {mine[1]:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()

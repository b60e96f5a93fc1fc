"""The draft model's weight format, side by side: `hybrid` with the 0.5B draft in each format against `ar`.

A draft's format moves only how often the target agrees, never the output (greedy outputs are checked
against `ar`'s here). Every prompt runs `ar` and then each format in turn, so the host's drift hits all
alike. Usage: .venv/bin/python scripts/draft_formats.py [--count 20] [--sampled] [--formats gguf q4_1]
"""

from __future__ import annotations

import argparse

from speculant.bench.prompts import load_prompts
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.config import MethodConfig
from speculant.models import load_model
from speculant.exact.sampler import SamplingConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=20, help="HumanEval prompts")
    ap.add_argument("--sampled", action="store_true", help="T = 0.7, top-p 0.9, seeds 0 and 1 (else greedy)")
    ap.add_argument("--formats", nargs="+", default=["gguf", "q4_1"],
                    help="draft weight formats (--dtype values)")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    args = ap.parse_args()
    target = load_model(args.target, progress=False)
    engines = {"ar": Engine(target, None, MethodConfig("ar"))}
    for fmt in args.formats:
        engines[f"hybrid, draft {fmt}"] = Engine(target, load_model(args.draft, fmt), MethodConfig("hybrid"))
    prompts = [engines["ar"].encode_prompt(p.text, chat=p.chat) for p in load_prompts("humaneval", args.count)]
    for e in engines.values():  # warm-up
        e.generate(prompts[0], GenerationConfig(max_new_tokens=8, ignore_eos=True))
    totals = {name: [0, 0.0, 0] for name in engines}  # tokens, decode seconds, rounds
    samplings = [SamplingConfig()]
    if args.sampled:
        samplings = [SamplingConfig(temperature=0.7, top_p=0.9, seed=seed) for seed in (0, 1)]
    for i, ids in enumerate(prompts):
        for sampling in samplings:
            gen = GenerationConfig(max_new_tokens=128, ignore_eos=True, sampling=sampling)
            reference = None
            for name, engine in engines.items():
                done = engine.generate(ids, gen)
                reference = reference or done.token_ids
                if not args.sampled and done.token_ids != reference:
                    raise SystemExit(f"prompt {i}: {name} differs from ar")
                t = totals[name]
                t[0] += done.stats.generated_tokens
                t[1] += done.stats.decode_seconds
                t[2] += done.stats.rounds
        print(f"\r{i + 1}/{len(prompts)} prompts", end="", flush=True)
    mode = "sampled (T 0.7, top-p 0.9, 2 seeds)" if args.sampled else "greedy"
    print(f"\n{mode}, HumanEval {len(prompts)}, 128 tokens")
    base = totals["ar"][0] / totals["ar"][1]
    for name, (n, sec, rounds) in totals.items():
        print(f"{name:22s} {n / sec:7.2f} decode tok/s  {n / sec / base:.3f}x  "
              f"tokens per round {n / max(rounds, 1):.2f}")


if __name__ == "__main__":
    main()

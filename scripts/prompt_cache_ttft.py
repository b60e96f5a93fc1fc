"""Time to first token of a 6-turn chat with and without the prompt cache (Engine.prompt_cache).

Each turn's prompt is the whole conversation so far through the chat template. Per turn, the same
prompt runs twice: with the conversation's prompt cache, and fresh (no cache); the greedy answers
must be equal (the cache is exact), and the time to the first streamed token is compared.

    SPECULANT_THREADS=2 .venv/bin/python scripts/prompt_cache_ttft.py [--model M] [--draft D] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import time

from speculant.cli import DEFAULT_DRAFT, DEFAULT_TARGET, build_parser, load_engine
from speculant.decoding.engine import Chunk, Done, GenerationConfig

TURNS = ["Write a Python function that parses a CSV file into a list of dicts.",
         "Add type hints and a docstring.",
         "Now make it skip blank lines and strip whitespace from every field.",
         "Write two pytest tests for it.",
         "How would you handle a file that does not fit in memory?",
         "Summarize the final version of the function in three bullet points."]


def first_token(engine, ids, gen, cache=None):
    t0 = time.perf_counter()
    ttft, done = None, None
    for ev in engine.stream(ids, gen, cache=cache):
        if isinstance(ev, Chunk) and ttft is None:
            ttft = time.perf_counter() - t0
        elif isinstance(ev, Done):
            done = ev
    return ttft, done


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--method", default="hybrid")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    # the CLI's own options (all defaults but these), so the script follows whatever load_engine reads
    argv = ["generate", "x", "--model", a.model, "--draft", a.draft, "--method", a.method, "--no-progress"]
    args = build_parser().parse_args(argv + (["--threads", str(a.threads)] if a.threads else []))
    engine = load_engine(args)
    tok = engine.tokenizer
    gen = GenerationConfig(max_new_tokens=a.max_tokens)
    cache = engine.prompt_cache()
    engine.generate("Hello", GenerationConfig(max_new_tokens=4))  # warm up kernels outside the timings
    messages: list[dict[str, str]] = []
    print(f"{engine.target.name} + {engine.draft.name if engine.draft else '-'} ({engine.method.name}), "
          f"{a.max_tokens}-token answers")
    print("turn  prompt  cached  ttft_cache_s  ttft_fresh_s  speedup  same_answer")
    for turn, text in enumerate(TURNS, 1):
        messages.append({"role": "user", "content": text})
        ids = tok.encode(tok.apply_chat_template(messages), add_special=False)
        t_cache, with_cache = first_token(engine, ids, gen, cache)
        t_fresh, fresh = first_token(engine, ids, gen)
        same = with_cache.token_ids == fresh.token_ids
        print(f"{turn:4d}  {len(ids):6d}  {with_cache.stats.cached_prompt_tokens:6d}  {t_cache:12.3f}  "
              f"{t_fresh:12.3f}  {t_fresh / t_cache:6.2f}x  {same}", flush=True)
        messages.append({"role": "assistant", "content": with_cache.text})


if __name__ == "__main__":
    main()

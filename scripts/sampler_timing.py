"""Per-row cost of sampling from 151,936 logits: the full-sort code the sampler replaced vs the candidate
pipeline, on real next-token logits of a Qwen2.5 model (its vocabulary is 151,936 ids).

Usage: .venv/bin/python scripts/sampler_timing.py [MODEL]   (default qwen2.5-coder-0.5b-instruct)

"before" = tests/test_sampling.py's `_old_probs` (sort, float32 softmax and cumsum over the whole row)
then torch.multinomial, one row at a time, as the engine did; "after" = Sampler.dist + draw, one row
at a time (plain decoding) and 6 rows together (one verification pass of 5 drafts). Each setting is
timed in turns, median of REPEATS, per row.
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_sampling import _old_probs  # noqa: E402  the code the fast path replaced

from speculant.exact.distributions import draw  # noqa: E402
from speculant.models import load_model  # noqa: E402
from speculant.threads import configure_threads  # noqa: E402
from speculant.exact.sampler import Sampler, SamplingConfig  # noqa: E402

REPEATS = 7
PROMPT = ('def has_close_elements(numbers: list[float], threshold: float) -> bool:\n    """Check if in given list of '
          'numbers, are any two numbers closer to each other than given threshold."""\n    for i, a in enumerate(numbers):\n'
          '        for j, b in enumerate(numbers):\n            if i != j and abs(a - b) < threshold:\n'
          '                return True\n    return False\n')

threads = configure_threads()
name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b-instruct"
loaded = load_model(name, progress=False)
ids = loaded.tokenizer.encode(PROMPT)
model = loaded.model
with torch.no_grad():
    logits = model(torch.tensor(ids), model.new_cache(len(ids) + 1), logit_rows=slice(None)).logits.float()  # [n, V]
rows = logits[8:]  # next-token distributions along real code
g = torch.Generator().manual_seed(0)


def per_row(fn, batch: int) -> float:
    """Median over REPEATS of the seconds per row of fn over all rows, `batch` rows per call."""
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        for i in range(0, rows.shape[0] - batch + 1, batch):
            fn(rows[i : i + batch])
        times.append((time.perf_counter() - t) / (rows.shape[0] // batch * batch))
    return statistics.median(times)


print(f"{name}: {rows.shape[0]} rows of {rows.shape[1]} logits, {threads} threads, torch {torch.__version__}")
print(f"{'setting':34s} {'before ms/row':>14s} {'after ms/row':>13s} {'after, 6 rows':>14s} {'kept':>6s}")
for cfg in (SamplingConfig(0.7, top_p=0.9), SamplingConfig(0.7, top_k=40, top_p=0.95, min_p=0.05),
            SamplingConfig(1.0, top_p=0.95), SamplingConfig(1.0, min_p=0.1),
            SamplingConfig(0.7, top_p=0.9, repeat_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)):
    sampler = Sampler(cfg, rows.shape[1])
    sampler.start(ids)
    old = None
    if cfg.top_k == 0 and cfg.min_p == 0 and not cfg.penalized:
        old = per_row(lambda x: torch.multinomial(_old_probs(x, cfg.temperature, cfg.top_p), 1, generator=g), 1)
    new = per_row(lambda x: draw(sampler.dist(x, [5] * (x.shape[0] - 1)), g), 1)
    new6 = per_row(lambda x: draw(sampler.dist(x, [5] * (x.shape[0] - 1)), g), 6)
    kept = (sampler.dist(rows, [5] * (rows.shape[0] - 1)).p > 0).sum(-1).float().mean()
    label = f"T={cfg.temperature}" + "".join(f", {k}={v}" for k, v, off in (
        ("top_k", cfg.top_k, 0), ("top_p", cfg.top_p, 1.0), ("min_p", cfg.min_p, 0.0)) if v != off)
    label += ", penalties" if cfg.penalized else ""
    before = f"{old * 1e3:14.2f}" if old is not None else f"{'-':>14s}"
    print(f"{label:34s} {before} {new * 1e3:13.3f} {new6 * 1e3:14.3f} {kept:6.1f}")

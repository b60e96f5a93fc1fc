"""What a load that converts a .gguf file costs, on one thread: every tensor dequantized by the kernels
(models/formats/ggml_blocks.dequantize) against the gguf package (and checked bit for bit), the float32 load, and the
int8 conversion with an empty conversion cache (a temporary $SPECULANT_HOME with the pulled models and built kernels linked in), then
the same int8 load from the cache it wrote.

Usage: .venv/bin/python scripts/conversion_timing.py [--models qwen2.5-coder-1.5b-instruct ...] [--skip-int8]
(docs/measurements.md, "AMD EPYC Zen 5: conversions on a new machine")
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from speculant.gguf_file import GGUFFile  # noqa: E402
from speculant.hub import resolve_model, speculant_home  # noqa: E402
from speculant.models import load_model, native  # noqa: E402
from speculant.models.formats.ggml_blocks import dequantize  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"])
ap.add_argument("--skip-int8", action="store_true", help="only the dequantization and the float32 load")
args = ap.parse_args()
torch.set_num_threads(1)
native.gq_library()  # built (or found) now, not inside the first tensor's time
cached = speculant_home()
for name in args.models:
    f = GGUFFile(resolve_model(name))
    ours = theirs = 0.0
    for t in f.tensors:
        t0 = time.perf_counter()
        a = dequantize(f, t)
        t1 = time.perf_counter()
        b = f.dequantize(t)
        ours, theirs = ours + t1 - t0, theirs + time.perf_counter() - t1
        if not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
            sys.exit(f"{name}: tensor {t.name} differs from the gguf package's")
    print(f"{name}: {len(f.tensors)} tensors dequantized in {ours:.1f} s (kernels) / {theirs:.1f} s (gguf package), "
          "bit-identical")
    t0 = time.perf_counter()
    load_model(name, "float32", progress=False, use_cache=False)
    print(f"{name}: float32 load {time.perf_counter() - t0:.1f} s")
    if args.skip_int8:
        continue
    with tempfile.TemporaryDirectory() as home:
        for d in ("models", "kernels"):  # the pulled models and the built kernels, but no converted/
            os.symlink(cached / d, Path(home) / d)
        old = os.environ.get("SPECULANT_HOME")
        os.environ["SPECULANT_HOME"] = home
        try:
            for what in ("int8 conversion (empty cache)", "int8 load from the cache"):
                t0 = time.perf_counter()
                load_model(name, "int8", progress=False)
                print(f"{name}: {what} {time.perf_counter() - t0:.1f} s")
        finally:
            if old is None:
                os.environ.pop("SPECULANT_HOME")
            else:
                os.environ["SPECULANT_HOME"] = old

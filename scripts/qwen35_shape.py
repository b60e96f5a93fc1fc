"""Qwen3.5-2B's text shape with random weights, as a Q4_K_M GGUF with one MTP layer, and its decode speed: ours vs
llama.cpp's on the same file, the MTP step's cost per drafted token, and the verification cost curve.

Where the real weights cannot be had, speed still can: a forward's cost depends on the shapes and the block types,
not the values. The shape is Qwen/Qwen3.5-2B's published config.json (text_config): hidden 2048, 24 layers in the
[linear x3, full] pattern, 8 query / 2 KV heads of 256 (rotary 25%), FFN 6144, Gated DeltaNet 16 key / 16 value
heads of 128, conv kernel 4, vocabulary 248320, tied embeddings, one MTP layer (mtp_num_hidden_layers 1).

    python scripts/qwen35_shape.py build     # ~/.cache/speculant/shapes/qwen35-2b-shape-Q4_K_M.gguf (once)
    python scripts/qwen35_shape.py measure   # the timings, each repeated (median and spread)
    python scripts/qwen35_shape.py profile   # torch.profiler's ops of a decode step and a verification pass, and
                                             # the passes' time beside their weight matmuls

The build writes the random model in bfloat16 (never a float32 copy), converts it with llama.cpp's
convert_hf_to_gguf.py to BF16 and quantizes that with llama-quantize (the tools tests/llama_cpp_ref.py builds), then
deletes the folder and the BF16 file. The converter needs a real Qwen tokenizer: Qwen2.5's, from the
qwen2.5-coder-0.5b-instruct preset's GGUF (as tests/test_qwen35_gguf.py does); the converter pads the vocabulary to
248320 with [PAD] entries, so the embedding and output have the real shape.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
             num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
             max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True, mtp_num_hidden_layers=1,
             rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
REAL_TOKENIZER = "qwen2.5-coder-0.5b-instruct"
NAME = "qwen35-2b-shape"
KS = range(1, 9)
REPEATS = 3


def shapes_dir() -> Path:
    from speculant.hub import speculant_home

    d = speculant_home() / "shapes"
    d.mkdir(parents=True, exist_ok=True)
    return d


def llama_cpp() -> Path:
    """The llama.cpp build folder (bin/, src/) of scripts/build_llama_cpp.sh."""
    done = subprocess.run(["bash", str(Path(__file__).with_name("build_llama_cpp.sh"))], capture_output=True,
                          text=True, env=dict(os.environ, PYTHON=sys.executable), check=True)
    return Path(done.stdout.strip().splitlines()[-1])


def build_folder(folder: Path) -> None:
    """The random model in bfloat16 with `mtp.*` tensors of the published names, and Qwen2.5's tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from speculant.hub import resolve_model

    real = resolve_model(REAL_TOKENIZER)
    tok = AutoTokenizer.from_pretrained(str(real.parent), gguf_file=real.name)
    cfg = AutoConfig.for_model("qwen3_5_text", **SHAPE, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tensors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: the embedding's
    D = SHAPE["hidden_size"]
    g = torch.Generator().manual_seed(1)
    last = max(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    tensors |= {"mtp.fc.weight": (torch.randn(D, 2 * D, generator=g) * (2 * D) ** -0.5).bfloat16(),
                **{f"mtp.{n}.weight": torch.zeros(D, dtype=torch.bfloat16)
                   for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    tensors |= {f"mtp.layers.0.{k}": v.clone() for k, v in model.model.layers[last].state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    cfg.architectures = ["Qwen3_5ForCausalLM"]  # what the converter picks its model class by
    cfg.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    del model, tensors
    tok.save_pretrained(folder)


def build(args) -> Path:
    out = shapes_dir() / f"{NAME}-Q4_K_M.gguf"
    if out.is_file() and not args.force:
        print(out)
        return out
    root = llama_cpp()
    folder, bf16 = shapes_dir() / f"{NAME}-hf", shapes_dir() / f"{NAME}-BF16.gguf"
    try:
        build_folder(folder)
        env = dict(os.environ, PYTHONPATH=str(root / "src" / "gguf-py"))
        subprocess.run([sys.executable, str(root / "src" / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(bf16),
                        "--outtype", "bf16"], check=True, env=env)
        shutil.rmtree(folder)
        subprocess.run([str(root / "bin" / "llama-quantize"), str(bf16), str(out), "Q4_K_M"], check=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        bf16.unlink(missing_ok=True)
    print(out)
    return out


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f})"


def llama_bench(root: Path, gguf: Path, threads: int, n: int) -> float:
    done = subprocess.run([str(root / "bin" / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(n), "-t",
                           str(threads), "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def measure(args) -> None:
    from speculant.bench.speed import cost_curve, decode_tps
    from speculant.models import load_model
    from speculant.threads import configure_threads

    gguf = shapes_dir() / f"{NAME}-Q4_K_M.gguf"
    if not gguf.is_file():
        sys.exit(f"{gguf} is missing: run `python scripts/qwen35_shape.py build` first")
    configure_threads(args.threads)
    root = llama_cpp()
    model = load_model(str(gguf), progress=False).model
    ids = list(range(1000, 1000 + args.context))
    ours, theirs, curves, mtp_ms = [], [], [], []
    for _ in range(REPEATS):  # in turns, so load on the shared machine hits both sides alike
        ours.append(decode_tps(model, ids, args.tokens)[0])
        theirs.append(llama_bench(root, gguf, args.threads, args.tokens))
        curves.append(cost_curve(model, ids, range(1, max(KS) + 2), repeats=3))
        mtp_ms.append(mtp_step_ms(model, ids))
        print(f"run {len(ours)}: ours {ours[-1]:.3f} tok/s, llama.cpp {theirs[-1]:.3f} tok/s, forward of 1 "
              f"{curves[-1][1]:.1f} ms, MTP step {mtp_ms[-1]:.1f} ms", flush=True)
    print(f"file {gguf.name}, {args.threads} threads, {args.context}-token context")
    print(f"decode tok/s  ours {spread(ours)}  llama.cpp (llama-bench -p 0 -n {args.tokens}) {spread(theirs)}")
    print(f"ratio ours/llama.cpp {spread([a / b for a, b in zip(ours, theirs)])}")
    one = [c[1] for c in curves]
    print(f"target forward of 1 token: {spread(one)} ms")
    print(f"MTP step per drafted token: {spread(mtp_ms)} ms; c = {spread([m / o for m, o in zip(mtp_ms, one)])}")
    for k in KS:
        print(f"r({k}) (a forward of {k + 1} tokens / of 1): {spread([c[k + 1] / c[1] for c in curves])}")


def mtp_step_ms(model, ids: list[int], steps: int = 16) -> float:
    """Median ms of one chained MTP draft step (one token, the drafter's own hidden state in)."""
    import torch

    mtp = model.mtp
    cache = mtp.new_cache(model, len(ids) + steps + 1)
    h = torch.zeros(len(ids), model.cfg.dim)
    tokens = torch.tensor(ids)
    h, _ = mtp(model, tokens, h, cache)
    base = cache.length
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        mtp(model, tokens[i : i + 1], h[-1:], cache)
        if i:
            times.append((time.perf_counter() - t) * 1e3)
        cache.rollback(base)
    return statistics.median(times)


def profile(args) -> None:
    """Where a decode step (1 token) and a verification pass (9 tokens) spend their time: torch.profiler's ops."""
    import torch
    from torch.profiler import profile as torch_profile

    from speculant.models import load_model
    from speculant.threads import configure_threads

    configure_threads(args.threads)
    model = load_model(str(shapes_dir() / f"{NAME}-Q4_K_M.gguf"), progress=False).model
    cache = model.new_cache(args.context + 16)
    model(torch.arange(1000, 1000 + args.context), cache)
    base = cache.length
    for S in (1, 9):
        model(torch.arange(S), cache)
        cache.rollback(base)
        with torch_profile() as prof:
            for _ in range(5):
                model(torch.arange(S), cache)
                cache.rollback(base)
        print(f"forward of {S} token(s), 5 runs")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    rest_of_step(model, cache, base)


def rest_of_step(model, cache, base: int, runs: int = 7) -> None:
    """What a pass costs beside its weight matmuls (the C calls torch.profiler does not see): the pass timed in turns
    with and without them (each GGML linear then returns zeros; the other work is the same)."""
    import torch

    from speculant.models.formats import GGMLLinear

    real = GGMLLinear.forward

    def zeros(self, x):
        return torch.zeros(x.shape[0], self.out_features)

    for S in (1, 9):
        times = {real: [], zeros: []}
        try:
            for _ in range(runs):
                for fn in times:
                    GGMLLinear.forward = fn
                    t = time.perf_counter()
                    model(torch.arange(S), cache)
                    times[fn].append((time.perf_counter() - t) * 1e3)
                    cache.rollback(base)
        finally:
            GGMLLinear.forward = real
        full, rest = statistics.median(times[real]), statistics.median(times[zeros])
        print(f"forward of {S} token(s): {full:.1f} ms, without the weight matmuls {rest:.1f} ms "
              f"({rest / full:.0%} of the pass), median of {runs} in turns")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--force", action="store_true")
    m = sub.add_parser("measure")
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--tokens", type=int, default=64)
    m.add_argument("--context", type=int, default=64)
    f = sub.add_parser("profile")
    f.add_argument("--threads", type=int, default=2)
    f.add_argument("--context", type=int, default=64)
    a = p.parse_args()
    {"build": build, "measure": measure, "profile": profile}[a.cmd](a)


if __name__ == "__main__":
    main()

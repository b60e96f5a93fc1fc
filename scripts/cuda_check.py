"""The cuda path, checked on random models built in-process (no model files): one pass, one report.

Usage: python scripts/cuda_check.py [--device cuda] [--tests tests/] [--out DIR] [--quick]
(--device cpu runs every check on the CPU: a dry run of the script itself.)

1. batch invariance: a short pass's rows equal the same rows scored one token at a time (float32 linears
   raw and as FloatLinear pads them; then whole chain and tree passes of a model, with and without the pad);
2. greedy: every method's output token for token `ar`'s on the device (governor off: every round
   speculates), with and without penalties and logit bias;
3. `ar` on the device against `ar` on the CPU (float32): the first difference and the logit margin there;
4. sampled: every method completes a seeded run, and repeats it exactly;
5. the command line: HF folders written from the models, `speculant generate --device DEV --dtype float32`
   for every method (text equal to ar's) and the clear errors (a block format, a missing GPU);
6. tokens/s of ar, lookup, draft and hybrid on a bigger random model (random-model numbers: how much a
   random model's text repeats decides the acceptance; only the per-round costs carry over), what a pass
   of S rows costs against one row, and the host syncs per round;
7. chi-square of seeded speculative sampling against the exact marginals (tests/sampled.py).
Every check prints one line; a summary JSON goes to --out. Exit status 1 if a check failed.

A run's results on a GPU: docs/measurements.md "GPU".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
ap.add_argument("--tests", default=str(Path(__file__).resolve().parent.parent / "tests"))
ap.add_argument("--out", default=None)
ap.add_argument("--quick", action="store_true", help="smaller models and fewer runs (a dry run)")
ap.add_argument("--skip", default="", help="comma-separated phases to skip (invariance,greedy,cpu,sampled,cli,speed,chi2)")
args = ap.parse_args()
sys.path.insert(0, args.tests)

from conftest import tiny_model  # noqa: E402  (tests/conftest.py: the random-model builder the tests use)
from test_heads import random_head  # noqa: E402  (a random head saved as a checkpoint folder)

from speculant.cli import main as cli_main  # noqa: E402
from speculant.decoding.engine import Engine, GenerationConfig  # noqa: E402
from speculant.methods.governor import GovernorConfig  # noqa: E402
from speculant.methods.heads import HeadsConfig  # noqa: E402
from speculant.methods.config import MethodConfig  # noqa: E402
from speculant.methods.base import DraftLengthConfig  # noqa: E402
from speculant.methods.draft_model import DraftModelConfig  # noqa: E402
from speculant.methods.hybrid import HybridConfig  # noqa: E402
from speculant.methods.lookup import LookupConfig  # noqa: E402
from speculant.models import LoadedModel  # noqa: E402
from speculant.models.formats import FloatLinear, SHORT_PASS_MAX  # noqa: E402
from speculant.exact.sampler import SamplingConfig  # noqa: E402
from speculant.exact.tree import DraftTree  # noqa: E402

DEV = torch.device(args.device)
QUICK = args.quick
SKIP = set(filter(None, args.skip.split(",")))
T0 = time.perf_counter()
summary: dict[str, object] = {"device": str(DEV), "checks": [], "numbers": {}}
failed: list[str] = []


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def check(name: str, ok: bool, detail: str = "") -> None:
    summary["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
    if not ok:
        failed.append(name)
    log(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def on(loaded: LoadedModel, dev: torch.device) -> LoadedModel:
    """A copy of a loaded model on `dev` (the original stays where it is)."""
    m = copy.deepcopy(loaded.model).to(dev)
    return LoadedModel(loaded.name, loaded.path, m, loaded.tokenizer, loaded.dtype)


@contextlib.contextmanager
def unpadded():
    """FloatLinear as it was before the cuda fix: F.linear on whatever rows come (to show what the pad buys)."""
    orig = FloatLinear.forward
    FloatLinear.forward = lambda self, x: F.linear(x, self.weight, self.bias)
    try:
        yield
    finally:
        FloatLinear.forward = orig


def phase(name: str):
    def deco(fn):
        if name in SKIP:
            log(f"---- {name}: skipped")
            return fn
        log(f"---- {name}")
        try:
            fn()
        except Exception as e:  # one phase's crash is a failed check, the others still run
            traceback.print_exc()
            check(f"{name} ran", False, f"{type(e).__name__}: {str(e)[:300]}")
        return fn
    return deco


# ------------------------------------------------------------------------------------------------ environment
log(f"torch {torch.__version__}, device {DEV}"
    + (f" = {torch.cuda.get_device_name(DEV)}, tf32 matmul {torch.backends.cuda.matmul.allow_tf32}"
       if DEV.type == "cuda" else ""))
summary["torch"] = torch.__version__
if DEV.type == "cuda":
    summary["gpu"] = torch.cuda.get_device_name(DEV)

V_SMALL = 96 if QUICK else 256
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5,
          3, 1, 4, 1, 5, 9, 2, 6]  # repeats, so prompt lookup finds matches
TARGET = tiny_model(V_SMALL, seed=1, dim=128, heads=4, kv_heads=2, hidden=256, layers=4, logit_scale=2.0)
# same weights, flatter head: the same greedy choices, other distributions (sampled rejections)
SELF_DRAFT = tiny_model(V_SMALL, seed=1, dim=128, heads=4, kv_heads=2, hidden=256, layers=4, logit_scale=1.0)
OTHER_DRAFT = tiny_model(V_SMALL, seed=7, dim=64, heads=4, kv_heads=2, hidden=128, layers=2, logit_scale=2.0)
T, DS, DO = on(TARGET, DEV), on(SELF_DRAFT, DEV), on(OTHER_DRAFT, DEV)
OFF = GovernorConfig("off")
PENALTIES = SamplingConfig(0.0, repeat_penalty=1.3, repeat_last_n=16, presence_penalty=0.2,
                           frequency_penalty=0.1, logit_bias={5: -2.0, 7: 1.5, 11: float("-inf")})
HEADS_DIR = Path(tempfile.mkdtemp(prefix="cuda-check-heads-"))


V_TARGET = TARGET.config.vocab_size
HEADS = {m: random_head(TARGET, m, HEADS_DIR, draft_vocab=None if m == "eagle2" else V_TARGET - 8)
         for m in ("medusa", "eagle2", "eagle3")}


def engines(target: LoadedModel, dself: LoadedModel, dother: LoadedModel, governor=OFF) -> dict[str, Engine]:
    """Every method: chains k=4 up to 8 (heuristic), trees of 8 nodes, the heads' trees."""
    dl = DraftLengthConfig(4, "heuristic", 8)
    base = MethodConfig("ar", dl, governor=governor)
    hc = HeadsConfig(nodes=8, depth=4, topk=3)
    out = {
        "ar": Engine(target, method=base),
        "lookup": Engine(target, method=replace(base, name="lookup")),
        "lookup_tree": Engine(target, method=replace(base, name="lookup_tree")),
        "draft/self": Engine(target, dself, replace(base, name="draft", draft_model=DraftModelConfig(0.0))),
        "draft/other": Engine(target, dother, replace(base, name="draft")),
        "hybrid/self": Engine(target, dself, replace(base, name="hybrid", draft_model=DraftModelConfig(0.0))),
        "hybrid/other": Engine(target, dother, replace(base, name="hybrid")),
        "hybrid/never": Engine(target, dother, replace(base, name="hybrid", hybrid=HybridConfig("never"))),
        "draft_tree/other": Engine(target, dother, replace(base, name="draft_tree")),
    }
    for m, folder in HEADS.items():
        out[m] = Engine(target, method=replace(base, name=m, heads=replace(hc, name=str(folder))))
    return out


# ------------------------------------------------------------------------------------------------ 1. invariance
@phase("invariance")
def _invariance():
    g = torch.Generator().manual_seed(0)
    for n_out in (4096, 32000):
        W = (torch.randn(n_out, 1024, generator=g) * 0.03).to(DEV)
        b = (torch.randn(n_out, generator=g) * 0.1).to(DEV)
        x = torch.randn(SHORT_PASS_MAX, 1024, generator=g).to(DEV)
        lin = FloatLinear(W, b)
        for label, fn in (("raw F.linear", lambda t: F.linear(t, W, b)), ("FloatLinear", lin)):
            worst, bad = 0.0, []
            for M in (1, 2, 3, 5, 8, 16, 31, 32):
                ref = torch.cat([fn(x[i : i + 1]) for i in range(M)])
                d = float((fn(x[:M]) - ref).abs().max())
                worst = max(worst, d)
                if d:
                    bad.append(M)
            summary["numbers"][f"linear {n_out}x1024 {label} max |rows of M - rows alone|"] = worst
            log(f"  linear {n_out}x1024, {label}: rows of an M-row pass vs alone, max diff {worst:.3g}"
                f"{' at M=' + str(bad) if bad else ' (bit-identical)'}")
            if label == "FloatLinear" and DEV.type != "cpu":  # the CPU's float32 GEMM is not (test_tree_pass.py)
                check(f"FloatLinear {n_out}x1024 batch-invariant", worst == 0.0, f"max diff {worst:.3g}")
    x = torch.randn(8, 1024, generator=g).to(DEV)
    w = torch.rand(1024, generator=g).to(DEV)
    d = max(float((F.rms_norm(x[:M], (1024,), w, 1e-5) - torch.cat([F.rms_norm(x[i:i+1], (1024,), w, 1e-5)
                                                                     for i in range(M)])).abs().max()) for M in (2, 5, 8))
    log(f"  F.rms_norm rows of a pass vs alone: max diff {d:.3g}")
    check("rms_norm batch-invariant", d == 0.0, f"max diff {d:.3g}")

    model = (tiny_model(512, seed=3, dim=256, heads=8, kv_heads=2, hidden=512, layers=4, arch="llama")
             if not QUICK else tiny_model(64, seed=3, dim=64, heads=4, kv_heads=2, hidden=128, layers=2)).model.to(DEV)
    V = model.cfg.vocab_size

    def clone(c):
        n = model.new_cache(c.max_len)
        n.k.copy_(c.k), n.v.copy_(c.v)
        n.length = c.length
        return n

    def chain_and_tree(seed: int) -> tuple[int, int, int]:
        """(chain rows != alone, tree rows != alone, rows) for a random 12-node tree after a 21-token prompt."""
        gg = torch.Generator().manual_seed(seed)
        cache = model.new_cache(128)
        model(torch.randint(0, V, (21,), generator=gg).to(DEV), cache, logit_rows=slice(0, 0))
        base = cache.length
        n = 12
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gg)) for i in range(1, n)]
        tree = DraftTree(torch.randint(0, V, (n,), generator=gg).to(DEV), parents)
        pending = torch.randint(0, V, (1,), generator=gg).to(DEV)
        tc = clone(cache)
        out = model(torch.cat([pending, tree.tokens]), tc, positions=tree.positions(base, DEV),
                    mask=tree.ancestor_mask(DEV))
        bad_chain = bad_tree = 0
        for i in [-1] + list(range(n)):
            path = tree.path(i)
            toks = torch.cat([pending, tree.tokens[path]])
            chain = model(toks, clone(cache)).logits[-1]
            step = clone(cache)
            for t in toks:
                one = model(t[None], step).logits[0]
            bad_chain += not torch.equal(chain, one)
            bad_tree += not torch.equal(out.logits[i + 1], one)
        return bad_chain, bad_tree, n + 1

    for label, ctx in (("padded (this fix)", contextlib.nullcontext), ("unpadded (before)", unpadded)):
        with ctx():
            tot = [0, 0, 0]
            for seed in range(3):
                for j, v in enumerate(chain_and_tree(seed)):
                    tot[j] += v
        log(f"  model {label}: chain rows != one-at-a-time {tot[0]}/{tot[2]}, tree rows != one-at-a-time "
            f"{tot[1]}/{tot[2]}")
        summary["numbers"][f"model rows differing, {label}"] = {"chain": tot[0], "tree": tot[1], "rows": tot[2]}
        if label.startswith("padded") and DEV.type != "cpu":
            check("model chain and tree rows bit-identical to one-at-a-time decoding", tot[0] == tot[1] == 0,
                  f"chain {tot[0]}, tree {tot[1]} of {tot[2]}")


# ------------------------------------------------------------------------------------------------ 2. greedy
N_GREEDY = 48 if QUICK else 96


@phase("greedy")
def _greedy():
    for label, sampling in (("greedy", SamplingConfig()), ("greedy+penalties+bias", PENALTIES)):
        gen = GenerationConfig(max_new_tokens=N_GREEDY, sampling=sampling, ignore_eos=True)
        es = engines(T, DS, DO)
        ref = es["ar"].generate(PROMPT, gen).token_ids
        for name, e in es.items():
            if name == "ar":
                continue
            done = e.generate(PROMPT, gen)
            out, s = done.token_ids, done.stats
            first = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
            ok = out == ref and s.rounds > 0 and s.drafted_tokens > 0
            check(f"{label} {name} == ar on {DEV.type}", ok,
                  f"rounds {s.rounds}, drafted {s.drafted_tokens}, accepted {s.accepted_tokens}, tau "
                  f"{s.mean_accepted_tokens:.2f}" + ("" if first is None else f"; first difference at {first}"))


# ------------------------------------------------------------------------------------------------ 3. cpu vs device
def margin_report(cpu: LoadedModel, dev: LoadedModel, prompt: list[int], out: list[int], i: int) -> str:
    """The logits of the position where two greedy outputs first differ, scored once by each model (a prefill)."""
    ctx = torch.tensor(prompt + out[:i])
    lc = cpu.model(ctx, cpu.model.new_cache(len(ctx)), logit_rows=slice(-1, None)).logits[0]
    ld = dev.model(ctx.to(dev.model.device), dev.model.new_cache(len(ctx)), logit_rows=slice(-1, None)).logits[0].cpu()
    top = lc.topk(2)
    a, b = top.indices.tolist()
    return (f"CPU top-2 there: {a} ({float(lc[a]):.6f}), {b} ({float(lc[b]):.6f}), margin {float(lc[a] - lc[b]):.3g}; "
            f"{DEV.type}: {float(ld[a]):.6f}, {float(ld[b]):.6f}, margin {float(ld[a] - ld[b]):.3g}; "
            f"max |cpu - {DEV.type}| over the row {float((lc - ld).abs().max()):.3g}")


def cpu_vs_device(label: str, cpu: LoadedModel, dev: LoadedModel, prompt: list[int], n: int) -> None:
    gen = GenerationConfig(max_new_tokens=n, ignore_eos=True)
    a = Engine(cpu).generate(prompt, gen).token_ids
    b = Engine(dev).generate(prompt, gen).token_ids
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    detail = f"{n} tokens identical" if first is None else f"first difference at token {first}: " + \
        margin_report(cpu, dev, prompt, a, first)
    summary["numbers"][f"cpu vs {DEV.type} ar, {label}"] = detail
    check(f"ar {label}: {DEV.type} == cpu float32", first is None, detail)


BIG = dict(seed=11, dim=1024, heads=16, kv_heads=4, hidden=2816, layers=8, arch="llama", context=1024)
BIG_DRAFT = dict(seed=12, dim=256, heads=4, kv_heads=2, hidden=704, layers=2, arch="llama", context=1024)
if QUICK:
    BIG = dict(BIG, dim=128, heads=4, kv_heads=2, hidden=256, layers=2)
    BIG_DRAFT = dict(BIG_DRAFT, dim=64, hidden=128)
V_BIG = 2000 if QUICK else 32000
_big: dict[str, LoadedModel] = {}


def big() -> tuple[LoadedModel, LoadedModel, LoadedModel]:
    """(target on the CPU, target on DEV, draft on DEV), built once."""
    if not _big:
        t = time.perf_counter()
        _big["cpu"] = tiny_model(V_BIG, logit_scale=1.0, **BIG)
        _big["dev"] = on(_big["cpu"], DEV)
        _big["draft"] = on(tiny_model(V_BIG, logit_scale=1.0, **BIG_DRAFT), DEV)
        log(f"  built the bigger models ({sum(p.numel() for p in _big['cpu'].model.parameters()) / 1e6:.0f}M and "
            f"{sum(p.numel() for p in _big['draft'].model.parameters()) / 1e6:.0f}M parameters) in "
            f"{time.perf_counter() - t:.1f}s")
    return _big["cpu"], _big["dev"], _big["draft"]


g_big = torch.Generator().manual_seed(5)
MOTIF = torch.randint(0, V_BIG, (12,), generator=g_big).tolist()
BIG_PROMPT = (MOTIF + torch.randint(0, V_BIG, (4,), generator=g_big).tolist()) * 4  # 64 tokens, repeating


@phase("cpu")
def _cpu():
    cpu_vs_device(f"small model, {N_GREEDY} tokens", TARGET, T, PROMPT, N_GREEDY)
    c, d, _ = big()
    cpu_vs_device(f"bigger model, {32 if QUICK else 64} tokens", c, d, BIG_PROMPT, 32 if QUICK else 64)


# ------------------------------------------------------------------------------------------------ 4. sampled
@phase("sampled")
def _sampled():
    samplings = {"t0.8 top-p0.95 seed1": SamplingConfig(0.8, top_p=0.95, seed=1),
                 "t1 seed2 (no cut)": SamplingConfig(1.0, seed=2),
                 "t0.7 top-k20 penalties bias seed3": replace(PENALTIES, temperature=0.7, top_k=20, seed=3)}
    for label, sampling in samplings.items():
        gen = GenerationConfig(max_new_tokens=48, sampling=sampling, ignore_eos=True)
        for name, e in engines(T, DS, DO).items():
            a = e.generate(PROMPT, gen)
            b = e.generate(PROMPT, gen)
            s = a.stats
            ok = len(a.token_ids) == 48 and a.token_ids == b.token_ids and (name == "ar" or s.drafted_tokens > 0)
            check(f"sampled {label} {name}", ok,
                  f"{len(a.token_ids)} tokens, repeat {'identical' if a.token_ids == b.token_ids else 'DIFFERENT'}, "
                  f"drafted {s.drafted_tokens}, accepted {s.accepted_tokens}")


# ------------------------------------------------------------------------------------------------ 5. command line
def write_hf(loaded: LoadedModel, folder: Path) -> Path:
    """An HF folder (config.json, model.safetensors, tokenizer.json) holding exactly this model's weights."""
    from safetensors.torch import save_file

    m, c = loaded.model, loaded.config
    folder.mkdir(parents=True, exist_ok=True)
    H, Hkv, hd, Fd = c.n_heads, c.n_kv_heads, c.head_dim, c.hidden_dim
    st = {"model.embed_tokens.weight": m.embed.weight, "model.norm.weight": m.norm, "lm_head.weight": m.lm_head.weight}
    for i, b in enumerate(m.blocks):
        p = f"model.layers.{i}."
        q, k, v = b.qkv.weight.split([H * hd, Hkv * hd, Hkv * hd])
        st |= {p + "input_layernorm.weight": b.attn_norm, p + "post_attention_layernorm.weight": b.ffn_norm,
               p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
               p + "self_attn.o_proj.weight": b.o.weight, p + "mlp.gate_proj.weight": b.gate_up.weight[:Fd],
               p + "mlp.up_proj.weight": b.gate_up.weight[Fd:], p + "mlp.down_proj.weight": b.down.weight}
        if c.qkv_bias:
            qb, kb, vb = b.qkv.bias.split([H * hd, Hkv * hd, Hkv * hd])
            st |= {p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb, p + "self_attn.v_proj.bias": vb}
    save_file({k: t.detach().cpu().contiguous() for k, t in st.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    arch = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[c.arch]
    cfg = {"architectures": [arch], "model_type": c.arch, "hidden_size": c.dim, "intermediate_size": Fd,
           "num_hidden_layers": c.n_layers, "num_attention_heads": H, "num_key_value_heads": Hkv,
           "vocab_size": c.vocab_size, "max_position_embeddings": c.context_length, "rope_theta": c.rope_base,
           "rms_norm_eps": c.norm_eps, "tie_word_embeddings": False, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(cfg))
    loaded.tokenizer._backend.save(str(folder / "tokenizer.json"))
    return folder


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@phase("cli")
def _cli():
    work = Path(tempfile.mkdtemp(prefix="cuda-check-cli-"))
    os.environ["SPECULANT_HOME"] = str(work / "home")
    tf, df = write_hf(TARGET, work / "target"), write_hf(OTHER_DRAFT, work / "draft")
    text = " ".join(f"t{i}" for i in PROMPT)
    common = ["generate", "--model", str(tf), "--device", args.device, "--no-progress", "-n", "40", "--stats",
              "--governor", "off"]
    rc, ref, err = cli(*common, "--dtype", "float32", "--method", "ar", text)
    check(f"cli --device {args.device} --dtype float32 ar", rc == 0 and len(ref.split()) > 0, err.strip()[-300:])
    direct = Engine(T).generate(PROMPT, GenerationConfig(max_new_tokens=40)).text
    check("cli ar text == the in-process engine's on the same weights", ref.strip() == direct.strip(),
          f"{ref.strip()[:60]!r} vs {direct.strip()[:60]!r}")
    for method, extra in (("lookup", []), ("lookup_tree", []), ("draft", ["--draft", str(df)]),
                          ("hybrid", ["--draft", str(df)]), ("draft_tree", ["--draft", str(df)]),
                          ("hybrid (default dtype)", ["--draft", str(df)])):
        dtype = [] if "default" in method else ["--dtype", "float32"]
        rc, out, err = cli(*common, *dtype, "--method", method.split()[0], *extra, text)
        stats = json.loads(err.strip().splitlines()[-1]) if rc == 0 else {}
        check(f"cli {method} == ar", rc == 0 and out == ref,
              err.strip()[-300:] if rc else f"drafted {stats.get('drafted_tokens')}, accepted {stats.get('accepted_tokens')}")
    rc, out, err = cli(*common, "--dtype", "float32", "--method", "hybrid", "--draft", str(df), "-t", "0.8",
                       "--top-p", "0.9", "--seed", "3", "--repeat-penalty", "1.2", text)
    check("cli sampled hybrid", rc == 0 and len(out.split()) > 0, err.strip()[-300:])
    if DEV.type == "cuda":
        for argv, needle in ((["--dtype", "q8_0"], "runs on the CPU only"),
                             (["--device", f"cuda:{torch.cuda.device_count()}"], "there is no GPU"),
                             (["--device", "mps"], "not supported")):
            rc, out, err = cli(*common, *argv, "--method", "ar", text)
            check(f"cli {' '.join(argv)} is a clear error", rc == 2 and needle in err and len(err.strip().splitlines()) == 1,
                  err.strip())


# ------------------------------------------------------------------------------------------------ 6. speed
@phase("speed")
def _speed():
    _, target, draft = big()
    n = 128
    gen = GenerationConfig(max_new_tokens=n, ignore_eos=True)
    dl = DraftLengthConfig()
    rows = []
    for label, name, gov in (("ar", "ar", "off"), ("lookup", "lookup", "off"), ("lookup (governor auto)", "lookup", "auto"),
                             ("draft", "draft", "off"), ("hybrid", "hybrid", "off"),
                             ("hybrid (governor auto)", "hybrid", "auto"), ("lookup_tree", "lookup_tree", "off")):
        e = Engine(target, draft if name in ("draft", "hybrid") else None,
                   MethodConfig(name, dl, governor=GovernorConfig(gov)))
        e.generate(BIG_PROMPT, replace(gen, max_new_tokens=16))  # warm-up (allocator, cuBLAS handles)
        tps, dec, outs = [], [], []
        for _ in range(3):
            sync()
            t = time.perf_counter()
            done = e.generate(BIG_PROMPT, gen)
            sync()
            tps.append(n / (time.perf_counter() - t))
            dec.append(done.stats.decode_tokens_per_second)
            outs.append(done.token_ids)
        s = done.stats
        rows.append((label, statistics.median(tps), statistics.median(dec), s.mean_accepted_tokens, s.acceptance_rate,
                     s.paused_rounds, outs[0]))
    ar_dec = rows[0][2]
    log(f"  random-model numbers, {DEV}: target {BIG['dim']}-dim {BIG['layers']} layers vocab {V_BIG}, draft "
        f"{BIG_DRAFT['dim']}-dim {BIG_DRAFT['layers']} layers; {n} tokens after a {len(BIG_PROMPT)}-token prompt, "
        "median of 3")
    for label, t, d, tau, acc, paused, out in rows:
        log(f"  {label:24s} {t:8.1f} tok/s end to end, decode {d:8.1f} tok/s ({d / ar_dec:.2f}x ar), tau {tau:.2f}, "
            f"acceptance {acc:.2f}, paused rounds {paused}, output == ar: {out == rows[0][6]}")
        summary["numbers"][f"speed {label}"] = {"tok_s": round(t, 1), "decode_tok_s": round(d, 1),
                                               "x_ar": round(d / ar_dec, 3), "tau": round(tau, 3),
                                               "acceptance": round(acc, 3), "same_as_ar": out == rows[0][6]}
    check("speed runs: every method's output == ar on the bigger model", all(r[6] == rows[0][6] for r in rows))
    # what a verification pass costs: one forward of S rows after a 64-token prompt, against one of 1 row
    for label, m in (("target", target.model), ("draft", draft.model)):
        cache = m.new_cache(256)
        m(torch.tensor(BIG_PROMPT, device=DEV), cache, logit_rows=slice(0, 0))
        base = cache.length
        cost = {}
        for S in (1, 2, 4, 8, 16, 32):
            toks = torch.tensor(BIG_PROMPT[:S], device=DEV)
            ts = []
            for _ in range(12):
                sync()
                t = time.perf_counter()
                m(toks, cache)
                sync()
                ts.append(time.perf_counter() - t)
                cache.rollback(base)
            cost[S] = statistics.median(ts[2:]) * 1e3
        log(f"  {label} forward of S rows, ms (x one row): "
            + ", ".join(f"{S}: {v:.2f} ({v / cost[1]:.2f}x)" for S, v in cost.items()))
        summary["numbers"][f"forward ms by rows, {label}"] = {S: round(v, 3) for S, v in cost.items()}
    if DEV.type != "cuda":
        return
    import warnings

    # host syncs per round: every read of a device value and every copy of a host list to the GPU waits for its queue
    for label, name in (("ar", "ar"), ("lookup", "lookup"), ("draft", "draft"), ("hybrid", "hybrid"),
                        ("lookup_tree", "lookup_tree")):
        e = Engine(target, draft if name in ("draft", "hybrid") else None, MethodConfig(name, dl, governor=GovernorConfig("off")))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                done = e.generate(BIG_PROMPT, replace(gen, max_new_tokens=32))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        n_sync = sum("synchroniz" in str(w.message) for w in caught)
        rounds = done.stats.rounds + done.stats.paused_rounds
        log(f"  host syncs, {label}: {n_sync} in a 32-token generation ({rounds} rounds, {n_sync / max(rounds, 1):.1f} a round, "
            f"prefill included)")
        summary["numbers"][f"syncs per round {label}"] = round(n_sync / max(rounds, 1), 2)


# ------------------------------------------------------------------------------------------------ 7. chi-square
@phase("chi2")
def _chi2():
    from sampled import exact_marginals, sample_runs

    V, n_tok = 4, 4
    runs = 400 if QUICK else 1000
    target = tiny_model(V, seed=5, logit_scale=0.2)
    draft = tiny_model(V, seed=6, logit_scale=0.2, dim=16, layers=1)
    t, d = on(target, DEV), on(draft, DEV)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    samplings = (("hybrid", SamplingConfig(1.0, top_p=0.9)),
                 ("draft", replace(PENALTIES, temperature=0.8, logit_bias=())), ("lookup_tree", SamplingConfig(0.8)))
    for name, sampling in samplings:
        if time.perf_counter() - T0 > 200:  # the device call's limit is 300 s: leave the rest
            log(f"  chi-square {name}: skipped (time)")
            continue
        exp = exact_marginals(target, prompt, sampling, n_tok)
        e = Engine(t, d if name in ("draft", "hybrid") else None,
                   MethodConfig(name, DraftLengthConfig(3, "fixed"), LookupConfig(3, min_ngram=1),
                                DraftModelConfig(0.0, 0)))
        t1 = time.perf_counter()
        r = sample_runs(lambda i: e, prompt, sampling, n_tok, V, runs)
        p = r.pvalues(exp)
        check(f"chi-square {name} on {DEV.type} ({runs} runs, {n_tok} positions)",
              min(p) > 1e-4 and 0 < r.accepted < r.drafted,
              f"p-values {[round(x, 4) for x in p]}, drafted {r.drafted}, accepted {r.accepted}, "
              f"{time.perf_counter() - t1:.1f}s")


log(f"done: {len(summary['checks']) - len(failed)} of {len(summary['checks'])} checks passed"
    + (f"; FAILED: {failed}" if failed else ""))
summary["failed"] = failed
if args.out:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1))
sys.exit(1 if failed else 0)

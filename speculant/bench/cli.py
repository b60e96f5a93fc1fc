"""`speculant bench speed|methods`: argument wiring, model loading and where the reports go.

Tables go to stdout, progress and warnings to stderr, and every run writes JSON (raw values),
Markdown (the tables) and, for `methods`, a PNG chart into --out. `methods` exits 1 when any method
produced tokens different from `ar`'s (an exactness failure), after writing its reports.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.console import Console

from ..errors import SpeculantError
from ..models.cache import KV_DTYPES, kv_dtype_name
from ..models.formats import WEIGHT_FORMATS
from .prompts import DATASETS, TURNS
from .speed import DEFAULT_DTYPES, DEFAULT_MODELS, KS, PEERS

# what `bench methods` compares by default: the methods that need no trained heads (tree and head
# methods are asked for by name, the heads with --heads)
DEFAULT_METHODS = ("ar", "draft", "lookup", "hybrid")

DEFAULT_OUT = "bench_out"


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    from ..cli_options import DEFAULT_DRAFT, add_model_args, add_sampler_args

    bench = subparsers.add_parser("bench", help="benchmark model speed or decoding methods")
    modes = bench.add_subparsers(dest="bench_mode", required=True)

    s = modes.add_parser("speed", help="prefill/decode tok/s, bandwidth use and verification cost per weight format")
    s.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="presets, .gguf files or HF folders")
    s.add_argument("--dtypes", nargs="+", choices=WEIGHT_FORMATS, default=None,
                   help=f"weight formats (default: {' '.join(DEFAULT_DTYPES)}, gguf where its kernels build)")
    s.add_argument("--threads", type=int, default=None, help="CPU threads (default: one per physical core)")
    s.add_argument("--tokens", type=int, default=64, help="greedy decode steps timed")
    s.add_argument("--cache", type=int, default=256, help="prompt tokens: prefill length and cost-curve cache")
    s.add_argument("--kv-dtype", choices=tuple(KV_DTYPES), default=None,
                   help="our KV caches' type (default f16, f32 beside float32 weights)")
    s.add_argument("--repeats", type=int, default=5, help="repeats per timing (median reported)")
    s.add_argument("--ks", type=int, nargs="+", default=list(KS), help="cost-curve batch sizes")
    s.add_argument("--bandwidth-gib", type=float, default=1.0, help="array size of the bandwidth measurement")
    s.add_argument("--against", nargs="+", choices=PEERS, default=[], help="peer engines to measure too")
    s.add_argument("--out", default=DEFAULT_OUT, help=f"report folder (default: {DEFAULT_OUT})")
    s.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    _add_isa_arg(s)

    m = modes.add_parser("methods", help="end-to-end speed of ar / draft / lookup on HumanEval or Spec-Bench")
    add_model_args(m)
    m.set_defaults(draft=DEFAULT_DRAFT)
    for action in m._actions:  # the shared --method (one method) does not apply here: --methods does
        if action.dest == "method":
            action.help = argparse.SUPPRESS
    m.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   help="methods to compare: ar, draft, lookup, hybrid, or variants such as draft:k=4,schedule=fixed "
                        "(keys: k, schedule, max_k, conf, vocab, ctx, ngram, ngram_min, check, governor)")
    m.add_argument("--dataset", choices=DATASETS, default="humaneval", help="prompt set")
    m.add_argument("--categories", nargs="+", default=[], help="Spec-Bench categories (e.g. summarization rag)")
    m.add_argument("--count", type=int, default=20, help="prompts per category")
    m.add_argument("--turns", choices=TURNS, default="first",
                   help="Spec-Bench: each question's first turn, or all its turns as one conversation (its prompt "
                        "cache shared by the turns, as in a chat; later turns are rows ID#2, ...)")
    m.add_argument("--max-tokens", "-n", type=int, default=128, help="tokens generated per prompt (fixed)")
    m.add_argument("--warmup-tokens", type=int, default=8, help="untimed tokens each method generates first")
    m.add_argument("--specbench-file", default=None,
                   help="spec_bench_question.jsonl (default: $SPECULANT_SPECBENCH or ../shared/data/)")
    m.add_argument("--against", nargs="+", choices=("transformers",), default=[], help="peer engines to run too")
    add_sampler_args(m)  # greedy unless --temperature > 0
    m.add_argument("--seeds", type=int, default=1,
                   help="sampled runs: generate each prompt with seeds --seed (default 0) .. --seed + N - 1")
    m.add_argument("--bandwidth-gib", type=float, default=0.25,
                   help="array size of the memory bandwidth measured before each prompt (0: none)")
    m.add_argument("--out", default=DEFAULT_OUT, help=f"report folder (default: {DEFAULT_OUT})")
    _add_isa_arg(m)

    v = modes.add_parser("serve", help="load test of `speculant serve` on loopback: concurrent streaming clients, "
                                       "every response checked against the request run alone")
    add_model_args(v)
    v.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    v.add_argument("--seconds", type=float, default=60.0, help="duration of the load")
    v.add_argument("--max-tokens", "-n", type=int, default=96, help="largest max_tokens of the request mix")
    v.add_argument("--json", default=None, help="also write the report to this JSON file")


def _add_isa_arg(p: argparse.ArgumentParser) -> None:
    from ..models.native import BUILDS

    p.add_argument("--isa", choices=BUILDS, default=None,
                   help="the kernels' build (default: $SPECULANT_ISA, else the fastest this CPU runs): a narrower one "
                        "than the CPU allows measures that build on this host; one the CPU lacks is refused")


def _use_isa(args: argparse.Namespace) -> None:
    """--isa, before any kernel loads: every user of the kernels reads the build from $SPECULANT_ISA."""
    from ..models import native

    if getattr(args, "isa", None):
        native.check_build(args.isa)
        os.environ["SPECULANT_ISA"] = args.isa
    native.forced_build()  # a bad $SPECULANT_ISA is refused now, not after loading the models


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_mode in ("speed", "methods"):
        _use_isa(args)
    if args.bench_mode == "speed":
        return _speed(args)
    if args.bench_mode == "methods":
        return _methods(args)
    if args.bench_mode == "serve":
        return _serve(args)
    raise SpeculantError(f"unknown bench mode {args.bench_mode!r}; use speed or methods")


def _serve(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from ..cli_options import load_engine
    from ..server.loadtest import print_report, run_load_test

    if args.clients < 1 or not args.seconds > 0 or args.max_tokens < 2:
        raise SpeculantError("--clients must be >= 1, --seconds > 0 and --max-tokens >= 2")
    rep = run_load_test(load_engine(args), clients=args.clients, seconds=args.seconds, max_tokens=args.max_tokens)
    print_report(rep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dataclasses.asdict(rep), f, indent=1)
    return 0 if rep.errors == 0 and rep.mismatches == 0 and rep.duplicate_ids == 0 else 1


def _speed(args: argparse.Namespace) -> int:
    from ..threads import configure_threads
    from .report import output_dir, publish
    from .speed import SpeedConfig
    from .speed_run import run_speed, speed_tables

    dtypes = args.dtypes or _default_dtypes()
    cfg = SpeedConfig(models=tuple(args.models), dtypes=tuple(dict.fromkeys(dtypes)), tokens=args.tokens,
                      cache=args.cache, repeats=args.repeats, ks=tuple(sorted(set(args.ks))),
                      against=tuple(args.against), bandwidth_gib=args.bandwidth_gib, kv_dtype=args.kv_dtype)
    out = output_dir(args.out)
    threads = configure_threads(args.threads)
    err = Console(stderr=True)
    result = run_speed(cfg, threads=threads, progress=not args.no_progress, err=err)
    files = publish(speed_tables(result), result.to_dict(), out, "speed")
    err.print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _default_dtypes() -> list[str]:
    from ..models.formats import ggml_available

    return [d for d in DEFAULT_DTYPES if d != "gguf" or ggml_available()]


def _methods(args: argparse.Namespace) -> int:
    import torch

    from ..cli_options import load_engine
    from ..decoding.engine import Engine
    from ..methods.config import MODEL_METHODS, method_name, parse_method
    from ..hub import resolve_model
    from .methods import MethodsConfig, chart_series, methods_tables, run_methods
    from .peers import TransformersPeers
    from .prompts import load_prompts
    from .report import bar_chart, output_dir, publish

    if args.method:
        raise SpeculantError("bench methods compares several methods: use --methods (e.g. --methods ar draft lookup)")
    from ..cli_options import sampling_config

    cfg = MethodsConfig(tuple(args.methods), args.max_tokens, args.warmup_tokens, sampling_config(args), args.seeds,
                        args.bandwidth_gib)
    prompts = load_prompts(args.dataset, args.count, tuple(args.categories), args.specbench_file, args.turns)
    out = output_dir(args.out)
    err = Console(stderr=True)

    need_draft = any(method_name(m) in MODEL_METHODS for m in cfg.methods)
    ns = argparse.Namespace(**vars(args))
    ns.method, ns.draft = ("draft", args.draft) if need_draft else ("ar", None)
    base = load_engine(ns)
    specs = {name: parse_method(name, base.method) for name in cfg.methods}
    engines = {name: Engine(base.target, base.draft if spec.name in MODEL_METHODS else None, spec,
                            threads=base.threads)
               for name, spec in specs.items()}
    peers = None
    if "transformers" in args.against:
        with err.status("loading the models in transformers (float32)"):
            peers = TransformersPeers(resolve_model(args.model), resolve_model(args.draft) if need_draft else None,
                                      base.tokenizer.eos_id)
    result = run_methods(engines, prompts, cfg, peers=peers, progress=not args.no_progress, err=err)
    dl = base.method.draft_length
    result.info = {
        "target": args.model, "draft": args.draft if need_draft else None, "dtype": base.target.dtype,
        "draft_dtype": base.draft.dtype if base.draft is not None else None,
        "kv_dtype": kv_dtype_name(base.target.model.kv_dtype),
        "threads": torch.get_num_threads(),
        "dataset": args.dataset, "prompts": len(prompts), "torch": torch.__version__,
        "draft_length": {"k": dl.k, "schedule": dl.schedule, "max_k": dl.max_k},
        "min_confidence": base.method.draft_model.min_confidence, "lookup_max_ngram": base.method.lookup.max_ngram,
        "lookup_min_ngram": base.method.lookup.min_ngram,
        "draft_vocab": base.method.draft_model.vocab, "draft_context": base.method.draft_model.context,
        "hybrid_check": base.method.hybrid.check, "governor": base.method.governor.mode,
    }
    files = publish(methods_tables(result), result.to_dict(), out, "methods")
    cats, series = chart_series(result)
    if series:
        files.append(bar_chart(out / "methods.png", cats, series, ylabel=f"speedup over {cfg.reference} (tok/s)",
                               title=f"{Path(args.model).name} on {args.dataset}, {cfg.max_new_tokens} tokens"))
    err.print("wrote " + ", ".join(str(f) for f in files))
    bad = result.mismatches
    if bad:
        err.print(f"[bold red]EXACTNESS FAILURE: {len(bad)} generation(s) differ from {cfg.reference}[/bold red] "
                  f"(see records with matches_reference=false in {out / 'methods.json'})")
        return 1
    return 0

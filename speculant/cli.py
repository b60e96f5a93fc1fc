"""The `speculant` command: thin argument parsing around the engine, the hub and the benchmark.

Generated text goes to stdout as it streams; progress, stats and errors go to stderr. User errors
print one line and exit 2 (set SPECULANT_DEBUG=1 for a traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import SpeculantError
from .models.cache import KV_DTYPES

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_TARGET, help="target: preset name, .gguf path or HF folder")
    p.add_argument("--draft", "-d", default=None,
                   help="draft model for --method draft or hybrid (preset, .gguf or HF folder)")
    p.add_argument("--method", choices=("ar", "draft", "lookup", "hybrid", "lookup_tree", "draft_tree", "medusa", "eagle2", "eagle3"),
                   default=None,
                   help="decoding method: ar, draft (a draft model), lookup (n-grams of the context), hybrid "
                        "(prompt lookup's guesses, checked by the draft model where that pays, else the draft model), "
                        "lookup_tree, medusa / eagle2 / eagle3 (draft heads on the target's hidden states, trained by "
                        "`speculant train-heads`); default: hybrid if --draft is given, else lookup (exact like "
                        "every method, and needs no second model)")
    p.add_argument("--heads", default=None,
                   help="draft heads for --method medusa/eagle2/eagle3: a name in SPECULANT_HOME/heads or a folder "
                        "(default: MODEL-METHOD); speculant, Medusa and EAGLE/EAGLE-3 layouts (safetensors)")
    p.add_argument("--tree-nodes", type=int, default=None, help="head methods: tree nodes the target checks per round (default 4)")
    p.add_argument("--tree-depth", type=int, default=None, help="eagle2/eagle3: draft steps per round (default 4)")
    p.add_argument("--tree-topk", type=int, default=None, help="eagle2/eagle3: children per expanded node (default 2)")
    p.add_argument("--dtype", default=None, help="weight format: gguf (a .gguf file's own block types, the default for .gguf files), "
                   "bf16/f16 (default for HF folders storing them), q8_0, q6_k, q5_1, q5_0, q4_k, q4_1, q4_0 (quantize on load), "
                   "int8, float32 (the reference)")
    p.add_argument("--draft-dtype", default=None,
                   help="weight format of the draft (default: as --dtype; without --dtype, q4_0 for a .gguf draft stored "
                        "in more bits, else the file's own: drafting streams the draft's weights every token, and its "
                        "format never changes the output)")
    p.add_argument("--kv-dtype", choices=tuple(KV_DTYPES), default=None,
                   help="keys and values in the KV caches: f16 (default; half the memory and the streaming of f32, "
                        "rounded once as written, as llama.cpp's default cache is; exact all the same: every method "
                        "reads the same cache as ar), q8_0 (a quarter of f32: llama.cpp's q8_0 blocks, for long contexts) "
                        "or f32 (the default with --dtype float32, the reference)")
    p.add_argument("--draft-tokens", "-k", type=int, default=None, help="tokens drafted per round (start value)")
    p.add_argument("--draft-schedule", choices=("auto", "fixed", "heuristic"), default=None,
                   help="fixed k; heuristic: grow on full acceptance, shrink otherwise; auto (default): heuristic, "
                        "then the length that measured acceptance and verification cost favour (greedy or "
                        "unseeded runs; seeded ones keep heuristic)")
    p.add_argument("--max-draft-tokens", type=int, default=None, help="upper bound of the adaptive draft length (at most 31: the target checks 1 + k tokens per pass)")
    p.add_argument("--min-confidence", type=float, default=None,
                   help="draft model stops drafting when its top probability falls below this (default 0.5; 0 = never)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft only among the first N token ids (smaller draft output layer; default 65536, 0 = all)")
    p.add_argument("--draft-context", type=int, default=None,
                   help="the draft model reads only the last N prompt tokens (0 = all; default: 128 for hybrid, whose "
                        "lookup sees them all, all for draft): cheaper draft prefill of long prompts")
    p.add_argument("--hybrid-check", choices=("auto", "always", "never"), default=None,
                   help="hybrid: does the draft model check prompt lookup's guesses? auto (default: whichever yields "
                        "more per cost in this generation), always, never")
    p.add_argument("--governor", choices=("auto", "on", "off"), default=None,
                   help="fall back to plain rounds while speculating is measured slower: auto (default: for greedy "
                        "and unseeded sampling, whose output cannot depend on timing), on (also with --seed: the "
                        "draws then need not repeat run to run), off")
    p.add_argument("--ngram", type=int, default=None, help="largest n-gram prompt lookup matches")
    p.add_argument("--ngram-min", type=int, default=None,
                   help="shortest n-gram prompt lookup accepts as a match (default: 1 for lookup, 2 for hybrid)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads, >= 1 (default: $SPECULANT_THREADS, else one per physical core within the "
                        "container's CPU quota, fewer while other processes keep the cores busy)")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda / cuda:N (float32 weights only: the block formats' kernels are the CPU's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def add_sampler_args(p: argparse.ArgumentParser) -> None:
    """The sampler's flags (generate, chat, bench methods); `sampling_config` reads them."""
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens up to this mass (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this fraction as likely as the top one (0 = off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="divide the logits of tokens in the last --repeat-last-n tokens by this (1 = off; llama.cpp)")
    p.add_argument("--repeat-last-n", type=int, default=64,
                   help="tokens of the context the penalties look back over (default 64; -1 = all, 0 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from tokens that occur in that window (0 = off; OpenAI)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times each token's count in that window (0 = off; OpenAI)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS to token ID's logit (repeatable; BIAS -inf bans the token)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def sampling_config(args: argparse.Namespace):
    """The SamplingConfig of the sampler flags (a SpeculantError names what to fix)."""
    from .sampling import SamplingConfig

    bias = {}
    for item in args.logit_bias:
        tid, eq, value = item.partition("=")
        try:
            if not eq:
                raise ValueError
            bias[int(tid)] = float(value)
        except ValueError:
            raise SpeculantError(f"--logit-bias takes ID=BIAS (e.g. 42=-inf or 42=2.5), got {item!r}") from None
    return SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          logit_bias=bias)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=256, help="new tokens at most")
    add_sampler_args(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system message (with --chat / chat)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="speculant", description="Exact speculative decoding for local LLMs.")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    g.add_argument("--stats", action="store_true", help="print a JSON object of stats to stderr at the end")
    g.add_argument("prompt", help="the prompt ('-' reads stdin)")

    c = sub.add_parser("chat", help="interactive chat in the terminal")
    _add_model_args(c)
    _add_sampling_args(c)
    c.add_argument("--stats", action="store_true", help="print stats after each answer")

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server with a chat page (speculative decoding, prompt cache)")
    _add_model_args(v)
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    v.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECULANT_API_KEY, else none)")
    v.add_argument("--model-id", default=None, help="the model name clients send (default: the --model preset/file name)")
    v.add_argument("--max-queue", type=int, default=16, help="requests that may wait for the engine; more get 429")
    v.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (413 above)")
    v.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds from arrival after which a generation is cut (finish_reason length)")
    v.add_argument("--default-max-tokens", type=int, default=1024, help="max tokens for requests that set none")
    v.add_argument("--no-prompt-cache", action="store_true", help="prefill every prompt in full")
    v.add_argument("--prompt-cache-slots", type=int, default=4, metavar="N",
                   help="conversations whose prompt caches are kept at once (default 4)")
    v.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds a running generation may finish after SIGTERM before it is aborted")

    p = sub.add_parser("pull", help="download and verify default models into the cache")
    p.add_argument("names", nargs="*", help="preset names (default: all)")
    p.add_argument("--list", action="store_true", help="list presets and whether they are cached")
    p.add_argument("--force", action="store_true", help="download again even if cached")

    k = sub.add_parser("cache", help="list or remove what is cached (models, converted weights, kernels, heads)")
    k.add_argument("action", choices=("ls", "rm"), help="ls: list with sizes; rm: remove")
    k.add_argument("targets", nargs="*", help="for rm: all, a kind (models, converted, kernels, heads, tmp), "
                                              "a preset name or a file name from `cache ls`")

    from .bench.cli import add_bench_parser
    from .heads.cli import add_heads_parsers

    add_bench_parser(sub)
    add_heads_parsers(sub)
    return ap


def load_engine(args: argparse.Namespace):
    """Models and method from the common arguments (shared by generate, chat and bench)."""
    from .engine import Engine
    from .governor import GovernorConfig
    from .method import MODEL_METHODS, MethodConfig
    from .methods.base import DraftLengthConfig
    from .methods.draft_model import DraftModelConfig
    from .methods.hybrid import HybridConfig
    from .methods.lookup import LookupConfig
    from .models import load_model
    from .runtime import configure_threads

    configure_threads(args.threads)
    # Without a draft model, prompt lookup: it needs nothing more and beat `ar` in every measured setting
    # (README "Measured here": HumanEval 1.20x greedy / 1.12x seeded sampling, Spec-Bench 1.08x / 1.03x;
    # this session's `bench methods` runs: HumanEval 1.22-1.29x, Spec-Bench 26 prompts 1.10x, each category
    # 1.04-1.40x). With one, hybrid, which uses it.
    method = args.method or ("hybrid" if args.draft else "lookup")
    if method in MODEL_METHODS and not args.draft:
        raise SpeculantError(f"--method {method} needs --draft MODEL (e.g. --draft {DEFAULT_DRAFT})")
    if method not in MODEL_METHODS and args.draft:
        raise SpeculantError(f"--draft is only used with --method draft or hybrid, not {method}")
    from .heads.runtime import HeadsConfig

    head_methods = ("medusa", "eagle2", "eagle3")
    if args.heads and method not in head_methods and getattr(args, "command", None) != "bench":
        raise SpeculantError(f"--heads is only used with --method {', '.join(head_methods)}, not {method}")
    hc = HeadsConfig()
    heads = HeadsConfig(args.heads, args.tree_nodes or hc.nodes, args.tree_depth or hc.depth, args.tree_topk or hc.topk)
    dl, dm, lk = DraftLengthConfig(), DraftModelConfig(), LookupConfig()
    k = args.draft_tokens if args.draft_tokens is not None else dl.k
    mk = args.max_draft_tokens if args.max_draft_tokens is not None else max(dl.max_k, k)
    cfg = MethodConfig(
        method,
        DraftLengthConfig(k, args.draft_schedule or dl.schedule, mk),
        LookupConfig(args.ngram if args.ngram is not None else lk.max_ngram,
                     args.ngram_min if args.ngram_min is not None else lk.min_ngram),
        DraftModelConfig(
            args.min_confidence if args.min_confidence is not None else dm.min_confidence,
            args.draft_vocab if args.draft_vocab is not None else dm.vocab,
            args.draft_context,
        ),
        HybridConfig(args.hybrid_check or HybridConfig().check),
        heads=heads,
        governor=GovernorConfig(args.governor or GovernorConfig().mode),
    )
    progress = not args.no_progress
    target = load_model(args.model, args.dtype, device=args.device, progress=progress, kv_dtype=args.kv_dtype)
    draft = None
    if args.draft:
        draft = load_model(args.draft, args.draft_dtype or args.dtype, device=args.device, progress=progress,
                           draft=True, kv_dtype=args.kv_dtype)
    return Engine(target, draft, cfg, threads=args.threads)


def _gen_config(args: argparse.Namespace):
    from .engine import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_tokens, sampling=sampling_config(args),
                            stop_strings=tuple(args.stop))


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import Chunk

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    gen = _gen_config(args)  # validate sampling values before loading a model
    engine = load_engine(args)
    for ev in engine.stream(prompt, gen, chat=args.chat, system=args.system):
        if isinstance(ev, Chunk):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        else:
            sys.stdout.write("\n")
            if args.stats:
                print(json.dumps({**ev.stats.to_dict(), "finish_reason": ev.finish_reason}), file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from .chat import Conversation

    gen = _gen_config(args)
    engine = load_engine(args)
    chat = Conversation(engine, gen, args.system)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    print("speculant chat: empty line or Ctrl-D to quit, /reset to start over, Ctrl-C stops an answer", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        except KeyboardInterrupt:
            print("\n(Ctrl-D or an empty line quits)", file=sys.stderr)
            continue
        if not line.strip():
            break
        if line.strip() == "/reset":
            chat.reset()
            print("(new conversation)", file=sys.stderr)
            continue
        turn = chat.turn(line, write)
        print()
        if turn.finish == "interrupted":
            print("(answer interrupted)", file=sys.stderr)
        elif turn.error:
            print(f"speculant: {turn.error}", file=sys.stderr)
        elif turn.finish == "length" and turn.stats is not None and turn.stats.generated_tokens < args.max_tokens:
            print("(the context is full: answer cut; /reset starts a new conversation)", file=sys.stderr)
        if args.stats and turn.stats is not None:
            print(json.dumps(turn.stats.to_dict()), file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .server.app import ServerConfig
    from .server.run import serve

    key = args.api_key if args.api_key is not None else os.environ.get("SPECULANT_API_KEY") or None
    model_id = args.model_id or (Path(args.model).stem if args.model.endswith(".gguf") else Path(args.model).name)
    # validated before the model loads
    cfg = ServerConfig(model_id, key, args.max_queue, args.max_body, args.request_timeout, args.default_max_tokens,
                       not args.no_prompt_cache, args.shutdown_grace, args.prompt_cache_slots)
    return serve(load_engine(args), cfg, args.host, args.port)


def cmd_pull(args: argparse.Namespace) -> int:
    from .hub import list_presets, model_path, pull

    presets = {p.name: p for p in list_presets()}
    if args.list:
        for p in presets.values():
            cached = "cached" if model_path(p.name).exists() else "-"
            print(f"{p.name:32s} {p.role:12s} {p.size / 1e6:8.1f} MB  {cached:7s} {p.description}")
        return 0
    for name in args.names or list(presets):
        print(pull(name, force=args.force))
    return 0


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def cmd_cache(args: argparse.Namespace) -> int:
    from .hub import cache_entries, remove_cache, speculant_home

    if args.action == "rm":
        removed = remove_cache(args.targets)
        for e in removed:
            print(f"removed {e.kind:10s} {_size(e.size):>10s}  {e.path}")
        print(f"freed {_size(sum(e.size for e in removed))}")
        return 0
    if args.targets:
        raise SpeculantError("`speculant cache ls` takes no arguments")
    entries = cache_entries()
    print(f"cache: {speculant_home()}")
    for e in entries:
        print(f"{e.kind:10s} {_size(e.size):>10s}  {e.path.name}")
    totals = {kind: sum(e.size for e in entries if e.kind == kind) for kind in dict.fromkeys(e.kind for e in entries)}
    print("total: " + (", ".join(f"{k} {_size(v)}" for k, v in totals.items()) or "empty")
          + f"; all {_size(sum(totals.values()))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "pull": cmd_pull, "cache": cmd_cache}
    try:
        if args.command == "bench":
            from .bench.cli import cmd_bench

            return cmd_bench(args)
        if args.command in ("train-heads", "export-heads"):
            from .heads.cli import cmd_export_heads, cmd_train_heads

            return (cmd_train_heads if args.command == "train-heads" else cmd_export_heads)(args)
        return handlers[args.command](args)
    except SpeculantError as e:
        if os.environ.get("SPECULANT_DEBUG"):
            raise
        print(f"speculant: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspeculant: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

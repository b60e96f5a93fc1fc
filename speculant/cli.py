"""The `speculant` command: thin argument parsing around the engine, the hub and the benchmark.

Generated text goes to stdout as it streams; progress, stats and errors go to stderr. User errors
print one line and exit 2 (set SPECULANT_DEBUG=1 for a traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# DEFAULT_TARGET, DEFAULT_DRAFT and load_engine are re-exported: scripts and library users import them from here
from .cli_options import (DEFAULT_DRAFT, DEFAULT_TARGET, add_model_args, add_sampler_args,  # noqa: F401
                          load_engine, sampling_config)
from .errors import SpeculantError


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=256, help="new tokens at most")
    add_sampler_args(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system message (with --chat / chat)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="speculant", description="Exact speculative decoding for local LLMs.")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    g.add_argument("--stats", action="store_true", help="print a JSON object of stats to stderr at the end")
    g.add_argument("prompt", help="the prompt ('-' reads stdin)")

    c = sub.add_parser("chat", help="interactive chat in the terminal")
    add_model_args(c)
    _add_sampling_args(c)
    c.add_argument("--stats", action="store_true", help="print stats after each answer")

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server with a chat page (speculative decoding, prompt cache)")
    add_model_args(v)
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
    from .training.cli import add_heads_parsers

    add_bench_parser(sub)
    add_heads_parsers(sub)
    return ap


def _gen_config(args: argparse.Namespace):
    from .decoding.engine import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_tokens, sampling=sampling_config(args),
                            stop_strings=tuple(args.stop))


def cmd_generate(args: argparse.Namespace) -> int:
    from .decoding.engine import Chunk

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
            from .training.cli import cmd_export_heads, cmd_train_heads

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

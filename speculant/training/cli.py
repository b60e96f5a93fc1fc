"""`speculant train-heads` and `speculant export-heads`: argument parsing around train.py and formats.py."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import SpeculantError
from ..heads.config import TRAINABLE
from .answers import ANSWER_TOKENS


def add_heads_parsers(sub) -> None:
    t = sub.add_parser("train-heads", help="train draft heads (medusa, eagle2, eagle3) or a DFlash block drafter "
                                           "(dflash) for a model on this machine")
    t.add_argument("--method", required=True, choices=TRAINABLE,
                   help="which head; dflash: a block drafter in z-lab's layout, run with --method dflash --drafter OUT")
    t.add_argument("--model", "-m", default="qwen2.5-coder-1.5b-instruct", help="target: preset, .gguf or HF folder")
    t.add_argument("--dtype", default=None, help="the target's weight format (default: as generate)")
    t.add_argument("--data", nargs="+", default=None, metavar="PATH",
                   help="training text: files or folders (default: this Python's standard library sources and "
                        "installed packages' docs; never HumanEval or Spec-Bench)")
    t.add_argument("--prompts", default=None, metavar="FILE",
                   help="train on the target's own answers to these prompts first (one per line, or JSON lines "
                        "with \"prompt\"): prompts like the ones the head will draft for")
    t.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS,
                   help=f"--prompts: most tokens per answer (default {ANSWER_TOKENS})")
    t.add_argument("--tokens", type=int, default=None,
                   help="training tokens to extract (default: 100,000 for a hidden size under 1,024, 60,000 above)")
    t.add_argument("--minutes", type=float, default=5.0, help="time budget, extraction included (default 5)")
    t.add_argument("--out", default=None, help="output folder (default: SPECULANT_HOME/heads/MODEL-METHOD)")
    t.add_argument("--draft-vocab", type=int, default=8192,
                   help="tokens the head proposes (default 8192); dflash: the tokens its training softmax covers (it "
                        "drafts from the whole vocabulary; the vocabulary's size trains DFlash's full softmax)")
    t.add_argument("--heads", type=int, default=4, help="medusa: number of heads (default 4)")
    t.add_argument("--steps", type=int, default=3, help="eagle: unrolled draft steps in training (default 3)")
    t.add_argument("--intermediate", type=int, default=None,
                   help="eagle, dflash: MLP width of the head's layers (default: the target's)")
    t.add_argument("--block", type=int, default=8, help="dflash: block size, the anchor and its drafts (default 8)")
    t.add_argument("--layers", type=int, default=1, help="dflash: the drafter's layers (default 1)")
    t.add_argument("--anchors", type=int, default=16, help="dflash: blocks trained per sequence and step (default 16)")
    t.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    t.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence (default 256)")
    t.add_argument("--lr", type=float, default=None, help="learning rate (default 3e-3 medusa, 4e-3 eagle)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=None, help="CPU threads")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")

    e = sub.add_parser("export-heads", help="write an eagle3 head in the speculators layout (vLLM, SGLang)")
    e.add_argument("heads", help="head name (SPECULANT_HOME/heads/NAME) or folder")
    e.add_argument("out", help="output folder")
    e.add_argument("--model", "-m", default="qwen2.5-coder-1.5b-instruct", help="the head's target")


def cmd_train_heads(args: argparse.Namespace) -> int:
    from ..models import load_model
    from ..threads import configure_threads
    from ..heads.store import default_name, heads_dir
    from .answers import AnswerConfig, read_prompts
    from .data import DataConfig, default_sources, expand
    from .train import TrainConfig, train

    configure_threads(args.threads)
    tcfg = TrainConfig(args.method, args.minutes, args.batch, args.lr, args.steps, args.draft_vocab, args.heads,
                       args.intermediate, seed=args.seed, block=args.block, layers=args.layers, anchors=args.anchors)
    files = expand(args.data) if args.data else default_sources()
    prompts = read_prompts(args.prompts) if args.prompts else None
    acfg = AnswerConfig(args.answer_tokens)
    target = load_model(args.model, args.dtype, progress=not args.no_progress)
    tokens = args.tokens or (100_000 if target.config.dim < 1024 else 60_000)
    dcfg = DataConfig(seq_len=args.seq_len, tokens=tokens, seed=args.seed)
    out = Path(args.out) if args.out else heads_dir() / default_name(args.model, args.method)
    answers = f"answers to {len(prompts)} prompts, then " if prompts else ""
    print(f"training {args.method} heads for {args.model} ({answers}{len(files)} source files, {tokens} tokens, "
          f"{args.minutes:g} min) -> {out}", file=sys.stderr)
    stats = train(target, tcfg, dcfg, files, out, progress=not args.no_progress, prompts=prompts, acfg=acfg)
    print(json.dumps({"heads": str(out), **{k: stats.get(k) for k in ("val", "best_step", "steps", "epochs", "train_tokens",
                                                               "answers", "extract_seconds", "total_seconds")}}))
    return 0


def cmd_export_heads(args: argparse.Namespace) -> int:
    from ..models import load_model
    from ..heads.formats import export_speculators, load_head
    from ..heads.store import resolve_heads

    target = load_model(args.model, progress=False)
    folder = resolve_heads(args.heads, args.model, "eagle3")
    head, _ = load_head(folder, target.config)
    if head.cfg.method != "eagle3":
        raise SpeculantError(f"{folder} holds {head.cfg.method} heads; only eagle3 exports to the speculators layout")
    print(export_speculators(head, Path(args.out), target.config, args.model))
    return 0

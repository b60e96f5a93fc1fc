"""The command-line options the `speculant` subcommands share, and the engine they describe.

`speculant generate|chat|serve` (cli.py) and `speculant bench methods|load` (bench/cli.py) take the same
model, method and sampler flags; both import them from here, so neither command module imports the
other's options.
"""

from __future__ import annotations

import argparse

from .errors import SpeculantError
from .methods.config import METHODS
from .methods.registry import METHOD_SPECS
from .models.cache import KV_DTYPES

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_TARGET, help="target: preset name, .gguf path or HF folder")
    p.add_argument("--draft", "-d", default=None,
                   help="draft model for --method draft or hybrid (preset, .gguf or HF folder)")
    p.add_argument("--method", choices=METHODS, default=None,
                   help="decoding method; default: hybrid if --draft is given, else lookup (exact like every method, "
                        "and needs no second model). " + "; ".join(f"{n}: {s.summary}" for n, s in METHOD_SPECS.items()))
    p.add_argument("--heads", default=None,
                   help="draft heads for --method medusa/eagle2/eagle3: a name in SPECULANT_HOME/heads or a folder "
                        "(default: MODEL-METHOD); speculant, Medusa and EAGLE/EAGLE-3 layouts (safetensors, or "
                        "pytorch_model.bin through torch's weights-only loader)")
    p.add_argument("--drafter", default=None, metavar="PATH",
                   help="a published drafter folder (EAGLE-3 in the EAGLE / AngelSlim, SpecForge or speculators "
                        "layout: config.json + model.safetensors or pytorch_model.bin; or llama.cpp's EAGLE-3 drafter .gguf "
                        "file), or any folder --heads takes; picks --method from its config (eagle3) unless --method is given")
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
    p.add_argument("--max-draft-tokens", type=int, default=None, help="upper bound of the adaptive draft length (default 6, or a block drafter's block less one; at most 31: the target checks 1 + k tokens per pass)")
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
    from .exact.sampler import SamplingConfig

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


def default_method(model: str, draft: str | None) -> str:
    """The method when none is named: hybrid with a draft model; the model's own MTP layer where it ships one
    (Qwen3.5: a drafter trained by the model's makers, about one decoder layer a draft; the governor still runs
    plain rounds where it measures speculation losing); else prompt lookup."""
    if draft:
        return "hybrid"
    from pathlib import Path

    from .models.load_qwen35 import ships_mtp

    return "mtp" if ships_mtp(Path(model).expanduser()) else "lookup"


def load_engine(args: argparse.Namespace):
    """Models and method from the common arguments (shared by generate, chat and bench)."""
    from .decoding.engine import Engine
    from .methods.governor import GovernorConfig
    from .methods.config import HEAD_METHODS, MODEL_METHODS, MethodConfig
    from .methods.base import DraftLengthConfig
    from .methods.draft_model import DraftModelConfig
    from .methods.hybrid import HybridConfig
    from .methods.lookup import LookupConfig
    from .models import load_model
    from .threads import configure_threads

    configure_threads(args.threads)
    # Without a draft model, prompt lookup: it needs nothing more and beat `ar` in every measured setting
    # (`speculant bench methods`, docs/measurements.md). With one, hybrid, which uses it.
    drafter = getattr(args, "drafter", None)
    if drafter and args.heads:
        raise SpeculantError("give --drafter or --heads, not both (they name the same thing: the drafter's folder)")
    bench = getattr(args, "command", None) == "bench"
    if drafter and not args.method:
        from .heads.formats import head_method
        from .heads.store import resolve_heads

        args.method = head_method(resolve_heads(drafter, args.model, "eagle3"))
    method = args.method or default_method(args.model, args.draft)
    if method in MODEL_METHODS and not args.draft:
        raise SpeculantError(f"--method {method} needs --draft MODEL (e.g. --draft {DEFAULT_DRAFT})")
    if method not in MODEL_METHODS and args.draft:
        raise SpeculantError(f"--draft is only used with --method draft or hybrid, not {method}")
    from .methods.heads import HeadsConfig

    if (args.heads or drafter) and method not in HEAD_METHODS and not bench:  # the methods that load a folder
        flag = "--drafter" if drafter else "--heads"
        raise SpeculantError(f"{flag} is only used with --method {', '.join(HEAD_METHODS)}, not {method}")
    hc = HeadsConfig()
    heads = HeadsConfig(args.heads or drafter, args.tree_nodes or hc.nodes, args.tree_depth or hc.depth, args.tree_topk or hc.topk)
    dl, dm, lk = DraftLengthConfig(), DraftModelConfig(), LookupConfig()
    k = args.draft_tokens if args.draft_tokens is not None else dl.k
    mk = args.max_draft_tokens  # None: the method's default (DraftLengthConfig.limit)
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

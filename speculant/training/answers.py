"""The target's own answers to prompts written for training (`train-heads --prompts FILE`).

A head learns to guess what the target says next, and no text is closer to that than the target's own
answers to the kind of request the head will draft for. Measured on SmolLM2 (eagle3, 5 minutes each,
greedy, 40 held-out requests to write a function for a stdlib signature; `train-heads --prompts` with
762 such requests answered 221 of them in its 35% of the budget): a 2-token chain had 22.8% of its
drafts accepted (tau 1.46) against 18.6% (tau 1.37) for the default head trained on stdlib text. Stop
24's note had 2x (24.2% vs 12.3%) with 63k tokens of raw-completion answers generated beforehand. On
requests of another kind (HumanEval's raw completions, Spec-Bench chat) such answers did not help, so
the default recipe does not generate: `--prompts` is how a user brings prompts like their own.

Prompts: a text file with one prompt per line, or JSON lines (`.jsonl`) with a "prompt" string each.
Every prompt is answered through the model's chat template (a model without one continues the prompt
as raw text), greedily, by prompt lookup decoding (the tokens plain decoding gives, sooner), and the
whole turn (template and answer) becomes one training document. Answers are kept in a folder keyed by
the model, the prompts and the settings: a rerun or a resumed run reuses them, and one that ran out of
time continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpeculantError

ANSWER_TOKENS = 256  # default cap on an answer's tokens


@dataclass(frozen=True, slots=True)
class AnswerConfig:
    max_tokens: int = ANSWER_TOKENS

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= 4096:
            raise SpeculantError(f"--answer-tokens must be in 1..4096, got {self.max_tokens}")


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a file: one per non-empty line, or JSON lines with a "prompt" string (.jsonl)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SpeculantError(f"--prompts {path}: cannot read it as UTF-8 text ({e})") from None
    prompts = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(line.strip())
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpeculantError(f"--prompts {path}, line {no}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise SpeculantError(f"--prompts {path}, line {no}: expected an object with a non-empty \"prompt\" string")
        prompts.append(row["prompt"])
    if not prompts:
        raise SpeculantError(f"--prompts {path}: no prompts in it (one per line, or JSON lines with \"prompt\")")
    return prompts


def answers_folder(root: Path, target, prompts: list[str], cfg: AnswerConfig) -> Path:
    """Where the answers of `target` to `prompts` under `cfg` are kept (below `root`)."""
    h = hashlib.sha256(json.dumps([str(target.path), target.dtype, cfg.max_tokens, prompts]).encode()).hexdigest()[:16]
    return root / f"{Path(str(target.path)).stem}-{h}"


def answer(target, prompts: list[str], cfg: AnswerConfig, folder: Path, deadline: float,
           tick: Callable[[int], None] = lambda n: None) -> list[Path]:
    """One document per prompt in `folder` (those already there are kept); stops when `deadline`
    (time.monotonic()) passes. Returns the documents, in prompt order."""
    from ..decoding.engine import Engine, GenerationConfig
    from ..methods.config import MethodConfig

    folder.mkdir(parents=True, exist_ok=True)
    engine = Engine(target, method=MethodConfig("lookup"))
    gen = GenerationConfig(max_new_tokens=cfg.max_tokens)
    chat = target.tokenizer.chat_template is not None
    out = []
    for i, prompt in enumerate(prompts):
        path = folder / f"{i:06d}.txt"
        if not path.is_file():
            if time.monotonic() >= deadline:
                break
            try:
                ids = engine.encode_prompt(prompt, chat=chat)
            except SpeculantError as e:
                raise SpeculantError(f"--prompts, prompt {i + 1}: {e}") from None
            done = engine.generate(ids, gen)
            tmp = path.with_suffix(".tmp")
            # special tokens stay in the text: the training tokenizer reads them back as those tokens
            tmp.write_text(target.tokenizer.decode(ids + done.token_ids), encoding="utf-8")
            tmp.replace(path)
        out.append(path)
        tick(1)
    return out

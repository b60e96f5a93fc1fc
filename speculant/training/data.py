"""Training text for draft heads: what is on this machine, never the evaluation sets.

The default corpus is the running Python's standard library (its .py sources: code, docstrings and
comments; pydoc_data's topics: prose) and the README/description text that installed packages ship in
their METADATA. Nothing comes from HumanEval or Spec-Bench (their prompts live in speculant/bench and
are not read here). `--data PATH` replaces the default by text files or folders of them; the target's
answers to `--prompts` (answers.py) come before either.

Documents are tokenized whole, cut into sequences of `seq_len` tokens, and split into train and
validation by a hash of the document's path, so the held-out acceptance is measured on documents the
head never saw.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpeculantError

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".js", ".ts", ".html", ".toml", ".yaml", ".yml")
MAX_DOC_CHARS = 200_000  # longer files are cut (a few huge generated modules would dominate otherwise)


@dataclass(frozen=True, slots=True)
class DataConfig:
    seq_len: int = 256
    tokens: int = 200_000  # training tokens to extract (validation takes val_fraction more)
    val_fraction: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if not 16 <= self.seq_len <= 4096:
            raise SpeculantError(f"training sequences must be 16..4096 tokens, got {self.seq_len}")
        if self.tokens < self.seq_len:
            raise SpeculantError(f"--tokens must be at least one sequence ({self.seq_len}), got {self.tokens}")
        if not 0.0 < self.val_fraction < 0.5:
            raise SpeculantError(f"validation fraction must be in (0, 0.5), got {self.val_fraction}")


def default_sources() -> list[Path]:
    """The standard library's sources and the installed packages' METADATA files, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(stdlib.rglob("*.py"))
             if not any(part in ("test", "tests", "idle_test", "site-packages", "dist-packages") for part in p.parts)]
    purelib = Path(sysconfig.get_paths()["purelib"])
    files += sorted(purelib.glob("*.dist-info/METADATA"))
    return files


def expand(paths: list[str]) -> list[Path]:
    """Files named by --data: files as given, folders searched for text files."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += [f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in TEXT_SUFFIXES]
        elif p.is_file():
            out.append(p)
        else:
            raise SpeculantError(f"--data {p}: no such file or folder")
    if not out:
        raise SpeculantError(f"--data {' '.join(paths)}: no text files found ({', '.join(TEXT_SUFFIXES)})")
    return out


def _is_val(path: Path, cfg: DataConfig) -> bool:
    h = hashlib.sha256(f"{cfg.seed}:{path.name}:{path.parent.name}".encode()).digest()
    return h[0] / 256 < cfg.val_fraction * 2  # small files are many: aim at ~val_fraction of the tokens


def sequences(tokenizer, files: list[Path], cfg: DataConfig,
              first: Sequence[Path] = ()) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train [N, seq_len], val [M, seq_len]) token ids and a fingerprint of the data, from `first`
    (the target's answers, answers.py), then `files`.

    Each list is visited in a seeded shuffle until `tokens` training tokens (and ~val_fraction of that
    in validation) are collected."""
    order = []
    for group in (list(first), list(files)):
        random.Random(cfg.seed).shuffle(group)
        order += group
    want = {False: cfg.tokens, True: max(cfg.seq_len, int(cfg.tokens * cfg.val_fraction))}
    bufs: dict[bool, list[int]] = {False: [], True: []}
    digest = hashlib.sha256(f"{cfg}".encode())
    for path in order:
        if all(len(bufs[s]) >= want[s] for s in bufs):
            break
        split = _is_val(path, cfg)
        if len(bufs[split]) >= want[split]:
            continue
        text = _read(path)
        if not text:
            continue
        ids = tokenizer.encode(text, add_special=False)
        # whole sequences only; the tail of a document starts a sequence of its own next time
        n = len(ids) // cfg.seq_len * cfg.seq_len
        if n == 0:
            continue
        bufs[split] += ids[:n]
        digest.update(str(path).encode())
    out = []
    for split in (False, True):
        ids = bufs[split][: want[split] // cfg.seq_len * cfg.seq_len]
        if not ids:
            raise SpeculantError(f"not enough training text for one {cfg.seq_len}-token {'validation' if split else 'training'} "
                                 "sequence; pass more with --data")
        out.append(torch.tensor(ids, dtype=torch.long).view(-1, cfg.seq_len))
    return out[0], out[1], digest.hexdigest()[:16]


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="ignore")[:MAX_DOC_CHARS]
    except OSError:
        return ""


def batches(n: int, batch: int, seed: int, epoch: int) -> Iterator[torch.Tensor]:
    """Shuffled index batches of one epoch (seeded: a resumed run sees the same order)."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    perm = torch.randperm(n, generator=g)
    for i in range(0, n - batch + 1, batch):
        yield perm[i: i + batch]

"""Self-distillation data: the target's own hidden states and next-token distributions over training text.

One target forward per sequence gives everything a head trains on: the features it reads (taps,
bf16) and the target's top-`TOP` next-token probabilities at every position (the labels: a head is
trained to guess what the *target* would say, not what the text says). Extraction is most of the
cost of training on a CPU, so it is cached on disk as safetensors shards (a rerun or a resumed run
reads them back; a changed model, data or tap set gets a new folder).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

TOP = 8  # target probabilities kept per position (the rest of its mass is < 1e-3 on most positions)
SHARD = 32  # sequences per cache shard


@dataclass(slots=True)
class Features:
    tokens: Tensor  # [N, T] long
    feats: Tensor  # [N, T, Df] bfloat16: the taps, concatenated in the head's order
    top_ids: Tensor  # [N, T, TOP] long: the target's most likely next tokens at each position
    top_p: Tensor  # [N, T, TOP] float32: their probabilities

    @property
    def n(self) -> int:
        return self.tokens.shape[0]


def extract_one(target, tokens: Tensor, taps: tuple[int, ...], cache=None) -> tuple[Tensor, Tensor, Tensor]:
    """tokens [T] -> (feats [T, Df] bf16, top_ids [T, TOP], top_p [T, TOP]) from one target forward."""
    T = tokens.shape[0]
    cache = cache if cache is not None and cache.max_len >= T else target.new_cache(T)
    cache.rollback(0)
    out = target(tokens, cache, taps=taps)
    feats = torch.cat([out.taps[t] for t in taps], -1).to(torch.bfloat16)
    p, ids = out.logits.float().softmax(-1).topk(TOP, -1)
    return feats, ids, p


def extract(target, tokens: Tensor, taps: tuple[int, ...], folder: Path | None,
            tick: Callable[[int], None] = lambda n: None, deadline: float | None = None) -> Features:
    """Features of every sequence of `tokens` [N, T], reusing shards cached in `folder`.

    Stops early (fewer sequences) when `deadline` (time.monotonic()) passes."""
    N, T = tokens.shape
    parts: list[dict[str, Tensor]] = []
    cache = target.new_cache(T)
    for s0 in range(0, N, SHARD):
        s1 = min(s0 + SHARD, N)
        path = None if folder is None else folder / f"{s0 // SHARD:05d}.safetensors"
        if path is not None and path.exists():
            shard = load_file(str(path))
            if shard["tokens"].shape[0] == s1 - s0 and torch.equal(shard["tokens"], tokens[s0:s1]):
                parts.append(shard)
                tick(s1 - s0)
                continue
        if deadline is not None and time.monotonic() > deadline:
            break
        rows = []
        for i in range(s0, s1):
            rows.append(extract_one(target, tokens[i], taps, cache))
            tick(1)
        shard = {"tokens": tokens[s0:s1].contiguous(), "feats": torch.stack([r[0] for r in rows]),
                 "top_ids": torch.stack([r[1] for r in rows]).int(), "top_p": torch.stack([r[2] for r in rows]).half()}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            save_file(shard, str(tmp))
            tmp.replace(path)
        parts.append(shard)
    if not parts:
        raise TimeoutError("no time left to extract any features")
    return Features(torch.cat([p["tokens"] for p in parts]), torch.cat([p["feats"] for p in parts]),
                    torch.cat([p["top_ids"] for p in parts]).long(), torch.cat([p["top_p"] for p in parts]).float())

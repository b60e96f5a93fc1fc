"""From logits to the distribution the user asked for, and draws from it.

`SamplingConfig` is the user's choice. A `Sampler` applies it during one generation, in the order of
HF and llama.cpp: logit bias, then the repetition penalty and the presence / frequency penalties over
the last `repeat_last_n` tokens of the context (llama.cpp's semantics, prompt included), then
temperature, top-k, top-p and min-p (`candidates.truncated`). Greedy decoding (temperature 0) takes
the top token after bias and penalties.

Every step is a deterministic function of the logits and the tokens before the position. Speculative
decoding applies it alike to the target's p and the draft's q at every position, each row seeing
the tokens drafted before it, so its output keeps exactly the target's distribution.
Draws take the Sampler's explicit `torch.Generator`: seeded runs repeat exactly, and no global RNG
is touched.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .distributions import Dist, draw, truncated
from ..errors import SpeculantError

MIN_TEMPERATURE = 1e-6  # below this, logits / temperature overflow float32; 0 is greedy


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    min_p: float = 0.0  # 0 = off; keep tokens at least min_p times as likely as the top one
    repeat_penalty: float = 1.0  # 1 = off; llama.cpp / CTRL: logit / penalty if > 0, else * penalty
    repeat_last_n: int = 64  # tokens the penalties look back over (prompt included); -1 = all, 0 = off
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token in the window
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the window
    # token id -> added to its logit (-inf bans it). A mapping is accepted and stored as sorted pairs;
    # ids may be strings of digits (OpenAI's JSON keys).
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        t = self.temperature
        if not (t >= 0.0) or t == math.inf or 0.0 < t < MIN_TEMPERATURE:
            raise SpeculantError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {t}")
        if self.top_k < 0:
            raise SpeculantError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SpeculantError(f"top-p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:  # what torch.Generator takes
            raise SpeculantError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if not (0.0 <= self.min_p <= 1.0):
            raise SpeculantError(f"min-p must be in [0, 1] (0 = off), got {self.min_p}")
        if not (0.0 < self.repeat_penalty < math.inf):
            raise SpeculantError(f"repeat penalty must be a finite number > 0 (1 = off), got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise SpeculantError(f"repeat-last-n must be >= -1 (-1 = the whole context, 0 = off), got {self.repeat_last_n}")
        for name, v in (("presence", self.presence_penalty), ("frequency", self.frequency_penalty)):
            if not math.isfinite(v):
                raise SpeculantError(f"{name} penalty must be a finite number (0 = off), got {v}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Do the penalties change any logit?"""
        on = self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        return on and self.repeat_last_n != 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def _bias_pairs(bias: Mapping[int | str, float] | Iterable[tuple[int | str, float]]) -> tuple[tuple[int, float], ...]:
    items = bias.items() if isinstance(bias, Mapping) else bias
    out: dict[int, float] = {}
    for key, value in items:
        try:
            tid, b = int(key), float(value)
        except (TypeError, ValueError):
            raise SpeculantError(f"logit bias needs token id -> number, got {key!r}: {value!r}") from None
        if isinstance(key, float) or tid < 0:
            raise SpeculantError(f"logit bias token ids must be integers >= 0, got {key!r}")
        if math.isnan(b) or b == math.inf:
            raise SpeculantError(f"logit bias of token {tid} must be a number or -inf (ban), got {value!r}")
        out[tid] = b
    return tuple(sorted(out.items()))


def top_token(logits: Tensor) -> Tensor:
    """The index of the largest logit per row, the first on ties: logits [..., V] -> [...] long.

    torch's max() does this several times faster than argmax() on CPU (`scripts/sampler_timing.py` times
    the sampler on real logits), a cost every decoding round pays once per scored row.
    """
    return logits.max(-1).indices


class Sampler:
    """One generation's sampling: the settings, the context window the penalties count, the generator.

    The engine `start`s it with the prompt and `push`es every emitted token; target and drafter share
    it, so the penalties of both see the same context.
    """

    def __init__(self, cfg: SamplingConfig, vocab: int, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        outside = [tid for tid, _ in cfg.logit_bias if tid >= vocab]
        if outside:
            raise SpeculantError(f"logit bias token id {outside[0]} is outside the model's vocabulary "
                                 f"(ids 0..{vocab - 1})")
        if sum(b == -math.inf for _, b in cfg.logit_bias) >= vocab:
            raise SpeculantError("logit bias bans every token of the vocabulary; leave at least one")
        self.generator = None if cfg.greedy else cfg.generator(device)
        self.penalized = cfg.penalized
        self.active = self.penalized or bool(cfg.logit_bias)  # does adjust() change the logits?
        self._bias_ids = torch.tensor([t for t, _ in cfg.logit_bias], dtype=torch.long, device=device)
        self._bias = torch.tensor([b for _, b in cfg.logit_bias], dtype=torch.float32, device=device)
        self._window: deque[int] = deque()  # the last repeat_last_n context tokens (all for -1)
        self._counts: Counter[int] = Counter()  # their counts

    def start(self, context: Iterable[int]) -> None:
        self._window.clear()
        self._counts.clear()
        self.push(context)

    def push(self, tokens: Iterable[int]) -> None:
        """Tokens that became context."""
        if not self.penalized:
            return
        n = self.cfg.repeat_last_n
        for t in tokens:
            self._window.append(t)
            self._counts[t] += 1
            if 0 < n < len(self._window):
                old = self._window.popleft()
                self._counts[old] -= 1
                if not self._counts[old]:
                    del self._counts[old]

    def adjust(self, logits: Tensor, drafted: Sequence[int] = (),
               paths: Sequence[Sequence[int]] | None = None) -> Tensor:
        """logits [R, W] -> [R, W] float32 with logit bias and penalties (the input when there are none).

        The rows score the R positions that end after `drafted` (tokens past the context, at least
        R - 1): row j follows the context + drafted[: len(drafted) - R + 1 + j]. Rows of a tree of
        drafts pass `paths` instead: row j follows the context + paths[j] (its own ancestors). W may be
        below the vocabulary (a draft model's reduced output layer): ids past it are skipped.
        """
        if not self.active:
            return logits
        if paths is not None and self.penalized:
            return torch.cat([self.adjust(logits[j : j + 1], path) for j, path in enumerate(paths)])
        R, W = logits.shape
        x = logits.float()
        x = x.clone() if x is logits else x
        if self._bias_ids.numel():
            ids, bias = self._bias_ids, self._bias
            if W < self.cfg.logit_bias[-1][0] + 1:
                ids, bias = ids[ids < W], bias[ids < W]
            x.index_add_(1, ids, bias.expand(R, -1))
        if self.penalized:
            rows, ids, counts = self._window_counts(R, drafted, W)
            if rows:
                r = torch.tensor(rows, device=x.device)
                i = torch.tensor(ids, device=x.device)
                n = torch.tensor(counts, dtype=torch.float32, device=x.device)
                v = x[r, i]
                cfg = self.cfg
                if cfg.repeat_penalty != 1.0:
                    v = torch.where(v > 0, v / cfg.repeat_penalty, v * cfg.repeat_penalty)
                x[r, i] = v - n * cfg.frequency_penalty - cfg.presence_penalty
        return x

    def _window_counts(self, R: int, drafted: Sequence[int], W: int) -> tuple[list[int], list[int], list[int]]:
        """(row, token id, count in the row's window) for every token the R rows' windows hold."""
        if len(drafted) < R - 1:
            raise ValueError(f"{R} rows need at least {R - 1} drafted tokens, got {len(drafted)}")
        n = self.cfg.repeat_last_n
        window = list(self._window)
        counts = dict(self._counts)
        first = len(drafted) - R + 1  # drafted tokens before row 0
        rows: list[int] = []
        ids: list[int] = []
        cnt: list[int] = []
        for i in range(len(drafted) + 1):
            if i >= first:
                for t, c in counts.items():
                    if t < W:
                        rows.append(i - first)
                        ids.append(t)
                        cnt.append(c)
            if i < len(drafted):
                t = int(drafted[i])
                counts[t] = counts.get(t, 0) + 1
                out = len(window) + i - n  # the window's length is now len(window) + i + 1
                if n > 0 and out >= 0:
                    old = window[out] if out < len(window) else int(drafted[out - len(window)])
                    counts[old] -= 1
                    if not counts[old]:
                        del counts[old]
        return rows, ids, cnt

    def dist(self, logits: Tensor, drafted: Sequence[int] = (), paths: Sequence[Sequence[int]] | None = None) -> Dist:
        """logits [R, W] -> the sampling distributions of the R rows (not for greedy; rows as in adjust)."""
        c = self.cfg
        return truncated(self.adjust(logits, drafted, paths), c.temperature, c.top_k, c.top_p, c.min_p)

    def pick(self, logits: Tensor, drafted: Sequence[int] = ()) -> Tensor:
        """One token per row: the top token (greedy) or a draw. logits [R, W] -> [R] long."""
        if self.generator is None:
            return top_token(self.adjust(logits, drafted))
        return draw(self.dist(logits, drafted), self.generator)

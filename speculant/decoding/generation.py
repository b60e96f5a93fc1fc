"""One generation's settings (GenerationConfig) and what it emits: accepted tokens turned into text chunks
(stop tokens, max tokens, stop strings held back until they are ruled out, streaming), and the final `Done`
with the stats."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..errors import SpeculantError
from ..exact.sampler import SamplingConfig
from .stats import Stats


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's end-of-turn tokens
    ignore_eos: bool = False  # benchmarks generate a fixed number of tokens

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise SpeculantError(f"max tokens must be >= 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise SpeculantError("stop strings must be non-empty")


@dataclass(slots=True)
class Chunk:
    text: str
    token_ids: list[int]
    # The first `drafted` of token_ids were the drafter's, accepted by the target; the rest the target's
    # own. `drafted_chars` leading characters of `text` came while emitting those (a chat page colours them).
    drafted: int = 0
    drafted_chars: int = 0
    proposed: int = 0  # drafts the target checked in the round that emitted this chunk


@dataclass(slots=True)
class Done:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end token or stop string) | "length" (max tokens or context)
    stats: Stats


class Output:
    """Turns accepted tokens into emitted text: stop tokens, max tokens, stop strings, streaming."""

    def __init__(self, tokenizer, gen: GenerationConfig, stops: frozenset[int]) -> None:
        self.detok = tokenizer.detokenizer()
        self.gen = gen
        self.stops = stops
        self.token_ids: list[int] = []
        self.text = ""  # emitted text
        self.held = ""  # text that might be the start of a stop string
        self.finished = False
        self.reason = "length"
        self.hold = max((len(s) for s in gen.stop_strings), default=0)
        self.string_hit = False

    @property
    def count(self) -> int:
        return len(self.token_ids)

    def finish(self, reason: str) -> None:
        self.finished, self.reason = True, reason

    def push(self, tokens: list[int], drafted: int = 0, proposed: int = 0) -> Iterator[Chunk]:
        emitted: list[int] = []
        piece = ""
        drafted_chars = None
        for i, t in enumerate(tokens):
            if i == drafted:
                drafted_chars = len(piece)
            if t in self.stops:
                self.finish("stop")
                break
            self.token_ids.append(t)
            emitted.append(t)
            new = self.detok.push(t)
            if self.gen.stop_strings:
                new, hit = self._scan(new)
                piece += new
                if hit:
                    self.string_hit = True
                    self.finish("stop")
                    break
            else:
                piece += new
            if self.count >= self.gen.max_new_tokens:
                self.finish("length")
                break
        if piece or emitted:
            self.text += piece
            n = min(drafted, len(emitted))
            yield Chunk(piece, emitted, n, len(piece) if drafted_chars is None else drafted_chars, proposed)

    def _scan(self, piece: str) -> tuple[str, bool]:
        """Return the text safe to emit and whether a stop string was hit (text cut before it)."""
        buf = self.held + piece
        cut = min((i for i in (buf.find(s) for s in self.gen.stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return buf[:cut], True
        # Keep back the longest tail that could still grow into a stop string.
        keep = 0
        for n in range(1, min(self.hold, len(buf) + 1)):
            if any(s.startswith(buf[-n:]) for s in self.gen.stop_strings):
                keep = n
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> Iterator[Chunk]:
        if self.string_hit:  # the text ends before the stop string; nothing more to say
            return
        rest = self.detok.flush()
        if self.gen.stop_strings:
            rest, hit = self._scan(rest)
            if not hit:
                rest += self.held
            self.held = ""
        if rest:
            self.text += rest
            yield Chunk(rest, [])

"""Response bodies in OpenAI's shapes: completions and chat completions, whole or as stream chunks,
errors, and speculant's extension field (`speculant`: speculation statistics, per-chunk draft info)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from ..decoding.engine import Chunk
from ..decoding.stats import Stats


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def sse(obj: object) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def stats_extension(stats: Stats | None, ttft: float | None, queued: float, stopped: str | None) -> dict[str, object]:
    ext: dict[str, object] = {"time_to_first_token": None if ttft is None else round(ttft, 4),
                              "queue_seconds": round(queued, 4)}
    if stats is not None:
        ext.update(method=stats.method, acceptance_rate=round(stats.acceptance_rate, 4),
                   mean_accepted_tokens=round(stats.mean_accepted_tokens, 4), drafted_tokens=stats.drafted_tokens,
                   accepted_tokens=stats.accepted_tokens, cached_prompt_tokens=stats.cached_prompt_tokens,
                   prefill_seconds=round(stats.prefill_seconds, 4),
                   decode_tokens_per_second=round(stats.decode_tokens_per_second, 3))
    if stopped is not None:
        ext["stopped"] = stopped  # "time_limit" or "shutdown": the answer was cut short
    return ext


@dataclass(slots=True)
class Reply:
    """One request's answer as it accumulates, rendered as a completion or a chat completion."""

    chat: bool
    model: str
    prompt_tokens: int
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    tokens: int = 0
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]

    def usage(self) -> dict[str, object]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def _head(self, stream: bool) -> dict[str, object]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def full(self, finish: str, ext: dict[str, object]) -> dict[str, object]:
        if self.chat:
            choice: dict[str, object] = {"index": 0, "message": {"role": "assistant", "content": self.text},
                                         "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": finish, "logprobs": None}
        return {**self._head(False), "choices": [choice], "usage": self.usage(), "speculant": ext}

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, object]:
        if not self.chat:
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        delta: dict[str, object] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}

    def role_chunk(self) -> dict[str, object]:
        """A chat stream opens with the assistant's role and empty content, as OpenAI's does."""
        return {**self._head(True), "choices": [self._choice("", None, role=True)]}

    def chunk(self, c: Chunk) -> dict[str, object]:
        self.text += c.text
        self.tokens += len(c.token_ids)
        ext = {"tokens": len(c.token_ids), "drafted": c.drafted, "drafted_chars": c.drafted_chars,
               "proposed": c.proposed}
        return {**self._head(True), "choices": [self._choice(c.text, None)], "speculant": ext}

    def last_chunk(self, finish: str, ext: dict[str, object]) -> dict[str, object]:
        return {**self._head(True), "choices": [self._choice(None if self.chat else "", finish)], "speculant": ext}

    def usage_chunk(self) -> dict[str, object]:
        return {**self._head(True), "choices": [], "usage": self.usage()}

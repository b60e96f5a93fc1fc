"""Request bodies of the OpenAI-compatible API (pydantic), and their translation into engine configs.

Every field OpenAI defines that would change the output and that speculant cannot honour (n > 1,
tools, logprobs, ...) is rejected with a 400 that names it, never silently ignored: unknown fields
are forbidden, and known-but-unsupported ones are checked in `unsupported()`.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..sampling import SamplingConfig

MAX_STOP = 16  # stop strings per request (OpenAI allows 4)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "1" is not a number, 1.5 not an int


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Common(_Body):
    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0)] = 0  # extension (0 = off)
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0  # extension (llama.cpp), where the engine has it
    seed: StrictInt | None = None
    stop: StrictStr | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    method: StrictStr | None = None  # extension: ar, lookup, draft or hybrid (default: the server's --method)
    user: StrictStr | None = None  # no effect on the output
    metadata: dict[str, StrictStr] | None = None  # no effect on the output

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for a field whose value speculant cannot honour, else None."""
        if self.n != 1:
            return "n", "n must be 1: speculant generates one choice per request"
        if self.logprobs not in (None, False, 0) or self.top_logprobs not in (None, 0):
            name = "logprobs" if self.logprobs not in (None, False, 0) else "top_logprobs"
            return name, f"{name} is not supported"
        have = {f.name for f in dataclasses.fields(SamplingConfig)}
        for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("min_p", 0.0)):
            if getattr(self, name) != off and name not in have:
                return name, f"{name} is not supported by this engine"
        if self.logit_bias and "logit_bias" not in have:
            return "logit_bias", "logit_bias is not supported by this engine"
        return None

    def sampling(self, vocab: int) -> SamplingConfig:
        """The sampling config (raises SpeculantError/ValueError with a message on bad values)."""
        have = {f.name for f in dataclasses.fields(SamplingConfig)}
        extra: dict[str, Any] = {}
        for name in ("presence_penalty", "frequency_penalty", "min_p"):
            if name in have:
                extra[name] = getattr(self, name)
        if self.logit_bias and "logit_bias" in have:
            pairs = []
            for key, bias in self.logit_bias.items():
                if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab:
                    raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}")
                pairs.append((int(key), float(bias)))
            extra["logit_bias"] = tuple(sorted(pairs))
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed, **extra)


class CompletionRequest(_Common):
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=1)] | \
        Annotated[list[StrictInt], Field(min_length=1)]
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix (fill-in-the-middle) is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of must be 1"
        return super().unsupported()

    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        return p[0] if isinstance(p[0], str) else list(p)  # type: ignore[return-value]


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def as_template_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        # OpenAI's "developer" messages are the newer name of "system" ones; templates know "system".
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ResponseFormat(_Body):
    type: Literal["text"]  # json_object / json_schema would need constrained decoding: rejected


class ChatRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    response_format: ResponseFormat | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# Fields OpenAI defines that speculant rejects by name (tools, audio, ...): forbidding extra fields
# rejects them too; this gives a clearer message.
NOT_SUPPORTED = {
    "tools": "tool calling is not supported", "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported", "function_call": "function calling is not supported",
    "parallel_tool_calls": "tool calling is not supported", "audio": "audio output is not supported",
    "modalities": "only text output is supported", "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported", "reasoning_effort": "reasoning effort is not supported",
    "service_tier": "service tiers are not supported", "store": "stored completions are not supported",
}

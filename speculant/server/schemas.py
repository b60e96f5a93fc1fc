"""Request bodies of the OpenAI-compatible API (pydantic), and their translation into engine configs.

Every field OpenAI defines that would change the output and that speculant cannot honour (n > 1,
tools, logprobs, ...) is rejected with a 400 that names it, never silently ignored: unknown fields
are forbidden, and known-but-unsupported ones are checked in `unsupported()`. The sampling fields
(OpenAI's temperature, top_p, seed, presence_penalty, frequency_penalty, logit_bias, and llama.cpp's
top_k, min_p, repeat_penalty, repeat_last_n as extensions) map one to one onto `SamplingConfig`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from ..errors import SpeculantError
from ..exact.sampler import MIN_TEMPERATURE, SamplingConfig
from .responses import APIError

MAX_STOP = 16  # stop strings per request (OpenAI allows 4)
MAX_LOGIT_BIAS = 1024  # entries (OpenAI allows 300)


class _Body(BaseModel):
    # strict: "1" is not a number, 1.5 not an int; NaN and Infinity (which Python's json reads) are refused
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Common(_Body):
    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=0)] = 0  # extension (0 = off)
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0  # extension (llama.cpp; 0 = off)
    repeat_penalty: Annotated[float, Field(gt=0.0)] = 1.0  # extension (llama.cpp; 1 = off)
    repeat_last_n: Annotated[StrictInt, Field(ge=-1)] = 64  # extension (llama.cpp): penalty window; -1 = all
    seed: Annotated[StrictInt, Field(ge=-(1 << 63), lt=1 << 64)] | None = None  # what torch.Generator takes
    stop: StrictStr | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    # token id (a string of digits, as JSON keys are) -> bias added to its logit; -100 all but bans it
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    method: StrictStr | None = None  # extension: a method the server offers (default: the server's --method)
    user: StrictStr | None = None  # no effect on the output
    metadata: dict[str, StrictStr] | None = None  # no effect on the output

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, t: float) -> float:
        if 0.0 < t < MIN_TEMPERATURE:  # logits / t would overflow float32
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return t

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (strings of digits), got {key!r}")
        return bias

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
        return None

    def sampling(self, vocab: int) -> SamplingConfig:
        """The sampling config; a value the schema could not check alone is an APIError naming its field."""
        bias = tuple(sorted((int(k), float(b)) for k, b in (self.logit_bias or {}).items()))
        outside = [tid for tid, _ in bias if tid >= vocab]
        if outside:
            raise APIError(400, f"invalid value for 'logit_bias': token id {outside[0]} is outside the model's "
                                f"vocabulary (ids 0..{vocab - 1})", param="logit_bias", code="invalid_value")
        try:
            return SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed, min_p=self.min_p,
                                  repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n,
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  logit_bias=bias)
        except SpeculantError as e:  # the schema's ranges are SamplingConfig's: a bug if this is reached
            raise APIError(400, str(e), code="invalid_value") from None


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

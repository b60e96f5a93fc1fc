"""What every API request goes through before it reaches the engine: the API key and the JSON body, read
within a size limit and validated into its schema, with an OpenAI-style error for each way it can be wrong."""

from __future__ import annotations

import hmac
import json

from fastapi import Request
from pydantic import BaseModel, ValidationError

from .responses import APIError
from .schemas import NOT_SUPPORTED


def authorize(request: Request, api_key: str | None) -> None:
    """Raise 401 unless the request carries `api_key` as a bearer token (no key: every request passes)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), api_key.encode()):
        raise APIError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                       type="authentication_error", code="invalid_api_key")


async def read_body(request: Request, model: type[BaseModel], max_bytes: int, model_id: str) -> BaseModel:
    """The JSON body as a validated `model`: size-limited while it streams in, every way it can be wrong a
    400 (or 413, 404 for another model) that names the field."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(413, f"request body of {length} bytes exceeds the limit of {max_bytes}",
                       code="request_too_large")
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes",
                           code="request_too_large")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    for name in body:
        if name in NOT_SUPPORTED:
            raise APIError(400, f"unsupported field '{name}': {NOT_SUPPORTED[name]}", param=name,
                           code="unsupported_field")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "list[", "str", "int")))
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"unsupported field '{param}': speculant does not implement it", param=param,
                           code="unsupported_field") from None
        if err["type"] == "missing":
            raise APIError(400, f"missing required field '{param}'", param=param, code="missing_field") from None
        why = err["msg"].removeprefix("Value error, ")  # (pydantic's prefix for a validator's message)
        raise APIError(400, f"invalid value for '{param}': {why}", param=param,
                       code="invalid_value") from None
    bad = req.unsupported()  # type: ignore[attr-defined]
    if bad is not None:
        raise APIError(400, f"unsupported value of '{bad[0]}': {bad[1]}", param=bad[0], code="unsupported_value")
    if req.model != model_id:  # type: ignore[attr-defined]
        raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{model_id}'",  # type: ignore[attr-defined]
                       param="model", code="model_not_found")
    return req

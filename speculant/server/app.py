"""The FastAPI app: OpenAI's /v1/models, /v1/completions and /v1/chat/completions over one engine,
/health, /metrics (Prometheus) and the chat page at /.

Handlers validate, tokenize and submit a job to the worker (worker.py), then answer with a whole
response or a server-sent-event stream ending in `data: [DONE]`. No decoding happens here.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from ..engine import Chunk, Done, Engine, GenerationConfig
from ..heads.store import default_name
from ..method import HEAD_METHODS, METHODS, MODEL_METHODS
from ..errors import SpeculantError
from .metrics import Metrics
from .responses import APIError, Reply, sse, stats_extension
from .schemas import NOT_SUPPORTED, ChatRequest, CompletionRequest
from .worker import Failed, Job, QueueFull, ShuttingDown, Stopped, Worker, WorkerConfig

STATIC = Path(__file__).parent / "static"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_id: str
    api_key: str | None = None
    max_queue: int = 16
    max_body_bytes: int = 1 << 20
    request_timeout: float = 600.0  # seconds from arrival (queue included) until a generation is cut
    default_max_tokens: int = 1024  # for requests that set no max_tokens (less where the context is shorter)
    prompt_cache: bool = True
    shutdown_grace: float = 10.0  # seconds a running generation may finish after SIGTERM
    prompt_cache_slots: int = 4  # conversations whose prompt caches are kept at once (WorkerConfig)

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise SpeculantError(f"max body size must be >= 1024 bytes, got {self.max_body_bytes}")
        if not self.request_timeout > 0 or not self.shutdown_grace >= 0:
            raise SpeculantError("request timeout must be > 0 and shutdown grace >= 0 seconds")
        if self.default_max_tokens < 1:
            raise SpeculantError(f"default max tokens must be >= 1, got {self.default_max_tokens}")
        if self.prompt_cache_slots < 1:
            raise SpeculantError(f"prompt cache slots must be >= 1, got {self.prompt_cache_slots}")
        if self.api_key is not None and not self.api_key:
            raise SpeculantError("the API key must not be empty")


def offered_methods(engine: Engine) -> list[str]:
    """The methods a request may pick on this engine's loaded models: those needing a draft model only
    with one, and a head method only the one the server was started with (its heads are loaded)."""
    return [m for m in METHODS if m == engine.method.name or not (
        m in HEAD_METHODS or (m in MODEL_METHODS and engine.draft is None))]


def create_app(engine: Engine, cfg: ServerConfig) -> FastAPI:
    worker = Worker(engine, WorkerConfig(cfg.max_queue, cfg.prompt_cache, cfg.prompt_cache_slots))
    metrics = Metrics(lambda: worker.waiting, lambda: int(worker.running is not None))
    context = engine.target.config.context_length
    methods: dict[str, Engine | None] = {m: None for m in offered_methods(engine)}
    methods[engine.method.name] = engine

    def engine_for(req: CompletionRequest | ChatRequest) -> Engine:
        name = req.method or engine.method.name
        if name not in methods:
            raise APIError(400, f"unknown or unavailable method '{name}'; this server offers {', '.join(methods)}",
                           param="method", code="invalid_value")
        if methods[name] is None:
            try:
                methods[name] = engine.with_method(name)
            except SpeculantError as e:
                raise APIError(400, f"method '{name}' is not available here: {e}", param="method",
                               code="invalid_value") from None
        return methods[name]  # type: ignore[return-value]

    def retry_after() -> int:
        """Seconds until the queue has likely moved on: the mean latency times the jobs ahead."""
        return max(1, math.ceil(metrics.mean_latency() * (worker.waiting + 1)))

    def cut_short(reason: str, job: Job, reply: Reply) -> APIError | None:
        """The error for a generation stopped before its first token, else None (a partial answer)."""
        if reply.tokens:
            return None
        if reason == "time_limit" and not job.started:
            wait = retry_after()
            return APIError(503, f"the request waited {cfg.request_timeout:g} s in the queue (the server's "
                                 f"--request-timeout) without starting: the server is busy; retry in {wait} s",
                            type="server_error", code="queue_timeout", headers={"Retry-After": str(wait)})
        if reason in ("cancelled", "shutdown"):
            return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        return None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.get_running_loop().run_in_executor(None, worker.stop, cfg.shutdown_grace)

    app = FastAPI(title="speculant", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics = worker, metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        metrics.request(request.url.path, e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(404)
    async def not_found(request: Request, e: Exception) -> JSONResponse:
        return await api_error(request, APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, e: Exception) -> JSONResponse:
        return await api_error(request, APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                                 code="method_not_allowed"))

    def authorize(request: Request) -> None:
        if cfg.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), cfg.api_key.encode()):
            raise APIError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    async def read_body(request: Request, model: type[BaseModel]) -> BaseModel:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_body_bytes:
            raise APIError(413, f"request body of {length} bytes exceeds the limit of {cfg.max_body_bytes}",
                           code="request_too_large")
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > cfg.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {cfg.max_body_bytes} bytes",
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
        if req.model != cfg.model_id:  # type: ignore[attr-defined]
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{cfg.model_id}'",  # type: ignore[attr-defined]
                           param="model", code="model_not_found")
        return req

    def generation(req: CompletionRequest | ChatRequest, ids: list[int], limit: int | None) -> GenerationConfig:
        what = "messages" if isinstance(req, ChatRequest) else "prompt"
        if len(ids) >= context:
            raise APIError(400, f"this model's maximum context length is {context} tokens, but the {what} has "
                                f"{len(ids)} tokens; shorten it", param=what, code="context_length_exceeded")
        if limit is not None and len(ids) + limit > context:
            raise APIError(400, f"this model's maximum context length is {context} tokens, but you requested "
                                f"{len(ids) + limit} tokens ({len(ids)} in the {what}, {limit} for the completion); "
                                "shorten the prompt or lower max_tokens", param="max_tokens",
                           code="context_length_exceeded")
        max_new = limit if limit is not None else min(cfg.default_max_tokens, context - len(ids))
        try:
            return GenerationConfig(max_new, req.sampling(engine.tokenizer.vocab_size), req.stop_strings())
        except (SpeculantError, ValueError) as e:
            raise APIError(400, str(e), code="invalid_value") from None

    def checked(ids: list[int], param: str) -> list[int]:
        """`ids` after the engine's checks (token ids in range, not empty); call after generation()."""
        try:
            return engine.encode_prompt(ids)
        except SpeculantError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None

    async def answer(request: Request, endpoint: str, req: CompletionRequest | ChatRequest, ids: list[int],
                     gen: GenerationConfig, chat: bool) -> Response:
        arrival = time.monotonic()
        job = Job(ids, gen, engine_for(req), asyncio.get_running_loop(), arrival + cfg.request_timeout)
        stream, usage = req.stream, bool(req.stream_options and req.stream_options.include_usage)
        try:
            worker.submit(job)
        except QueueFull:
            wait = retry_after()
            raise APIError(429, f"the server is busy: {worker.waiting} requests are waiting; retry in {wait} s",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": str(wait)}) from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down") from None
        reply = Reply(chat, cfg.model_id, len(ids))
        if stream:
            metrics.request(endpoint, 200)
            return StreamingResponse(_stream(job, reply, arrival, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, endpoint, job, reply, arrival)

    async def _events(job: Job, reply: Reply, arrival: float, request: Request | None = None):
        """('chunk', Chunk) ... then one of ('end', (finish_reason, ext)), ('stopped', (reason, ext)),
        ('failed', APIError), or ('gone', None) once `request`'s client has disconnected. A job still
        queued at its deadline is stopped here, at the deadline, not when the engine reaches it."""
        ttft = None
        while True:
            try:  # cancelling a Queue.get() is safe (cancelling this generator would end it)
                ev = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                # (streaming: a client that leaves ends the response task instead)
                if request is not None and await request.is_disconnected():
                    yield "gone", None
                    return
                if not job.started and time.monotonic() > job.deadline:
                    job.cancelled.set()  # the worker skips it when it gets there
                    ev = Stopped("time_limit")
                else:
                    continue
            if isinstance(ev, Chunk):
                if ttft is None:
                    ttft = time.monotonic() - arrival
                    metrics.first_token(ttft)
                yield "chunk", ev
                continue
            queued = (job.started or time.monotonic()) - arrival
            if isinstance(ev, Done):
                reply.cached_tokens = ev.stats.cached_prompt_tokens
                metrics.finished(time.monotonic() - arrival, reply.prompt_tokens, len(ev.token_ids), ev.stats)
                yield "end", (ev.finish_reason, stats_extension(ev.stats, ttft, queued, None))
            elif isinstance(ev, Stopped):
                metrics.finished(time.monotonic() - arrival, reply.prompt_tokens, reply.tokens, None)
                yield "stopped", (ev.reason, stats_extension(None, ttft, queued, ev.reason))
            else:
                assert isinstance(ev, Failed)
                user = isinstance(ev.error, SpeculantError)
                yield "failed", APIError(400 if user else 500, str(ev.error) if user else "internal error: "
                                         f"{type(ev.error).__name__}", type="invalid_request_error" if user else "server_error")
            return

    async def _stream(job: Job, reply: Reply, arrival: float, usage: bool) -> AsyncIterator[str]:
        try:
            if reply.chat:
                yield sse(reply.role_chunk())
            async for kind, payload in _events(job, reply, arrival):
                if kind == "chunk":
                    yield sse(reply.chunk(payload))
                elif kind == "failed":
                    yield sse(payload.body())
                else:
                    finish, ext = payload
                    if kind == "stopped" and finish == "cancelled":
                        return
                    error = cut_short(finish, job, reply) if kind == "stopped" else None
                    if error is not None:  # the status line (200) is sent: an error event, then [DONE]
                        yield sse(error.body())
                        continue  # (the last event)
                    yield sse(reply.last_chunk(finish if kind == "end" else "length", ext))
                    if usage:
                        yield sse(reply.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # a client that left (or a finished job: no effect) frees the engine

    async def _whole(request: Request, endpoint: str, job: Job, reply: Reply, arrival: float) -> Response:
        events = _events(job, reply, arrival, request)
        try:
            async for kind, payload in events:
                if kind == "gone":
                    return Response(status_code=499)  # nobody reads it; the finally frees the engine
                if kind == "chunk":
                    reply.chunk(payload)
                    continue
                if kind == "failed":
                    raise payload
                finish, ext = payload
                error = cut_short(finish, job, reply) if kind == "stopped" else None
                if error is not None:
                    raise error
                metrics.request(endpoint, 200)
                return JSONResponse(reply.full(finish if kind == "end" else "length", ext))
            raise APIError(500, "the generation ended without a result", type="server_error")
        finally:
            job.cancelled.set()
            await events.aclose()

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "stopping" if worker.stopping else "ok", "model": cfg.model_id,
                "method": engine.method.name, "queue": worker.waiting, "running": worker.running is not None}

    @app.get("/metrics")
    async def get_metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, object]:
        authorize(request)
        entry = {"id": cfg.model_id, "object": "model", "created": 0, "owned_by": "speculant",
                 "method": engine.method.name, "methods": list(methods)}
        if engine.method.name in HEAD_METHODS:  # the heads / published drafter the head method runs
            entry["drafter"] = engine.method.heads.name or default_name(engine.target.name, engine.method.name)
        return {"object": "list", "data": [entry]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        req = await read_body(request, CompletionRequest)
        assert isinstance(req, CompletionRequest)
        prompt = req.prompt_input()
        if isinstance(prompt, str) and not prompt.strip():
            raise APIError(400, "the prompt is empty; pass some text to continue", param="prompt", code="invalid_value")
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        gen = generation(req, ids, req.max_tokens)
        ids = checked(ids, "prompt")
        return await answer(request, "/v1/completions", req, ids, gen, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        req = await read_body(request, ChatRequest)
        assert isinstance(req, ChatRequest)
        tok = engine.tokenizer
        if tok.chat_template is None:
            raise APIError(400, f"the model '{cfg.model_id}' has no chat template; use /v1/completions",
                           code="no_chat_template")
        try:  # the template runs in jinja2's immutable sandbox (tokenizer.py)
            text = tok.apply_chat_template([m.as_template_dict() for m in req.messages])
        except SpeculantError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        ids = tok.encode(text, add_special=False)
        gen = generation(req, ids, req.limit())
        ids = checked(ids, "messages")
        return await answer(request, "/v1/chat/completions", req, ids, gen, chat=True)

    return app

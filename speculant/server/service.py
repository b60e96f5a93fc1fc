"""One server's request handling over its engine: which engine a request's method runs on, its generation
settings, the job it submits to the worker (worker.py), and the answer: a whole response or a stream of
server-sent events ending in `data: [DONE]`, with the errors of a job cut short. No decoding happens here."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..decoding.engine import Chunk, Done, Engine, GenerationConfig
from ..errors import SpeculantError
from .metrics import Metrics
from .responses import APIError, Reply, sse, stats_extension
from .schemas import ChatRequest, CompletionRequest
from .worker import Failed, Job, QueueFull, ShuttingDown, Stopped, Worker


class Service:
    """The state one app serves from: its engine (one per method, built when first asked for), the worker that
    owns the engine, the metrics, and the server's settings (`cfg`: app.ServerConfig)."""

    def __init__(self, engine: Engine, cfg, worker: Worker, metrics: Metrics, methods: list[str]) -> None:
        self.engine, self.cfg, self.worker, self.metrics = engine, cfg, worker, metrics
        self.context = engine.target.config.context_length
        self.methods: dict[str, Engine | None] = {m: None for m in methods}
        self.methods[engine.method.name] = engine

    def engine_for(self, req: CompletionRequest | ChatRequest) -> Engine:
        name = req.method or self.engine.method.name
        if name not in self.methods:
            raise APIError(400, f"unknown or unavailable method '{name}'; this server offers {', '.join(self.methods)}",
                           param="method", code="invalid_value")
        if self.methods[name] is None:
            try:
                self.methods[name] = self.engine.with_method(name)
            except SpeculantError as e:
                raise APIError(400, f"method '{name}' is not available here: {e}", param="method",
                               code="invalid_value") from None
        return self.methods[name]  # type: ignore[return-value]

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved on: the mean latency times the jobs ahead."""
        return max(1, math.ceil(self.metrics.mean_latency() * (self.worker.waiting + 1)))

    def cut_short(self, reason: str, job: Job, reply: Reply) -> APIError | None:
        """The error for a generation stopped before its first token, else None (a partial answer)."""
        if reply.tokens:
            return None
        if reason == "time_limit" and not job.started:
            wait = self.retry_after()
            return APIError(503, f"the request waited {self.cfg.request_timeout:g} s in the queue (the server's "
                                 f"--request-timeout) without starting: the server is busy; retry in {wait} s",
                            type="server_error", code="queue_timeout", headers={"Retry-After": str(wait)})
        if reason in ("cancelled", "shutdown"):
            return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        return None

    def generation(self, req: CompletionRequest | ChatRequest, ids: list[int], limit: int | None) -> GenerationConfig:
        what = "messages" if isinstance(req, ChatRequest) else "prompt"
        context = self.context
        if len(ids) >= context:
            raise APIError(400, f"this model's maximum context length is {context} tokens, but the {what} has "
                                f"{len(ids)} tokens; shorten it", param=what, code="context_length_exceeded")
        if limit is not None and len(ids) + limit > context:
            raise APIError(400, f"this model's maximum context length is {context} tokens, but you requested "
                                f"{len(ids) + limit} tokens ({len(ids)} in the {what}, {limit} for the completion); "
                                "shorten the prompt or lower max_tokens", param="max_tokens",
                           code="context_length_exceeded")
        max_new = limit if limit is not None else min(self.cfg.default_max_tokens, context - len(ids))
        try:
            return GenerationConfig(max_new, req.sampling(self.engine.tokenizer.vocab_size), req.stop_strings())
        except (SpeculantError, ValueError) as e:
            raise APIError(400, str(e), code="invalid_value") from None

    def checked(self, ids: list[int], param: str) -> list[int]:
        """`ids` after the engine's checks (token ids in range, not empty); call after generation()."""
        try:
            return self.engine.encode_prompt(ids)
        except SpeculantError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None

    async def answer(self, request: Request, endpoint: str, req: CompletionRequest | ChatRequest, ids: list[int],
                     gen: GenerationConfig, chat: bool) -> Response:
        arrival = time.monotonic()
        job = Job(ids, gen, self.engine_for(req), asyncio.get_running_loop(), arrival + self.cfg.request_timeout)
        stream, usage = req.stream, bool(req.stream_options and req.stream_options.include_usage)
        try:
            self.worker.submit(job)
        except QueueFull:
            wait = self.retry_after()
            raise APIError(429, f"the server is busy: {self.worker.waiting} requests are waiting; retry in {wait} s",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": str(wait)}) from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down") from None
        reply = Reply(chat, self.cfg.model_id, len(ids))
        if stream:
            self.metrics.request(endpoint, 200)
            return StreamingResponse(self._stream(job, reply, arrival, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, endpoint, job, reply, arrival)

    async def _events(self, job: Job, reply: Reply, arrival: float, request: Request | None = None):
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
                    self.metrics.first_token(ttft)
                yield "chunk", ev
                continue
            queued = (job.started or time.monotonic()) - arrival
            if isinstance(ev, Done):
                reply.cached_tokens = ev.stats.cached_prompt_tokens
                self.metrics.finished(time.monotonic() - arrival, reply.prompt_tokens, len(ev.token_ids), ev.stats)
                yield "end", (ev.finish_reason, stats_extension(ev.stats, ttft, queued, None))
            elif isinstance(ev, Stopped):
                self.metrics.finished(time.monotonic() - arrival, reply.prompt_tokens, reply.tokens, None)
                yield "stopped", (ev.reason, stats_extension(None, ttft, queued, ev.reason))
            else:
                assert isinstance(ev, Failed)
                user = isinstance(ev.error, SpeculantError)
                yield "failed", APIError(400 if user else 500, str(ev.error) if user else "internal error: "
                                         f"{type(ev.error).__name__}", type="invalid_request_error" if user else "server_error")
            return

    async def _stream(self, job: Job, reply: Reply, arrival: float, usage: bool) -> AsyncIterator[str]:
        try:
            if reply.chat:
                yield sse(reply.role_chunk())
            async for kind, payload in self._events(job, reply, arrival):
                if kind == "chunk":
                    yield sse(reply.chunk(payload))
                elif kind == "failed":
                    yield sse(payload.body())
                else:
                    finish, ext = payload
                    if kind == "stopped" and finish == "cancelled":
                        return
                    error = self.cut_short(finish, job, reply) if kind == "stopped" else None
                    if error is not None:  # the status line (200) is sent: an error event, then [DONE]
                        yield sse(error.body())
                        continue  # (the last event)
                    yield sse(reply.last_chunk(finish if kind == "end" else "length", ext))
                    if usage:
                        yield sse(reply.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # a client that left (or a finished job: no effect) frees the engine

    async def _whole(self, request: Request, endpoint: str, job: Job, reply: Reply, arrival: float) -> Response:
        events = self._events(job, reply, arrival, request)
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
                error = self.cut_short(finish, job, reply) if kind == "stopped" else None
                if error is not None:
                    raise error
                self.metrics.request(endpoint, 200)
                return JSONResponse(reply.full(finish if kind == "end" else "length", ext))
            raise APIError(500, "the generation ended without a result", type="server_error")
        finally:
            job.cancelled.set()
            await events.aclose()

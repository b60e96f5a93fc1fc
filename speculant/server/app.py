"""The FastAPI app over one engine: its settings (ServerConfig), the methods it offers, and `create_app`, which
puts together the worker (worker.py), the request handling (service.py) and the routes (routes.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..decoding.engine import Engine
from ..errors import SpeculantError
from ..methods.config import HEAD_METHODS, METHODS, MODEL_METHODS
from ..methods.registry import METHOD_SPECS
from .metrics import Metrics
from .responses import APIError
from .routes import router
from .service import Service
from .worker import Worker, WorkerConfig


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
    with one, a head method only the one the server was started with (its heads are loaded), and none the
    target cannot run (trees on Qwen3.5, mtp without an MTP layer: MethodSpec.why_not)."""
    return [m for m in METHODS if m == engine.method.name or not (
        m in HEAD_METHODS or (m in MODEL_METHODS and engine.draft is None)
        or METHOD_SPECS[m].why_not(engine.target.model) is not None)]


def create_app(engine: Engine, cfg: ServerConfig) -> FastAPI:
    """The app serving `engine`: its worker, metrics and Service (service.py) in `app.state`, the routes of
    routes.py, and OpenAI-style JSON errors for every status."""
    worker = Worker(engine, WorkerConfig(cfg.max_queue, cfg.prompt_cache, cfg.prompt_cache_slots))
    metrics = Metrics(lambda: worker.waiting, lambda: int(worker.running is not None))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.get_running_loop().run_in_executor(None, worker.stop, cfg.shutdown_grace)

    app = FastAPI(title="speculant", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics = worker, metrics
    app.state.service = Service(engine, cfg, worker, metrics, offered_methods(engine))

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

    app.include_router(router)
    return app

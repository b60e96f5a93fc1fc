"""The routes: OpenAI's /v1/models, /v1/completions and /v1/chat/completions, /health, /metrics (Prometheus)
and the chat page at /. Each reads the app's Service (service.py) from `request.app.state.service`."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, PlainTextResponse, Response

from ..errors import SpeculantError
from ..heads.store import default_name
from ..methods.config import HEAD_METHODS
from .requests import authorize, read_body
from .responses import APIError
from .schemas import ChatRequest, CompletionRequest
from .service import Service

STATIC = Path(__file__).parent / "static"

router = APIRouter()  # routes only; each app's state is its Service


def _service(request: Request) -> Service:
    return request.app.state.service


async def _body(request: Request, model: type) -> CompletionRequest | ChatRequest:
    svc = _service(request)
    authorize(request, svc.cfg.api_key)
    req = await read_body(request, model, svc.cfg.max_body_bytes, svc.cfg.model_id)
    assert isinstance(req, model)
    return req


@router.get("/health")
async def health(request: Request) -> dict[str, object]:
    svc = _service(request)
    return {"status": "stopping" if svc.worker.stopping else "ok", "model": svc.cfg.model_id,
            "method": svc.engine.method.name, "queue": svc.worker.waiting, "running": svc.worker.running is not None}


@router.get("/metrics")
async def get_metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(_service(request).metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/")
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/v1/models")
async def models(request: Request) -> dict[str, object]:
    svc = _service(request)
    authorize(request, svc.cfg.api_key)
    engine = svc.engine
    entry = {"id": svc.cfg.model_id, "object": "model", "created": 0, "owned_by": "speculant",
             "method": engine.method.name, "methods": list(svc.methods)}
    if engine.method.name in HEAD_METHODS:  # the heads / published drafter the head method runs
        entry["drafter"] = engine.method.heads.name or default_name(engine.target.name, engine.method.name)
    return {"object": "list", "data": [entry]}


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    svc = _service(request)
    req = await _body(request, CompletionRequest)
    prompt = req.prompt_input()
    if isinstance(prompt, str) and not prompt.strip():
        raise APIError(400, "the prompt is empty; pass some text to continue", param="prompt", code="invalid_value")
    ids = svc.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    gen = svc.generation(req, ids, req.max_tokens)
    ids = svc.checked(ids, "prompt")
    return await svc.answer(request, "/v1/completions", req, ids, gen, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    svc = _service(request)
    req = await _body(request, ChatRequest)
    tok = svc.engine.tokenizer
    if tok.chat_template is None:
        raise APIError(400, f"the model '{svc.cfg.model_id}' has no chat template; use /v1/completions",
                       code="no_chat_template")
    try:  # the template runs in jinja2's immutable sandbox (text/tokenizer.py)
        text = tok.apply_chat_template([m.as_template_dict() for m in req.messages])
    except SpeculantError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    ids = tok.encode(text, add_special=False)
    gen = svc.generation(req, ids, req.limit())
    ids = svc.checked(ids, "messages")
    return await svc.answer(request, "/v1/chat/completions", req, ids, gen, chat=True)

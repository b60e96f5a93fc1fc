"""Run the app under uvicorn: SIGTERM/SIGINT stop accepting, let the running generation finish within
the grace period (then abort it at its next round), and exit cleanly."""

from __future__ import annotations

import ipaddress
import logging
import signal
import sys

from ..decoding.engine import Engine
from ..errors import SpeculantError
from .app import ServerConfig, create_app


def serve(engine: Engine, cfg: ServerConfig, host: str = "127.0.0.1", port: int = 8000) -> int:
    import uvicorn

    if not 0 <= port < 65536:
        raise SpeculantError(f"port must be in [0, 65535], got {port}")
    try:
        public = not ipaddress.ip_address(host).is_loopback
    except ValueError:
        public = host != "localhost"
    if public and cfg.api_key is None:
        print(f"speculant: warning: serving on {host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    app = create_app(engine, cfg)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", access_log=True,
                            timeout_graceful_shutdown=max(1, round(cfg.shutdown_grace)), lifespan="on",
                            limit_concurrency=cfg.max_queue + 64, timeout_keep_alive=5)
    server = uvicorn.Server(config)
    print(f"speculant: serving {cfg.model_id} ({engine.method.name}) on http://{host}:{port} "
          f"(chat page at /, API at /v1)", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal that stopped it once it has shut down; a SIGTERM that ended in a
    # clean shutdown should exit with 0, so the handler it restores and re-raises into does nothing.
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("speculant: server stopped", file=sys.stderr, flush=True)
    return 0

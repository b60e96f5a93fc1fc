"""`speculant serve`: an OpenAI-compatible HTTP server over one engine (app.py), its request bodies
(schemas.py), the queue that owns the engine (worker.py), Prometheus metrics (metrics.py) and the
chat page (static/)."""

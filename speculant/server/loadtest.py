"""`speculant bench serve`: a load test of the server on loopback, checked request by request.

N concurrent streaming clients send a mix of chat and completion requests under every method the
server offers (greedy, plus seeded sampling) for a fixed time, and one more client keeps opening
streams and dropping them after a few chunks. Then every distinct request runs alone, one after
another, through the engine as `speculant generate` runs it (no server, no prompt cache): each
server response must be that text exactly, and the server's throughput is compared with that
sequential run's.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

from ..decoding.engine import Engine, GenerationConfig
from ..exact.sampler import SamplingConfig
from .app import ServerConfig, create_app, offered_methods

SYSTEM = "You are a concise assistant."
CHATS = ["Write a Python function that reverses a string.", "What is the capital of France? One sentence.",
         "List three uses of a hash map.", "Explain recursion to a child in two sentences.",
         "Write a SQL query that counts rows per day in a table events(ts).", "Give me a haiku about the sea."]
COMPLETIONS = ["def quicksort(items):\n", "The three laws of robotics are", "import json\n\ndef load(path):\n",
               "Once upon a time, in a small village,"]


@dataclass(frozen=True, slots=True)
class Spec:
    """One distinct request of the mix."""

    chat: bool
    text: str
    method: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None

    def body(self, model: str) -> dict[str, object]:
        b: dict[str, object] = {"model": model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                                "method": self.method, "stream": True, "stream_options": {"include_usage": True}}
        if self.seed is not None:
            b["seed"] = self.seed
        if self.chat:
            b["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.text}]
        else:
            b["prompt"] = self.text
        return b


def request_mix(methods: list[str], max_tokens: int) -> list[Spec]:
    specs = []
    for i, text in enumerate(CHATS + COMPLETIONS):
        method = methods[i % len(methods)]
        sampled = i % 5 == 4  # every fifth request samples (seeded), the rest are greedy
        specs.append(Spec(i < len(CHATS), text, method, max_tokens // 2 + (i * 17) % (max_tokens // 2 + 1),
                          0.8 if sampled else 0.0, 1000 + i if sampled else None))
    return specs


@dataclass(slots=True)
class Result:
    spec: Spec
    ok: bool
    text: str = ""
    tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    error: str = ""
    id: str = ""


@dataclass(slots=True)
class Report:
    clients: int
    seconds: float
    requests: int = 0
    errors: int = 0
    mismatches: int = 0
    duplicate_ids: int = 0
    dropped_streams: int = 0
    completion_tokens: int = 0
    server_tokens_per_second: float = 0.0
    sequential_tokens_per_second: float = 0.0
    throughput_ratio: float = 0.0
    ttft_p50: float = 0.0
    ttft_p95: float = 0.0
    latency_p50: float = 0.0
    latency_p95: float = 0.0
    error_samples: list[str] = field(default_factory=list)


async def _one(client, url: str, spec: Spec, model: str, drop_after: int = 0) -> Result:
    import httpx

    t0 = time.perf_counter()
    res = Result(spec, False)
    try:
        async with client.stream("POST", url + "/v1/" + ("chat/completions" if spec.chat else "completions"),
                                 json=spec.body(model)) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            pieces, done, chunks = [], False, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    res.error = ev["error"]["message"]
                    return res
                res.id = res.id or ev["id"]
                if ev["id"] != res.id or ev["model"] != model:
                    res.error = "a chunk of another response in this stream"
                    return res
                if ev.get("usage"):
                    res.tokens = ev["usage"]["completion_tokens"]
                for c in ev["choices"]:
                    piece = c["delta"].get("content") if spec.chat else c.get("text")
                    if piece:
                        if not pieces:
                            res.ttft = time.perf_counter() - t0
                        pieces.append(piece)
                        chunks += 1
                if drop_after and chunks >= drop_after:
                    return Result(spec, True, error="dropped")
            res.text, res.latency = "".join(pieces), time.perf_counter() - t0
            res.ok = done
            if not done:
                res.error = "stream ended without [DONE]"
    except (httpx.HTTPError, ValueError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _load(url: str, model: str, specs: list[Spec], clients: int, seconds: float) -> tuple[list[Result], int]:
    import httpx

    results: list[Result] = []
    end = time.perf_counter() + seconds
    dropped = 0

    async def client(i: int) -> None:
        async with httpx.AsyncClient(timeout=600) as h:
            n = i
            while time.perf_counter() < end:
                results.append(await _one(h, url, specs[n % len(specs)], model))
                n += clients

    async def dropper() -> None:  # opens a stream, reads 3 pieces, leaves; again and again
        nonlocal dropped
        async with httpx.AsyncClient(timeout=600) as h:
            n = 0
            while time.perf_counter() < end:
                spec = Spec(False, COMPLETIONS[n % len(COMPLETIONS)], "ar", 400)
                r = await _one(h, url, spec, model, drop_after=3)
                dropped += r.error == "dropped"
                n += 1
                await asyncio.sleep(1.0)

    await asyncio.gather(*(client(i) for i in range(clients)), dropper())
    return results, dropped


def reference(e: Engine, spec: Spec) -> tuple[str, int]:
    """The request run alone through the engine (under spec.method), as `speculant generate [--chat]` runs it."""
    gen = GenerationConfig(spec.max_tokens, SamplingConfig(spec.temperature, seed=spec.seed))
    done = e.generate(spec.text, gen, chat=spec.chat, system=SYSTEM if spec.chat else None)
    return done.text, len(done.token_ids)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def run_load_test(engine: Engine, *, clients: int = 8, seconds: float = 60.0, max_tokens: int = 96,
                  log=print) -> Report:
    import socket

    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    model = "load-test"
    app = create_app(engine, ServerConfig(model, max_queue=clients + 8))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    methods = offered_methods(engine)
    specs = request_mix(methods, max_tokens)
    log(f"load: {clients} streaming clients + 1 that drops its streams, {seconds:.0f} s, {len(specs)} distinct "
        f"requests, methods {', '.join(methods)}")
    t0 = time.perf_counter()
    try:
        results, dropped = asyncio.run(_load(f"http://127.0.0.1:{port}", model, specs, clients, seconds))
    finally:
        wall = time.perf_counter() - t0
        server.should_exit = True
        thread.join(60)
    rep = Report(clients, round(wall, 2), requests=len(results), dropped_streams=dropped)
    ok = [r for r in results if r.ok]
    rep.errors = len(results) - len(ok)
    rep.error_samples = [f"{r.spec.text[:30]!r} {r.spec.method}: {r.error}" for r in results if not r.ok][:5]
    rep.duplicate_ids = len(ok) - len({r.id for r in ok})
    rep.completion_tokens = sum(r.tokens for r in ok)
    rep.server_tokens_per_second = round(rep.completion_tokens / wall, 2)
    # Each distinct request alone, in the order the server finished them (so the sequential run does
    # the same work): the reference text, and the sequential throughput.
    refs: dict[Spec, str] = {}
    seq_tokens, seq_time = 0, 0.0
    engines = {m: engine.with_method(m) for m in methods}  # built once, as a CLI process builds one
    for r in ok:
        t = time.perf_counter()
        text, n = reference(engines[r.spec.method], r.spec)
        seq_time += time.perf_counter() - t
        seq_tokens += n
        refs.setdefault(r.spec, text)
        if r.text != text:
            rep.mismatches += 1
            if len(rep.error_samples) < 10:
                rep.error_samples.append(f"mismatch {r.spec.method} {r.spec.text[:30]!r}: {r.text[:60]!r} != {text[:60]!r}")
    rep.sequential_tokens_per_second = round(seq_tokens / seq_time, 2) if seq_time else 0.0
    rep.throughput_ratio = round(rep.server_tokens_per_second / rep.sequential_tokens_per_second, 3) \
        if rep.sequential_tokens_per_second else 0.0
    ttfts, lats = [r.ttft for r in ok], [r.latency for r in ok]
    rep.ttft_p50, rep.ttft_p95 = round(_pct(ttfts, 50), 3), round(_pct(ttfts, 95), 3)
    rep.latency_p50, rep.latency_p95 = round(_pct(lats, 50), 3), round(_pct(lats, 95), 3)
    return rep


def print_report(rep: Report, log=print) -> None:
    log(json.dumps(asdict(rep), indent=1))
    log(f"requests {rep.requests}, errors {rep.errors}, mismatches {rep.mismatches}, duplicate ids "
        f"{rep.duplicate_ids}, dropped streams {rep.dropped_streams}")
    log(f"time to first token p50 {rep.ttft_p50} s, p95 {rep.ttft_p95} s; latency p50 {rep.latency_p50} s, "
        f"p95 {rep.latency_p95} s")
    log(f"server {rep.server_tokens_per_second} tokens/s vs one after another through the engine "
        f"{rep.sequential_tokens_per_second} tokens/s: ratio {rep.throughput_ratio}")

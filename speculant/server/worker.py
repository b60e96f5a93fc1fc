"""The one engine and its queue: generations run one at a time, in arrival order, on one thread.

HTTP handlers submit a `Job` and read its events from an asyncio queue; the worker thread runs the
engine and posts events back to the event loop. A job whose client left (or whose time is up) is
stopped at the engine's next round by closing its stream, which frees the engine for the next job.
All jobs share one prompt cache (whatever their method: the keys/values do not depend on it), so a
chat that goes on prefills only its new turn.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..decoding.engine import Chunk, Done, Engine, GenerationConfig
from ..errors import SpeculantError
from ..models.prompt_cache import PromptCachePool

log = logging.getLogger("speculant.server")


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass(slots=True)
class Stopped:
    """The generation ended before its Done: 'cancelled' (client left), 'time_limit' or 'shutdown'."""

    reason: str


@dataclass(slots=True)
class Failed:
    error: Exception


Event = Chunk | Done | Stopped | Failed


@dataclass(eq=False)
class Job:
    ids: list[int]
    gen: GenerationConfig
    engine: Engine  # the server's engine under the request's method (the same models)
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic() after which the generation stops
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: float = 0.0  # monotonic time the engine took it (0 while queued)

    def post(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    max_queue: int = 16  # jobs waiting (the running one not counted); more get 429
    prompt_cache: bool = True
    # conversations whose prompt caches are kept at once (prefix.PromptCachePool): clients taking turns keep
    # theirs; each holds the keys/values of its last prompt and answer (1.5B, f16: 28 KB a token)
    prompt_cache_slots: int = 4

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise SpeculantError(f"queue size must be >= 0, got {self.max_queue}")
        if self.prompt_cache_slots < 1:
            raise SpeculantError(f"prompt cache slots must be >= 1, got {self.prompt_cache_slots}")


class Worker:
    def __init__(self, engine: Engine, cfg: WorkerConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self.caches = PromptCachePool(lambda: engine.prompt_cache(reuse=cfg.prompt_cache),
                                      cfg.prompt_cache_slots if cfg.prompt_cache else 1)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0
        self.running: Job | None = None
        self.rounds = 0  # engine events posted so far (tests wait on progress with it)
        self.stopping = False
        self._thread = threading.Thread(target=self._run, name="speculant-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.stopping:
                raise ShuttingDown
            if self.waiting >= self.cfg.max_queue and (self.running is not None or self.waiting > 0):
                raise QueueFull
            self.waiting += 1
        self._jobs.put(job)

    def stop(self, grace: float) -> None:
        """Refuse new jobs, end the queued ones, give the running one `grace` seconds, then abort it."""
        with self._lock:
            self.stopping = True
        self._jobs.put(None)
        self._thread.join(grace)
        job = self.running
        if job is not None:
            job.cancelled.set()
        self._thread.join(30.0)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            with self._lock:
                self.waiting -= 1
                self.running = job
            try:
                if self.stopping:  # queued before the shutdown began: not started
                    job.post(Stopped("shutdown"))
                elif job.cancelled.is_set():
                    job.post(Stopped("cancelled"))
                elif time.monotonic() > job.deadline:
                    job.post(Stopped("time_limit"))
                else:
                    self._generate(job)
            finally:
                with self._lock:
                    self.running = None

    def _generate(self, job: Job) -> None:
        job.started = time.monotonic()
        cache = self.caches.take(job.ids)
        stream = job.engine.stream(job.ids, job.gen, cache=cache)
        try:
            for event in stream:
                job.post(event)
                self.rounds += 1
                if isinstance(event, Done):
                    return
                if job.cancelled.is_set():
                    job.post(Stopped("shutdown" if self.stopping else "cancelled"))
                    return
                if time.monotonic() > job.deadline:
                    job.post(Stopped("time_limit"))
                    return
        except SpeculantError as e:
            job.post(Failed(e))
        except Exception as e:  # a bug: keep serving, but start the next prompt from an empty cache
            log.exception("generation failed")
            cache.forget()
            job.post(Failed(e))
        finally:
            stream.close()  # a stopped generation ends here, at the round it reached

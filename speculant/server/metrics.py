"""Server metrics in Prometheus' text format (GET /metrics): counters, gauges and two histograms.

Written by hand (a few dozen lines) rather than through prometheus_client, whose default registry
is module-global state; one `Metrics` object belongs to one app.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..decoding.stats import Stats

_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * len(_BUCKETS)
        self.total = 0.0
        self.n = 0

    def observe(self, x: float) -> None:
        for i, b in enumerate(_BUCKETS):
            if x <= b:
                self.counts[i] += 1
        self.total += x
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(_BUCKETS, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]


class Metrics:
    def __init__(self, queue_length: Callable[[], int], running: Callable[[], int]) -> None:
        self._lock = threading.Lock()
        self._queue_length = queue_length
        self._running = running
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.completion_tokens = 0
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.ttft = _Histogram()
        self.latency = _Histogram()
        self.last_tokens_per_second = 0.0

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def finished(self, seconds: float, prompt_tokens: int, completion_tokens: int, stats: Stats | None) -> None:
        with self._lock:
            self.latency.observe(seconds)
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            if stats is not None:
                self.cached_prompt_tokens += stats.cached_prompt_tokens
                self.drafted_tokens += stats.drafted_tokens
                self.accepted_tokens += stats.accepted_tokens
                self.last_tokens_per_second = stats.decode_tokens_per_second

    def mean_latency(self) -> float:
        with self._lock:
            return self.latency.total / self.latency.n if self.latency.n else 0.0

    def render(self) -> str:
        with self._lock:
            rate = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
            rows: list[tuple[str, str, str, list[str]]] = [
                ("speculant_requests_total", "counter", "HTTP requests by endpoint and status",
                 [f'speculant_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                  for (e, s), n in sorted(self.requests.items())]),
                ("speculant_prompt_tokens_total", "counter", "prompt tokens of finished generations",
                 [f"speculant_prompt_tokens_total {self.prompt_tokens}"]),
                ("speculant_cached_prompt_tokens_total", "counter", "prompt tokens reused from the prompt cache",
                 [f"speculant_cached_prompt_tokens_total {self.cached_prompt_tokens}"]),
                ("speculant_completion_tokens_total", "counter", "generated tokens",
                 [f"speculant_completion_tokens_total {self.completion_tokens}"]),
                ("speculant_drafted_tokens_total", "counter", "tokens the drafter proposed",
                 [f"speculant_drafted_tokens_total {self.drafted_tokens}"]),
                ("speculant_accepted_tokens_total", "counter", "drafted tokens the target accepted",
                 [f"speculant_accepted_tokens_total {self.accepted_tokens}"]),
                ("speculant_acceptance_rate", "gauge", "accepted / drafted tokens since start",
                 [f"speculant_acceptance_rate {rate:.6f}"]),
                ("speculant_tokens_per_second", "gauge", "decode tokens/s of the last finished generation",
                 [f"speculant_tokens_per_second {self.last_tokens_per_second:.3f}"]),
                ("speculant_time_to_first_token_seconds", "histogram", "request arrival to first token (queue included)",
                 self.ttft.lines("speculant_time_to_first_token_seconds")),
                ("speculant_request_duration_seconds", "histogram", "request arrival to last token",
                 self.latency.lines("speculant_request_duration_seconds")),
                ("speculant_queue_length", "gauge", "requests waiting for the engine",
                 [f"speculant_queue_length {self._queue_length()}"]),
                ("speculant_running", "gauge", "generations running (0 or 1)",
                 [f"speculant_running {self._running()}"]),
            ]
        out: list[str] = []
        for name, kind, help_text, lines in rows:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines]
        return "\n".join(out) + "\n"

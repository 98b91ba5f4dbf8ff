"""The server's periodic stats line, as vLLM's engine logs one ("Avg prompt throughput: ... tokens/s, Avg generation
throughput: ..., Running: ... reqs, Waiting: ... reqs, GPU KV cache usage: ...%, Prefix cache hit rate: ...%"):
`openm3 serve` prints it to stderr every `--log-stats-interval` seconds (10) while there is work, unless
`--disable-log-stats` (vLLM's flag). Throughputs are over the interval: prompt tokens handed to the engine and
tokens sampled; the cache figures come from a backend that reports them (`BatchedGenerator.metrics`).

    stats = StatsLog(latency, backend.metrics)   # latency: the app's `metrics.RequestLatency`
    stats.line()                                 # the line for the interval since the last call, None if idle
    stop = stats.start(10.0)                     # a daemon thread printing it; stop.set() ends it
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from .metrics import RequestLatency


class StatsLog:
    """Builds the stats line from the app's request counters and the backend's metrics rows (optional)."""

    def __init__(self, latency: RequestLatency, backend_metrics: Callable[[], list] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.latency, self.backend_metrics, self.clock = latency, backend_metrics, clock
        self._last = (clock(), latency.live(), self._engine())

    def _engine(self) -> dict:
        """The backend's figures by name ({} without any)."""
        if self.backend_metrics is None:
            return {}
        return {name: value for name, _kind, _help, value in self.backend_metrics()}

    def line(self) -> str | None:
        """The figures of the interval since the last call, or None when nothing ran in it."""
        now, live, engine = self.clock(), self.latency.live(), self._engine()
        (then, before, engine_before), self._last = self._last, (now, live, engine)
        seconds = max(now - then, 1e-9)
        prompt, generated = live["prompt"] - before["prompt"], live["generated"] - before["generated"]
        if not (prompt or generated or live["in_flight"]):
            return None
        parts = [f"prompt {prompt / seconds:.1f} tokens/s", f"generation {generated / seconds:.1f} tokens/s",
                 f"running {live['in_flight'] - live['waiting']} reqs", f"waiting {live['waiting']} reqs"]
        if engine.get("cache_pages"):
            parts.append(f"cache {100 * engine['cache_pages_used'] / engine['cache_pages']:.1f}% used")
        admitted = engine.get("prompt_tokens_total", 0) - engine_before.get("prompt_tokens_total", 0)
        if admitted > 0:
            hits = engine["prefix_cache_hit_tokens_total"] - engine_before.get("prefix_cache_hit_tokens_total", 0)
            parts.append(f"prefix cache hits {100 * hits / admitted:.1f}%")
        return "openm3 stats: " + ", ".join(parts)

    def start(self, interval: float, out=None) -> threading.Event:
        """Prints `line()` (when not None) every `interval` seconds from a daemon thread; returns its stop event."""
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval):
                text = self.line()
                if text is not None:
                    print(f"{time.strftime('%H:%M:%S')} {text}", file=out or sys.stderr, flush=True)

        threading.Thread(target=loop, name="openm3-stats", daemon=True).start()
        return stop

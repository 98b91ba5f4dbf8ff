"""`GET /metrics` in Prometheus' text format, and the per-request latency histograms vLLM's server exports (time
to first token, inter-token latency, end-to-end latency, queue / prefill / decode time, prompt and generation
lengths), so a dashboard built for vLLM reads openm3's figures under the same names (prefixed `openm3:`).

    latency = RequestLatency(max_total_tokens=32768)
    timer = latency.start(prompt_tokens=812)     # when the engine is handed the request
    timer.admitted()                              # when it gets a place in the batch (if the backend says)
    timer.token()                                 # per sampled token
    timer.end()                                   # once, when it ended (however)
    prometheus_text(latency.rows() + other_rows)
"""

from __future__ import annotations

import bisect
import math
import threading
import time

# seconds; the first token's buckets reach the long prefills of 1M-token prompts
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def length_buckets(most: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `most` (a token count's buckets, as vLLM's up to max_model_len)."""
    out, scale = [], 1
    while scale <= most:
        out += [step * scale for step in (1, 2, 5) if step * scale <= most]
        scale *= 10
    return tuple(out) if out[-1] == most else (*out, most)


class Histogram:
    """A Prometheus histogram: cumulative bucket counts at `buckets` (upper bounds) and +Inf, a sum and a count.
    Thread-safe; `observe` is a lock and a bisect."""

    def __init__(self, buckets):
        self.buckets = tuple(float(b) for b in buckets)
        if list(self.buckets) != sorted(set(self.buckets)) or not self.buckets:
            raise ValueError(f"buckets must be increasing and distinct, got {buckets!r}")
        self._counts = [0] * (len(self.buckets) + 1)  # per bucket, not cumulative; the last one is +Inf
        self._sum, self._lock = 0.0, threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[tuple[str, int]], float, int]:
        """([(le, cumulative count)] including '+Inf', sum, count), read consistently."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        running, out = 0, []
        for bound, n in zip([*map(_number, self.buckets), "+Inf"], counts):
            running += n
            out.append((bound, running))
        return out, total, running


class RequestTimer:
    """One request's clock (`RequestLatency.start`): records into the histograms as its events come."""

    def __init__(self, latency: "RequestLatency", prompt_tokens: int):
        self.latency, self.prompt_tokens = latency, prompt_tokens
        self.arrived = self.last = time.perf_counter()
        self.admitted_at: float | None = None
        self.first: float | None = None
        self.tokens, self.ended, self.placed = 0, False, False
        latency._count(in_flight=1, waiting=1, prompt=prompt_tokens)

    def _place(self) -> None:
        if not self.placed:  # admitted, or (a backend that does not say) its first token came
            self.placed = True
            self.latency._count(waiting=-1)

    def admitted(self) -> None:
        """It got its place in the batch (a backend that reports admissions: `on_cached`)."""
        if self.admitted_at is None:
            self.admitted_at = time.perf_counter()
            self.latency.queue.observe(self.admitted_at - self.arrived)
            self._place()

    def token(self) -> None:
        now = time.perf_counter()
        self.latency._count(generated=1)
        if self.first is None:
            self._place()
            self.first = now
            self.latency.ttft.observe(now - self.arrived)
            if self.admitted_at is not None:
                self.latency.prefill.observe(now - self.admitted_at)
        else:
            self.latency.itl.observe(now - self.last)
        self.last, self.tokens = now, self.tokens + 1

    def end(self) -> None:
        """The request ended (finished, stopped, failed or abandoned); later calls do nothing."""
        if self.ended:
            return
        self.ended = True
        now, lat = time.perf_counter(), self.latency
        lat._count(in_flight=-1, waiting=0 if self.placed else -1)
        lat.e2e.observe(now - self.arrived)
        if self.first is not None:
            lat.decode.observe(now - self.first)
        if self.admitted_at is not None:
            lat.inference.observe(now - self.admitted_at)
        lat.prompt_tokens.observe(self.prompt_tokens)
        lat.generation_tokens.observe(self.tokens)


class RequestLatency:
    """The server's request histograms (vLLM's names): `start` one `RequestTimer` per generation."""

    def __init__(self, max_total_tokens: int):
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self.e2e, self.queue, self.prefill, self.decode, self.inference = (Histogram(REQUEST_BUCKETS)
                                                                           for _ in range(5))
        lengths = length_buckets(max(1, max_total_tokens))
        self.prompt_tokens, self.generation_tokens = Histogram(lengths), Histogram(lengths)
        self._live = {"in_flight": 0, "waiting": 0, "prompt": 0, "generated": 0}
        self._lock = threading.Lock()

    def start(self, prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, prompt_tokens)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for key, n in deltas.items():
                self._live[key] += n

    def live(self) -> dict[str, int]:
        """Requests in flight and waiting for their place (admission, or else their first token) now, and the
        prompt tokens handed over and tokens sampled so far (for the periodic stats line)."""
        with self._lock:
            return dict(self._live)

    def rows(self) -> list[tuple[str, str, str, Histogram]]:
        return [
            ("time_to_first_token_seconds", "histogram", "from a request's hand-over to the engine to its first "
             "token", self.ttft),
            ("inter_token_latency_seconds", "histogram", "between a request's consecutive tokens", self.itl),
            ("e2e_request_latency_seconds", "histogram", "from a request's hand-over to the engine to its end",
             self.e2e),
            ("request_queue_time_seconds", "histogram", "waiting for a place in the batch (backends that report "
             "admissions)", self.queue),
            ("request_prefill_time_seconds", "histogram", "from admission to the first token", self.prefill),
            ("request_decode_time_seconds", "histogram", "from the first token to the end", self.decode),
            ("request_inference_time_seconds", "histogram", "from admission to the end", self.inference),
            ("request_prompt_tokens", "histogram", "prompt tokens per request", self.prompt_tokens),
            ("request_generation_tokens", "histogram", "sampled tokens per request", self.generation_tokens),
        ]


def prometheus_text(rows) -> str:
    """Prometheus' text exposition of (name, type, help, value) rows; a dict value holds one sample per label set:
    its keys are either label strings (`a="x",b="y"`) or plain values of a `reason` label; a `Histogram` value
    gives its `_bucket`, `_sum` and `_count` samples."""
    out = []
    for name, kind, text, value in rows:
        name = f"openm3:{name}"
        out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        if isinstance(value, Histogram):
            buckets, total, count = value.snapshot()
            out += [f'{name}_bucket{{le="{le}"}} {n}' for le, n in buckets]
            out += [f"{name}_sum {total!r}", f"{name}_count {count}"]
            continue
        samples = value.items() if isinstance(value, dict) else [(None, value)]
        for labels, v in samples:
            if labels is not None and "=" not in labels:
                labels = f'reason="{labels}"'
            v = str(v) if isinstance(v, int) else repr(float(v))  # counters stay exact integers
            out.append(f"{name}{{{labels}}} {v}" if labels else f"{name} {v}")
    return "\n".join(out) + "\n"


def _number(bound: float) -> str:
    """A bucket bound as Prometheus clients write it (1.0, 0.005, 32768.0)."""
    return repr(float(bound)) if math.isfinite(bound) else "+Inf"

"""The Prometheus pieces of `openm3.serve.metrics`: histogram buckets (upper bounds inclusive, cumulative, +Inf),
token-length buckets, and a request's clock recording queue, prefill, first-token, inter-token and end times."""

from __future__ import annotations

import threading
import time

import pytest

from openm3.serve.metrics import Histogram, RequestLatency, length_buckets, prometheus_text
from openm3.serve.stats_log import StatsLog


def test_a_histogram_counts_each_value_in_the_first_bucket_that_holds_it():
    h = Histogram([0.1, 1, 10])
    for v in (0.05, 0.1, 0.5, 1.0, 3, 100):
        h.observe(v)
    buckets, total, count = h.snapshot()
    assert buckets == [("0.1", 2), ("1.0", 4), ("10.0", 5), ("+Inf", 6)]  # le: value <= bound
    assert total == pytest.approx(104.65) and count == 6
    text = prometheus_text([("x_seconds", "histogram", "a test", h)])
    assert text.splitlines() == ["# HELP openm3:x_seconds a test", "# TYPE openm3:x_seconds histogram",
                                 'openm3:x_seconds_bucket{le="0.1"} 2', 'openm3:x_seconds_bucket{le="1.0"} 4',
                                 'openm3:x_seconds_bucket{le="10.0"} 5', 'openm3:x_seconds_bucket{le="+Inf"} 6',
                                 f"openm3:x_seconds_sum {total!r}", "openm3:x_seconds_count 6"]
    with pytest.raises(ValueError, match="increasing"):
        Histogram([1, 1, 2])


def test_a_histogram_observed_from_many_threads_loses_nothing():
    h = Histogram([0.5])
    threads = [threading.Thread(target=lambda: [h.observe(i % 2) for i in range(1000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.snapshot() == ([("0.5", 2000), ("+Inf", 4000)], 2000.0, 4000)


def test_length_buckets_run_1_2_5_up_to_the_limit():
    assert length_buckets(1) == (1,)
    assert length_buckets(10) == (1, 2, 5, 10)
    assert length_buckets(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4096)


def test_a_request_timer_records_each_phase_once():
    latency = RequestLatency(max_total_tokens=64)
    timer = latency.start(prompt_tokens=12)
    timer.admitted()
    timer.admitted()  # a second report changes nothing
    for _ in range(3):
        timer.token()
    timer.end()
    timer.end()
    counts = {name: h.snapshot()[2] for name, _, _, h in latency.rows()}
    assert counts == {"time_to_first_token_seconds": 1, "inter_token_latency_seconds": 2,
                      "e2e_request_latency_seconds": 1, "request_queue_time_seconds": 1,
                      "request_prefill_time_seconds": 1, "request_decode_time_seconds": 1,
                      "request_inference_time_seconds": 1, "request_prompt_tokens": 1,
                      "request_generation_tokens": 1}
    assert latency.generation_tokens.snapshot()[1] == 3 and latency.prompt_tokens.snapshot()[1] == 12
    unadmitted = latency.start(prompt_tokens=5)  # a backend that reports no admission, ended before a token
    unadmitted.end()
    assert latency.queue.snapshot()[2] == 1 and latency.decode.snapshot()[2] == 1
    assert latency.e2e.snapshot()[2] == 2 and latency.ttft.snapshot()[2] == 1


def test_the_stats_line_reports_an_intervals_throughput_requests_and_cache():
    now = [100.0]
    latency = RequestLatency(max_total_tokens=4096)
    engine = {"cache_pages": 40, "cache_pages_used": 10, "prompt_tokens_total": 0, "prefix_cache_hit_tokens_total": 0}
    rows = lambda: [(k, "gauge", "", v) for k, v in engine.items()]  # noqa: E731 - the backend's metrics rows
    stats = StatsLog(latency, rows, clock=lambda: now[0])
    assert stats.line() is None  # nothing ran
    first = latency.start(prompt_tokens=100)
    first.admitted()
    for _ in range(5):
        first.token()
    latency.start(prompt_tokens=20)  # not placed yet: waiting
    engine.update(prompt_tokens_total=100, prefix_cache_hit_tokens_total=40)
    now[0] += 2.0
    assert stats.line() == ("openm3 stats: prompt 60.0 tokens/s, generation 2.5 tokens/s, running 1 reqs, "
                            "waiting 1 reqs, cache 25.0% used, prefix cache hits 40.0%")
    now[0] += 1.0
    first.end()
    assert stats.line() == ("openm3 stats: prompt 0.0 tokens/s, generation 0.0 tokens/s, running 0 reqs, "
                            "waiting 1 reqs, cache 25.0% used")  # the waiting one is still in flight


def test_the_stats_thread_prints_while_there_is_work_and_stops():
    import io

    latency = RequestLatency(max_total_tokens=64)
    out = io.StringIO()
    stop = StatsLog(latency).start(0.02, out=out)
    timer = latency.start(prompt_tokens=8)
    timer.token()
    deadline = time.monotonic() + 10
    while "openm3 stats:" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    timer.end()
    stop.set()
    assert "running 1 reqs, waiting 0 reqs" in out.getvalue()  # no backend figures: no cache part
    assert "cache" not in out.getvalue()
    with pytest.raises(ValueError, match="interval"):
        StatsLog(latency).start(0)


def test_the_stats_options_parse_and_a_bad_interval_fails_before_the_model_loads(capsys):
    from openm3.serve.cli import build_parser, main

    args = build_parser().parse_args(["--preset", "m3-tiny", "--disable-log-stats", "--log-stats-interval", "2.5"])
    assert args.disable_log_stats and args.log_stats_interval == 2.5
    assert not build_parser().parse_args(["--preset", "m3-tiny"]).disable_log_stats
    with pytest.raises(SystemExit):
        main(["--preset", "m3-tiny", "--log-stats-interval", "0"])
    assert "--log-stats-interval: expected seconds > 0" in capsys.readouterr().err

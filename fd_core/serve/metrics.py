"""The server's counters, gauges and histograms, exposed through prometheus_client (its collector interface and
text exposition, which escapes label values). Labels come from fixed sets only: the route a request matched (one
label for every path no route matches) and its HTTP status, so no client can add a series or break the page."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The endpoint label of a request no route matched (a 404, or a 401 before routing): never the raw path.
UNMATCHED = "unmatched"
# The probes' and scrapers' routes: not counted, whatever they answer (a 405 to POST /health too), so that a health
# check every second does not swamp the API's requests.
UNCOUNTED = frozenset({"/health", "/metrics"})
# The paged KV cache's counts (rank 0's, as of the last sequence that ended): metric, type, key, help.
KV_METRICS = (
    ("fd_kv_cache_blocks_total", "gauge", "blocks_total", "KV-cache blocks a rank holds for sequences."),
    ("fd_kv_cache_blocks_used", "gauge", "blocks_used", "KV-cache blocks held by running sequences."),
    ("fd_prefix_cache_hit_tokens_total", "counter", "prefix_cache_hit_tokens",
     "Prompt tokens whose keys and values were found cached (shared full blocks)."),
    ("fd_prefix_cache_queried_tokens_total", "counter", "prefix_cache_queried_tokens",
     "Prompt tokens looked up in the prefix cache."),
    ("fd_preemptions_total", "counter", "preemptions",
     "Sequences preempted (their blocks freed, recomputed later) when the KV cache ran out."),
    ("fd_spec_proposed_tokens_total", "counter", "spec_proposed_tokens",
     "Tokens speculative decoding proposed (--speculative)."),
    ("fd_spec_accepted_tokens_total", "counter", "spec_accepted_tokens",
     "Proposed tokens the model's verify step accepted."),
    ("fd_kv_sent_tokens_total", "counter", "kv_sent_tokens",
     "Prompt positions whose keys and values this instance sent to a decode instance (rank 0's)."),
    ("fd_kv_sent_bytes_total", "counter", "kv_sent_bytes", "Bytes of keys and values rank 0 sent."),
    ("fd_kv_received_tokens_total", "counter", "kv_received_tokens",
     "Prompt positions whose keys and values this instance received from a prefill instance (rank 0's)."),
    ("fd_kv_received_bytes_total", "counter", "kv_received_bytes", "Bytes of keys and values rank 0 received."),
)
# Seconds: from a few milliseconds (a tiny model at low load) to a minute (a long prompt behind a full batch).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus histograms are exposed."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1


class Metrics:
    """What the server has done: requests by endpoint and status, tokens, time to first token, decode rate."""

    def __init__(
        self, queue_length: Callable[[], int], running: Callable[[], int],
        kv_cache: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        self.lock = threading.Lock()  # the engine's pump threads report tokens while the event loop reports requests
        self.requests: dict[tuple[str, str], int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cancelled = 0
        self.ttft = Histogram()
        self.duration = Histogram()
        self.decode_tokens = 0
        self.decode_s = 0.0
        self.queue_length = queue_length
        self.running = running
        self.kv_cache = kv_cache

    def request(self, endpoint: str, status: int | str) -> None:
        """One request answered (status: the HTTP code, or "cancelled" for a client that went away); none on UNCOUNTED
        routes."""
        if endpoint in UNCOUNTED:
            return
        with self.lock:
            key = (endpoint, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1
            if status == "cancelled":
                self.cancelled += 1

    def finished(
        self, prompt_tokens: int, completion_tokens: int, submitted: float, first_token_at: float | None, done_at: float
    ) -> None:
        """A generation that ran to its end: its tokens, its time to first token, its decode time (time.time()
        values)."""
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += completion_tokens
            self.duration.observe(max(0.0, done_at - submitted))
            if first_token_at is not None:
                self.ttft.observe(max(0.0, first_token_at - submitted))
                if completion_tokens > 1 and done_at > first_token_at:
                    self.decode_tokens += completion_tokens - 1
                    self.decode_s += done_at - first_token_at

    def text(self) -> str:
        """Every metric in Prometheus' text format, written by prometheus_client."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry).decode()

    def families(self) -> list[Any]:
        """The metric families as they stand (prometheus_client's), read under the lock."""
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        with self.lock:
            requests = CounterMetricFamily("fd_requests", "HTTP requests answered, by endpoint and status.",
                                           labels=["endpoint", "status"])
            for (endpoint, status), n in sorted(self.requests.items()):
                requests.add_metric([endpoint, status], n)
            out: list[Any] = [requests]
            rate = self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0
            for name, kind, help_text, value in (
                ("fd_prompt_tokens_total", "counter", "Prompt tokens of finished generations.", self.prompt_tokens),
                ("fd_generation_tokens_total", "counter", "Tokens generated by finished generations.",
                 self.generation_tokens),
                ("fd_requests_cancelled_total", "counter", "Generations cancelled because the client went away.",
                 self.cancelled),
                ("fd_queue_length", "gauge", "Requests admitted by the server and not yet answered.",
                 self.queue_length()),
                ("fd_engine_requests", "gauge", "Requests waiting or running in the engine.", self.running()),
                ("fd_decode_tokens_total", "counter",
                 "Tokens after each generation's first, over fd_decode_seconds_total.", self.decode_tokens),
                ("fd_decode_seconds_total", "counter", "Seconds from each generation's first token to its last.",
                 round(self.decode_s, 6)),
                ("fd_decode_tokens_per_second", "gauge",
                 "Mean decode rate of one generation: fd_decode_tokens_total / fd_decode_seconds_total.",
                 round(rate, 3)),
            ):
                out.append(_family(name, kind, help_text, value))
            kv = self.kv_cache()
            out += [_family(name, kind, help_text, int(kv[key])) for name, kind, key, help_text in KV_METRICS
                    if key in kv]
            for name, help_text, hist in (
                ("fd_time_to_first_token_seconds", "Seconds from admission to a generation's first token.", self.ttft),
                ("fd_request_duration_seconds", "Seconds from admission to a generation's last token.", self.duration),
            ):
                buckets = [(str(bound), n) for bound, n in zip(hist.buckets, hist.counts, strict=True)]
                out.append(HistogramMetricFamily(name, help_text, buckets=[*buckets, ("+Inf", hist.count)],
                                                 sum_value=hist.total))
            return out


def _family(name: str, kind: str, help_text: str, value: float) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    return (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, help_text, value=value)


class _Collector:
    """prometheus_client's collector interface over a Metrics."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        yield from self.metrics.families()

"""The server's Prometheus metrics, GET /metrics in Prometheus's text format (docs/http-api.md,
"Metrics"). Each app has a registry of its own, so that several apps live in one process.

    nanoeuler_requests_total{route, status}          HTTP requests answered
    nanoeuler_prompt_tokens_total                     prompt tokens of the requests that completed
    nanoeuler_completion_tokens_total                 tokens they generated
    nanoeuler_time_to_first_token_seconds             request received -> its first text (histogram)
    nanoeuler_inter_token_latency_seconds             between a choice's successive pieces of text (histogram)
    nanoeuler_queue_depth                             requests waiting for a row
    nanoeuler_rows_busy, nanoeuler_rows               rows decoding, rows in all
    nanoeuler_prefix_cache_hits_total                 prompts whose prefill began from the prefix cache
    nanoeuler_prefix_cache_tokens_total               prompt tokens whose keys and values it gave
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


class Metrics:
    """The counters and histograms the app updates, and the scheduler's load read at each scrape."""

    def __init__(self, scheduler):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("nanoeuler_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=registry)
        self.prompt_tokens = Counter("nanoeuler_prompt_tokens", "prompt tokens of the completed requests",
                                     registry=registry)
        self.completion_tokens = Counter("nanoeuler_completion_tokens", "tokens generated for the completed requests",
                                         registry=registry)
        self.first_token = Histogram("nanoeuler_time_to_first_token_seconds", "from a request received to its "
                                     "first text", buckets=FIRST_TOKEN_BUCKETS, registry=registry)
        self.between_tokens = Histogram("nanoeuler_inter_token_latency_seconds", "between a choice's successive "
                                        "pieces of text", buckets=TOKEN_BUCKETS, registry=registry)
        registry.register(_SchedulerCollector(scheduler))

    def request(self, path: str, status: int) -> None:
        route = next((r for r in ROUTES if path == r), "/v1/models" if path.startswith("/v1/models/") else "other")
        self.requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector:
    """The scheduler's load and its prefix cache's hits, as they are at the scrape."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        load = self.scheduler.load()
        for name, what, value in (("nanoeuler_queue_depth", "requests waiting for a row", load["waiting"]),
                                  ("nanoeuler_rows_busy", "rows decoding", load["active"]),
                                  ("nanoeuler_rows", "rows decoded at once (--max-batch)", load["rows"])):
            yield GaugeMetricFamily(name, what, value=value)
        prefix = self.scheduler.prefix_stats()
        yield CounterMetricFamily("nanoeuler_prefix_cache_hits", "prompts whose prefill began from the prefix cache",
                                  value=prefix["prefix_cache_hits"])
        yield CounterMetricFamily("nanoeuler_prefix_cache_tokens", "prompt tokens whose keys and values the prefix "
                                  "cache gave", value=prefix["prefix_tokens_reused"])

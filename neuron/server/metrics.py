"""Prometheus metrics of the leader, named and shaped as vLLM's (``vllm:`` becomes ``neuron:``)
where they mean the same, so existing dashboards work with the prefix changed. Latencies come
from the request's leader-side timeline (``RequestTrace``), never from rank clocks."""

from __future__ import annotations

import os
import time
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from neuron.server.output.state import OutputState
from protocol.engine_client import FinishEvent

from neuron.server.request_trace import RequestTrace

# vLLM's buckets, so histograms from both servers can be compared bucket by bucket.
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
         40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
            480.0, 960.0, 1920.0, 7680.0)
_TOKENS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 5_000_000

MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"  # set before prometheus_client is imported: its multiprocess mode
FINISH_REASONS = ("stop", "length", "abort", "error")
STATUSES = ("loading", "loaded", "poisoned", "recovering", "failed", "unloading")


class _EngineState:
    """Read at scrape time from each Engine's stats, so a model that is unloaded drops out."""

    def __init__(self) -> None:
        self.models: dict[str, Any] = {}

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        label = ["model_name"]
        running = GaugeMetricFamily("neuron:num_requests_running", "Requests in the running batch", labels=label)
        waiting = GaugeMetricFamily("neuron:num_requests_waiting", "Requests waiting to be scheduled", labels=label)
        kv = GaugeMetricFamily("neuron:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent", labels=label)
        preempt = CounterMetricFamily("neuron:num_preemptions", "Preemptions of running requests", labels=label)
        queries = CounterMetricFamily("neuron:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels=label)
        hits = CounterMetricFamily("neuron:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   labels=label)
        tier_hits = CounterMetricFamily("neuron:prefix_cache_tier_hits", "Prompt tokens found in each tier of the "
                                        "prefix cache (device: the ranks' own cache; host: its host tier)",
                                        labels=["model_name", "tier"])
        moved = CounterMetricFamily("neuron:prefix_cache_tier_blocks_moved", "KV blocks copied into the host tier "
                                    "(offload) and back (restore)", labels=["model_name", "direction"])
        moved_bytes = CounterMetricFamily("neuron:prefix_cache_tier_bytes_moved", "Bytes of those blocks, all ranks "
                                          "together", labels=["model_name", "direction"])
        move_s = CounterMetricFamily("neuron:prefix_cache_tier_move_seconds", "Device time those copies took "
                                     "(rank 0's; the ranks copy side by side)", labels=["model_name", "direction"])
        bandwidth = GaugeMetricFamily("neuron:prefix_cache_tier_bandwidth_bytes_per_second", "bytes_moved over "
                                      "move_seconds since the model loaded", labels=["model_name", "direction"])
        encodes = CounterMetricFamily("neuron:image_encodes", "Images the vision tower encoded", labels=label)
        reuses = CounterMetricFamily("neuron:image_embedding_reuses",
                                     "Images served from the ranks' kept embeddings, not encoded again", labels=label)
        drafts = CounterMetricFamily("neuron:spec_decode_num_drafts", "Decodes that carried drafts (speculative "
                                     "decoding)", labels=label)
        drafted = CounterMetricFamily("neuron:spec_decode_num_draft_tokens", "Draft tokens checked", labels=label)
        accepted = CounterMetricFamily("neuron:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       labels=label)
        status = GaugeMetricFamily("neuron:model_status", "1 for the model's current status",
                                   labels=["model_name", "status"])
        where = ["model_name", "rank", "device"]
        used = GaugeMetricFamily("neuron:device_memory_used_bytes", "A rank's device memory in use (on a CPU, "
                                 "the host's)", labels=where)
        total = GaugeMetricFamily("neuron:device_memory_total_bytes", "A rank's device memory", labels=where)
        util = GaugeMetricFamily("neuron:device_utilization_perc", "A rank's device utilisation, where reported",
                                 labels=where)
        temp = GaugeMetricFamily("neuron:device_temperature_celsius", "A rank's device temperature, where reported",
                                 labels=where)
        threads = GaugeMetricFamily("neuron:cpu_threads", "A CPU rank's torch threads, by its kernels' level",
                                    labels=["model_name", "rank", "cpu_isa"])
        for model_id, handle in list(self.models.items()):
            stats = handle.client.stats()
            running.add_metric([model_id], stats.running)
            waiting.add_metric([model_id], stats.waiting)
            kv.add_metric([model_id], stats.kv_usage)
            preempt.add_metric([model_id], stats.preemptions)
            queries.add_metric([model_id], stats.prefix_cache_queries)
            hits.add_metric([model_id], stats.prefix_cache_hits)
            tier_hits.add_metric([model_id, "device"], stats.prefix_cache_hits - stats.host_hits - stats.disk_hits)
            if stats.host_blocks:
                tier_hits.add_metric([model_id, "host"], stats.host_hits)
            if stats.disk_blocks:
                tier_hits.add_metric([model_id, "disk"], stats.disk_hits)
                for direction, n in (("disk_write", stats.disk_written), ("disk_read", stats.disk_read)):
                    moved.add_metric([model_id, direction], n)
                    moved_bytes.add_metric([model_id, direction], n * handle.host_block_bytes)
            if stats.host_blocks:
                for direction, n, secs in (("offload", stats.host_offloaded, stats.host_offload_s),
                                           ("restore", stats.host_restored, stats.host_restore_s)):
                    moved.add_metric([model_id, direction], n)
                    moved_bytes.add_metric([model_id, direction], n * handle.host_block_bytes)
                    move_s.add_metric([model_id, direction], secs)
                    if secs > 0:
                        bandwidth.add_metric([model_id, direction], n * handle.host_block_bytes / secs)
            encodes.add_metric([model_id], stats.image_encodes)
            reuses.add_metric([model_id], stats.image_reuses)
            drafts.add_metric([model_id], stats.spec_drafts)
            drafted.add_metric([model_id], stats.spec_draft_tokens)
            accepted.add_metric([model_id], stats.spec_accepted_tokens)
            for name in STATUSES:
                status.add_metric([model_id, name], 1 if handle.status == name else 0)
            for t in handle.telemetry():
                labels = [model_id, str(t["rank"]), t["device"]]
                used.add_metric(labels, t["memory_used"])
                total.add_metric(labels, t["memory_total"])
                if t.get("utilization", -1) >= 0:
                    util.add_metric(labels, t["utilization"])
                if t.get("temperature_c", -1) >= 0:
                    temp.add_metric(labels, t["temperature_c"])
                if t.get("threads"):
                    threads.add_metric([model_id, str(t["rank"]), t.get("cpu_isa", "")], t["threads"])
        yield from (running, waiting, kv, preempt, queries, hits, tier_hits, moved, moved_bytes, move_s, bandwidth, encodes,
                    reuses, drafts, drafted, accepted, status,
                    used, total, util, temp, threads)


class Metrics:
    def __init__(self, max_principals: int = 100) -> None:
        self.max_principals = max_principals  # named in the series; the rest count as "other"
        self.named: set[str] = set()
        self.registry = r = CollectorRegistry()
        self.engines = _EngineState()
        r.register(self.engines)
        label = ["model_name"]
        self.started = Counter("neuron:requests_started", "Requests handed to an engine", label, registry=r)
        self.success = Counter("neuron:request_success", "Finished requests, by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("neuron:prompt_tokens", "Prompt tokens of finished requests", label,
                                     registry=r)
        self.generation_tokens = Counter("neuron:generation_tokens", "Tokens generated", label, registry=r)
        self.ttft = Histogram("neuron:time_to_first_token_seconds", "From arrival to the first token", label,
                              buckets=_TTFT, registry=r)
        self.itl = Histogram("neuron:inter_token_latency_seconds", "Between consecutive token events", label,
                             buckets=_ITL, registry=r)
        self.e2e = Histogram("neuron:e2e_request_latency_seconds", "From arrival to finish", label,
                             buckets=_REQUEST, registry=r)
        self.queue = Histogram("neuron:request_queue_time_seconds", "From arrival to a place in the batch",
                               label, buckets=_REQUEST, registry=r)
        self.request_prompt = Histogram("neuron:request_prompt_tokens", "Prompt tokens per request", label,
                                        buckets=_TOKENS, registry=r)
        self.request_generation = Histogram("neuron:request_generation_tokens", "Generated tokens per request",
                                            label, buckets=_TOKENS, registry=r)
        who = ["principal"]
        self.principal_requests = Counter("neuron:principal_requests", "Finished requests, by principal (API key)",
                                          who, registry=r)
        self.principal_prompt = Counter("neuron:principal_prompt_tokens", "Prompt tokens, by principal", who,
                                        registry=r)
        self.principal_cached = Counter("neuron:principal_cached_tokens",
                                        "Prompt tokens served from the prefix cache, by principal", who, registry=r)
        self.principal_generation = Counter("neuron:principal_generation_tokens", "Tokens generated, by principal",
                                            who, registry=r)
        self.principal_rejections = Counter("neuron:principal_rejections",
                                            "Requests refused before they ran, by principal and error code",
                                            ["principal", "code"], registry=r)

    def request_started(self, model: str) -> None:
        self.started.labels(model).inc()

    def who(self, principal: str) -> str:
        """``principal`` as a series' label: the first ``max_principals`` names, then "other"."""
        if principal in self.named:
            return principal
        if len(self.named) < self.max_principals:
            self.named.add(principal)
            return principal
        return "other"

    def request_rejected(self, principal: str, code: str) -> None:
        self.principal_rejections.labels(self.who(principal), code).inc()

    def request_finished(self, model: str, req: OutputState, fin: FinishEvent, trace: RequestTrace | None) -> None:
        reason = "error" if fin.error else fin.reason
        self.success.labels(model, reason).inc()
        self.prompt_tokens.labels(model).inc(fin.prompt_tokens)
        self.generation_tokens.labels(model).inc(fin.completion_tokens)
        self.request_prompt.labels(model).observe(fin.prompt_tokens)
        self.request_generation.labels(model).observe(fin.completion_tokens)
        who = self.who(req.wire.principal)
        self.principal_requests.labels(who).inc()
        self.principal_prompt.labels(who).inc(fin.prompt_tokens)
        self.principal_cached.labels(who).inc(fin.cached_tokens)
        self.principal_generation.labels(who).inc(fin.completion_tokens)
        self.e2e.labels(model).observe(time.monotonic() - req.arrival)
        if trace is None:
            return
        if trace.admitted_at is not None:
            self.queue.labels(model).observe(trace.admitted_at - req.arrival)
        times = trace.token_times
        if times:
            self.ttft.labels(model).observe(times[0] - req.arrival)
        itl = self.itl.labels(model)
        for before, after in zip(times, times[1:]):
            itl.observe(after - before)

    def render(self, models: dict[str, Any]) -> bytes:
        self.engines.models = models
        for model in models:  # every model's series from its start, at 0 (the multiprocess mode shows no others)
            for metric in (self.started, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                           self.queue, self.request_prompt, self.request_generation):
                metric.labels(model)
            for reason in FINISH_REASONS:
                self.success.labels(model, reason)
        shared = os.environ.get(MULTIPROCESS_DIR)
        if not shared:
            return generate_latest(self.registry)
        # API processes (``[server] api_processes``): each counts into files of this directory,
        # and any of them answers with the sums over all, the ones that died included.
        registry = CollectorRegistry()
        MultiProcessCollector(registry, shared)
        registry.register(self.engines)
        return generate_latest(registry)

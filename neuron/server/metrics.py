"""Prometheus metrics of the leader."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from neuron.engine.request import FinishEvent, GenRequest

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("neuron_requests", "Requests finished, by outcome", ["model", "outcome"], registry=r)
        self.started = Counter("neuron_requests_started", "Requests admitted", ["model"], registry=r)
        self.prompt_tokens = Counter("neuron_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.generation_tokens = Counter("neuron_generation_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram("neuron_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=_LATENCY, registry=r)
        self.e2e = Histogram("neuron_request_latency_seconds", "End-to-end request latency", ["model"],
                             buckets=_LATENCY, registry=r)
        self.running = Gauge("neuron_running_requests", "Sequences in the batch", ["model"], registry=r)
        self.waiting = Gauge("neuron_waiting_requests", "Requests in the admission queue", ["model"], registry=r)
        self.slots = Gauge("neuron_kv_slots_used", "KV slots in use", ["model"], registry=r)
        self.status = Gauge("neuron_model_status", "1 for the model's current status", ["model", "status"], registry=r)

    def request_started(self, model: str) -> None:
        self.started.labels(model).inc()

    def request_finished(self, model: str, req: GenRequest, fin: FinishEvent) -> None:
        outcome = "error" if fin.error else fin.reason
        self.requests.labels(model, outcome).inc()
        self.prompt_tokens.labels(model).inc(fin.prompt_tokens)
        self.generation_tokens.labels(model).inc(fin.completion_tokens)
        now = time.monotonic()
        if req.first_token_at is not None:
            self.ttft.labels(model).observe(req.first_token_at - req.arrival)
        self.e2e.labels(model).observe(now - req.arrival)

    def render(self, models: dict) -> bytes:
        for model_id, handle in models.items():
            stats = handle.engine.stats()
            self.running.labels(model_id).set(stats.running)
            self.waiting.labels(model_id).set(stats.waiting)
            self.slots.labels(model_id).set(stats.slots_used)
            for status in ("loading", "loaded", "poisoned", "recovering", "failed", "unloading"):
                self.status.labels(model_id, status).set(1 if handle.status == status else 0)
        return generate_latest(self.registry)

"""/metrics: the scheduler's numbers and the requests' latencies in Prometheus' format, through
prometheus_client (a registry of the app's own, so two apps in one process do not share one).

The runtime's counters and gauges are read from `Scheduler.stats()` at each scrape (a collector);
time to first token and time per output token are histograms the handlers feed: the first from
the request's acceptance to its first piece of text (the wait in the queue and the prompt's
evaluation, what a client sees), the second the mean gap between the reply's later tokens.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_ROWS = [  # name, kind, help, stats key
    ("mbolt_budget_bytes", "gauge", "memory budget of the runtime", "budget_bytes"),
    ("mbolt_dense_resident_bytes", "gauge", "dense weights held resident", "dense_resident_bytes"),
    ("mbolt_expert_slots", "gauge", "expert cache slots per layer (decode)", "expert_slots"),
    ("mbolt_expert_cache_hits_total", "counter", "decode: selected experts found in the cache", "cache_hits"),
    ("mbolt_expert_cache_misses_total", "counter", "decode: selected experts read", "cache_misses"),
    ("mbolt_read_bytes_total", "counter", "bytes this process read from the device", "device_read_bytes"),
    ("mbolt_major_faults_total", "counter", "major page faults of this process", "major_faults"),
    ("mbolt_prompt_tokens_total", "counter", "prompt tokens evaluated", "prompt_tokens"),
    ("mbolt_prompt_seconds_total", "counter", "seconds spent evaluating prompts", "prompt_s"),
    ("mbolt_decode_tokens_total", "counter", "tokens decoded", "decode_tokens"),
    ("mbolt_decode_seconds_total", "counter", "seconds spent decoding", "decode_s"),
    ("mbolt_requests_total", "counter", "requests run", "requests"),
    ("mbolt_queue_length", "gauge", "requests waiting", "queue_length"),
    ("mbolt_slots", "gauge", "slots (-np/--parallel): conversations decoded together", "parallel"),
    ("mbolt_slots_busy", "gauge", "slots holding a request", "slots_busy"),
    ("mbolt_tokens_per_second", "gauge", "tokens decoded per second over the last 10 s, all slots", "tokens_per_s_recent"),
    ("mbolt_mixed_passes_total", "counter", "prompt passes that carried replies' decode rows (continuous batching)",
     "mixed_passes"),
    ("mbolt_rows_per_step", "gauge", "mean sequences per decode step (the batch)", "rows_per_step"),
    ("mbolt_prompt_cached_tokens_total", "counter", "prompt tokens not evaluated: a slot's own prefix, a copy from "
     "another slot, a restore from the prompt cache", "cached_tokens"),
    ("mbolt_kv_copies_total", "counter", "prompt prefixes copied from another slot's KV cache", "kv_copies"),
    ("mbolt_prompt_cache_restores_total", "counter", "prompt prefixes restored from the prompt cache on disk",
     "prompt_cache_restores"),
    ("mbolt_prompt_cache_restored_tokens_total", "counter", "prompt tokens restored from the prompt cache",
     "prompt_cache_restored_tokens"),
    ("mbolt_prompt_cache_restore_bytes_total", "counter", "bytes of KV state restored from the prompt cache",
     "prompt_cache_restore_bytes"),
    ("mbolt_prompt_cache_restore_seconds_total", "counter", "seconds spent restoring (read, checksum, load)",
     "prompt_cache_restore_s"),
    ("mbolt_prompt_cache_saves_total", "counter", "KV states saved to the prompt cache", "prompt_cache_saves"),
    ("mbolt_prompt_cache_save_failures_total", "counter", "saves dropped (a full disk, an I/O error)",
     "prompt_cache_save_failures"),
    ("mbolt_prompt_cache_evicted_total", "counter", "files removed to keep the cache within its size",
     "prompt_cache_evicted"),
    ("mbolt_prompt_cache_bytes", "gauge", "bytes of this model's files in the prompt cache", "prompt_cache_bytes"),
    ("mbolt_prompt_cache_size_bytes", "gauge", "--prompt-cache-size", "prompt_cache_size"),
    ("mbolt_expert_union_per_step", "gauge", "mean distinct experts per MoE layer and decode step (the batch's "
     "union: k alone, less than rows x k when the batch shares)", "expert_union_per_step"),
]
_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)


class _Stats:
    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        s = self.stats()
        for name, kind, help_, key in _ROWS:
            v = s.get(key)
            if v is None:
                continue
            fam = CounterMetricFamily(name, help_) if kind == "counter" else GaugeMetricFamily(name, help_)
            fam.add_metric([], float(v))
            yield fam
        per_slot = GaugeMetricFamily("mbolt_slot_tokens_per_second", "tokens decoded per second over the last 10 s, "
                                     "per slot", labels=["slot"])
        for slot in s.get("slots", []):
            per_slot.add_metric([str(slot["id"])], float(slot["tokens_per_s"]))
        yield per_slot
        if "prompt_cache_skipped" in s:
            skipped = CounterMetricFamily("mbolt_prompt_cache_skipped", "prompt cache files skipped, by reason "
                                          "(model, layout, checksum, truncated, format, llama)", labels=["reason"])
            for reason, n in sorted(s["prompt_cache_skipped"].items()):
                skipped.add_metric([reason], float(n))
            yield skipped


class Metrics:
    def __init__(self, stats):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Stats(stats))
        self.ttft = Histogram("mbolt_time_to_first_token_seconds", "from a request's acceptance to its first text",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("mbolt_time_per_output_token_seconds", "mean time per output token after the first, "
                              "per request", buckets=_TPOT_BUCKETS, registry=self.registry)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class Clock:
    """One request's times, fed to the histograms when it ends."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.t0 = time.perf_counter()
        self.first: float | None = None

    def saw(self, kind: str, data) -> None:
        now = time.perf_counter()
        if kind == "text" and self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.t0)
        elif kind == "end" and self.first is not None:
            n = data["usage"]["completion_tokens"]
            if n > 1:
                self.metrics.tpot.observe((now - self.first) / (n - 1))

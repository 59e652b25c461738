"""The broker's Prometheus metrics (``/metrics``), named by Prometheus's conventions: the
``sparecycles_`` prefix, the unit in the name (``_seconds``, ``_bytes``), ``_total`` on
counters, histograms for latencies.

Two kinds of figure, so that several replicas (processes) add up correctly:

* **Events** are counted where they happen, in the process they happen in: HTTP requests,
  jobs submitted, placed and finished, the latency histograms, blob bytes written, ledger
  postings, agent messages. Each replica is its own scrape target (Prometheus labels it
  with ``instance``; ``sparecycles_broker_info{replica=…}`` names it), so ``sum()`` over
  the targets is the broker's figure and a replica that restarts starts its counters at
  zero, which ``rate()`` handles. No multiprocess mode is needed: one replica is one
  process (the asyncio front and its thread pools).
* **States** the replicas share are read from the database at scrape time (jobs in flight
  by state and plugin, the queue's depth and age, ledger transactions by kind, checks by
  status, disputes): the same on every replica, so dashboards take ``max()`` of them, not
  ``sum()``. The reading is a few grouped counts over indexed columns, cached for
  ``db_interval_s``, and runs on the health thread, never on the event loop.

Agents' connections are per replica (each holds its own streams): connected agents and
free slots per plugin are summed over replicas. So are the agents' telemetry series, each
exported by the replica that holds the agent's stream.

The hot path pays a dictionary look-up and a lock-free-ish increment per event:
label children are cached (``labels()`` is not called per request).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

log = logging.getLogger(__name__)
# No ``_created`` series beside each counter and histogram: they double the exposition and
# no dashboard here reads them.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# HTTP answers: a cached GET takes well under a millisecond, a long poll up to 60 s.
HTTP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                  2.5, 5.0, 10.0, 30.0, 60.0)
# Placement: microseconds when a slot is free, the queue's wait otherwise.
PLACEMENT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                       2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
# A job end to end: an echo job in milliseconds, an SDXL image in tens of seconds.
JOB_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0, 300.0, 600.0, 1800.0, 3600.0)
SETTLE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0)


class BrokerMetrics:
    """Every metric of one broker process, in a registry of its own (several brokers in
    one test process do not mix). The job service, the front and the gateway call the
    small methods below; :meth:`render` answers a scrape."""

    def __init__(self, *, replica: str, version: str = "", db_reader=None,
                 db_interval_s: float = 5.0, clock: Callable[[], float] = time.time):
        self.registry = CollectorRegistry(auto_describe=False)
        self.replica = replica
        self.clock = clock
        r = self.registry
        info = Gauge("sparecycles_broker_info", "This broker replica (always 1).",
                     ["replica", "version"], registry=r)
        info.labels(replica, version).set(1)
        self.http_requests = Counter(
            "sparecycles_http_requests_total",
            "HTTP requests answered, by route template, method and status code.",
            ["route", "method", "status"], registry=r)
        self.http_duration = Histogram(
            "sparecycles_http_request_duration_seconds",
            "Time from a request's arrival to its answer's end, by route template and "
            "method (long polls and event streams included: their route tells them apart).",
            ["route", "method"], buckets=HTTP_BUCKETS_S, registry=r)
        self.jobs_submitted = Counter(
            "sparecycles_jobs_submitted_total", "Jobs queued (each sibling of a split "
            "counts; verification checks too), by plugin.", ["plugin"], registry=r)
        self.jobs_finished = Counter(
            "sparecycles_jobs_finished_total", "Jobs that ended, by plugin and end state "
            "(settled, failed, cancelled, refunded).", ["plugin", "state"], registry=r)
        self.job_duration = Histogram(
            "sparecycles_job_duration_seconds", "A job's life from submission to its end, "
            "by plugin and end state.", ["plugin", "state"], buckets=JOB_BUCKETS_S,
            registry=r)
        self.placement = Histogram(
            "sparecycles_job_placement_seconds", "Time a job waited queued before it was "
            "leased to a provider (each attempt), by plugin.", ["plugin"],
            buckets=PLACEMENT_BUCKETS_S, registry=r)
        self.settlement = Histogram(
            "sparecycles_job_settlement_seconds", "Time from a receipt's arrival to the "
            "job settled with its money moved, by plugin.", ["plugin"],
            buckets=SETTLE_BUCKETS_S, registry=r)
        self.blob_bytes = Counter(
            "sparecycles_blob_written_bytes_total", "Bytes written to the broker's blob "
            "stores (job outputs, checkpoints, registry packages), by store.", ["store"],
            registry=r)
        self.ledger_posted = Counter(
            "sparecycles_ledger_postings_total", "Ledger transactions written by this "
            "replica, by kind (an idempotent replay counts again).", ["kind"], registry=r)
        self.earnings = Counter(
            "sparecycles_provider_earnings_credits_total", "Credits posted to providers' "
            "vesting balances when their jobs settled (their share, after the fee).",
            registry=r)
        self.payouts = Counter(
            "sparecycles_payouts_credits_total", "Credits paid out to providers and "
            "publishers.", registry=r)
        self.telemetry_received = Counter(
            "sparecycles_agent_telemetry_reports_total", "Telemetry reports received in "
            "agents' heartbeats.", registry=r)
        # Label children cached: the hot path never calls labels().
        self._children: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self._db = _DatabaseCollector(db_reader, db_interval_s, clock) if db_reader else None
        if self._db is not None:
            r.register(self._db)
        from broker.storage import counting  # the benchmark's statement counts (issue #28)
        if counting.enabled():
            self.add_collector(counting.COUNTS.collect)

    # ---- hot path ------------------------------------------------------------------
    def _child(self, metric, *labels):
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children.get(key)
                if child is None:
                    child = self._children[key] = metric.labels(*labels)
        return child

    def http_request(self, route: str, method: str, status: int, duration_s: float) -> None:
        # Label values a client cannot multiply: known methods, statuses 100-599.
        method = method if method in _METHODS else "other"
        self._child(self.http_requests, route, method, _STATUS.get(status, "other")).inc()
        self._child(self.http_duration, route, method).observe(duration_s)

    # JobMetrics (broker.jobs.ports)
    def submitted(self, plugin: str, n: int = 1) -> None:
        self._child(self.jobs_submitted, plugin).inc(n)

    def placed(self, plugin: str, waited_s: float) -> None:
        self._child(self.placement, plugin).observe(max(0.0, waited_s))

    def ended(self, plugin: str, state: str, age_s: float) -> None:
        self._child(self.jobs_finished, plugin, state).inc()
        self._child(self.job_duration, plugin, state).observe(max(0.0, age_s))

    def settled(self, plugin: str, settle_s: float) -> None:
        self._child(self.settlement, plugin).observe(max(0.0, settle_s))

    def blob_written(self, store: str, n_bytes: int) -> None:
        self._child(self.blob_bytes, store).inc(n_bytes)

    def ledger_transaction(self, kind: str, provider_micro: int = 0, paid_micro: int = 0) -> None:
        self._child(self.ledger_posted, kind).inc()
        if provider_micro > 0:
            self.earnings.inc(provider_micro / 1_000_000)
        if paid_micro > 0:
            self.payouts.inc(paid_micro / 1_000_000)

    # ---- scrape time ---------------------------------------------------------------
    def add_collector(self, collect: Callable[[], Iterable]) -> None:
        """A callable giving metric families at scrape time (the front's and gateway's
        counters, connected agents, agents' telemetry)."""
        self.registry.register(_Callback(collect))

    def render(self) -> bytes:
        """The exposition text of every metric (reads the database when its cached facts
        are older than ``db_interval_s``: call it off the event loop)."""
        return generate_latest(self.registry)


_STATUS = {s: str(s) for s in range(100, 600)}
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class _Callback:
    def __init__(self, collect):
        self._collect = collect

    def collect(self):
        try:
            yield from self._collect()
        except Exception:  # noqa: BLE001 - one bad collector must not blank /metrics
            log.exception("a metrics collector failed")


class _DatabaseCollector:
    """The shared facts (see the module docstring), read at most every ``interval_s``."""

    def __init__(self, reader, interval_s: float, clock):
        self.reader = reader
        self.interval_s = interval_s
        self.clock = clock
        self._facts = None
        self._read_at = float("-inf")
        self._ok = False
        self._lock = threading.Lock()

    def _current(self):
        with self._lock:
            if time.monotonic() - self._read_at >= self.interval_s:
                try:
                    self._facts = self.reader.read()
                    self._ok = True
                except Exception as exc:  # noqa: BLE001 - say so in the metrics
                    log.warning("metrics: reading the database failed: %s", exc)
                    self._ok = False
                self._read_at = time.monotonic()
            return self._facts, self._ok

    def collect(self):
        facts, ok = self._current()
        up = GaugeMetricFamily("sparecycles_metrics_database_up", "1 when the last reading "
                               "of the shared facts from the database succeeded.")
        up.add_metric([], 1.0 if ok else 0.0)
        yield up
        if facts is None:
            return
        read = GaugeMetricFamily("sparecycles_metrics_database_read_seconds",
                                 "What the last reading of the shared facts took.")
        read.add_metric([], facts.read_s)
        yield read
        jobs = GaugeMetricFamily("sparecycles_jobs", "Jobs not yet ended, by state and "
                                 "plugin (shared by all replicas: take max, not sum).",
                                 labels=["state", "plugin"])
        depth: dict[str, int] = {}
        for (state, plugin), n in sorted(facts.jobs.items()):
            jobs.add_metric([state, plugin], n)
            if state == "queued":
                depth[plugin] = n
        yield jobs
        queue = GaugeMetricFamily("sparecycles_queue_depth_jobs", "Jobs queued, waiting "
                                  "for a provider, by plugin.", labels=["plugin"])
        for plugin in sorted(set(depth) | set(facts.oldest_queued_at)):
            queue.add_metric([plugin], depth.get(plugin, 0))
        yield queue
        age = GaugeMetricFamily("sparecycles_queue_oldest_age_seconds", "Age of the oldest "
                                "queued job, by plugin (absent: nothing queued).",
                                labels=["plugin"])
        now = self.clock()
        for plugin, created_at in sorted(facts.oldest_queued_at.items()):
            age.add_metric([plugin], max(0.0, now - created_at))
        yield age
        txns = CounterMetricFamily("sparecycles_ledger_transactions", "Ledger transactions "
                                   "in the database, by kind (all replicas').",
                                   labels=["kind"])
        for kind, n in sorted(facts.ledger_transactions.items()):
            txns.add_metric([kind], n)
        yield txns
        checks = GaugeMetricFamily("sparecycles_verifications", "Verification records by "
                                   "status (unchecked, checking, valid, disputed, invalid, "
                                   "…) and plugin.", labels=["status", "plugin"])
        for (status, plugin), n in sorted(facts.verifications.items()):
            checks.add_metric([status, plugin], n)
        yield checks
        disputes = GaugeMetricFamily("sparecycles_disputes", "Disputes by state and plugin.",
                                     labels=["state", "plugin"])
        for (state, plugin), n in sorted(facts.disputes.items()):
            disputes.add_metric([state, plugin], n)
        yield disputes
        providers = GaugeMetricFamily("sparecycles_providers", "Providers the broker knows, "
                                      "by status (active, paused, banned).",
                                      labels=["status"])
        for status, n in sorted(facts.providers.items()):
            providers.add_metric([status], n)
        yield providers


def agent_families(sessions: Iterable) -> Iterable:
    """Connected agents and their slots per plugin build, from the dispatcher's sessions
    on this replica (``sessions``: AgentSession objects)."""
    connected = GaugeMetricFamily("sparecycles_agents_connected", "Agents whose stream "
                                  "this replica holds (draining and paused included).")
    draining = GaugeMetricFamily("sparecycles_agents_draining", "Connected agents that "
                                 "take no new jobs (draining or paused).")
    slots = GaugeMetricFamily("sparecycles_agent_slots", "Job slots of connected agents, "
                              "by plugin build they serve.", labels=["plugin", "version"])
    free = GaugeMetricFamily("sparecycles_agent_free_slots", "Free job slots of connected "
                             "agents, by plugin build they serve.", labels=["plugin", "version"])
    n = idle = 0
    total: dict[tuple[str, str], int] = {}
    open_: dict[tuple[str, str], int] = {}
    for session in sessions:
        n += 1
        idle += bool(session.draining or session.paused)
        f = max(0, session.free)
        for build in session.plugins:
            key = tuple(build.split("@", 1)) if "@" in build else (build, "")
            total[key] = total.get(key, 0) + session.slots
            open_[key] = open_.get(key, 0) + f
    connected.add_metric([], n)
    draining.add_metric([], idle)
    for key in sorted(total):
        slots.add_metric(list(key), total[key])
        free.add_metric(list(key), open_[key])
    return [connected, draining, slots, free]

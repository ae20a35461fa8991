"""The tracker's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class TrackerMetrics:
    """Prometheus metrics of one tracker (own registry: several trackers may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.applied = Counter("hardelete_tracker_events_applied", "events applied to Redis",
                               registry=r)
        self.skipped = Counter("hardelete_tracker_events_redelivered",
                               "redelivered events skipped by offset", registry=r)
        self.dlq = Counter("hardelete_tracker_dlq", "events sent to the dead-letter topic",
                           ["reason_kind"], registry=r)
        self.facts_failed = Counter("hardelete_tracker_facts_failed",
                                    "dead-letter holds kept in Redis only: their repository's "
                                    "fact log could not take them", registry=r)
        self.incidents = Counter("hardelete_tracker_incidents",
                                 "references for addresses being reaped or reaped", registry=r)
        self.batch = Histogram("hardelete_tracker_batch_seconds", "decode+apply+commit per batch",
                               buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10),
                               registry=r)
        self.lag = Gauge("hardelete_tracker_lag", "highwater - position", ["partition"],
                         registry=r)
        self.progress = Gauge("hardelete_tracker_progress_ms",
                              "Redis-clock ms up to which the partition is applied",
                              ["partition"], registry=r)
        self.unanchored = Counter("hardelete_tracker_anchor_refused",
                                  "anchor records the broker did not take (such a log is known "
                                  "only by its start until one is taken)", registry=r)
        # `hardelete health tracker`: a loop that stopped (stuck on Redis, a rebalance, a
        # hung apply) shows here while its endpoint still answers.
        self.cycle = Gauge("hardelete_tracker_cycle_timestamp_seconds",
                           "when this tracker last completed a cycle of its loop (fetch, "
                           "apply, progress; also on an idle topic)", registry=r)
        self.ticks = Counter("hardelete_tracker_ticks",
                             "signed ticks sent to the services' relays (one per sequenced "
                             "repository and round)", registry=r)
        self.resends = Counter("hardelete_tracker_resends",
                               "ranges of seqs asked for again (a gap holds the horizon back)",
                               registry=r)
        self.clock_stall = Gauge("hardelete_tracker_clock_stall_seconds",
                                 "how far the slot clock of a sequenced repository is ahead of "
                                 "its Redis node's clock, the most of the last tick round (a "
                                 "node clock that stepped back: its horizon waits)", registry=r)
        self.fetch_wait = Gauge("hardelete_tracker_fetch_wait_ms",
                                "longest wait of the next fetch (raised while behind the log's "
                                "end)", registry=r)

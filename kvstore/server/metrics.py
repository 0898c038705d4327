"""Prometheus metrics of a node (docs/design.md §7; listed in docs/operations.md). Names carry their unit last."""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


# From half a millisecond (a local stale Get) to ten seconds (a write waiting out a takeover):
# p50 and p99 of every kind of request fall between two buckets that are at most 2.5x apart.
REQUEST_DURATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """One registry per node, so several nodes in one process (tests) do not collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.commit_latency = Histogram("kvstore_commit_latency_seconds", "WAL batch append+commit time",
                                        ["shard"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.batch_records = Histogram("kvstore_batch_records", "records per committed WAL batch", ["shard"],
                                       buckets=_BATCH_BUCKETS, registry=r)
        self.applied_offset = Gauge("kvstore_applied_offset", "next WAL offset this replica will apply",
                                    ["shard"], registry=r)
        self.end_offset = Gauge("kvstore_end_offset", "last known WAL high watermark", ["shard"], registry=r)
        self.lag_records = Gauge("kvstore_lag_records", "end_offset - applied_offset (markers included)",
                                 ["shard"], registry=r)
        self.w3_rejections = Counter("kvstore_w3_rejections", "WAL records skipped by the acceptance rule",
                                     ["shard"], registry=r)
        self.fencings = Counter("kvstore_fencings", "times this node's writer was fenced", ["shard"], registry=r)
        self.leader_changes = Counter("kvstore_leader_changes", "times this node took leadership", ["shard"],
                                      registry=r)
        self.rebuilds = Counter("kvstore_rebuilds", "local state wiped and rebuilt from the WAL", ["shard"],
                                registry=r)
        self.snapshot_loads = Counter("kvstore_snapshot_loads", "times a replica was loaded from a snapshot",
                                      ["shard"], registry=r)
        self.unknown_outcomes = Counter("kvstore_unknown_outcomes", "WAL batches whose commit outcome was unknown (W7)",
                                        ["shard"], registry=r)
        self.apply_failures = Counter("kvstore_apply_failures",
                                      "committed batches the local store failed to apply (the shard was given up)",
                                      ["shard"], registry=r)
        self.open_txn_age = Gauge("kvstore_open_txn_age_seconds", "age of the open WAL transaction (0: none)",
                                  ["shard"], registry=r)
        self.requests = Counter("kvstore_requests",
                                "gRPC requests by method, status code and ErrorInfo reason ('' when OK)",
                                ["method", "code", "reason"], registry=r)
        # Unary calls only: a stream (Watch) lasts as long as its client wants, not a latency.
        self.request_duration = Histogram("kvstore_request_duration_seconds",
                                          "time from a unary call's arrival to its answer or error, by method and "
                                          "status code", ["method", "code"], buckets=REQUEST_DURATION_BUCKETS_S,
                                          registry=r)
        self.forwarded = Counter("kvstore_forwarded_requests",
                                 "client requests this node sent on to the shard's leader (kvstore.server.forward)",
                                 ["method"], registry=r)
        # A replica that cannot lead (rebuilding, below a truncated log start) leaves its shard's
        # leadership group, and rejoins once it can.
        self.group_leaves = Counter("kvstore_group_leaves",
                                    "times a replica left its shard's leadership group because it cannot lead",
                                    registry=r)
        self.group_rejoins = Counter("kvstore_group_rejoins",
                                     "times a replica rejoined its shard's leadership group once it could lead again",
                                     registry=r)
        # Placement (kvstore.core.placement): every step of a move, and what a learner loaded.
        self.placement_steps = Counter("kvstore_placement_steps",
                                       "placement steps taken here: open (a learner), join (caught up), leave "
                                       "(no longer placed), drop (data removed)", ["step"], registry=r)
        # The placement controller (kvstore.server.controller): its term while it is the controller
        # (0: not the controller), what it recorded, what operators asked that it refused.
        self.controller_term = Gauge("kvstore_placement_controller_term",
                                     "this node's term as the placement controller (0: not the controller)", registry=r)
        self.placement_decisions = Counter("kvstore_placement_decisions",
                                           "records this node appended to the placement log as its controller, "
                                           "by kind", ["kind"], registry=r)
        self.placement_refused = Counter("kvstore_placement_refused_requests",
                                         "operators' drains and moves the controller refused (stale epoch, below R, "
                                         "unknown node or shard)", registry=r)
        self.moves_in_progress = Gauge("kvstore_placement_moves_in_progress",
                                       "copies the placement log has as learners or retiring now", registry=r)
        self.placement_skipped = Gauge("kvstore_placement_log_skipped_records",
                                       "records of the placement log this node's reader skipped (hostile or broken)",
                                       registry=r)
        self.learner_bytes = Counter("kvstore_learner_bytes",
                                     "bytes on disk of replicas when they caught up as learners", registry=r)
        self.shards_held = Gauge("kvstore_shards_held", "replicas this node holds, by placement state", ["state"],
                                 registry=r)
        # Cross-shard transactions (docs/design.md §10; kvstore.server.txns).
        self.txns = Counter("kvstore_txns", "cross-shard transactions this node drove, by the client's outcome: "
                            "committed, aborted (definite), unknown", ["outcome"], registry=r)
        self.txn_recoveries = Counter("kvstore_txn_recoveries",
                                      "prepares in doubt this node's resolvers finished, by the decision learned "
                                      "(unknown: the coordinator did not answer)", ["outcome"], registry=r)
        self.scan_cut_rounds = Counter("kvstore_scan_cut_rounds",
                                       "linearizable multi-shard scan pages read again because something in the page "
                                       "changed between the shards' reads (kvstore.core.cut)", registry=r)
        self.txn_finishes = Counter("kvstore_txn_finishes",
                                    "decisions this node's coordinator shards held past txn_finish_after_ms and "
                                    "resolved again at every participant, by the decision", ["outcome"], registry=r)
        self.txn_decisions_pending = Gauge("kvstore_txn_decisions_pending",
                                           "decisions the coordinator shards this node leads keep until every "
                                           "participant resolved them", registry=r)
        self.txn_in_doubt_age = Gauge("kvstore_txn_in_doubt_oldest_seconds",
                                      "age of the oldest prepared cross-shard transaction at the shards this node "
                                      "leads (0: none)", registry=r)
        self._request_counters: dict[tuple[str, str, str], Any] = {}
        self._request_durations: dict[tuple[str, str], Any] = {}

    def forget_shard(self, shard: int) -> None:
        """A replica dropped by placement: its gauges go (a frozen value would read as a live one);
        its counters stay, since rates over them must not see a reset."""
        label = str(shard)
        for gauge in (self.applied_offset, self.end_offset, self.lag_records, self.open_txn_age):
            with contextlib.suppress(KeyError):
                gauge.remove(label)

    def count_request(self, method: str, code: str, reason: str = "") -> None:
        """`requests{method, code, reason}` += 1, with the labelled child cached: `labels()` takes
        a lock and builds a key on every call, which is measurable on a path run once per request."""
        key = (method, code, reason)
        child = self._request_counters.get(key)
        if child is None:
            child = self._request_counters[key] = self.requests.labels(method=method, code=code, reason=reason)
        child.inc()

    def observe_request(self, method: str, code: str, duration_s: float) -> None:
        """`request_duration{method, code}` observes one unary call (children cached, as above)."""
        key = (method, code)
        child = self._request_durations.get(key)
        if child is None:
            child = self._request_durations[key] = self.request_duration.labels(method=method, code=code)
        child.observe(duration_s)

"""Partition ownership through a Kafka consumer group (DESIGN.md §5): liveness, not safety.

Every member subscribes to the WAL topic in one group; the partitions the group assigns to a
member are the shards it should lead. The group only decides who *should* write: two members
may transiently both believe they own a partition (a paused process, a slow revocation), and
W4 (fencing) plus W2 (expected offsets) keep that harmless.

Choices, each for a reason:

* `cooperative-sticky`: a member joining or leaving moves only the partitions that must move,
  so the other leaders keep writing through a rebalance (no stop-the-world).
* static membership (`group.instance.id` = the node id): a node that crashes and restarts
  within the session timeout gets its partitions back without any rebalance.
* a clean `leave()` unsubscribes before closing: librdkafka then sends LeaveGroup even for a
  static member, so a graceful shutdown hands its partitions over at once instead of after
  the session timeout (measured: 0.25 s instead of ~2 s).
* assigned partitions are paused at once: the group is used for assignment only, nothing is
  fetched through it and no offset is ever committed.
* `client.id` carries the member's advertised address, so any member (or an admin tool) can
  map partitions to addresses with DescribeConsumerGroups, without a side channel.

The member's callbacks run on its own thread; `on_revoked` blocks the rebalance until it
returns (bounded by the caller), so a clean handover lets the old owner finish its batch
before the new owner fences it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from wal.clients import ClientSecurity, client_config

log = logging.getLogger(__name__)

ADDRESS_SEPARATOR = "@"
POLL_INTERVAL_S = 0.05  # also the heartbeat cadence (see _membership) and the delay of a leave
LEAVE_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class Member:
    """One group member as the coordinator sees it."""

    member_id: str  # the static instance id (the node id)
    address: str  # advertised address, from client.id; "" if the member is not one of ours
    partitions: tuple[int, ...]


def client_id(member_id: str, address: str) -> str:
    """The client.id that carries a member's advertised address (see `parse_client_id`)."""
    if ADDRESS_SEPARATOR in member_id or not member_id:
        raise ValueError(f"member id {member_id!r} must be non-empty and must not contain {ADDRESS_SEPARATOR!r}")
    return f"{member_id}{ADDRESS_SEPARATOR}{address}"


def parse_client_id(raw: str) -> tuple[str, str]:
    """(member id, address) from a client.id written by `client_id`; address "" if foreign."""
    member, sep, address = raw.partition(ADDRESS_SEPARATOR)
    return (member, address) if sep else (raw, "")


def owners(members: Iterable[Member]) -> dict[int, Member]:
    """partition -> owning member. The coordinator never assigns a partition twice within one
    generation; if a description ever shows that, neither claim is trusted."""
    seen: dict[int, Member] = {}
    doubled: set[int] = set()
    for member in members:
        for partition in member.partitions:
            if partition in seen:
                doubled.add(partition)
            seen[partition] = member
    for partition in doubled:
        del seen[partition]
    return seen


def group_config(bootstrap_servers: str, group: str, member_id: str, address: str,
                 session_timeout_ms: int, security: ClientSecurity | None = None) -> dict[str, object]:
    # The remaining members learn of a rebalance (a node left or died) at their next heartbeat,
    # so this bounds part of every takeover. librdkafka sends heartbeats only when its main
    # thread wakes up (idle: about every 0.5 s, measured p50 0.48 s with 100 ms asked); the
    # member thread wakes it every POLL_INTERVAL_S, so 100 ms is what it gets.
    heartbeat_ms = max(50, min(100, session_timeout_ms // 5))
    return {
        **client_config(bootstrap_servers, security),
        "group.id": group,
        "group.instance.id": member_id,
        "client.id": client_id(member_id, address),
        "partition.assignment.strategy": "cooperative-sticky",
        "session.timeout.ms": session_timeout_ms,
        "heartbeat.interval.ms": heartbeat_ms,
        # We poll every POLL_INTERVAL_S on a dedicated thread; this only catches a wedged thread.
        "max.poll.interval.ms": max(30_000, session_timeout_ms),
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": False,
        # Troubleshooting: e.g. WAL_GROUP_DEBUG=cgrp logs librdkafka's group state machine.
        **({"debug": os.environ["WAL_GROUP_DEBUG"]} if os.environ.get("WAL_GROUP_DEBUG") else {}),
    }


class GroupMember:
    """The shell: one consumer, one thread, callbacks with the partitions gained and lost.

    `on_assigned(partitions)` is told every gain; `on_revoked(partitions, lost)` every loss
    (`lost`: the group already gave them away, e.g. after our session expired, so there is
    nothing to hand over cleanly); `on_rebalanced()` the end of every rebalance this member
    took part in, also one that changed nothing of its own (the others' assignments may have
    changed). All run on the member's thread.
    """

    def __init__(self, *, bootstrap_servers: str, group: str, topic: str, member_id: str, address: str,
                 session_timeout_ms: int, on_assigned: Callable[[list[int]], None],
                 on_revoked: Callable[[list[int], bool], None],
                 on_rebalanced: Callable[[], None] | None = None, security: ClientSecurity | None = None) -> None:
        self.group = group
        self.topic = topic
        self.member_id = member_id
        self._config = group_config(bootstrap_servers, group, member_id, address, session_timeout_ms, security)
        self._security = security
        self._config["error_cb"] = self._on_error
        self._fatal: KafkaError | None = None
        self._rejoin = threading.Event()
        self._away = threading.Event()  # out of the group on purpose until come_back()
        self._bootstrap_servers = bootstrap_servers
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._on_rebalanced = on_rebalanced
        self._owned: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._joined = threading.Event()  # a first assignment arrived (possibly empty)
        self._thread = threading.Thread(target=self._run, name=f"group-{member_id}", daemon=True)
        self._admin: AdminClient | None = None

    def start(self) -> None:
        self._thread.start()

    @property
    def joined(self) -> bool:
        """True once the group gave this member its first assignment (which may be empty)."""
        return self._joined.is_set()

    @property
    def owned(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._owned)

    def leave(self, timeout_s: float = LEAVE_TIMEOUT_S) -> None:
        """Hand every partition back (revocation callbacks run first) and leave the group."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s + 1)
            if self._thread.is_alive():
                log.warning("group member %s did not leave within %.1fs", self.member_id, timeout_s + 1)

    def step_aside(self) -> None:
        """Leave the group (every partition handed over, revocation callbacks first) and stay
        out until `come_back()`: a consumer group cannot give up one partition alone, and a
        member that cannot serve one of its partitions must not keep it."""
        self._away.set()

    def come_back(self) -> None:
        self._away.clear()

    @property
    def away(self) -> bool:
        return self._away.is_set()

    def rejoin(self) -> None:
        """Start over with a new consumer: for a member the coordinator no longer lists while
        librdkafka believes it is in the group (seen after a broker restart: a fatal
        FENCED_INSTANCE_ID that neither poll() nor error_cb reported)."""
        self._rejoin.set()

    def describe(self, timeout_s: float) -> list[Member]:
        """The group as its coordinator sees it now. Raises KafkaException."""
        if self._admin is None:
            self._admin = AdminClient(client_config(self._bootstrap_servers, self._security,
                                                    **{"client.id": f"{self.member_id}-describe"}))
        try:
            futures = self._admin.describe_consumer_groups([self.group], request_timeout=timeout_s)
            description = futures[self.group].result(timeout=timeout_s + 1)
        except Exception:
            self._admin = None  # a fresh client next time: stale metadata must not stick
            raise
        return [members_from(m, self.topic) for m in description.members]

    # ---- the member thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._away.is_set():
                self._stop.wait(0.1)
                continue
            try:
                self._membership()
            except KafkaException as exc:
                log.warning("group member %s: %s; rejoining in 1s", self.member_id, exc)
                self._give_up_all(lost=True)
                self._stop.wait(1.0)
            except Exception:
                log.exception("group member %s failed; rejoining in 1s", self.member_id)
                self._give_up_all(lost=True)
                self._stop.wait(1.0)

    def _membership(self) -> None:
        consumer = Consumer(self._config)
        try:
            consumer.subscribe([self.topic], on_assign=self._assigned, on_revoke=self._revoked,
                               on_lost=self._lost)
            while not self._stop.is_set() and not self._away.is_set():
                message = consumer.poll(POLL_INTERVAL_S)
                if message is not None and message.error() is not None:
                    log.debug("group member %s: %s", self.member_id, message.error())
                # librdkafka serves its consumer group (heartbeats included) only when its main
                # thread wakes up, for an op or a timer: idle, that is about every 0.5 s whatever
                # heartbeat.interval.ms says. This request is such an op, so heartbeats go out
                # at the configured interval and a rebalance is noticed that much sooner.
                consumer.assignment()
                if self._rejoin.is_set():
                    self._rejoin.clear()
                    raise KafkaException(KafkaError(KafkaError._STATE, "the group does not list this member"))
                fatal, self._fatal = self._fatal, None
                if fatal is not None:
                    # e.g. FENCED_INSTANCE_ID after a broker restart: librdkafka's rejoin raced
                    # its own earlier registration. This consumer is dead; start a new one.
                    raise KafkaException(fatal)
            # Unsubscribe first: it sends LeaveGroup even for a static member, and its
            # revocation callback runs in the polls below. LeaveGroup goes out only after the
            # revocation completed inside librdkafka, which then clears the member id; closing
            # before that ends the consumer without a LeaveGroup, and the others wait out the
            # session timeout (seen: 1.6 s instead of 0.1 s when a slow revocation lost that race).
            leaving = time.monotonic()
            consumer.unsubscribe()
            deadline = leaving + LEAVE_TIMEOUT_S
            while (self.owned or consumer.memberid()) and time.monotonic() < deadline:
                consumer.poll(0.01)  # short: the revocation callback runs inside, then we go
            log.info("group member %s: left the group in %d ms", self.member_id, (time.monotonic() - leaving) * 1000)
        finally:
            self._give_up_all(lost=False)
            consumer.close()

    def _on_error(self, error: KafkaError) -> None:
        """librdkafka reports fatal consumer errors here (not through poll)."""
        if error.fatal():
            self._fatal = error
        else:
            log.debug("group member %s: %s", self.member_id, error)

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign(partitions)
        if partitions:
            consumer.pause(partitions)  # assignment only: never fetch through the group
        gained = sorted(p.partition for p in partitions if p.topic == self.topic)
        with self._lock:
            self._owned.update(gained)
        self._joined.set()
        if gained:
            log.info("group member %s: assigned %s", self.member_id, gained)
            self._on_assigned(gained)
        if self._on_rebalanced is not None:
            self._on_rebalanced()

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._give_up(consumer, partitions, lost=False)

    def _lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._give_up(consumer, partitions, lost=True)

    def _give_up(self, consumer: Consumer, partitions: list[TopicPartition], lost: bool) -> None:
        gone = sorted(p.partition for p in partitions if p.topic == self.topic)
        with self._lock:
            self._owned.difference_update(gone)
        if gone:
            log.info("group member %s: %s %s", self.member_id, "lost" if lost else "revoked", gone)
            self._on_revoked(gone, lost)
        try:
            consumer.incremental_unassign(partitions)
        except KafkaException as exc:  # e.g. the consumer is closing: nothing left to unassign
            log.debug("incremental_unassign: %s", exc)

    def _give_up_all(self, lost: bool) -> None:
        with self._lock:
            gone = sorted(self._owned)
            self._owned.clear()
        if gone:
            self._on_revoked(gone, lost)


def members_from(description: object, topic: str) -> Member:
    """A `Member` from confluent-kafka's MemberDescription (partitions of `topic` only)."""
    member_id, address = parse_client_id(str(getattr(description, "client_id", "")))
    instance = getattr(description, "group_instance_id", None)
    assignment = getattr(description, "assignment", None)
    partitions = tuple(sorted(tp.partition for tp in getattr(assignment, "topic_partitions", None) or []
                              if tp.topic == topic))
    return Member(member_id=instance or member_id, address=address, partitions=partitions)

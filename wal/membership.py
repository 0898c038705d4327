"""Partition ownership through a Kafka consumer group (docs/design.md §6): liveness, not safety.

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
* a loss librdkafka declares by itself is held until the group confirms it (`settle`). Besides
  the coordinator, librdkafka keeps a session timer of its own: no heartbeat *answer* for
  session.timeout.ms and it drops the assignment ("lost"), resets its member id and joins
  again. A broker starved of CPU for longer than the session timeout answers that late, often
  without having removed the member (issue 18, bench/README.md: heartbeat round trips of 1.5 s
  at a run queue of ~300 on 2 cores); the static member's new join then gets its assignment
  back in the same generation, without a rebalance, so nobody else can have been assigned those
  partitions meanwhile: the owner keeps leading them throughout instead of resigning and fencing
  again (a false failover). Back in a new generation they are told as a gain again (the owner
  checks its writers: someone may have fenced it meanwhile); not back within the rebalance
  timeout (`rebalance_timeout_ms`, 30 s), they are given up as before. Safety never rested on the
  group (W4, W2): holding only decides who keeps serving while the group makes up its mind.

The member's callbacks run on its own thread; `on_revoked` blocks the rebalance until it
returns (bounded by the caller), so a clean handover lets the old owner finish its batch
before the new owner fences it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
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
MISSING_LIMIT_S = 5.0  # not listed by the coordinator this long (at least): rejoin (`listed`)
# librdkafka's own timeout of a DescribeConsumerGroups request: far past any wait of ours, so it
# never fires while the client lives. When it fires with the request still waiting for a group
# coordinator, librdkafka frees the request's state under it, and the coordinator's coming back
# then aborts the process (`rd_kafka_enq_once_del_source_return: Assertion eonce->refcnt > 0`:
# librdkafka issues 4605 and 3663, fix in pull request 5397, not in 2.16; nodes exited -6 three
# times in issue 22's campaign). `describe` waits its own bound instead and then destroys the
# client, whose shutdown ends the request while its state is still alive.
DESCRIBE_REQUEST_TIMEOUT_S = 600.0
# Polls further apart than this share of the session timeout are logged: heartbeats then go out
# only on librdkafka's own wake-ups (see _membership), and a stall that long is worth knowing.
POLL_GAP_WARN_SHARE = 1 / 3
# rd_kafka_consumer_group_metadata_write (librdkafka src/rdkafka_cgrp.c): this magic, the
# generation id (int32, host byte order), then the group id, NUL-terminated, then the rest.
CGMD_MAGIC = b"CGMDv2:"


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


def generation_of(metadata: bytes, group: str) -> int | None:
    """The generation id in librdkafka's serialized consumer group metadata (the bytes
    `Consumer.consumer_group_metadata()` returns), or None when the bytes are not that format for
    `group`: then no loss is held (a loss is a loss), never a guessed generation."""
    head = len(CGMD_MAGIC)
    if not metadata.startswith(CGMD_MAGIC) or len(metadata) < head + 5:
        return None
    (generation,) = struct.unpack_from("=i", metadata, head)
    group_id, terminated, _ = metadata[head + 4:].partition(b"\0")
    if not terminated or group_id != group.encode():
        return None
    return int(generation) if generation >= 0 else None


@dataclasses.dataclass(frozen=True)
class Hold:
    """Partitions librdkafka dropped without a rebalance, still led until the group says."""

    partitions: frozenset[int]
    generation: int  # the generation they were assigned in
    deadline: float  # monotonic; no verdict by then and they are given up


@dataclasses.dataclass(frozen=True)
class Settled:
    """What a hold comes to once the group assigned again (`settle`)."""

    kept: frozenset[int]  # back in the same generation: led throughout, nobody hears of it
    regained: frozenset[int]  # back in a new generation: a gain again (someone may have led them)
    released: frozenset[int]  # not back: lost after all


def settle(hold: Hold, assigned: frozenset[int], generation: int | None) -> Settled:
    """The verdict on held partitions, from the next assignment (`assigned`, in `generation`).

    The classic protocol assigns partitions only in a rebalance, and every rebalance starts a new
    generation. So held partitions assigned again in the very generation they were held in were
    never anyone else's: kept, as if nothing happened. Assigned again in a new (or unknown)
    generation, someone else may have been given them and fenced their writer meanwhile:
    regained, told as a gain, so the owner checks it is still the only writer. Not assigned again:
    released, lost after all."""
    back = hold.partitions & assigned
    same = generation is not None and generation == hold.generation
    return Settled(kept=back if same else frozenset(), regained=frozenset() if same else back,
                   released=hold.partitions - back)


def rebalance_timeout_ms(session_timeout_ms: int) -> int:
    """max.poll.interval.ms, which librdkafka also sends as the group's rebalance timeout. We poll
    every POLL_INTERVAL_S on a dedicated thread; this only catches a wedged thread.

    It also bounds how long a lost assignment is held (module docstring). The join that brings it
    back goes to the very coordinator whose slowness caused the loss, so the bound must outlast
    such a stall: broker JVMs starved for ~5 s on 2 shared cores, a coordinator answering nothing
    for 13 s after another broker of three died (bench/README.md, test_three_brokers.py). While
    the coordinator answers no one it assigns nothing to anyone either, and once it answers, a
    rebalance ends within this timeout."""
    return max(30_000, session_timeout_ms)


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
        "max.poll.interval.ms": rebalance_timeout_ms(session_timeout_ms),
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
    changed). All run on the member's thread. A loss librdkafka declares by itself reaches
    `on_revoked` only once the group confirmed it (`settle`); until then the partitions stay in
    `owned`. Given back in the same generation, no callback hears of it; given back in a new one,
    `on_assigned` is told again without an `on_revoked` before: the owner still leads them, but
    someone else may have been given them meanwhile, so it should check its writers.
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
        self._session_timeout_s = session_timeout_ms / 1000
        self._hold_s = rebalance_timeout_ms(session_timeout_ms) / 1000
        # Member thread only: the generation of the current assignment, and a lost one on hold.
        self._generation: int | None = None
        self._hold: Hold | None = None
        self._missing_since: float | None = None  # `listed`: when the coordinator stopped listing us
        self.missing_limit_s = max(MISSING_LIMIT_S, 3 * session_timeout_ms / 1000)
        self.losses_held = 0  # losses librdkafka declared that the group gave back (kept or regained)

    def start(self) -> None:
        self._thread.start()

    @property
    def joined(self) -> bool:
        """True once the group gave this member its first assignment (which may be empty)."""
        return self._joined.is_set()

    @property
    def generation(self) -> int | None:
        """The group generation of the current assignment, as librdkafka last reported it."""
        return self._generation

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

    def listed(self, listed: bool) -> None:
        """Watchdog, fed with every description of the group: the coordinator's word is final. A
        member it has not listed for `missing_limit_s` is not in the group, whatever the local
        consumer believes (a dead consumer librdkafka did not report), so it starts over with a
        new consumer (`rejoin`). Out of the group on purpose (`away`) is not missing."""
        now = time.monotonic()
        if self.away or listed:
            self._missing_since = None
        elif self._missing_since is None:
            self._missing_since = now
        elif now - self._missing_since > self.missing_limit_s:
            log.warning("group %s has not listed %s for %.0fs; rejoining", self.group, self.member_id,
                        now - self._missing_since)
            self.rejoin()
            self._missing_since = None

    def describe(self, timeout_s: float) -> list[Member]:
        """The group as its coordinator sees it now, within `timeout_s`. Raises KafkaException, or
        TimeoutError past the bound (the client is then destroyed: DESCRIBE_REQUEST_TIMEOUT_S)."""
        assert 0 < timeout_s < DESCRIBE_REQUEST_TIMEOUT_S, f"describe bound {timeout_s}s"
        if self._admin is None:
            self._admin = AdminClient(client_config(self._bootstrap_servers, self._security,
                                                    **{"client.id": f"{self.member_id}-describe"}))
        try:
            futures = self._admin.describe_consumer_groups([self.group], request_timeout=DESCRIBE_REQUEST_TIMEOUT_S)
            description = futures[self.group].result(timeout=timeout_s)
        except Exception:
            # A fresh client next time: stale metadata must not stick, and a request still
            # waiting must end with its client, never by librdkafka's timer (above).
            self._admin = None
            raise
        return [members_from(m, self.topic) for m in description.members]

    # ---- the member thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._away.is_set():
                self._stop.wait(0.1)
                continue
            if self._hold is not None and time.monotonic() > self._hold.deadline:
                self._release_hold(f"the group did not assign them again within {self._hold_s:.1f}s")
            try:
                self._membership()
            except KafkaException as exc:
                # The consumer is dead (e.g. FENCED_INSTANCE_ID: librdkafka's rejoin after its own
                # session timeout raced its earlier registration), not necessarily the membership:
                # `_membership` held what it owned, and the next consumer's assignment settles it.
                log.warning("group member %s: %s; rejoining in 1s%s", self.member_id, exc,
                            "" if self._hold is None else f" (still leading {sorted(self._hold.partitions)} "
                                                          "until the group answers)")
                if self._hold is None:
                    self._give_up_all(lost=True)
                self._stop.wait(1.0)
            except Exception:
                log.exception("group member %s failed; rejoining in 1s", self.member_id)
                self._release_hold("the member failed")  # a bug: nothing is held through it
                self._give_up_all(lost=True)
                self._stop.wait(1.0)

    def _membership(self) -> None:
        consumer = Consumer(self._config)
        left = False  # left the group on purpose (stop, step_aside), as opposed to a dead consumer
        try:
            consumer.subscribe([self.topic], on_assign=self._assigned, on_revoke=self._revoked,
                               on_lost=self._lost)
            last, gap_warn_s = time.monotonic(), self._session_timeout_s * POLL_GAP_WARN_SHARE
            while not self._stop.is_set() and not self._away.is_set():
                message = consumer.poll(POLL_INTERVAL_S)
                now = time.monotonic()
                if now - last > gap_warn_s:  # e.g. the GIL held elsewhere that long
                    log.warning("group member %s: %d ms between two polls (asked %d ms, session timeout %d ms)",
                                self.member_id, (now - last) * 1000, POLL_INTERVAL_S * 1000,
                                self._session_timeout_s * 1000)
                last = now
                if self._hold is not None and now > self._hold.deadline:
                    self._release_hold(f"the group did not assign them again within {self._hold_s:.1f}s")
                error = message.error() if message is not None else None
                if error is not None:
                    if is_fatal(error):
                        self._fatal = error
                    log.debug("group member %s: %s", self.member_id, error)
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
            self._release_hold("leaving the group")
            consumer.unsubscribe()
            deadline = leaving + LEAVE_TIMEOUT_S
            while (self.owned or consumer.memberid()) and time.monotonic() < deadline:
                consumer.poll(0.01)  # short: the revocation callback runs inside, then we go
            log.info("group member %s: left the group in %d ms", self.member_id, (time.monotonic() - leaving) * 1000)
            left = True
        finally:
            if left or not self._hold_all():
                self._give_up_all(lost=False)
            try:
                consumer.close()
            except KafkaException as exc:  # a consumer that hit a fatal error may refuse to close cleanly
                log.debug("group member %s: close: %s", self.member_id, exc)

    def _on_error(self, error: KafkaError) -> None:
        """librdkafka reports fatal consumer errors here (not through poll)."""
        if is_fatal(error):
            self._fatal = error
        else:
            log.debug("group member %s: %s", self.member_id, error)

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign(partitions)
        if partitions:
            consumer.pause(partitions)  # assignment only: never fetch through the group
        assigned = frozenset(p.partition for p in partitions if p.topic == self.topic)
        self._generation = self._current_generation(consumer)
        gained = sorted(assigned)
        if self._hold is not None:
            hold, self._hold = self._hold, None
            verdict = settle(hold, assigned, self._generation)
            if verdict.released:
                self._give_up_owned(sorted(verdict.released), lost=True,
                                    why=f"not assigned again after librdkafka dropped them (generation "
                                        f"{hold.generation} -> {self._generation})")
            if verdict.kept:
                self.losses_held += 1
                log.info("group member %s: the group gave %s back in generation %d: librdkafka's session "
                         "timeout was its own, the coordinator never removed this member; led throughout",
                         self.member_id, sorted(verdict.kept), hold.generation)
            if verdict.regained:
                self.losses_held += 1
                log.info("group member %s: the group gave %s back in generation %s (held in %d): still "
                         "leading them, told as a gain so that their writers are checked", self.member_id,
                         sorted(verdict.regained), self._generation, hold.generation)
            gained = sorted(assigned - verdict.kept)
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
        """librdkafka dropped the assignment without a rebalance: its own session timer expired,
        or the coordinator said our member or generation is unknown. Which one only the next
        assignment's generation tells (`settle`), so the partitions are held until then."""
        gone = frozenset(p.partition for p in partitions if p.topic == self.topic)
        if not gone or self._generation is None or self._stop.is_set() or self._away.is_set():
            self._give_up(consumer, partitions, lost=True)
            return
        held = gone | (self._hold.partitions if self._hold is not None else frozenset())
        deadline = time.monotonic() + self._hold_s
        self._hold = Hold(held, self._generation, deadline)
        log.info("group member %s: librdkafka dropped %s (generation %d); still leading them until the group "
                 "assigns them again, at most %.1fs", self.member_id, sorted(gone), self._generation,
                 deadline - time.monotonic())
        try:
            consumer.incremental_unassign(partitions)
        except KafkaException as exc:
            log.debug("incremental_unassign: %s", exc)

    def _current_generation(self, consumer: Consumer) -> int | None:
        try:
            return generation_of(consumer.consumer_group_metadata(), self.group)
        except (KafkaException, RuntimeError, TypeError) as exc:
            log.debug("group member %s: no consumer group metadata: %s", self.member_id, exc)
            return None

    def _hold_all(self) -> bool:
        """A consumer died under us (not a leave): hold what it owned, as a loss librdkafka
        declared by itself is held (`_lost`), so that the next consumer's first assignment settles
        it. True if something is held now; False when nothing can be (stopping, stepping aside,
        no known generation, nothing owned)."""
        if self._stop.is_set() or self._away.is_set():
            return False
        owned = self.owned
        previous = self._hold
        if previous is not None:  # already held (librdkafka's own timeout came first): keep its generation
            self._hold = Hold(previous.partitions | owned, previous.generation, previous.deadline)
            return True
        if not owned or self._generation is None:
            return False
        self._hold = Hold(owned, self._generation, time.monotonic() + self._hold_s)
        log.info("group member %s: its consumer failed; still leading %s until a new one is assigned them again, "
                 "at most %.1fs", self.member_id, sorted(owned), self._hold_s)
        return True

    def _release_hold(self, why: str) -> None:
        if self._hold is not None:
            hold, self._hold = self._hold, None
            self._give_up_owned(sorted(hold.partitions), lost=True, why=why)

    def _give_up_owned(self, gone: list[int], lost: bool, why: str) -> None:
        with self._lock:
            self._owned.difference_update(gone)
        log.info("group member %s: %s %s (%s)", self.member_id, "lost" if lost else "revoked", gone, why)
        self._on_revoked(gone, lost)

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
        self._hold = None  # the held partitions are in _owned: given up with the rest
        self._generation = None
        with self._lock:
            gone = sorted(self._owned)
            self._owned.clear()
        if gone:
            self._on_revoked(gone, lost)


def is_fatal(error: KafkaError) -> bool:
    """A consumer that reported this is dead. librdkafka reports a fenced static member
    (FENCED_INSTANCE_ID) as an error whose code is _FATAL but whose `fatal()` is False
    (confluent-kafka-python issue #869): missed, the member kept a dead consumer, believed itself
    in the group and never rejoined (seen: tests/integration/test_membership_stall.py)."""
    return bool(error.fatal()) or error.code() == KafkaError._FATAL


def members_from(description: object, topic: str) -> Member:
    """A `Member` from confluent-kafka's MemberDescription (partitions of `topic` only)."""
    member_id, address = parse_client_id(str(getattr(description, "client_id", "")))
    instance = getattr(description, "group_instance_id", None)
    assignment = getattr(description, "assignment", None)
    partitions = tuple(sorted(tp.partition for tp in getattr(assignment, "topic_partitions", None) or []
                              if tp.topic == topic))
    return Member(member_id=instance or member_id, address=address, partitions=partitions)

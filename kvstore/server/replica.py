"""One shard's replica: follower, bootstrapping leader, leader with group commit, read barrier.

The I/O shell of the pure core: every decision is the core's (`kvstore.core.role.RoleMachine`
for the leadership's states, what each append outcome leads to and the read barrier;
`kvstore.core.batch` for admission, dedupe and batch planning; `kvstore.core.recovery` when the
WAL and the checkpoint disagree). This module fences, replays, appends, applies and answers, and
reports each result to the machine. The deterministic simulation (tests/sim) drives the same core.

Runs on the server's asyncio loop. Blocking WAL calls (librdkafka) run in worker threads; the
LevelDB store is touched only from the loop thread, so apply and reads never race.

Leader life (DESIGN.md §3-4):
  1. fence: `init_transactions` on the shard's transactional id (W4) -> upcoming offset e;
  2. bootstrap: replay read_committed from the checkpoint up to e (W6), applying with the same
     function as followers; only then accept writes;
  3. group commit: one batch in flight; requests arriving meanwhile form the next batch, bounded
     by count, bytes and a short linger; each request is evaluated against state + the pending
     batch at the revision (offset) its record will get; the batch is appended at that expected
     offset (W1, W2) and applied + answered only after commit (W5);
  4. any abort: fail the batch's requests as retriable and bootstrap again from the partition,
     from the first slot this leader has not seen (the one it assumed its commit marker took);
     unknown outcome: answer "unknown" (W7), fence again (which settles the undecided
     transaction), then bootstrap the same way; fenced: step down.

Once a batch committed its clients get the answers computed before the append, whatever the
local apply then does (the WAL is the truth): a failed apply gives the shard up and rebuilds the
replica. Shutdown never cancels an append in flight: it waits (bounded) and otherwise answers
"unknown outcome"; the producer is closed only once its thread returned.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import wal
import wal.clients
import wal.writer
from kvstore import errors, limits
from kvstore.core.batch import BatchLimits, Write, admit, plan_batch, probe_write
from kvstore.core.evaluate import Response
from kvstore.core.recovery import Beyond, SnapshotOffer, beyond_end, snapshots_to_try
from kvstore.core.role import (
    BROKEN,
    NEEDS_SNAPSHOT,
    REBUILDING,
    Activity,
    AppendDecision,
    AppendOutcome,
    Next,
    Role,
    RoleMachine,
)
from kvstore.core.state import Change, KeyState, decode_entry, effect_key
from kvstore.server import failpoints
from kvstore.server.clock import SYSTEM_CLOCK, Clock
from kvstore.server.config import ReplicaConfig
from kvstore.server.metrics import Metrics
from kvstore.server.storage import ShardStore, StorageError

log = logging.getLogger(__name__)

FOLLOW_POLL_S = 0.1  # a follower notices "lead now" within this (it cannot interrupt a poll)
CATCH_UP_POLL_S = 0.02  # a takeover waits for the tail (often one batch and its marker): poll briskly
REFENCE_PAUSE_S = 1.0  # after being fenced while still assigned the shard, before fencing back
PROGRESS_LOG_S = 2.0  # how often a snapshot load logs its progress
# Kafka's default replica.lag.time.max.ms: for about this long a restarted or newly elected
# partition leader may report a high watermark below what was acknowledged before.
BROKER_REPLICA_LAG_TIME_MAX_MS = 30_000
# How long a checkpoint beyond the partition end must persist before the replica is rebuilt:
# longer than the broker's own window above, so a stale end is waited out, never wiped over.
BEYOND_END_GRACE_S = BROKER_REPLICA_LAG_TIME_MAX_MS / 1000 * 1.5


@dataclasses.dataclass
class _Pending:
    write: Write
    size: int  # request bytes: only pre-bounds a batch (the plan bounds it by WAL-entry bytes)
    future: asyncio.Future[Response]


class Watcher:
    """A bounded queue of changes for one Watch stream; cut off if it falls too far behind."""

    def __init__(self, key: bytes, prefix: bytes) -> None:
        self.key = key
        self.prefix = prefix
        self.queue: asyncio.Queue[tuple[int, Change] | None] = asyncio.Queue(maxsize=limits.WATCH_QUEUE_EVENTS)
        # Per shard: changes below this revision come from WAL history, not from live apply.
        self.live_from: dict[int, int] = {}
        self.overflowed = False

    def matches(self, key: bytes) -> bool:
        return key.startswith(self.prefix) if self.prefix else key == self.key

    def offer(self, shard: int, change: Change) -> None:
        if self.overflowed or not self.matches(change.key) or change.revision < self.live_from.get(shard, 0):
            return
        try:
            self.queue.put_nowait((shard, change))
        except asyncio.QueueFull:
            self.overflowed = True
            self.close()

    def close(self) -> None:
        """End the stream: None is the end-of-stream marker, room is made for it if needed."""
        if self.queue.full():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


class ShardReplica:
    def __init__(self, config: ReplicaConfig, metrics: Metrics, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.clock = clock  # every wait and every time stamp (kvstore.server.clock)
        self.shard = config.shard
        self.metrics = metrics
        self.store = ShardStore(config.data_dir / f"shard-{config.shard}", topic=config.topic, shard=config.shard)
        # A snapshot load cut short (crash) leaves its scratch directory: never trust it.
        shutil.rmtree(self._loading_path(), ignore_errors=True)
        # Every leadership decision: role, term, upcoming offset, why it may not lead.
        self.machine = RoleMachine(config.shard)
        self.caught_up = False  # a follower reached the partition end seen when it started
        self.end_offset = 0  # last known high watermark
        self.watchers: set[Watcher] = set()
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=config.max_pending_writes)
        # Requests a full batch left over (WAL-entry bytes or count): first in the next batch.
        # Bounded by one batch's request count.
        self._carry: collections.deque[_Pending] = collections.deque()
        # The append running in a worker thread, and the requests it will answer.
        self._in_flight: asyncio.Future[wal.AppendResult] | None = None
        # Reasons not to lead are kept by the machine (`RoleMachine.unable`): BROKEN (a committed
        # batch it could not apply: it leads again only after a rebuild caught up, never a loop of
        # leading and failing), REBUILDING, and NEEDS_SNAPSHOT (its checkpoint is below a
        # truncated log start: only a snapshot can rebuild it).
        # Request ids with an attempt queued or committing here (see `write`). Bounded by the
        # queue plus one batch.
        self._ids_in_progress: set[str] = set()
        self._writer: wal.ShardWriter | None = None
        self._txn_started: float | None = None
        self._applied = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._standby = True
        # Wakes the replica loop: a write was queued, leadership was gained or given up, stop.
        self._work = asyncio.Event()
        self._lead_task: asyncio.Task[None] | None = None
        self._tail: wal.Replayer | None = None  # the standby's reader, handed to a takeover
        self._spare: wal.ShardWriter | None = None  # the standby's prepared writer, ditto
        self._round: asyncio.Future[int] | None = None
        self._round_task: asyncio.Task[None] | None = None
        self._probing = False
        self.ends = wal.clients.PartitionEnds(config.bootstrap_servers, config.call_timeout_s, config.kafka_security)
        # W3 rejections already counted, per replayer: each one counts from 0 (a bootstrap or a
        # takeover opens a new one), and a counter only goes up.
        self._counted_replayer: wal.Replayer | None = None
        self._seen_rejected = 0
        self._end_fresh = True  # the last end `_confirm_beyond_end` returned was read, not kept
        # Where the leader is, for "not the leader" answers; the node sets it (group view).
        self.leader_hint: Callable[[], str] = lambda: ""
        # Told (shard, reason) when this replica cannot lead (it must leave the assignment so
        # that another node leads) and (shard, None) once it can again; the node sets it.
        self.on_unable_to_lead: Callable[[int, str | None], None] = lambda shard, reason: None
        label = str(self.shard)
        for family in (metrics.w3_rejections, metrics.fencings, metrics.leader_changes, metrics.rebuilds,
                       metrics.snapshot_loads):
            family.labels(shard=label)  # export zeros from the start, so rates and alerts work
        metrics.applied_offset.labels(shard=label).set(self.store.applied_offset)
        if self.store.rebuilt_reason:
            metrics.rebuilds.labels(shard=label).inc()

    @property
    def role(self) -> Role:
        return self.machine.role

    @property
    def term(self) -> int:
        return self.machine.term

    @property
    def _stopping(self) -> bool:
        return self.machine.stopping

    @property
    def _want_lead(self) -> bool:
        return self.machine.want_lead

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, lead: bool, standby: bool = True) -> None:
        """Run the replica: lead while `lead` (see `set_lead`), otherwise follow the shard if
        `standby` (so a takeover replays only a short tail) or stay idle at its checkpoint."""
        self.machine.set_lead(lead)
        self._standby = standby
        self._tasks.append(asyncio.create_task(self._run(), name=f"shard-{self.shard}"))

    def set_lead(self, lead: bool) -> None:
        """Gain (or drop, without waiting) leadership; the replica loop acts on it."""
        unable = self.machine.set_lead(lead)
        if unable is not None:
            log.warning("shard %d: not taking leadership: %s", self.shard, unable)
            self.on_unable_to_lead(self.shard, unable)
            return
        self._work.set()

    async def resign(self, timeout_s: float) -> None:
        """Stop leading: the batch in flight finishes and is answered, queued writes are refused
        (UNAVAILABLE, retriable elsewhere), and nothing more is written. Bounded by `timeout_s`."""
        self.machine.set_lead(False)
        self._work.set()
        task = self._lead_task
        if task is not None and not task.done():
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                log.warning("shard %d: still leading %.1fs after resigning", self.shard, timeout_s)

    async def stop(self) -> None:
        """Graceful: stop taking writes, let the batch in flight finish and answer its clients."""
        self.machine.stop()
        self._work.set()
        bound_s = self.config.call_timeout_s * 2
        _done, pending = await asyncio.wait(self._tasks, timeout=bound_s) if self._tasks else (set(), set())
        if pending:  # wedged in a WAL call past its own timeouts: cut it off
            log.warning("shard %d: replica loop did not stop within %.1fs; cancelling", self.shard, bound_s)
            # Cancelling never stops an append's thread, and its batch may still commit: the
            # append answers its clients "unknown outcome" (W7) as it is cancelled, and the
            # leader closes its producer only after the thread returned (_close_writer).
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self._fail_queued(errors.UnavailableError(f"shard {self.shard}: node shutting down"))
        await self._close_tail()
        self.machine.stopped()
        for watcher in list(self.watchers):
            watcher.close()
        if self._writer is not None:
            await asyncio.to_thread(self._writer.close)
        await self._close_spare()
        self.store.close()

    async def _run(self) -> None:
        backoff = 0.2
        while (activity := self.machine.next_activity(self._standby)) is not Activity.EXIT:
            try:
                if activity is Activity.REBUILD:
                    await self._start_rebuild()
                    continue
                if activity is Activity.LEAD:
                    self._lead_task = asyncio.create_task(self._lead(), name=f"shard-{self.shard}-lead")
                    try:
                        await self._lead_task
                    finally:
                        self._lead_task = None
                    # Fenced while still asked to lead: someone else (a zombie, `kvstore fence`)
                    # took the shard. Pause before taking it back, so two nodes that both
                    # believe they lead do not fence each other in a tight loop.
                    pause_until = self.clock.monotonic() + REFENCE_PAUSE_S
                    while self._want_lead and not self._stopping and self.clock.monotonic() < pause_until:
                        await self.clock.sleep(0.05)
                elif activity is Activity.FOLLOW:
                    await self._follow()
                else:
                    self.caught_up = True  # idle at its checkpoint: catches up when it leads
                    await self._wait_work(1.0)
                backoff = 0.2
            except asyncio.CancelledError:
                raise
            except (wal.WalError, errors.StoreError) as exc:  # expected now and then: say it in a line
                log.warning("shard %d: %s; retrying in %.1fs", self.shard, exc, backoff)
                await self.clock.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:
                log.exception("shard %d: replica loop failed; retrying in %.1fs", self.shard, backoff)
                await self.clock.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _start_rebuild(self) -> None:
        """A committed batch could not be applied (disk full, I/O error): this replica no longer
        matches the WAL. Wipe it; following then replays the shard, and once it caught up the
        replica may lead again. If the wipe itself fails, the loop retries with backoff."""
        reason = self.machine.unable[BROKEN]
        self.caught_up = False
        self.machine.mark_unable(REBUILDING, f"rebuilding after: {reason}")
        self.store.wipe(f"a committed batch could not be applied: {reason}")
        self.metrics.rebuilds.labels(shard=str(self.shard)).inc()
        self.machine.clear_unable(BROKEN)

    def _rebuilt(self) -> None:
        if REBUILDING in self.machine.unable:
            log.info("shard %d: rebuilt at offset %d", self.shard, self.store.applied_offset)
            if self.machine.clear_unable(REBUILDING):
                self.on_unable_to_lead(self.shard, None)

    async def _wait_work(self, timeout_s: float) -> None:
        """Until something changed (see `_work`) or `timeout_s` passed."""
        self._work.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._work.wait(), timeout_s)

    # ---- follower ------------------------------------------------------------------------------

    async def _follow(self) -> None:
        """Tail the partition read_committed and apply, with the same function as bootstrap."""
        # This node may have led the shard: read the marker slot it assumed, as every replica does.
        self.store.rewind_unverified()
        if self.store.applied_offset == 0:
            await self._restore(0, "the replica is empty")
        replayer: wal.Replayer | None = await asyncio.to_thread(self._replayer)
        assert replayer is not None
        try:
            end = await asyncio.to_thread(replayer.end_offset)
            await self._prepare_spare()
            if self.store.applied_offset > end:
                end = await self._confirm_beyond_end(end, replayer.end_offset)
                if self.store.applied_offset > end:
                    self._wipe_beyond_end(end)
                    replayer.seek(0)
            while not self._stopping and not self._want_lead and BROKEN not in self.machine.unable:
                try:
                    records = await asyncio.to_thread(replayer.poll_payloads, FOLLOW_POLL_S)
                except wal.OffsetOutOfRangeError as exc:
                    await self._out_of_range(exc, replayer)
                    continue
                self._apply_replayed(records, replayer)
                if replayer.position >= end:
                    self.caught_up = True
                    self._rebuilt()
            if self._want_lead and not self._stopping:
                # Hand the warm reader to the takeover: its bootstrap continues from here
                # instead of opening a new consumer (saves a close, a connect and a first fetch).
                self._tail, replayer = replayer, None
        finally:
            if replayer is not None:
                await asyncio.to_thread(replayer.close)

    async def _out_of_range(self, exc: wal.OffsetOutOfRangeError, replayer: wal.Replayer) -> None:
        """The WAL no longer covers our position (auto.offset.reset=error: never a silent jump).

        Below the log start the records we need were truncated: only a snapshot can rebuild this
        replica, so say so and stay behind. Above the end: wait (bounded) for the end to catch
        up, as after a broker restart; if it does not, the WAL was recreated: rebuild from 0."""
        if exc.below_start:
            if await self._restore(exc.log_start, f"the WAL starts at {exc.log_start}, above the checkpoint "
                                                  f"{self.store.applied_offset} (truncated)"):
                if self.machine.clear_unable(NEEDS_SNAPSHOT):
                    self.on_unable_to_lead(self.shard, None)
                await asyncio.to_thread(replayer.seek, self.store.applied_offset)
                return
            why = (f"shard {self.shard}: the WAL was truncated at offset {exc.log_start}, above this replica's "
                   f"checkpoint {self.store.applied_offset}; it can only be rebuilt from a snapshot taken at or "
                   f"after {exc.log_start}")
            if NEEDS_SNAPSHOT not in self.machine.unable:
                log.error("%s; not leading it", why)
                # Leading from here would serve a state missing everything below the log start,
                # and retrying leadership would loop: leave the shard to a node that can.
                self.machine.mark_unable(NEEDS_SNAPSHOT, why)
                self.on_unable_to_lead(self.shard, why)
            raise errors.UnavailableError(why)
        end = await self._confirm_beyond_end(exc.log_end, replayer.end_offset)
        if self.store.applied_offset > end:
            self._wipe_beyond_end(end)
        await asyncio.to_thread(replayer.seek, self.store.applied_offset)

    # ---- snapshots -----------------------------------------------------------------------------

    def _loading_path(self) -> Path:
        return self.store.path.with_name(self.store.path.name + ".snapshot-load")

    async def _restore(self, at_least: int, why: str) -> bool:
        """Replace this replica by the newest usable snapshot whose cut is at least `at_least`
        and beyond its checkpoint (`kvstore serve --snapshot-dir`); True if one was loaded.

        Usable: complete, of this topic, and not beyond the partition's end (a cut beyond it is
        of another WAL, e.g. a recreated topic). One that does not load to its own digest is
        skipped for the next older one. The load runs into a scratch directory while this
        replica keeps serving what it has; the swap is one step on the event loop.
        """
        root = self.config.snapshot_dir
        if root is None:
            return False
        from kvstore.server import snapshot  # pyarrow: only nodes that use snapshots pay for it

        try:
            found = await asyncio.to_thread(snapshot.list_snapshots, root)
        except snapshot.SnapshotFormatError as exc:
            log.warning("shard %d: %s; cannot look for a snapshot: %s", self.shard, why, exc)
            return False
        end = await asyncio.to_thread(self.ends.high_watermark, self.config.topic, self.shard)
        manifests = {name: manifest for manifest, name in found if manifest is not None}
        offers = [SnapshotOffer(name, None) if manifest is None else
                  SnapshotOffer(name, manifest.topic, manifest.shard(self.shard).offset,
                                manifest.shard(self.shard).keys) for manifest, name in found]
        usable, notes = snapshots_to_try(offers, topic=self.config.topic, at_least=at_least,
                                         applied=self.store.applied_offset, end=end)
        for note in notes:
            log.warning("shard %d: %s: %s", self.shard, why, note)
        for offer in usable:
            manifest, cut = manifests[offer.name], offer.cut
            log.info("shard %d: %s: loading snapshot %s (cut %d, %d keys)", self.shard, why, manifest.name, cut,
                     manifest.shard(self.shard).keys)
            started = self.clock.monotonic()
            try:
                loaded = await asyncio.to_thread(self._load_snapshot, root, manifest)
            except (snapshot.SnapshotFormatError, OSError, StorageError) as exc:
                log.warning("shard %d: snapshot %s is unusable: %s", self.shard, manifest.name, exc)
                continue
            self._swap_in(loaded)
            elapsed = self.clock.monotonic() - started
            keys = manifest.shard(self.shard).keys
            log.info("shard %d: loaded snapshot %s: %d keys in %.1fs (%.0f keys/s); replaying the WAL from %d",
                     self.shard, manifest.name, keys, elapsed, keys / max(elapsed, 1e-6), cut)
            self.metrics.snapshot_loads.labels(shard=str(self.shard)).inc()
            self.metrics.applied_offset.labels(shard=str(self.shard)).set(cut)
            return True
        return False

    def _load_snapshot(self, root: str, manifest: Any) -> Path:
        """In a worker thread: the snapshot into a scratch store next to ours; returns its path."""
        from kvstore.server import snapshot

        path = self._loading_path()
        shutil.rmtree(path, ignore_errors=True)
        scratch = ShardStore(path, topic=self.config.topic, shard=self.shard)
        total = manifest.shard(self.shard).keys
        last_log = [self.clock.monotonic()]

        def progress(keys: int, requests: int) -> None:
            if self.clock.monotonic() - last_log[0] >= PROGRESS_LOG_S:
                last_log[0] = self.clock.monotonic()
                log.info("shard %d: loading snapshot %s: %d of %d keys, %d request ids", self.shard, manifest.name,
                         keys, total, requests)

        try:
            snapshot.load_into(scratch, root, manifest, on_progress=progress)
        except BaseException:
            scratch.close()
            shutil.rmtree(path, ignore_errors=True)
            raise
        scratch.close()
        return path

    def _swap_in(self, loaded: Path) -> None:
        """Make the loaded scratch store this replica's (on the event loop: no read or apply
        runs in between). A crash in here leaves no directory or a complete one: both are safe
        (an empty replica loads again)."""
        path = self.store.path
        self.store.close()
        shutil.rmtree(path)
        os.replace(loaded, path)
        self.store = ShardStore(path, topic=self.config.topic, shard=self.shard)
        if self.store.rebuilt_reason:
            raise StorageError(f"shard {self.shard}: the loaded snapshot did not reopen: {self.store.rebuilt_reason}")

    def _replayer(self) -> wal.Replayer:
        return wal.Replayer(self.config.bootstrap_servers, self.config.topic, self.shard, self.store.applied_offset,
                            call_timeout_s=self.config.call_timeout_s, security=self.config.kafka_security)

    def _apply_replayed(self, records: list[tuple[int, bytes]], replayer: wal.Replayer) -> None:
        """Apply one fetch of accepted records (offset, payload: `Replayer.poll_payloads`) with
        the replayer's position as the new checkpoint. Changes are built only for watchers: a
        bootstrap applies millions of effects that nobody watches (`Applied.changes`)."""
        if replayer is not self._counted_replayer:
            self._counted_replayer, self._seen_rejected = replayer, 0
        rejected = replayer.stats.rejected
        if rejected > self._seen_rejected:
            self.metrics.w3_rejections.labels(shard=str(self.shard)).inc(rejected - self._seen_rejected)
            self._seen_rejected = rejected
        if replayer.position <= self.store.applied_offset and not records:
            return
        applied = self.store.apply(records, replayer.position)
        self._after_apply(applied.changes if self.watchers else [])

    def _after_apply(self, changes: list[Change]) -> None:
        applied_offset = self.store.applied_offset
        self.metrics.applied_offset.labels(shard=str(self.shard)).set(applied_offset)
        self.end_offset = max(self.end_offset, applied_offset)
        for change in changes:
            for watcher in list(self.watchers):
                watcher.offer(self.shard, change)
        self._applied.set()
        self._applied = asyncio.Event()

    # ---- leader --------------------------------------------------------------------------------

    def writer_config(self) -> wal.WriterConfig:
        return writer_config(self.config)

    def check_fenced(self) -> bool:
        """Told that someone may have fenced us: write an empty probe entry; if we were fenced
        it fails and the leader steps down (and takes the shard back if still assigned).
        False if this replica does not lead."""
        if self.role is not Role.LEADING:
            return False
        self._probe()
        return True

    async def _prepare_spare(self) -> None:
        """A standby keeps a connected writer that has not fenced anyone (`ShardWriter.prepare`):
        a takeover then fences in ~10 ms instead of ~65 ms, or ~0.5 s when a brand-new
        producer's first coordinator lookup races its connection."""
        if self._spare is not None:
            return
        spare = wal.ShardWriter(self.writer_config())
        try:
            await asyncio.to_thread(spare.prepare)
        except wal.WalError as exc:  # the takeover will connect by itself
            log.debug("shard %d: no spare writer: %s", self.shard, exc)
            await asyncio.to_thread(spare.close)
            return
        self._spare = spare

    async def _close_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            await asyncio.to_thread(spare.close)

    async def _lead(self) -> None:
        machine = self.machine
        machine.begin_fencing()
        writer, self._spare = self._spare or wal.ShardWriter(self.writer_config()), None
        self._writer = writer
        started = self.clock.monotonic()
        try:
            end = await asyncio.to_thread(writer.fence)  # W4
            fenced = self.clock.monotonic()
            if not machine.fenced(end):
                return  # resigned while fencing: the next owner fences us in turn
            self.metrics.leader_changes.labels(shard=str(self.shard)).inc()
            writer.identity = wal.WriterIdentity(self.config.node_id, machine.term)
            await self._catch_up(end)  # W6
            if not machine.replayed_to(end):
                return
            self.caught_up = True
            log.info("shard %d: leading at offset %d (term %d) after fencing %d ms, bootstrap %d ms", self.shard,
                     end, machine.term, (fenced - started) * 1000, (self.clock.monotonic() - fenced) * 1000)
            await self._commit_loop(writer)
        finally:
            machine.step_down()
            machine.stepped_down()
            self._fail_queued(errors.UnavailableError(f"shard {self.shard}: leadership lost; retry"))
            self._writer = None
            await self._close_tail()
            await self._close_writer(writer)

    async def _close_writer(self, writer: wal.ShardWriter) -> None:
        """Close the producer only once no append runs on it: closing under a running
        commit_transaction would turn a commit that may still succeed into a crash or a hang."""
        in_flight = self._in_flight
        if in_flight is not None and not in_flight.done():
            bound_s = self.config.call_timeout_s * 2
            done, _ = await asyncio.wait({in_flight}, timeout=bound_s)
            if not done:
                log.warning("shard %d: an append is still running after %.1fs; its producer is left open "
                            "(the next leader's init_transactions settles its transaction)", self.shard, bound_s)
                return
        await asyncio.to_thread(writer.close)

    async def _catch_up(self, end: int) -> None:
        """Replay read_committed from the checkpoint up to `end` (bounded by bootstrap_timeout_s)."""
        self.store.rewind_unverified()  # a marker slot this node assumed when it led before
        if self.store.applied_offset == 0 and end > 0:
            await self._restore(0, "the replica is empty")
        if self.store.applied_offset > end:
            later = await self._confirm_beyond_end(
                end, lambda: self.ends.high_watermark(self.config.topic, self.shard))
            if self.store.applied_offset <= later:  # the end was stale; ours (the upcoming offset) too
                raise errors.UnavailableError(f"shard {self.shard}: partition end moved from {end} to {later} "
                                              "while taking over; taking over again")
            self._wipe_beyond_end(end)
        if self.store.applied_offset >= end:
            await self._close_tail()
            return
        replayer, self._tail = self._tail, None
        if replayer is None or replayer.position != self.store.applied_offset:
            if replayer is not None:
                await asyncio.to_thread(replayer.close)
            replayer = await asyncio.to_thread(self._replayer)
        deadline = self.clock.monotonic() + self.config.bootstrap_timeout_s
        try:
            while replayer.position < end and self._want_lead and not self._stopping:
                if self.clock.monotonic() > deadline:
                    raise errors.UnavailableError(
                        f"shard {self.shard}: bootstrap stuck at {replayer.position} of {end}")
                try:
                    records = await asyncio.to_thread(replayer.poll_payloads, CATCH_UP_POLL_S)
                except wal.OffsetOutOfRangeError as exc:
                    await self._out_of_range(exc, replayer)
                    continue
                self._apply_replayed(records, replayer)
        finally:
            await asyncio.to_thread(replayer.close)

    async def _confirm_beyond_end(self, end: int, read_end: Callable[[], int]) -> int:
        """A checkpoint beyond the partition's end means the WAL was recreated, or that a
        restarted broker reports a stale high watermark for a moment (it reloads it from a
        periodic checkpoint). Wait, bounded, for the end to catch up before concluding
        (`kvstore.core.recovery.beyond_end`); returns the last end read."""
        deadline = self.clock.monotonic() + BEYOND_END_GRACE_S
        fresh = True  # the end in hand was read by the last attempt, not kept from an earlier one
        while self.store.applied_offset > end and self.clock.monotonic() < deadline and not self._stopping:
            await self.clock.sleep(0.5)
            try:
                end = await asyncio.to_thread(read_end)
                fresh = True
            except Exception as exc:  # the broker is coming back: keep the last value, ask again
                log.debug("shard %d: reading the partition end: %s", self.shard, exc)
                fresh = False
        self._end_fresh = fresh
        return end

    def _wipe_beyond_end(self, end: int) -> None:
        """Our checkpoint is beyond the partition: the WAL was recreated. Never trust it."""
        verdict = beyond_end(self.store.applied_offset, end, end_fresh=self._end_fresh, stopping=self._stopping)
        if verdict is Beyond.NO:
            return
        if verdict is Beyond.UNCONFIRMED:
            raise errors.UnavailableError(f"shard {self.shard}: checkpoint {self.store.applied_offset} beyond the "
                                          f"partition end {end}, unconfirmed (end unreadable or stopping)")
        self.store.wipe(f"checkpoint {self.store.applied_offset} beyond WAL end {end}")
        self.metrics.rebuilds.labels(shard=str(self.shard)).inc()

    async def _close_tail(self) -> None:
        tail, self._tail = self._tail, None
        if tail is not None:
            await asyncio.to_thread(tail.close)

    async def _commit_loop(self, writer: wal.ShardWriter) -> None:
        while self.machine.may_start_batch():
            if self._queue.empty() and not self._carry:
                await self._wait_work(1.0)
                continue
            # Left over from a full batch first (their order kept), then the queue. The request
            # sizes only pre-bound the batch; the plan bounds it by WAL-entry bytes.
            batch = [self._carry.popleft() for _ in range(min(len(self._carry), self.config.max_batch_records))]
            if not batch:
                batch.append(self._queue.get_nowait())
            size = sum(item.size for item in batch)
            try:
                if self.config.linger_ms > 0 and self._queue.empty() and not self._carry:
                    await self.clock.sleep(self.config.linger_ms / 1000)
                while (len(batch) < self.config.max_batch_records and size < self.config.max_batch_bytes
                       and not self._queue.empty()):
                    item = self._queue.get_nowait()
                    batch.append(item)
                    size += item.size
                if not self.machine.may_start_batch():
                    return  # resigned while lingering: the finally below refuses the batch
                if not await self._commit_batch(writer, batch):
                    return  # leadership lost: _run decides what next
            finally:
                # Left (resigned, stopping, cancelled) before the batch was appended: say so
                # instead of hanging. Nothing of it was written, so a retry anywhere is safe.
                for pending in batch:
                    _answer(pending.future, errors.UnavailableError(
                        f"shard {self.shard}: leadership moving or node stopping; retry"))

    async def _commit_batch(self, writer: wal.ShardWriter, batch: list[_Pending]) -> bool:
        """Plan (`kvstore.core.batch`), append, apply, answer. False when this node must stop
        leading. Writes the plan carries over are taken out of `batch` and go first into the
        next one; the rest of `batch` is answered here."""
        machine = self.machine
        assert machine.upcoming is not None
        live = [p for p in batch if not p.future.done()]  # a client that gave up (deadline) is not written
        limits_ = writer.config
        plan = plan_batch([p.write for p in live], machine.upcoming, self.store.get, self.store,
                          self.clock.unix_ms(),
                          BatchLimits(limits_.max_batch_records, limits_.max_batch_bytes, limits_.max_record_bytes))
        # Refusals and replays are definite and independent of the append: answer them now.
        for index, answer in plan.now:
            _answer(live[index].future, answer)
        carried = [live[i] for i in plan.carry]
        self._carry.extendleft(reversed(carried))
        batch[:] = [live[i] for i, _ in plan.after_commit]  # the caller's clean-up answers only these
        if plan.payloads:
            machine.batch_started(plan.revision, len(plan.payloads))
            result = await self._append(writer, plan.payloads, plan.revision, batch)
            if result is None:
                return machine.may_start_batch()
            try:
                apply_error = self._apply_committed(result, plan.payloads)
            finally:
                # Committed: the clients get the answers computed before the append, whatever
                # the local apply did, even a bug raising here (W7: the WAL is the truth; the
                # replica is rebuilt from it). Nothing below may answer "nothing written".
                for index, response in plan.after_commit:
                    _answer(live[index].future, response)
            # The machine's bookkeeping (and its paired W2 assertions) only after every client
            # has its committed answer: should it raise, this leadership ends (the loop starts
            # over and replays from the checkpoint), but no committed write is reported failed.
            failpoints.check("bookkeeping-after-commit")
            machine.batch_committed(result.offsets, result.upcoming_offset)
            if apply_error is not None:
                self._give_up_after_apply_failure(apply_error)
                return False
            return True
        if plan.after_commit:
            # Read-only Txns saw committed state only; a barrier makes their answer linearizable.
            try:
                await self.barrier()
            except errors.StoreError as exc:
                for pending in batch:
                    _answer(pending.future, exc)
                return machine.may_start_batch()
            for index, response in plan.after_commit:
                _answer(live[index].future, response)
        return True

    async def _append(self, writer: wal.ShardWriter, payloads: list[bytes], revision: int,
                      waiting: list[_Pending]) -> wal.AppendResult | None:
        """Append one batch; None when it failed (its clients are answered then, and the
        machine decided what follows)."""
        self._txn_started = self.clock.monotonic()
        started = self.clock.monotonic()
        # The thread is shielded: cancelling this task (a shutdown past its bound) must not
        # make the append look finished while librdkafka may still commit it.
        in_flight = self._in_flight = asyncio.ensure_future(asyncio.to_thread(writer.append, payloads, revision))
        try:
            result = await asyncio.shield(in_flight)
        except asyncio.CancelledError:
            self._fail_batch(self.machine.batch_failed(AppendOutcome.CANCELLED), waiting, "")
            raise
        except wal.WalError as exc:
            await self._on_append_error(exc, waiting)
            return None
        except Exception as exc:
            # Not the WAL's word (a bug, a client library error): commit_transaction may have
            # run, so the outcome is unknown (W7); the loop restarts this leadership.
            self._fail_batch(self.machine.batch_failed(AppendOutcome.CRASHED), waiting, f"{type(exc).__name__}")
            raise
        finally:
            self._txn_started = None
        self.metrics.commit_latency.labels(shard=str(self.shard)).observe(self.clock.monotonic() - started)
        self.metrics.batch_records.labels(shard=str(self.shard)).observe(len(payloads))
        return result

    def _fail_batch(self, decision: AppendDecision, waiting: list[_Pending], detail: str) -> None:
        if decision.unknown:
            self.metrics.unknown_outcomes.labels(shard=str(self.shard)).inc()
        if decision.fencing:
            self.metrics.fencings.labels(shard=str(self.shard)).inc()
        error = decision.error(self.shard, detail)
        for pending in waiting:
            _answer(pending.future, error)

    def _apply_committed(self, result: wal.AppendResult, payloads: list[bytes]) -> Exception | None:
        """W5: apply a committed batch at the offsets its records were delivered at (checked by
        the guard before the commit, W2; the machine's paired check follows the answers), with
        the new checkpoint. Returns the error instead of raising: the batch is committed either
        way."""
        try:
            failpoints.check("apply-after-commit")
            # The marker's slot is assumed, not observed: the store remembers it.
            applied = self.store.apply(list(zip(result.offsets, payloads, strict=True)), result.upcoming_offset,
                                       unverified=result.marker_slot)
            self._after_apply(applied.changes if self.watchers else [])
        except Exception as exc:
            return exc
        return None

    def _give_up_after_apply_failure(self, exc: Exception) -> None:
        """Leave the shard to another node and rebuild this replica (see `_start_rebuild`)."""
        reason = f"{type(exc).__name__}: {exc}"
        log.error("shard %d: applying a committed batch failed (%s); giving the shard up and rebuilding",
                  self.shard, reason)
        self.metrics.apply_failures.labels(shard=str(self.shard)).inc()
        self.machine.apply_failed(reason)
        self.on_unable_to_lead(self.shard, reason)

    async def _on_append_error(self, exc: wal.WalError, waiting: list[_Pending]) -> None:
        """Answer the batch as the machine's table says, then do what it decided next."""
        shard = self.shard
        decision = self.machine.batch_failed(append_outcome(exc))
        self._fail_batch(decision, waiting, str(exc))
        if decision.then is Next.STEP_DOWN:
            log.warning("shard %d: stepping down: %s (%s)", shard, decision.message, exc)
            return
        # W2: after any abort or unknown outcome, learn the partition again before writing.
        log.warning("shard %d: %s; bootstrapping again", shard, exc)
        assert self._writer is not None
        try:
            if decision.then is Next.REFENCE:
                # A fresh producer's init_transactions completes or aborts our undecided
                # transaction at once. Waiting for the settled end instead would wait for the
                # broker's transaction timeout while that transaction holds the LSO.
                end = await asyncio.to_thread(self._writer.fence)
                if not self.machine.fenced(end):
                    return
            else:
                end = await asyncio.to_thread(self._writer.settled_end_offset)
            self.store.rewind_unverified()
            await self._catch_up(end)
        except Exception as resync_error:
            log.warning("shard %d: re-bootstrap failed: %s", shard, resync_error)
            self.machine.resync_failed()
            return
        self.machine.replayed_to(end)

    # ---- requests --------------------------------------------------------------------------------

    def require_leader(self) -> None:
        refusal = self.machine.write_refusal(self.leader_hint())
        if refusal is not None:
            raise refusal

    async def write(self, write: Write, size: int) -> Response:
        """Queue a write (`kvstore.core.batch.write_of`) for the next batch and wait for its
        answer (after commit). `size`: the request's bytes, a pre-bound on the batch."""
        self.require_leader()
        request_id = write.request_id
        answer = admit(write, self.store, self._ids_in_progress, self.clock.unix_ms())
        if isinstance(answer, errors.StoreError):
            raise answer
        if answer is not None:
            return answer  # committed before: the recorded answer, marked as a replay
        future: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        if request_id:
            self._ids_in_progress.add(request_id)
            future.add_done_callback(lambda _f: self._ids_in_progress.discard(request_id))
        try:
            self._queue.put_nowait(_Pending(write, size, future))
            self._work.set()
        except asyncio.QueueFull:
            future.cancel()  # never queued: frees its request id
            raise errors.OverloadedError(
                f"shard {self.shard}: {self.config.max_pending_writes} writes pending "
                f"(limit MAX_PENDING_WRITES_PER_SHARD); back off") from None
        return await future

    async def barrier(self) -> None:
        """Linearizable read barrier (DESIGN.md §4), shared by the reads waiting at that moment."""
        self.require_leader()
        if self._round is None:
            self._round = asyncio.get_running_loop().create_future()
            if self._round_task is None or self._round_task.done():
                self._round_task = asyncio.create_task(self._run_rounds())
        end = await asyncio.shield(self._round)
        verdict = self.machine.barrier(end)
        if verdict.wait_for is None:
            # This leader's view is stale. Queue a probe (an empty entry at our upcoming offset):
            # if the log moved, W2 aborts it and the leader bootstraps again; if we are fenced,
            # it steps down. Either way it settles.
            self._probe()
            raise errors.UnavailableError(verdict.why)
        await self.wait_applied(verdict.wait_for, self.config.barrier_timeout_s)

    def _probe(self) -> None:
        if self._probing:
            return
        self._probing = True
        future: asyncio.Future[Response] = asyncio.get_running_loop().create_future()

        def done(f: asyncio.Future[Response]) -> None:
            self._probing = False
            if not f.cancelled():
                f.exception()  # retrieved: the probe's outcome only matters through the replica's state

        future.add_done_callback(done)
        try:
            self._queue.put_nowait(_Pending(probe_write(), 0, future))
            self._work.set()
        except asyncio.QueueFull:
            self._probing = False  # writes are flowing anyway: they will hit W2 themselves

    async def _run_rounds(self) -> None:
        """One watermark query in flight at a time. A read joins the round that has not sent its
        query yet, so the query it waits for was always sent after it arrived (linearizable);
        reads arriving while a query is in flight form the next round, sent as soon as that
        query returns, and all share it: under load, one query per round trip serves every read
        that came meanwhile, instead of one query per burst of arrivals."""
        while (round_ := self._round) is not None:
            await asyncio.sleep(0)  # a yield, not a wait: let reads that arrived in this same tick join
            self._round = None  # reads arriving from now on wait for the next query
            try:
                end = await asyncio.to_thread(self.ends.high_watermark, self.config.topic, self.shard)
            except Exception as exc:
                round_.set_exception(errors.UnavailableError(f"shard {self.shard}: read barrier failed: {exc}"))
                continue
            self.end_offset = max(self.end_offset, end)
            round_.set_result(end)

    async def wait_applied(self, offset: int, timeout_s: float) -> None:
        """Until everything below `offset` is applied here."""
        deadline = self.clock.monotonic() + timeout_s
        while self.store.applied_offset < offset:
            remaining = deadline - self.clock.monotonic()
            if remaining <= 0:
                raise errors.UnavailableError(
                    f"shard {self.shard}: applied {self.store.applied_offset}, waited for {offset}")
            try:
                await asyncio.wait_for(self._applied.wait(), remaining)
            except TimeoutError:
                continue

    def open_txn_age_ms(self) -> int:
        started = self._txn_started
        return int((self.clock.monotonic() - started) * 1000) if started is not None else 0

    def _fail_queued(self, error: errors.StoreError) -> None:
        while self._carry:
            _answer(self._carry.popleft().future, error)
        while not self._queue.empty():
            _answer(self._queue.get_nowait().future, error)


def append_outcome(exc: wal.WalError) -> AppendOutcome:
    """What a WAL error says about an append, for the machine's table (`APPEND_DECISIONS`)."""
    if isinstance(exc, wal.UnknownOutcomeError):
        return AppendOutcome.UNKNOWN_FENCED if exc.fenced else AppendOutcome.UNKNOWN
    if isinstance(exc, wal.FencedError):
        return AppendOutcome.FENCED
    if isinstance(exc, wal.WriterFatalError):
        return AppendOutcome.WRITER_FATAL
    return AppendOutcome.ABORTED


def writer_config(config: ReplicaConfig) -> wal.WriterConfig:
    """The shard's writer: one transactional id per WAL partition, whoever writes (W4), also
    across deployments that share the topic."""
    return wal.WriterConfig(
        bootstrap_servers=config.bootstrap_servers, topic=config.topic, partition=config.shard,
        transactional_id=wal.shard_transactional_id(config.topic, config.shard),
        writer=wal.WriterIdentity(config.node_id, 0),
        transaction_timeout_ms=config.transaction_timeout_ms, call_timeout_s=config.call_timeout_s,
        max_batch_records=config.max_batch_records, max_batch_bytes=config.max_batch_bytes,
        max_record_bytes=config.max_record_bytes, security=config.kafka_security)


def _answer(future: asyncio.Future[Response], answer: Response | Exception) -> None:
    """Give a waiting request its answer, once (a client that gave up, or one answered already, is left)."""
    if future.done():
        return
    if isinstance(answer, Exception):
        future.set_exception(answer)
    else:
        future.set_result(answer)


def decode_changes(records: list[wal.AcceptedRecord]) -> list[Change]:
    """Changes carried by WAL records, for Watch history (versions are not known there: 0)."""
    from kvstore.core.state import ChangeType

    out: list[Change] = []
    for rec in records:
        entry = decode_entry(rec.payload)
        if entry is None:
            continue
        for effect in entry.effects:
            key = effect_key(effect)
            if effect.WhichOneof("kind") == "put":
                out.append(Change(ChangeType.PUT, key, KeyState(effect.put.value, 0, rec.offset, 0), rec.offset))
            else:
                out.append(Change(ChangeType.DELETE, key, None, rec.offset))
    return out

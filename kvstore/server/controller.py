"""The placement controller's shell (P1, P3; docs/design.md §9): it decides nothing.

The controller is the member of the node membership group that the group assigns the WAL's
partition 0 (cooperative-sticky: it stays there while its node lives; a node that dies loses it
after the session timeout, one that stops hands it over at once). While it has it, this shell
fences the placement log's writer (one transactional id, `<wal topic>.placement`: the same guard
as a shard's leader, so a deposed controller's appends fail, W4, and any that raced land nowhere
a reader accepts, W2), reads the log to the writer's upcoming offset, and then, every round of
the node, feeds `kvstore.core.placement_controller.PlacementController` the membership listing
and the nodes' reports, appends what it plans at the expected offset, and reads it back before it
plans again. Operators' requests (`request`) run under the same lock.

Two nodes that both believe they are the controller are harmless (P3): only one writer's appends
land, and every reader folds only what landed where it was expected.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence

import wal
from kvstore import errors
from kvstore.core import placement
from kvstore.core.placement_controller import (
    MAX_RECORDS_PER_ROUND,
    CopyReport,
    NodeReport,
    PlacementController,
    Request,
    RequestRefused,
    preview,
)
from kvstore.core.placement_log import STEP_NAMES, Settings
from kvstore.internal.v1 import placement_pb2
from kvstore.server.metrics import Metrics
from kvstore.server.placement_log import PlacementLogReader
from kvstore.v1 import cluster_pb2
from wal.clients import ClientSecurity, placement_transactional_id
from wal.topic import placement_topic

log = logging.getLogger(__name__)

READ_BACK_TIMEOUT_S = 10.0  # its own append read back, at most this long; else it starts over
# A decision rests on reports of the last second (READY_REPORT_MAX_AGE_MS): its append must not
# drag on. Each blocking call of the writer is bounded by this, retried this often at most.
CALL_TIMEOUT_S = 3.0
APPEND_RETRY_LIMIT = 2
TRANSACTION_TIMEOUT_MS = 10_000
RETRY_S = 0.5  # after a failed fence or append, before the office is taken again


REQUEST_ATTEMPTS = 3  # an operator's request whose append definitely failed is tried again this often


class NotRecordedError(errors.UnavailableError):
    """The append definitely failed (W2: it missed its expected offset, or it was fenced or
    aborted before its commit): nothing of it is in the log."""


class ControllerShell:
    def __init__(self, *, node_id: str, address: str, settings: Settings, reader: PlacementLogReader,
                 bootstrap_servers: str, wal_topic: str, security: ClientSecurity | None, metrics: Metrics,
                 call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.node_id = node_id
        self.address = address
        self.settings = settings
        self.reader = reader
        self.metrics = metrics
        self._writer_config = wal.WriterConfig(
            bootstrap_servers=bootstrap_servers, topic=placement_topic(wal_topic), partition=0,
            transactional_id=placement_transactional_id(wal_topic), writer=wal.WriterIdentity(node_id, 0),
            max_batch_records=MAX_RECORDS_PER_ROUND + 16, max_batch_bytes=4 * 1024 * 1024,
            max_record_bytes=64 * 1024, call_timeout_s=call_timeout_s, retry_limit=APPEND_RETRY_LIMIT,
            # An append cut off by a crash holds the log's read_committed end until the broker
            # aborts it: short, well inside a starting node's wait for the log's end.
            transaction_timeout_ms=TRANSACTION_TIMEOUT_MS, security=security or ClientSecurity())
        self._writer: wal.ShardWriter | None = None
        self.machine: PlacementController | None = None
        # This node's machine of an earlier term, and when it gave the office up after a failure: a
        # re-take soon after inherits what it observed (the role moving away forgets it).
        self._previous: tuple[PlacementController, float] | None = None
        self._lock = asyncio.Lock()  # one append at a time: rounds and operators' requests
        self._failed_at = 0.0
        self._owns = False  # the group gave this node the office, as of the last round
        self._last_listing: tuple[list[str], int] | None = None  # the last listing that succeeded, and when

    @property
    def active(self) -> bool:
        return self.machine is not None

    @staticmethod
    def now_ms() -> int:
        return _now_ms()

    # ---- taking and giving up the role -----------------------------------------------------

    async def step(self, owns: bool, listing: Iterable[str] | None, reports: Sequence[NodeReport]) -> None:
        """One round of the node: `owns` whether the group gives it the role now; `listing` the
        members if the group was listed this round (None: no listing, or it failed)."""
        self._owns = owns
        if listing is not None:
            self._last_listing = (list(listing), _now_ms())
        if not owns:
            if self.machine is not None or self._writer is not None:
                log.info("placement controller: the role moved to another node")
                await self._give_up(failed=False)
            return
        async with self._lock:
            if self.machine is None and (time.monotonic() - self._failed_at < RETRY_S or not await self._take()):
                return
            machine = self.machine
            assert machine is not None
            logged = self.reader.state.controller
            if logged is not None and logged.term >= machine.term and logged.node_id != self.node_id:
                # Another node took the office (a split brain the group has not settled): it fenced
                # this writer already; take the office again over it only through a fresh fence.
                log.warning("placement controller: %s took office at term %d: starting over", logged.node_id,
                            logged.term)
                self._failed_at = time.monotonic()
                await self._give_up()
                return
            now_ms = _now_ms()
            if listing is not None:
                machine.members_listed(listing, now_ms)
            for report in reports:
                machine.report(report)
            try:
                records = machine.plan(self.reader.state, now_ms)
            except Exception:  # a bug, or a log no rule foresaw: give the office up, say so loudly
                log.exception("placement controller: planning failed: giving the office up")
                self._failed_at = time.monotonic()
                await self._give_up()
                return
            if records:
                await self._append(records)

    async def _take(self) -> bool:
        """Fence every earlier controller and read the log up to here; False if that failed."""
        writer = wal.ShardWriter(self._writer_config)
        try:
            upcoming = await asyncio.to_thread(writer.fence)
        except wal.WalError as exc:
            log.warning("placement controller: fencing the placement log failed: %s", exc)
            await asyncio.to_thread(writer.close)
            self._failed_at = time.monotonic()
            return False
        self._writer = writer
        if not await self.reader.read_to(upcoming, READ_BACK_TIMEOUT_S):
            log.warning("placement controller: the placement log was not read up to %d in time", upcoming)
            await self._give_up()
            return False
        state = self.reader.state
        term = state.controller.term + 1 if state.controller is not None else 1
        writer.identity = wal.WriterIdentity(self.node_id, term)
        previous = None
        if self._previous is not None and time.monotonic() - self._previous[1] < self.settings.grace_ms / 1000:
            previous = self._previous[0]
        self.machine = PlacementController(self.node_id, self.address, term, self.settings, _now_ms(),
                                           previous=previous)
        if self._last_listing is not None:  # this node's last listing: a new machine needs one before it decides
            self.machine.members_listed(*self._last_listing)
        self.metrics.controller_term.set(term)
        log.warning("placement controller: took over (term %d, log at epoch %d)", term, state.epoch)
        return True

    async def _give_up(self, *, failed: bool = True) -> None:
        """Leave the office. `failed`: a failed fence, append or plan (the next re-take inherits
        this machine's observations); else the role moved to another node (forgotten: what it
        observed would be stale by the time the role came back)."""
        self._previous = (self.machine, time.monotonic()) if failed and self.machine is not None else None
        self.machine = None
        writer, self._writer = self._writer, None
        self.metrics.controller_term.set(0)
        if writer is not None:
            await asyncio.to_thread(writer.close)

    async def _append(self, records: Sequence[placement_pb2.PlacementRecord]) -> None:
        """Append `records` where the log ends and read them back; on any failure the role is
        given up here (the next round takes it again, if the group still gives it: a fresh fence,
        a fresh read, nothing assumed about the failed append)."""
        writer = self._writer
        assert writer is not None
        takeable = self._takeable(records)
        if len(takeable) < len(records):
            # The machine planned from a log it does not understand as the readers do (a record of
            # another controller, a hostile one): start over from a fresh fence and read.
            self._failed_at = time.monotonic()
            await self._give_up()
            raise NotRecordedError("the placement controller's decision does not fit the log as read: it takes the "
                                   "office again; retry")
        expected = writer.upcoming_offset
        assert expected is not None, "a writer's upcoming offset is known between successful appends"
        wall_ms = int(time.time() * 1000)
        for record in records:
            record.at_ms = wall_ms
        try:
            result = await asyncio.to_thread(writer.append, [r.SerializeToString() for r in records], expected)
        except wal.WalError as exc:
            log.warning("placement controller: appending %d records failed (%s): starting over", len(records), exc)
            self._failed_at = time.monotonic()
            await self._give_up()
            if isinstance(exc, wal.UnknownOutcomeError):
                raise errors.UnknownOutcomeError(f"recording the placement decision failed: {exc}; it may or may "
                                                 "not have been recorded: look at `kvstore placement log`") from exc
            # Anything else failed before the commit: the transaction was aborted or never sent.
            raise NotRecordedError(f"recording the placement decision failed, nothing was recorded: {exc}") from exc
        for record in records:
            kind = record.WhichOneof("kind") or ""
            step = record.step.kind if kind == "step" else 0
            self.metrics.placement_decisions.labels(kind=_kind_label(kind, step)).inc()
        if not await self.reader.read_to(result.upcoming_offset, READ_BACK_TIMEOUT_S):
            log.warning("placement controller: its append was not read back in time: starting over")
            await self._give_up()

    def _takeable(self, records: Sequence[placement_pb2.PlacementRecord]) -> list[placement_pb2.PlacementRecord]:
        """`records` without those the log's readers would skip (a bug of the machine, or an
        input no rule foresaw): never appended, so never appended again every round."""
        state = preview(self.reader.state, [])
        takeable = []
        for record in records:
            why = state.apply(state.position, record.SerializeToString())
            if why is None:
                takeable.append(record)
            else:
                log.error("placement controller: not appending a record the log's readers would skip (%s): %s",
                          why, record)
        return takeable

    # ---- operators -------------------------------------------------------------------------

    async def request(self, request: Request) -> tuple[list[tuple[int, tuple[str, ...], tuple[str, ...]]], int]:
        """Record an operator's request (see `_request`). Shielded: a caller that gives up (its
        deadline) must not cut an append off without the lock, with the office kept."""
        return await asyncio.shield(self._request_retried(request))

    async def _request_retried(self, request: Request,
                               ) -> tuple[list[tuple[int, tuple[str, ...], tuple[str, ...]]], int]:
        """Record an operator's request: (the target changes, the epoch after). Raises
        RequestRefused (the operator's mistake, or a stale epoch) or UnavailableError."""
        for attempt in range(1, REQUEST_ATTEMPTS + 1):
            try:
                return await self._request(request)
            except NotRecordedError:  # someone wrote at our offset (another controller, or not the store)
                if attempt == REQUEST_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    async def _request(self, request: Request) -> tuple[list[tuple[int, tuple[str, ...], tuple[str, ...]]], int]:
        async with self._lock:
            if self.machine is None and self._owns:  # it gave the office up after a failed append: take it again
                await self._take()
            machine = self.machine
            if machine is None:
                raise errors.UnavailableError("this node is not the placement controller (any more): retry")
            if not machine.listed():
                raise errors.UnavailableError("the placement controller has not listed the members yet: retry")
            state = self.reader.state
            try:
                records = machine.request(state, request, _now_ms())
            except RequestRefused:
                self.metrics.placement_refused.inc()
                raise
            before = state.targets()
            after = preview(state, records).targets() if records else before
            if records:
                await self._append(records)
            return placement.changes(before, after), self.reader.state.epoch

    async def close(self) -> None:
        await self._give_up(failed=False)


def node_report(view: cluster_pb2.ShardMapResponse, at_ms: int) -> NodeReport:
    """A node's report of itself (`Node.local_view`, over PeerService.LocalShardView) as the
    machine takes it: its zone and, per copy, whether it is in the group and caught up."""
    me = view.nodes[0]
    copies = {}
    for info in view.shards:
        for replica in info.replicas:
            if replica.node_id == me.node_id:
                copies[info.shard] = CopyReport(in_group=replica.in_group, caught_up=replica.caught_up)
    return NodeReport(me.node_id, me.zone, copies, at_ms)


def _kind_label(kind: str, step: int) -> str:
    return STEP_NAMES.get(step, "step") if kind == "step" else kind


def _now_ms() -> int:
    """The machine's clock: monotonic (grace periods and report ages must not jump with the wall
    clock); the records' `at_ms`, shown to operators, is set to the wall clock when appended."""
    return int(time.monotonic() * 1000)

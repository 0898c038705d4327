"""The placement log as a node reads it: a thin shell that tails `<wal topic>.placement` under
read_committed and the WAL's acceptance rule (W3, `wal.Replayer`) into the one fold,
`kvstore.core.placement_log.PlacementState`. It decides nothing.

A record the fold skips (hostile or broken: see the fold) is logged as a warning with its offset
and counted in `state.skipped`; a reader never stops on one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import wal
from kvstore.core.placement_log import PlacementState, Settings
from wal.clients import ClientSecurity
from wal.topic import placement_topic

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_S = 0.2
RETRY_S = 0.5
READ_TO_END_TIMEOUT_S = 60.0  # a node's start waits this long for the log's end, then gives up


class PlacementSettingsError(ValueError):
    """This node's settings disagree with the cluster's, as its placement log records them."""


def settings_problem(mine: Settings, log_settings: Settings) -> str | None:
    """Why a node configured with `mine` must not join a cluster whose log says `log_settings`."""
    differences = [f"{name} {getattr(mine, field)} here, {getattr(log_settings, field)} in the placement log"
                   for field, name in (("shard_count", "shard count"), ("replication_factor", "replication factor"),
                                       ("grace_ms", "placement grace (ms)"))
                   if getattr(mine, field) != getattr(log_settings, field)]
    if not differences:
        return None
    return ("this node's settings disagree with the cluster's: " + "; ".join(differences)
            + " (start it with the cluster's settings; the shard count is fixed when a cluster is created)")


class PlacementLogReader:
    def __init__(self, bootstrap_servers: str, wal_topic: str, *, security: ClientSecurity | None = None,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.topic = placement_topic(wal_topic)
        self.state = PlacementState()
        self.reached_end = False  # read to the end once: `state` is the placement as it was then
        self._bootstrap = bootstrap_servers
        self._security = security
        self._on_change = on_change
        self._replayer: wal.Replayer | None = None
        self._position = 0  # everything below it is folded into `state`
        self._moved = asyncio.Event()
        self._io = threading.Lock()  # the replayer: closed only while no poll runs on it

    @property
    def position(self) -> int:
        """The next offset not folded yet (past commit markers too: comparable with a writer's
        upcoming offset). Moved only once the records below it are in `state`: the replayer's own
        position runs ahead while its thread hands records over."""
        return self._position

    async def run(self) -> None:
        while True:
            try:
                await self._poll()
            except asyncio.CancelledError:
                raise
            except wal.OffsetOutOfRangeError:  # records deleted by hand below us: read what is left
                assert self._replayer is not None
                start = await asyncio.to_thread(self._replayer.log_start)
                log.warning("placement log %s: records below %d were deleted; reading from there", self.topic, start)
                await asyncio.to_thread(self._replayer.seek, max(start, self._replayer.position))
                self._position = max(self._position, start)
            except Exception as exc:  # a broker away: keep the last state, try again
                log.debug("placement log %s: %s", self.topic, exc)
                await asyncio.sleep(RETRY_S)

    async def _poll(self) -> None:
        if self._replayer is None:
            self._replayer = await asyncio.to_thread(lambda: wal.Replayer(
                self._bootstrap, self.topic, 0, 0, security=self._security))
        replayer = self._replayer
        records, position = await asyncio.to_thread(self._locked, self._poll_once, replayer)
        for record in records:
            why = self.state.apply(record.offset, record.payload)
            if why is not None:
                log.warning("placement log %s: skipped the record at offset %d: %s", self.topic, record.offset, why)
        self._position = max(self._position, position)
        changed = bool(records)
        if not self.reached_end:
            end = await asyncio.to_thread(self._locked, replayer.end_offset)
            if self._position >= end:
                self.reached_end = changed = True
        self._moved.set()
        self._moved.clear()
        if changed:
            self._on_change()

    async def read_to(self, offset: int, timeout_s: float) -> bool:
        """Wait until everything below `offset` was read; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.position < offset:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), min(remaining, POLL_S * 2))
        return True

    async def read_to_end_once(self, timeout_s: float = READ_TO_END_TIMEOUT_S) -> None:
        """Wait until the log was read to its end once; raises wal.UnavailableError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.reached_end:
            if time.monotonic() > deadline:
                raise wal.UnavailableError(f"placement log {self.topic}: not read to its end within {timeout_s:.0f} s "
                                           "(are the brokers reachable?)")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), POLL_S * 2)

    @staticmethod
    def _poll_once(replayer: wal.Replayer) -> tuple[list[wal.AcceptedRecord], int]:
        return replayer.poll_once(POLL_S), replayer.position

    def _locked(self, call: Callable[..., T], *args: object) -> T:
        with self._io:
            if self._replayer is None:
                raise wal.UnavailableError("placement log reader closed")
            return call(*args)

    def close(self) -> None:
        with self._io:
            if self._replayer is not None:
                self._replayer.close()
                self._replayer = None

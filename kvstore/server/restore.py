"""Loading a snapshot in place of a replica's store (`kvstore serve --snapshot-dir`): I/O only.

When to load, and for which log start, is the replica machine's decision (`LoadSnapshot`);
which snapshots are worth trying is `kvstore.core.recovery.snapshots_to_try`. Here: list them,
load the first usable one into a scratch store next to the replica's (in a worker thread, while
the replica keeps serving what it has), and swap it in, in one step on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from kvstore.core.recovery import SnapshotOffer, snapshots_to_try
from kvstore.server.clock import Clock
from kvstore.server.config import ReplicaConfig
from kvstore.storage.shard_store import ShardStore, StorageError

log = logging.getLogger(__name__)

PROGRESS_LOG_S = 2.0  # how often a snapshot load logs its progress


def scratch_path(store_path: Path) -> Path:
    """Where a load in progress lives; a load cut short (a crash) leaves it, never to be trusted."""
    return store_path.with_name(store_path.name + ".snapshot-load")


async def load_newest(config: ReplicaConfig, applied: int, end: int, at_least: int, why: str,
                      clock: Clock) -> tuple[Path, int] | None:
    """The newest usable snapshot whose cut is at least `at_least` and beyond `applied`, loaded
    into the scratch store: (its path, its cut), or None.

    Usable: complete, of this topic, and not beyond the partition's `end` (a cut beyond it is of
    another WAL, e.g. a recreated topic). One that does not load to its own digest is skipped for
    the next older one."""
    root = config.snapshot_dir
    if root is None:
        return None
    from kvstore.storage import snapshot  # pyarrow: only nodes that use snapshots pay for it

    shard = config.shard
    try:
        found = await asyncio.to_thread(snapshot.list_snapshots, root)
    except snapshot.SnapshotFormatError as exc:
        log.warning("shard %d: %s; cannot look for a snapshot: %s", shard, why, exc)
        return None
    manifests = {name: manifest for manifest, name in found if manifest is not None}
    offers = [SnapshotOffer(name, None) if manifest is None else
              SnapshotOffer(name, manifest.topic, manifest.shard(shard).offset, manifest.shard(shard).keys)
              for manifest, name in found]
    usable, notes = snapshots_to_try(offers, topic=config.topic, at_least=at_least, applied=applied, end=end)
    for note in notes:
        log.warning("shard %d: %s: %s", shard, why, note)
    for offer in usable:
        manifest = manifests[offer.name]
        log.info("shard %d: %s: loading snapshot %s (cut %d, %d keys)", shard, why, offer.name, offer.cut, offer.keys)
        started = clock.monotonic()
        try:
            path = await asyncio.to_thread(_load_into_scratch, config, root, manifest, clock)
        except (snapshot.SnapshotFormatError, OSError, StorageError) as exc:
            log.warning("shard %d: snapshot %s is unusable: %s", shard, offer.name, exc)
            continue
        elapsed = clock.monotonic() - started
        log.info("shard %d: loaded snapshot %s: %d keys in %.1fs (%.0f keys/s); replaying the WAL from %d", shard,
                 offer.name, offer.keys, elapsed, offer.keys / max(elapsed, 1e-6), offer.cut)
        return path, offer.cut
    return None


def _load_into_scratch(config: ReplicaConfig, root: str, manifest: Any, clock: Clock) -> Path:
    """In a worker thread: the snapshot into a scratch store next to the replica's."""
    from kvstore.storage import snapshot

    path = scratch_path(config.data_dir / f"shard-{config.shard}")
    shutil.rmtree(path, ignore_errors=True)
    scratch = ShardStore(path, topic=config.topic, shard=config.shard, max_request_ids=config.max_request_ids)
    total = manifest.shard(config.shard).keys
    last_log = [clock.monotonic()]

    def progress(keys: int, requests: int) -> None:
        if clock.monotonic() - last_log[0] >= PROGRESS_LOG_S:
            last_log[0] = clock.monotonic()
            log.info("shard %d: loading snapshot %s: %d of %d keys, %d request ids", config.shard, manifest.name,
                     keys, total, requests)

    try:
        snapshot.load_into(scratch, root, manifest, on_progress=progress)
    except BaseException:
        scratch.close()
        shutil.rmtree(path, ignore_errors=True)
        raise
    scratch.close()
    return path


def swap_in(store: ShardStore, loaded: Path, config: ReplicaConfig) -> ShardStore:
    """The loaded scratch store in place of `store` (closed); call it on the event loop, so that
    no read or apply runs in between. A crash in here leaves no directory or a complete one:
    both are safe (an empty replica loads again)."""
    path = store.path
    store.close()
    shutil.rmtree(path)
    os.replace(loaded, path)
    swapped = ShardStore(path, topic=config.topic, shard=config.shard, max_request_ids=config.max_request_ids)
    if swapped.rebuilt_reason:
        raise StorageError(f"shard {config.shard}: the loaded snapshot did not reopen: {swapped.rebuilt_reason}")
    return swapped

"""`kvstore wal readers [list]` and `kvstore wal readers remove NAME`: who still needs the WAL.

The registry (`wal.readers`) is what `kvstore wal truncate` honours: a registered reader's
position per shard is the oldest record it still needs. This command shows each reader with its
position, the shard's high watermark and log start, and its lag, so an operator can tell a
healthy reader from one that holds truncation back because it was abandoned, and deregister the
latter. Nothing here needs Spark.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvstore.output import Printer, format_table
from kvstore.pipeline.errors import PipelineError
from kvstore.pipeline.target import WalTarget

TIMEOUT_S = 30.0


def describe(target: WalTarget, timeout_s: float = TIMEOUT_S, now_ms: int | None = None) -> dict[str, Any]:
    """Every registered reader with, per shard it holds: its position, the shard's log start and
    high watermark, its lag (offsets behind the high watermark: records, commit markers and
    rejected records alike) and whether it is already broken (position below the log start)."""
    from confluent_kafka import KafkaException

    from wal import ReaderRegistry, RegistryError
    from wal.clients import PartitionEnds

    with ReaderRegistry(target.bootstrap_servers, target.topic, security=target.security,
                        timeout_s=timeout_s) as registry:
        try:
            listed = registry.list()
        except RegistryError as exc:
            raise PipelineError(str(exc)) from exc
    ends = PartitionEnds(target.bootstrap_servers, timeout_s, target.security)
    shards = sorted({s for r in listed.readers for s in r.positions})
    try:
        bounds = {s: (ends.log_start(target.topic, s), ends.high_watermark(target.topic, s))
                  for s in shards if s < target.shards}
    except KafkaException as exc:
        raise PipelineError(f"cannot read the WAL's offsets ({target.topic}): {exc}") from exc
    now = int(time.time() * 1000) if now_ms is None else now_ms
    readers = []
    for reader in listed.readers:
        rows = []
        for shard, position in sorted(reader.positions.items()):
            if shard not in bounds:  # a shard this WAL does not have: say so, do not guess
                rows.append({"shard": shard, "position": position, "log_start": None, "high_watermark": None,
                             "lag": None, "broken": False})
                continue
            start, high = bounds[shard]
            rows.append({"shard": shard, "position": position, "log_start": start, "high_watermark": high,
                         "lag": max(0, high - position), "broken": position < start})
        readers.append({"name": reader.name, "kind": reader.kind, "where": reader.where,
                        "updated_unix_ms": reader.updated_unix_ms,
                        "updated_age_s": round(max(0, now - reader.updated_unix_ms) / 1000, 1), "shards": rows})
    return {"topic": target.topic, "registry": registry.topic, "readers": readers,
            "malformed": [{"offset": m.offset, "key": m.key, "why": m.why} for m in listed.malformed]}


def remove(target: WalTarget, name: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Deregister `name`. Refused for a name the registry does not hold (a typo must not pass
    for a removal): registered or malformed records only."""
    from wal import ReaderRegistry, RegistryError

    with ReaderRegistry(target.bootstrap_servers, target.topic, security=target.security,
                        timeout_s=timeout_s) as registry:
        try:
            listed = registry.list()
            known = {r.name for r in listed.readers} | {m.key for m in listed.malformed if m.key}
            if name not in known:
                raise PipelineError(f"no reader {name!r} is registered for {target.topic}; registered: "
                                    f"{', '.join(sorted(known)) or 'none'}")
            registry.remove(name)
        except RegistryError as exc:
            raise PipelineError(str(exc)) from exc
    return {"removed": name, "topic": target.topic}


def command(args: argparse.Namespace, target: WalTarget | None, printer: Printer) -> int:
    assert target is not None, "readers reads the WAL's registry"
    if args.readers_action == "remove":
        if not args.name:
            raise PipelineError("`kvstore wal readers remove NAME`: which reader? (see `kvstore wal readers`)")
        result = remove(target, args.name)
        print(f"kvstore: wal readers: removed {args.name}: truncation no longer waits for it and may delete "
              "records it still needed (it fails with a gap if it runs again)", file=sys.stderr, flush=True)
        if printer.json:
            printer.record(result)
        else:
            printer.line(f"removed reader {args.name}")
        return 0
    if args.name:
        raise PipelineError(f"unexpected argument {args.name!r}: `kvstore wal readers` lists, "
                            "`kvstore wal readers remove NAME` removes")
    result = describe(target)
    if printer.json:
        printer.record(result)
        return 0
    if not result["readers"]:
        printer.line(f"no readers registered for {target.topic}")
    else:
        printer.line(format_table(
            ("READER", "KIND", "WHERE", "UPDATED", "SHARD", "POSITION", "LOG START", "HIGH WATERMARK", "LAG"),
            [(r["name"], r["kind"], r["where"], f"{r['updated_age_s']:.0f}s ago", s["shard"], s["position"],
              "-" if s["log_start"] is None else s["log_start"],
              "-" if s["high_watermark"] is None else s["high_watermark"],
              "BROKEN (below the log start)" if s["broken"] else ("-" if s["lag"] is None else s["lag"]))
             for r in result["readers"] for s in r["shards"]]))
    for m in result["malformed"]:
        printer.line(f"unreadable registry record at offset {m['offset']} (key {m['key']!r}): {m['why']}")
    return 0

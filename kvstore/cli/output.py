"""The client's results as the `kvstore` command prints them: a table for people, one JSON object
per line for scripts (`--output json`).

The JSON records are the command's interface to scripts: a field once printed keeps its name.
The generic parts (the printer's two formats, tables, bytes as text) are in `kvstore.output`,
which the pipeline's commands print with too.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable
from typing import Any

from kvstore.client import (
    DeleteResult,
    FenceResult,
    GetResult,
    KeyValue,
    MoveProgress,
    PlacementChange,
    PreparedTxn,
    PutResult,
    ShardInfo,
    ShardMap,
    TransactionInfo,
    TxnResolution,
    TxnResult,
    WatchEvent,
)
from kvstore.client.moves import describe
from kvstore.client.results import PlacementLog
from kvstore.output import Printer, bytes_field, display, format_table


def _clock(at_ms: int) -> str:
    """A record's wall-clock time for people (UTC, to the second)."""
    return datetime.datetime.fromtimestamp(at_ms / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S") if at_ms else "-"


def kv_record(kv: KeyValue) -> dict[str, Any]:
    return {**bytes_field("key", kv.key), **bytes_field("value", kv.value), "version": kv.version,
            "mod_revision": kv.mod_revision, "create_revision": kv.create_revision}


def get_record(result: GetResult) -> dict[str, Any]:
    record: dict[str, Any] = {**bytes_field("key", result.key), "found": result.found}
    if result.kv is not None:
        record.update(kv_record(result.kv))
    if result.header is not None:
        record.update(shard=result.header.shard, applied_revision=result.header.applied_revision,
                      served_by=result.header.served_by)
    return record


def put_record(result: PutResult) -> dict[str, Any]:
    return {**bytes_field("key", result.key), "shard": result.shard, "revision": result.revision,
            "version": result.version, "replayed": result.replayed, "request_id": result.request_id}


def delete_record(result: DeleteResult) -> dict[str, Any]:
    return {**bytes_field("key", result.key), "shard": result.shard, "revision": result.revision,
            "deleted": result.deleted, "replayed": result.replayed, "request_id": result.request_id}


def txn_record(result: TxnResult) -> dict[str, Any]:
    ops: list[dict[str, Any]] = []
    for r in result.results:
        if isinstance(r, PutResult):
            ops.append({"op": "put", **bytes_field("key", r.key), "version": r.version})
        elif isinstance(r, DeleteResult):
            ops.append({"op": "delete", **bytes_field("key", r.key), "deleted": r.deleted})
        else:
            get = get_record(r)
            ops.append({"op": "get", **get})
    return {"succeeded": result.succeeded, "shard": result.shard, "revision": result.revision,
            "replayed": result.replayed, "request_id": result.request_id, "results": ops}


def event_record(event: WatchEvent) -> dict[str, Any]:
    return {"type": event.type, "shard": event.shard, **kv_record(event.kv)}


def shard_map_record(smap: ShardMap) -> dict[str, Any]:
    return {"shard_count": smap.shard_count, "topic": smap.topic, "served_by": smap.served_by,
            "placement_epoch": smap.placement_epoch, "controller": smap.controller,
            "shards": [{"shard": s.shard, "leader": s.leader, "leader_id": s.leader_id, "leader_ready": s.leader_ready,
                        "term": s.term, "applied_offset": s.applied_offset, "end_offset": s.end_offset, "lag": s.lag,
                        "open_txn_age_ms": s.open_txn_age_ms, "placed_on": list(s.placed_on),
                        "replicas": [{"node_id": r.node_id, "address": r.address, "state": r.state,
                                      "applied_offset": r.applied_offset, "lag": r.lag, "caught_up": r.caught_up,
                                      "in_group": r.in_group} for r in s.replicas]}
                       for s in smap.shards],
            "nodes": [{"node_id": n.node_id, "address": n.address, "leads": list(n.leads), "can_lead": n.can_lead,
                       "zone": n.zone, "version": n.version} for n in smap.nodes]}


def _replicas(shard: ShardInfo) -> str:
    """Each copy as node:state (lag), replicas first: "n1:replica n3:learner(lag 120)"; a replica
    that is not in its shard's group yet (catching up after a restart) is "replica-", a stray copy
    (on a disk, not in the placement log) "stray"."""
    order = {"replica": 0, "follower": 1, "learner": 2, "retiring": 3, "stray": 4}
    copies = sorted(shard.replicas, key=lambda r: (order.get(r.state, 5), r.node_id))
    return " ".join(f"{r.node_id}:{r.state}" + ("-" if r.state == "replica" and not r.in_group else "")
                    + (f"(lag {r.lag})" if r.lag else "") for r in copies) or "-"


class ResultPrinter(Printer):
    """A `Printer` that also knows the client's results, one method per kind of result."""

    def get(self, result: GetResult, *, hex_bytes: bool = False, value_in: str | None = None) -> None:
        """`hex_bytes`: the key and the value as hex (JSON: `key_hex`, `value_hex`); `value_in`:
        the value was written to that file, so it is named instead of shown."""
        if self.json:
            record = get_record(result)
            if hex_bytes:
                for name in ("key", "value"):
                    record.pop(f"{name}_base64", None)
                    if name in record:
                        del record[name]
                        record[f"{name}_hex"] = (result.key if name == "key" else result.value or b"").hex()
            if value_in is not None and result.kv is not None:
                record.pop("value", None)
                record.pop("value_base64", None)
                record.pop("value_hex", None)
                record.update(value_file=value_in, value_bytes=len(result.kv.value))
            self.record(record)
        elif result.kv is None:
            self.line("(not found)")
        else:
            kv = result.kv
            shown = (f"({len(kv.value)} bytes in {value_in})" if value_in is not None
                     else kv.value.hex() if hex_bytes else display(kv.value))
            self.line(format_table(["KEY", "VALUE", "VERSION", "MOD_REVISION", "CREATE_REVISION"],
                                   [[kv.key.hex() if hex_bytes else display(kv.key), shown, kv.version,
                                     kv.mod_revision, kv.create_revision]]))

    def put(self, result: PutResult) -> None:
        if self.json:
            self.record(put_record(result))
        else:
            self.line(format_table(["KEY", "SHARD", "REVISION", "VERSION", "REPLAYED"],
                                   [[display(result.key), result.shard, result.revision, result.version,
                                     _yes(result.replayed)]]))

    def delete(self, result: DeleteResult) -> None:
        if self.json:
            self.record(delete_record(result))
        else:
            self.line(format_table(["KEY", "SHARD", "REVISION", "DELETED", "REPLAYED"],
                                   [[display(result.key), result.shard, result.revision, _yes(result.deleted),
                                     _yes(result.replayed)]]))

    def txn(self, result: TxnResult) -> None:
        if self.json:
            self.record(txn_record(result))
            return
        branch = "then" if result.succeeded else "else"
        self.line(f"succeeded: {_yes(result.succeeded)} (ran --{branch})  shard: {result.shard}  "
                  f"revision: {result.revision}  replayed: {_yes(result.replayed)}")
        rows: list[list[object]] = []
        for r in result.results:
            if isinstance(r, PutResult):
                rows.append(["put", display(r.key), f"version={r.version}"])
            elif isinstance(r, DeleteResult):
                rows.append(["del", display(r.key), f"deleted={_yes(r.deleted)}"])
            elif r.kv is None:
                rows.append(["get", display(r.key), "(not found)"])
            else:
                rows.append(["get", display(r.key), f"{display(r.kv.value)} (version={r.kv.version})"])
        if rows:
            self.line(format_table(["OP", "KEY", "RESULT"], rows))

    def kvs(self, kvs: Iterable[KeyValue], keys_only: bool) -> None:
        if self.json:
            for kv in kvs:
                self.record(bytes_field("key", kv.key) if keys_only else kv_record(kv))
            return
        if keys_only:
            rows: list[list[object]] = [[display(kv.key)] for kv in kvs]
            self.line(format_table(["KEY"], rows))
        else:
            rows = [[display(kv.key), display(kv.value), kv.version, kv.mod_revision] for kv in kvs]
            self.line(format_table(["KEY", "VALUE", "VERSION", "MOD_REVISION"], rows))

    def event_header(self) -> None:
        if not self.json:
            self.line(_event_line("TYPE", "MOD_REVISION", "SHARD", "KEY", "VALUE"))

    def event(self, event: WatchEvent) -> None:
        if self.json:
            self.record(event_record(event))
        else:
            value = display(event.kv.value) if event.type == "put" else ""
            self.line(_event_line(event.type.upper(), str(event.kv.mod_revision), str(event.shard),
                                  display(event.kv.key), value))

    def shard_map(self, smap: ShardMap) -> None:
        if self.json:
            self.record(shard_map_record(smap))
            return
        self.line(f"topic: {smap.topic}  shards: {smap.shard_count}  served by: {smap.served_by}  "
                  f"placement epoch: {smap.placement_epoch}  controller: {smap.controller or '-'}")
        self.line(format_table(
            ["SHARD", "LEADER", "NODE", "TERM", "APPLIED", "END", "LAG", "OPEN_TXN_MS", "TARGET", "REPLICAS"],
            [[s.shard, s.leader or "-", _leader_node(s.leader_id, s.leader_ready), s.term, s.applied_offset,
              s.end_offset, s.lag, s.open_txn_age_ms, ",".join(s.placed_on) or "-", _replicas(s)]
             for s in smap.shards]))
        if smap.nodes:
            self.line("")
            self.line(format_table(
                ["NODE", "ADDRESS", "ZONE", "LEADS", "ROLE", "VERSION"],
                [[n.node_id, n.address, n.zone or "-", ",".join(map(str, n.leads)) or "-",
                  "leader-capable" if n.can_lead else "read replica", n.version or "-"] for n in smap.nodes]))

    def transactions(self, txns: list[TransactionInfo]) -> None:
        if self.json:
            for t in txns:
                self.record(dataclasses.asdict(t))
            return
        if not txns:
            self.line("(no open transaction)")
            return
        self.line(format_table(["SHARD", "FIRST_OFFSET", "END", "AGE_MS", "LEADER"],
                               [[t.shard, t.first_offset, t.end_offset, t.age_ms, t.leader_id or "-"] for t in txns]))

    def prepared(self, txns: list[PreparedTxn], unreachable: list[str]) -> None:
        if self.json:
            self.record({"transactions": [dataclasses.asdict(t) | {"participants": list(t.participants)}
                                          for t in txns], "unreachable": unreachable})
            return
        if not txns:
            self.line("(no prepared cross-shard transaction)")
        else:
            self.line(format_table(
                ["TXN", "SHARD", "COORDINATOR", "PARTICIPANTS", "AGE_MS", "LOCKED_KEYS", "REQUEST_ID", "LEADER"],
                [[t.txn_id, t.shard, t.coordinator, ",".join(map(str, t.participants)), t.age_ms, t.locked_keys,
                  t.request_id or "-", t.leader_id] for t in txns]))
        for address in unreachable:
            self.line(f"note: {address} did not answer: its shards' prepared transactions are not listed")

    def resolution(self, resolution: TxnResolution) -> None:
        if self.json:
            self.record(dataclasses.asdict(resolution) | {"shards": list(resolution.shards)})
            return
        where = f" at shard(s) {','.join(map(str, resolution.shards))}" if resolution.shards else ""
        detail = f": {resolution.detail}" if resolution.detail else ""
        self.line(f"transaction {resolution.txn_id}: {resolution.outcome}{where}{detail}")

    def placement_changes(self, changes: list[PlacementChange]) -> None:
        if self.json:
            self.record({"changes": [{"shard": c.shard, "before": list(c.before), "after": list(c.after)}
                                     for c in changes]})
            return
        if not changes:
            self.line("no shard moves")
            return
        self.line(format_table(["SHARD", "FROM", "TO"], [[c.shard, ",".join(c.before) or "-", ",".join(c.after) or "-"]
                                                         for c in changes]))

    def placement_log(self, placement: PlacementLog) -> None:
        if self.json:
            self.record(dataclasses.asdict(placement) | {"entries": [dataclasses.asdict(e) for e in placement.entries]})
            return
        controller = (f"{placement.controller} (term {placement.controller_term})" if placement.controller
                      else "none yet")
        self.line(f"placement epoch {placement.epoch}, controller {controller}")
        if placement.skipped:
            self.line("records skipped (hostile or broken): "
                      + ", ".join(f"{why}: {count}" for why, count in sorted(placement.skipped.items())))
        self.line(format_table(["OFFSET", "EPOCH", "AT", "DECISION", "REASON"], [
            [e.offset, e.epoch, _clock(e.at_ms), e.summary, e.reason] for e in placement.entries]))

    def move_progress(self, progress: MoveProgress) -> None:
        left = progress.left
        if self.json:
            self.record({"done": progress.done, "left": len(left), "total": len(progress.moves),
                         "shards": [{"shard": m.shard, "want": list(m.want), "replicas": list(m.replicas),
                                     "learners": [{"node_id": n, "lag": lag} for n, lag in m.learners],
                                     "leaving": list(m.leaving)} for m in left]})
            return
        if progress.done:
            self.line(f"done: {len(progress.moves)} shard moves")
            return
        self.line(f"{len(left)} of {len(progress.moves)} shard moves left: " + " | ".join(describe(m) for m in left))

    def fenced(self, result: FenceResult) -> None:
        if self.json:
            self.record(dataclasses.asdict(result))
            return
        told = f"; leader {result.notified} told to check" if result.notified else "; no leader was reachable"
        self.line(f"shard {result.shard} fenced at offset {result.end_offset}{told}")


def _leader_node(node_id: str, ready: bool) -> str:
    if not node_id:
        return "-"
    return node_id if ready else f"{node_id} (taking over)"


def _event_line(kind: str, rev: str, shard: str, key: str, value: str) -> str:
    # A watch is a stream: fixed widths instead of a table measured over all rows.
    return f"{kind:<7} {rev:>12} {shard:>5}  {key}  {value}".rstrip()


def _yes(flag: bool) -> str:
    return "true" if flag else "false"


"""A replica machine's run as text, and the machine alone stepping it again.

Why: every event is plain data (`events.py`, `writes.py`), so the events a driver stepped into
one machine, with the times they came at, are the whole account of that machine's run. The
simulation records them (`tests/sim/replica.py`); `dumps` prints a trace, `loads` parses it
back, and `replay` steps a fresh machine over an empty store through the performers' store part
alone, checking that it returns the very actions recorded. A seed's surprise can then be read
line by line and replayed without the simulated cluster around it.

A line is one step, JSON: `{"now": ms, "unix": ms, "event": value, "actions": value}`. Values
are tagged by kind: a dataclass `{"$": name, field: value...}`, bytes `{"$b": hex}`, an enum
`{"$e": "Type.NAME"}`, a tuple `{"$t": [...]}`, a mapping `{"$d": [[key, value]...]}`, a
protobuf message `{"$m": full name, "b": hex}`, an error `{"$x": type, "text": str}` (in
answers only: printed, compared, never parsed back).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvstore.core import txn
from kvstore.core.replica import actions, events, writes
from kvstore.core.replica.config import ReplicaConfig
from kvstore.core.replica.machine import ReplicaMachine
from kvstore.core.replica.performers import perform_all
from kvstore.core.request_window import MemoryShard
from kvstore.core.role import AppendOutcome
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.v1 import kv_pb2

_DATA: dict[str, type] = {cls.__name__: cls for cls in (
    *events.Event.__args__, *writes.WriteRequest.__args__, txn.Decide)}
_ENUMS: dict[str, type[enum.Enum]] = {cls.__name__: cls for cls in (events.EndPurpose, AppendOutcome, actions.Ready)}
_MESSAGES = {"kvstore.v1": kv_pb2, "kvstore.internal.v1": wal_entry_pb2}


@dataclasses.dataclass(frozen=True)
class Step:
    now_ms: float
    unix_ms: int
    event: events.Event
    actions: str  # the actions the machine returned, encoded (`encode`)


def encode(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"$b": value.hex()}
    if isinstance(value, enum.Enum):
        return {"$e": f"{type(value).__name__}.{value.name}"}
    if isinstance(value, BaseException):
        return {"$x": type(value).__name__, "text": str(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"$": type(value).__name__, **fields}
    if hasattr(value, "DESCRIPTOR") and hasattr(value, "SerializeToString"):
        return {"$m": value.DESCRIPTOR.full_name, "b": value.SerializeToString(deterministic=True).hex()}
    if isinstance(value, tuple):
        return {"$t": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, Mapping):
        return {"$d": [[encode(k), encode(v)] for k, v in value.items()]}
    assert value is None or isinstance(value, (bool, int, float, str)), f"not plain data: {value!r}"
    return value


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "$b" in value:
        return bytes.fromhex(value["$b"])
    if "$e" in value:
        kind, name = value["$e"].split(".")
        return _ENUMS[kind][name]
    if "$t" in value:
        return tuple(decode(v) for v in value["$t"])
    if "$d" in value:
        return {decode(k): decode(v) for k, v in value["$d"]}
    if "$m" in value:
        package, _, name = value["$m"].rpartition(".")
        message = getattr(_MESSAGES[package], name)()
        message.ParseFromString(bytes.fromhex(value["b"]))
        return message
    assert "$x" not in value, "errors are printed, never parsed back"
    cls = _DATA[value["$"]]
    return cls(**{k: decode(v) for k, v in value.items() if k != "$"})


def dumps(steps: Iterable[Step]) -> str:
    return "".join(json.dumps({"now": s.now_ms, "unix": s.unix_ms, "event": encode(s.event),
                               "actions": json.loads(s.actions)}, sort_keys=True) + "\n" for s in steps)


def loads(text: str) -> list[Step]:
    steps = []
    for line in text.splitlines():
        raw = json.loads(line)
        steps.append(Step(raw["now"], raw["unix"], decode(raw["event"]),
                          json.dumps(raw["actions"], sort_keys=True)))
    return steps


def actions_text(out: list[actions.Action]) -> str:
    return json.dumps(encode(out), sort_keys=True)


class StorePerformers:
    """The performers' store part over a `MemoryShard` (what every driver does to its store),
    nothing else: the replay's, and the unit tests' `Drive`. Every other result the recorded
    events (or a scenario) report."""

    def __init__(self, store: MemoryShard) -> None:
        self.store = store

    def perform_apply_replayed(self, action: actions.ApplyReplayed) -> str | None:
        self.store.apply(list(action.records), action.checkpoint)
        return None

    def perform_apply_committed(self, action: actions.ApplyCommitted) -> str | None:
        self.store.apply(list(action.records), action.checkpoint, unverified=action.marker_slot)
        return None

    def perform_rewind(self, action: actions.RewindUnverified) -> None:
        self.store.rewind_unverified()

    def perform_wipe(self, action: actions.Wipe) -> None:
        self.store.wipe()

    def perform_load_snapshot(self, action: actions.LoadSnapshot) -> None:
        pass  # a trace that loaded one is not replayable alone (the snapshot is not in it)

    def _nothing(self, action: actions.Action) -> None:
        pass

    perform_fence = perform_set_term = perform_append = perform_read_end = perform_read_settled_end = _nothing
    perform_fetch = perform_answer = perform_close_writer = perform_unable = perform_able = _nothing
    perform_note = perform_resolve_now = perform_exit = _nothing


def replay(steps: list[Step], config: ReplicaConfig, new_store: Callable[[], MemoryShard]) -> str | None:
    """Step a fresh machine over `new_store()` (empty, as the recorded one started); None if it
    returned exactly the recorded actions at every step, else where it did not."""
    store = new_store()
    assert store.applied_offset == 0, "a replay starts from an empty store"
    machine, performers = ReplicaMachine(config, store), StorePerformers(store)
    for number, step in enumerate(steps):
        out = machine.step(step.event, now_ms=step.now_ms, unix_ms=step.unix_ms)
        got = actions_text(out)
        if got != step.actions:
            return f"step {number} {step.event!r}: got {got}, recorded {step.actions}"
        perform_all(performers, out)  # its local results are recorded steps of their own
    return None

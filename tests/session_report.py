"""Session-wide tallies that survive pytest-xdist (the fuzz tally, the simulation's step counts).

Under `-n`, tests run in worker processes and the session's summary is printed by the controller,
which runs no test: a module-level counter in a worker is lost with it. Tests add JSON-able items
here under a name; each worker ships its items to the controller when it finishes
(tests/conftest.py, `workeroutput`), and `items(name)` is the same list with or without workers.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Any

_LOCAL: collections.defaultdict[str, list[Any]] = collections.defaultdict(list)  # added in this process
_RELAYED: collections.defaultdict[str, list[Any]] = collections.defaultdict(list)  # shipped by workers


def add(name: str, item: Any) -> None:
    """Record `item` (JSON-able) under `name` for the session's summary."""
    _LOCAL[name].append(item)


def items(name: str) -> list[Any]:
    return [*_LOCAL[name], *_RELAYED[name]]


def shipped() -> str:
    """What a worker hands the controller as it finishes."""
    return json.dumps(_LOCAL)


def received(payload: str) -> None:
    for name, values in json.loads(payload).items():
        _RELAYED[name].extend(values)


def merged_fuzz(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One fuzz tally (tests/fuzz/tally.py `summary()`) from the tallies of several processes:
    counts added, each test's input digest kept, the overall digest recomputed over them as
    `tally.inputs_digest` computes it (equal to a single process's for the same requests)."""
    if not summaries:
        return None
    total: dict[str, Any] = {"seed": summaries[0]["seed"], "cases_per_test": summaries[0]["cases_per_test"]}
    for counter in ("by_code", "by_method", "by_size"):
        merged: collections.Counter[str] = collections.Counter()
        for summary in summaries:
            merged.update(summary[counter])
        total[counter] = dict(merged.most_common()) if counter != "by_method" else dict(sorted(merged.items()))
    for count in ("cases", "alive_checks", "state_checks"):
        total[count] = sum(int(summary[count]) for summary in summaries)
    total["methods"] = len(total["by_method"])
    inputs = dict(sorted(kv for summary in summaries for kv in summary["inputs_by_test"].items()))
    total["inputs_by_test"] = inputs
    total["inputs_sha256"] = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return total

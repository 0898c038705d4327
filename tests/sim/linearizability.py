"""A linearizability checker for the client-visible history, one key at a time.

Why per key: every operation the clients issue touches one key (Put, Delete, a compare-and-set
Txn on that key, Get), and linearizability is compositional (Herlihy & Wing): a history is
linearizable iff each key's sub-history is. Each key is a register holding (value, version),
where the version counts the writes since the key was created, exactly as the store answers it
(`kvstore.core.state.next_key_state`). Checking versions too means a write applied twice, or
applied although it was reported as failed, shows up in later answers.

The search is Wing & Gong's, with Lowe's memoisation (the set of linearized operations plus the
register state, visited once) as in Knossos and Porcupine. An operation whose outcome is unknown
(W7: the client never learnt whether it took effect) has no return: it may be linearized at any
point after its invocation, or not at all (which is the same as linearizing it after everything
else, since nothing observes it then).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tests.sim.client import Kind, Operation, Outcome, Output

State = tuple[bytes | None, int]  # value (None: absent) and version (0 when absent)
INITIAL: State = (None, 0)
_NEVER = float("inf")


def step(state: State, op: Operation) -> tuple[State, Output]:
    """The register's transition and the answer the store must have given."""
    value, version = state
    if op.kind is Kind.PUT:
        new: State = (op.value, version + 1 if value is not None else 1)
        return new, ("put", new[1])
    if op.kind is Kind.DELETE:
        return (None, 0), ("delete", value is not None)
    if op.kind is Kind.CAS:
        if value == op.expected:
            new = (op.value, version + 1 if value is not None else 1)
            return new, ("cas", True, new[1])
        return state, ("cas", False, value is not None, value, version)
    assert op.kind is Kind.GET
    return state, ("get", value is not None, value, version)


@dataclasses.dataclass(eq=False, slots=True)
class _Entry:
    op: int  # index into the key's operations; -1 for the list head
    call: bool
    match: _Entry | None = None  # a call's return entry
    prev: _Entry | None = None
    next: _Entry | None = None


def _lift(entry: _Entry) -> None:
    ret = entry.match
    assert entry.prev is not None and ret is not None and ret.prev is not None
    entry.prev.next = entry.next
    if entry.next is not None:
        entry.next.prev = entry.prev
    ret.prev.next = ret.next
    if ret.next is not None:
        ret.next.prev = ret.prev


def _unlift(entry: _Entry) -> None:
    ret = entry.match
    assert entry.prev is not None and ret is not None and ret.prev is not None
    ret.prev.next = ret
    if ret.next is not None:
        ret.next.prev = ret
    entry.prev.next = entry
    if entry.next is not None:
        entry.next.prev = entry


def relevant(history: Sequence[Operation]) -> list[Operation]:
    """What the checker judges: completed operations, and writes of unknown outcome. Failed
    operations took no effect; reads of unknown outcome observed nothing anyone saw."""
    return [op for op in history
            if op.outcome is Outcome.OK or (op.outcome is Outcome.UNKNOWN and op.kind is not Kind.GET)]


def check(ops: Sequence[Operation], budget: int = 2_000_000) -> str | None:
    """None if `ops` (one key's) is linearizable, else why not."""
    for op in ops:
        assert op.outcome in (Outcome.OK, Outcome.UNKNOWN), op
    events: list[tuple[float, int, int]] = []
    for index, op in enumerate(ops):
        events.append((op.invoke, 0, index))
        end = op.complete if op.outcome is Outcome.OK and op.complete is not None else _NEVER
        events.append((end, 1, index))
    events.sort()
    head = _Entry(-1, False)
    calls: dict[int, _Entry] = {}
    last = head
    for _, kind, index in events:
        node = _Entry(index, kind == 0, prev=last)
        last.next = node
        last = node
        if kind == 0:
            calls[index] = node
        else:
            calls[index].match = node

    state = INITIAL
    linearized = 0
    stack: list[tuple[_Entry, State]] = []
    cache: set[tuple[int, State]] = set()
    entry: _Entry | None = head.next
    deepest, stuck_at = -1, -1
    iterations = 0
    while entry is not None:
        iterations += 1
        if iterations > budget:
            return f"inconclusive: gave up after {budget} search steps over {len(ops)} operations"
        op = ops[entry.op]
        if entry.call:
            new_state, output = step(state, op)
            if op.outcome is not Outcome.OK or output == op.output:
                marked = linearized | (1 << entry.op)
                if (marked, new_state) not in cache:
                    cache.add((marked, new_state))
                    stack.append((entry, state))
                    state, linearized = new_state, marked
                    _lift(entry)
                    entry = head.next
                    continue
            entry = entry.next
            continue
        if op.outcome is not Outcome.OK:
            return None  # only unknown operations are left: they may all come last, or never
        if len(stack) > deepest:
            deepest, stuck_at = len(stack), entry.op
        if not stack:
            return _explain(ops, stuck_at)
        top, state = stack.pop()
        linearized &= ~(1 << top.op)
        _unlift(top)
        entry = top.next
    return None


def _explain(ops: Sequence[Operation], stuck: int) -> str:
    op = ops[stuck]
    nearby = sorted((o for o in ops if o.invoke <= (op.complete or op.invoke) and
                     (o.complete is None or o.complete >= op.invoke - 2_000)), key=lambda o: o.invoke)[-12:]
    lines = [f"no linearization reaches the answer of {describe(op)}; operations around it:"]
    lines += [f"    {describe(o)}" for o in nearby]
    return "\n".join(lines)


def describe(op: Operation) -> str:
    args = {Kind.PUT: f"{op.value!r}", Kind.DELETE: "", Kind.GET: "",
            Kind.CAS: f"{op.expected!r} -> {op.value!r}"}[op.kind]
    end = op.complete if op.complete is not None else "?"
    return (f"[{op.invoke}..{end}] c{op.client} {op.kind.value}({op.key!r}{', ' if args else ''}{args}) "
            f"{op.outcome.value if op.outcome else 'running'} {op.output} rev={op.revision} id={op.request_id}")

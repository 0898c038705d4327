"""The linearizability checker, on histories whose verdict is known by hand.

Each operation is written as (invoke, complete, kind, arguments, answer); complete None means
the outcome is unknown (W7)."""

from __future__ import annotations

from tests.sim.client import Kind, Operation, Outcome, Output
from tests.sim.linearizability import check, relevant

K = b"k"


def op(invoke: int, complete: int | None, kind: Kind, output: Output | None = None, *, value: bytes | None = None,
       expected: bytes | None = None, client: int = 0, failed: bool = False) -> Operation:
    outcome = Outcome.FAILED if failed else Outcome.OK if complete is not None else Outcome.UNKNOWN
    return Operation(client, kind, K, value, expected, f"r{invoke}", invoke, 0, complete, outcome,
                     output if outcome is Outcome.OK else None)


def put(i: int, c: int | None, value: bytes, version: int = 0, **kw: object) -> Operation:
    return op(i, c, Kind.PUT, ("put", version), value=value, **kw)  # type: ignore[arg-type]


def get(i: int, c: int, value: bytes | None, version: int = 0) -> Operation:
    return op(i, c, Kind.GET, ("get", value is not None, value, version))


def cas(i: int, c: int, expected: bytes | None, value: bytes, output: Output) -> Operation:
    return op(i, c, Kind.CAS, output, value=value, expected=expected)


def test_sequential_history() -> None:
    assert check([put(1, 2, b"a", 1), get(3, 4, b"a", 1), put(5, 6, b"b", 2), get(7, 8, b"b", 2)]) is None


def test_a_stale_read_is_caught() -> None:
    assert check([put(1, 2, b"a", 1), put(3, 4, b"b", 2), get(5, 6, b"a", 1)]) is not None


def test_concurrent_writes_may_take_effect_in_either_order() -> None:
    history = [put(1, 10, b"a", 2), put(2, 9, b"b", 1), get(11, 12, b"a", 2)]
    assert check(history) is None
    history = [put(1, 10, b"a", 1), put(2, 9, b"b", 2), get(11, 12, b"b", 2)]
    assert check(history) is None


def test_a_read_concurrent_with_a_write_sees_before_or_after() -> None:
    assert check([put(1, 2, b"a", 1), put(3, 10, b"b", 2), get(4, 5, b"a", 1)]) is None
    assert check([put(1, 2, b"a", 1), put(3, 10, b"b", 2), get(4, 5, b"b", 2)]) is None


def test_a_read_cannot_see_a_write_invoked_after_it_returned() -> None:
    assert check([get(1, 2, b"a", 1), put(3, 4, b"a", 1)]) is not None


def test_an_unknown_write_may_take_effect_late_or_never() -> None:
    assert check([put(1, None, b"a"), get(5, 6, None), get(7, 8, b"a", 1)]) is None  # late
    assert check([put(1, None, b"a"), get(5, 6, None), put(7, 8, b"b", 1)]) is None  # never


def test_an_unknown_write_cannot_take_effect_before_it_was_invoked() -> None:
    assert check([get(1, 2, b"a", 1), put(3, None, b"a")]) is not None


def test_a_write_applied_twice_shows_in_the_version() -> None:
    assert check([put(1, 2, b"a", 1), get(3, 4, b"a", 2)]) is not None


def test_a_definitely_failed_write_must_not_be_seen() -> None:
    history = [put(1, 2, b"a", failed=True), get(3, 4, b"a", 1)]
    assert check(relevant(history)) is not None


def test_compare_and_set() -> None:
    ok = [put(1, 2, b"a", 1), cas(3, 4, b"a", b"b", ("cas", True, 2)),
          cas(5, 6, b"a", b"c", ("cas", False, True, b"b", 2))]
    assert check(ok) is None
    both_won = [put(1, 2, b"a", 1), cas(3, 10, b"a", b"b", ("cas", True, 2)), cas(4, 11, b"a", b"c", ("cas", True, 2))]
    assert check(both_won) is not None
    absent = [cas(1, 2, None, b"a", ("cas", True, 1)), cas(3, 4, None, b"b", ("cas", False, True, b"a", 1))]
    assert check(absent) is None


def test_delete_resets_the_version() -> None:
    history = [put(1, 2, b"a", 1), op(3, 4, Kind.DELETE, ("delete", True)), put(5, 6, b"b", 1),
               op(7, 8, Kind.DELETE, ("delete", True)), op(9, 10, Kind.DELETE, ("delete", False))]
    assert check(history) is None
    assert check([op(1, 2, Kind.DELETE, ("delete", True))]) is not None


def test_the_search_handles_many_concurrent_clients() -> None:
    history: list[Operation] = []
    version = 0
    for round_ in range(200):
        base = round_ * 10
        writes = [put(base + i, base + 9, f"{round_}-{i}".encode(), 0, client=i) for i in range(4)]
        for write in writes:  # they took effect in client order
            version += 1
            write.output = ("put", version)
        history += writes
    history.append(get(5_000, 5_001, b"199-3", version))
    assert check(sorted(history, key=lambda o: o.invoke)) is None

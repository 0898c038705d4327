"""The server's own multi-shard Scan cut (`Scans.page`: `_read_once`, `_validate_part`,
`Transactions.validate`, `RecentWrites`) over real LevelDB stores.

The node around it is a stand-in that leads both shards and whose read barriers let a test
write between a round's reads and its validations: the moment a cut exists for. Barriers count
1, 2 for the first round's reads and 3, 4 for its validations (5-8 the second round's, ...).
The simulation checks the same cut end to end (`tests/sim/scan.py`); this checks the code the
node runs, paging and all, and that the mutation `scan-without-cut` returns the torn page."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore import errors
from kvstore.core.cut import CutConfig
from kvstore.core.evaluate import evaluate_put
from kvstore.server import scan as scan_module
from kvstore.server.scan import Scans
from kvstore.server.txns import Transactions
from kvstore.storage.shard_store import ShardStore
from kvstore.v1 import kv_pb2

Stores = list[ShardStore]


class _Replica:
    """What `Scans` asks of a replica: a barrier (here: run the test's hook) and the store."""

    def __init__(self, shard: int, store: ShardStore, node: Any) -> None:
        self.shard, self.store, self.node, self.state_epoch = shard, store, node, 0

    async def barrier(self, keys: tuple[bytes, ...] = (), span: object = None) -> int:
        self.node.barriers += 1
        hook = self.node.hooks.pop(self.node.barriers, None)
        if hook is not None:
            hook(self.node.stores)
        await asyncio.sleep(0)
        return self.state_epoch

    def unchanged_since(self, epoch: int) -> None:
        assert epoch == self.state_epoch


class _Rounds:
    def __init__(self) -> None:
        self.count = 0

    def inc(self, n: int = 1) -> None:
        self.count += n


class _Context:
    def time_remaining(self) -> None:
        return None

    def invocation_metadata(self) -> tuple[()]:
        return ()


def put(store: ShardStore, key: bytes, value: bytes, *, unverified: bool = False) -> None:
    """One record and its commit marker, as a leader commits it (its marker's slot assumed, or read)."""
    at = store.applied_offset
    entry = evaluate_put(kv_pb2.PutRequest(key=key, value=value), store.get, store.shard, at).entry
    store.apply([(at, entry.SerializeToString())], at + 2, unverified=at + 1 if unverified else None)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    stores = [ShardStore(tmp_path / f"shard-{i}", topic="wal", shard=i) for i in range(2)]
    node = types.SimpleNamespace(barriers=0, hooks={}, stores=stores, metrics=types.SimpleNamespace(
        scan_cut_rounds=_Rounds()), config=types.SimpleNamespace(shards=2, lead=True, node_id="n1"))
    replicas = [_Replica(i, store, node) for i, store in enumerate(stores)]
    node.replica = lambda shard: replicas[shard]
    node.leads = node.holds_shard = lambda shard: True
    node.leader_address = lambda shard: "n1"
    node.txns = Transactions(node, peers=None)  # type: ignore[arg-type]
    yield node
    for store in stores:
        store.close()


def scan(node: Any, request: kv_pb2.ScanRequest, hooks: dict[int, Callable[[Stores], None]]) -> kv_pb2.ScanResponse:
    node.hooks = dict(hooks)
    scans = Scans(node, peers=None)  # type: ignore[arg-type]
    return asyncio.run(scans.page(request, [0, 1], _Context(), forward=True))  # type: ignore[arg-type]


def rows(page: kv_pb2.ScanResponse) -> dict[bytes, bytes]:
    return {kv.key: kv.value for kv in page.kvs}


def accounts(stores: Stores) -> None:
    put(stores[0], b"acct-a", b"5")  # shard 0
    put(stores[1], b"acct-b", b"5")  # shard 1


def transfer(stores: Stores) -> None:
    """A transfer of 5 from a to b, resolved at both shards."""
    put(stores[0], b"acct-a", b"0")
    put(stores[1], b"acct-b", b"10")


EVERYTHING = kv_pb2.ScanRequest(prefix=b"acct-")


def test_a_transfer_between_the_reads_and_the_validations_reads_again(node: Any) -> None:
    accounts(node.stores)
    page = scan(node, EVERYTHING, {3: transfer})
    assert rows(page) == {b"acct-a": b"0", b"acct-b": b"10"}  # the sum is kept: both after
    assert node.barriers == 8 and node.metrics.scan_cut_rounds.count == 1
    assert [h.applied_revision for h in page.headers] == [4, 4]


def half_resolved(stores: Stores) -> None:
    put(stores[0], b"acct-a", b"0")  # the transfer resolved at shard 0 only, as both are read


def resolved_at_b(stores: Stores) -> None:
    put(stores[1], b"acct-b", b"10")  # and at shard 1 once they were


TORN = {2: half_resolved, 3: resolved_at_b}


def test_a_transfer_resolved_at_one_shard_when_read_is_read_again_once_resolved_at_both(node: Any) -> None:
    accounts(node.stores)
    assert rows(scan(node, EVERYTHING, TORN)) == {b"acct-a": b"0", b"acct-b": b"10"}
    assert node.barriers == 8


def test_the_mutation_answers_the_torn_page(node: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`scan-without-cut`: the same sequence, unvalidated, is a page in which 5 went missing."""
    monkeypatch.setattr(scan_module, "SCAN_CUT", CutConfig(skip_validation=True))
    accounts(node.stores)
    assert rows(scan(node, EVERYTHING, TORN)) == {b"acct-a": b"0", b"acct-b": b"5"}


def test_a_write_after_the_page_token_is_not_the_pages_business(node: Any) -> None:
    accounts(node.stores)
    page = scan(node, kv_pb2.ScanRequest(prefix=b"acct-", limit=1), {3: lambda s: put(s[1], b"acct-b", b"9")})
    assert rows(page) == {b"acct-a": b"5"} and page.next_page_token == b"acct-a\x00"
    assert node.barriers == 4  # one round


def test_an_insert_inside_the_pages_span_reads_again(node: Any) -> None:
    accounts(node.stores)
    page = scan(node, kv_pb2.ScanRequest(prefix=b"acct-", limit=1), {3: lambda s: put(s[1], b"acct-0", b"1")})
    assert rows(page) == {b"acct-0": b"1"} and node.barriers == 8


def test_a_second_page_ignores_an_insert_before_its_token(node: Any) -> None:
    accounts(node.stores)
    page = scan(node, kv_pb2.ScanRequest(prefix=b"acct-", page_token=b"acct-a\x00"),
                {3: lambda s: put(s[1], b"acct-0", b"1")})
    assert rows(page) == {b"acct-b": b"5"} and node.barriers == 4


def test_a_page_that_changes_every_round_is_refused_as_retriable(node: Any) -> None:
    accounts(node.stores)
    rounds = scan_module.SCAN_CUT.max_rounds
    with pytest.raises(errors.UnavailableError, match=f"for {rounds} rounds"):
        scan(node, EVERYTHING, {3 + 4 * n: transfer for n in range(rounds)})


def test_a_record_found_in_the_leaders_assumed_marker_slot_is_seen_by_the_validation(node: Any) -> None:
    """A leader's own commit assumes its marker took the slot after its batch. A read then is
    at that slot, not past it: if a writer outside the guard had put a record there, the
    replay after the rewind applies it at the slot, and the validation sees it (the Jepsen
    finding F1: read at slot + 1, the record was invisible to every validation)."""
    stores = node.stores
    put(stores[0], b"acct-a", b"5")
    put(stores[1], b"acct-b", b"5", unverified=True)
    slot = stores[1].unverified
    assert slot is not None and stores[1].read_revision == slot == stores[1].applied_offset - 1

    def foreign_record_in_the_slot(stores: Stores) -> None:
        store = stores[1]
        assert store.rewind_unverified() and store.applied_offset == slot
        entry = evaluate_put(kv_pb2.PutRequest(key=b"acct-b", value=b"7"), store.get, 1, slot).entry
        store.apply([(slot, entry.SerializeToString())], slot + 1)

    page = scan(node, EVERYTHING, {3: foreign_record_in_the_slot})
    assert rows(page) == {b"acct-a": b"5", b"acct-b": b"7"} and node.barriers == 8

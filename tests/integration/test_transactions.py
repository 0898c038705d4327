"""Cross-shard transactions on real nodes and a real broker (docs/design.md §10).

The bank: accounts on every shard, each starting at 100; transfers between random accounts are
cross-shard Txns whose compares check both balances (the failure branch reads them back), and
read-only Txns sum every account. Under leader SIGKILL and SIGSTOP: every sum a read-only Txn
saw equals the total, the accounts end at the total, no account was written more often than the
transfers that may have touched it (nothing applied twice), every replica of every shard ends
with the same state, and nothing stays prepared.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore import cli, limits
from kvstore.client import Client, Compare, Op, UnknownOutcome
from kvstore.core.sharding import shard_of
from kvstore.dev import demo
from kvstore.internal.v1 import peer_pb2, peer_pb2_grpc
from tests.integration.bank import Bank
from tests.integration.bank import account_keys as bank_accounts
from tests.integration.test_cluster import SHARDS, Cluster
from tests.waiting import wait_until
from wal.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

ACCOUNTS = 8


@pytest.fixture
def cluster(kafka: LocalKafka, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(kafka.bootstrap_servers, tmp_path).start()
    try:
        yield c
    finally:
        c.stop()


def account_keys() -> list[bytes]:
    return bank_accounts(ACCOUNTS, SHARDS)


def test_a_cross_shard_txn_commits_atomically_and_reads_a_consistent_cut(cluster: Cluster) -> None:
    a, b = next(k for k in account_keys() if shard_of(k, SHARDS) == 0), next(
        k for k in account_keys() if shard_of(k, SHARDS) == 3)
    with cluster.client() as client:
        client.put(a, b"10")
        client.put(b, b"5")
        result = client.txn([Compare.value(a, "==", b"10"), Compare.value(b, "==", b"5")],
                            [Op.put(a, b"7"), Op.put(b, b"8")], [Op.get(a), Op.get(b)], request_id="move-3")
        assert result.succeeded and result.shard == 0 and result.revision is not None
        assert client.get(a).value == b"7" and client.get(b).value == b"8"
        again = client.txn([Compare.value(a, "==", b"10"), Compare.value(b, "==", b"5")],
                           [Op.put(a, b"7"), Op.put(b, b"8")], [Op.get(a), Op.get(b)], request_id="move-3")
        assert again.succeeded and again.replayed and client.get(a).kv.version == 2  # once, not twice
        failed = client.txn([Compare.value(a, "==", b"10")], [Op.put(b, b"0")], [Op.get(a), Op.get(b)])
        assert not failed.succeeded and [r.value for r in failed.results] == [b"7", b"8"]
        snapshot = client.txn([], [Op.get(a), Op.get(b)])
        assert [r.value for r in snapshot.results] == [b"7", b"8"]


def _stopping(kafka: LocalKafka, tmp_path: Path, *, patient: bool) -> Iterator[Cluster]:
    """Every node's first driven transaction stops right after its decision (a failpoint);
    `patient`: the nodes' resolvers wait 10 minutes before they call a prepare in doubt, and the
    coordinators' finishers as long before they resolve a decision again."""
    c = Cluster(kafka.bootstrap_servers, tmp_path)
    for node in c.nodes:
        node.env["KVSTORE_FAILPOINTS"] = "txn-stop-after-decision=1"
        if patient:
            node.env["KVSTORE_TXN_IN_DOUBT_MS"] = "600000"
            node.env["KVSTORE_TXN_FINISH_AFTER_MS"] = "600000"
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def stopping_cluster(kafka: LocalKafka, tmp_path: Path) -> Iterator[Cluster]:
    yield from _stopping(kafka, tmp_path, patient=False)


@pytest.fixture
def patient_cluster(kafka: LocalKafka, tmp_path: Path) -> Iterator[Cluster]:
    yield from _stopping(kafka, tmp_path, patient=True)


def test_an_operator_lists_and_resolves_a_transaction_in_doubt(patient_cluster: Cluster,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """KIP-939's view: `kvstore txn list --in-doubt` shows the stopped transaction at the
    participant that prepared it (the coordinator applied its part with the decision) with its
    coordinator and age, the oldest-in-doubt gauge counts it, and `kvstore txn resolve` ends it
    with its coordinator's decision (a commit), which the coordinator then forgets."""
    cluster = patient_cluster
    a = next(k for k in account_keys() if shard_of(k, SHARDS) == 1)
    b = next(k for k in account_keys() if shard_of(k, SHARDS) == 3)
    with Client(cluster.endpoints, timeout_s=20, max_attempts=1) as once, pytest.raises(UnknownOutcome):
        once.txn([], [Op.put(a, b"x"), Op.put(b, b"y")], request_id="op-1")
    endpoints = ",".join(cluster.endpoints)
    assert cli.main(["--endpoints", endpoints, "-o", "json", "txn", "list", "--in-doubt"]) == 0
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = listed["transactions"]
    assert [r["shard"] for r in rows] == [3], listed
    assert all(r["coordinator"] == 1 and r["participants"] == [1, 3] and r["request_id"] == "op-1" for r in rows)
    txn_id = rows[0]["txn_id"]

    def gauge() -> float:
        return max(n.metric("kvstore_txn_in_doubt_oldest_seconds") for n in cluster.nodes)

    wait_until(lambda: gauge() > 0, 10, interval_s=0.2, what="the in-doubt gauge to count the prepare")
    assert cli.main(["--endpoints", endpoints, "txn", "resolve", txn_id]) == 0
    out = capsys.readouterr().out
    assert f"transaction {txn_id}: committed" in out, out
    assert not prepared(cluster)
    with cluster.client() as client:
        assert client.get(a).value == b"x" and client.get(b).value == b"y"
    wait_until(lambda: sum(n.metric("kvstore_txn_decisions_pending") for n in cluster.nodes) == 0, 10,
               interval_s=0.2, what="the coordinator to forget the decision every participant resolved")
    assert cli.main(["--endpoints", endpoints, "txn", "resolve", txn_id]) == 0
    assert "not prepared" in capsys.readouterr().out
    wait_until(lambda: gauge() == 0, 10, interval_s=0.2, what="the in-doubt gauge back to 0")


def test_a_read_of_a_locked_key_waits_for_the_decision_and_resolves_it(stopping_cluster: Cluster) -> None:
    """T3 and T4: the driver stops after its commit decision; the prepares stay locked. A
    linearizable Get of a written key waits, has the prepare resolved from the coordinator's WAL
    (the commit), and returns the committed value; the other participant is resolved too."""
    cluster = stopping_cluster
    a = next(k for k in account_keys() if shard_of(k, SHARDS) == 0)
    b = next(k for k in account_keys() if shard_of(k, SHARDS) == 2)
    with cluster.client() as client:
        client.put(a, b"old")
        client.put(b, b"old")
    with Client(cluster.endpoints, timeout_s=20, max_attempts=1) as once, pytest.raises(UnknownOutcome):
        once.txn([], [Op.put(a, b"new"), Op.put(b, b"new")], request_id="stopped")
    assert prepared(cluster), "the stopped driver left its prepares"
    with cluster.client() as client:
        assert client.get(b).value == b"new"  # waited, resolved: the decision was commit
        assert client.get(a).value == b"new"
        retry = client.txn([], [Op.put(a, b"new"), Op.put(b, b"new")], request_id="stopped")
        assert retry.replayed  # the request committed once
    wait_until(lambda: not prepared(cluster), 30, interval_s=0.5, what="no transaction left prepared")


def _settle_and_check(cluster: Cluster, bank: Bank) -> None:
    with cluster.client() as client:
        anomalies = bank.check(client)
    assert not anomalies, anomalies
    assert len(bank.sums) >= 3, f"only {len(bank.sums)} sums"
    acked = sum(bank.acked.values()) // 2
    assert acked > 20, f"only {acked} transfers acknowledged: the workload did not run ({bank.outcomes})"
    print(f"bank: {len(bank.sums)} sums, transfers {dict(bank.outcomes)}")

    wait_until(lambda: not prepared(cluster), 60, interval_s=0.5, what="no transaction left prepared")
    with cluster.client() as client:
        equal, digests = demo.converge(client, 90)
    assert equal, f"replicas differ: {digests}"


def prepared(cluster: Cluster) -> list[str]:
    """The transactions prepared at the shards the live nodes lead."""
    out: list[str] = []
    for node in cluster.nodes:
        if node.proc is None or node.proc.poll() is not None or node.channel is None:
            continue
        reply = peer_pb2_grpc.PeerServiceStub(node.channel).PreparedTxns(  # type: ignore[no-untyped-call]
            peer_pb2.PreparedTxnsRequest(), timeout=10)
        out += [p.txn_id for p in reply.prepared]
    return out


def test_bank_under_leader_sigkill_and_sigstop(cluster: Cluster) -> None:
    bank = Bank(cluster.endpoints, account_keys())
    bank.open_accounts()
    bank.start()
    try:
        time.sleep(4)
        victim = cluster.leader_of(0)  # the coordinator shard of most transfers
        victim.stop(signal.SIGKILL)
        time.sleep(3)
        victim.start(timeout_s=90)
        cluster.wait_settled(timeout_s=90)
        time.sleep(2)
        paused = cluster.leader_of(1)
        os.kill(paused.pid, signal.SIGSTOP)
        time.sleep(4)
        os.kill(paused.pid, signal.SIGCONT)
        cluster.wait_settled(timeout_s=90)
        time.sleep(3)
        # Enough transfers for the check to mean something, however slow a loaded machine is.
        try:
            wait_until(lambda: sum(bank.acked.values()) // 2 > 20, 90, interval_s=0.5, what="21 acknowledged transfers")
            wait_until(lambda: len(bank.sums) >= 3, 90, interval_s=0.5, what="3 consistent sums read")
        except AssertionError as slow:
            raise AssertionError(f"{slow}; transfers so far: {dict(bank.outcomes)}, sums {bank.sums}") from slow
    finally:
        bank.finish()
    _settle_and_check(cluster, bank)


# ---- a participant away past the request-id table's memory (issue 31) ----------------------------------------

MAX_REQUEST_IDS = 64  # the test flag: each shard remembers this many request ids


PLACEMENT_GRACE_MS = 25_000  # longer than the participant's outage below: nothing is placed elsewhere


@pytest.fixture
def sparse_cluster(kafka: LocalKafka, tmp_path: Path) -> Iterator[Cluster]:
    """Each shard on one node (RF 1), request-id tables of MAX_REQUEST_IDS ids, and every node's
    first driven transaction stopped right after its decision (a failpoint): its resolves are
    left to the participants and the coordinator. Started once placement settled (a fresh
    cluster holds extra copies for one grace period)."""
    c = Cluster(kafka.bootstrap_servers, tmp_path, extra_args=("--replication-factor", "1",
                                                                "--placement-grace-ms", str(PLACEMENT_GRACE_MS)))
    for node in c.nodes:
        node.env["KVSTORE_FAILPOINTS"] = "txn-stop-after-decision=1"
        node.env["KVSTORE_MAX_REQUEST_IDS"] = str(MAX_REQUEST_IDS)
    c.start()
    try:
        with c.client() as client:
            wait_until(lambda: all(len(s.replicas) == 1 and s.leader_ready for s in client.shard_map().shards),
                       PLACEMENT_GRACE_MS / 1000 + 60, interval_s=0.5, what="every shard held by one node only")
        yield c
    finally:
        for node in c.nodes:
            if node.proc is not None and node.proc.poll() is None:
                os.kill(node.pid, signal.SIGCONT)
        c.stop()


def test_a_participant_away_past_the_request_id_horizon_still_completes_the_transaction(
        sparse_cluster: Cluster) -> None:
    """T3 and T5 without the request-id horizon: a transaction decided (commit), its driver
    gone; the only replica of one participant SIGSTOPped (its prepare's lock held); the
    coordinator shard then takes more request ids than it remembers, so the decision's id and
    the client's are forgotten. A retry with the same request id, its prepare meeting the
    unavailable shard, gets the original answer from the coordinator's decision table; once the
    participant is resumed, the transaction completes by itself (no read, no operator) and the
    coordinator forgets the decision."""
    cluster = sparse_cluster
    with cluster.client() as client:
        holder = {s.shard: s.replicas[0].node_id for s in client.shard_map().shards}
    keys = account_keys()
    coordinator = next(s for s in range(SHARDS) if any(holder[p] != holder[s] for p in range(s + 1, SHARDS)))
    participant = next(p for p in range(coordinator + 1, SHARDS) if holder[p] != holder[coordinator])
    a = next(k for k in keys if shard_of(k, SHARDS) == coordinator)
    b = next(k for k in keys if shard_of(k, SHARDS) == participant)
    fill = [k for k in (f"fill-{i}".encode() for i in range(400)) if shard_of(k, SHARDS) == coordinator]
    ops = [Op.put(a, b"moved"), Op.put(b, b"moved")]
    with Client(cluster.endpoints, timeout_s=20, max_attempts=1) as once, pytest.raises(UnknownOutcome) as first:
        once.txn([], ops, request_id="away-1")
    first_ms = first.value.first_attempt_unix_ms
    with cluster.client() as client:
        assert client.get(a).value == b"moved"  # the coordinator applied its part with the decision
    away = cluster.node(holder[participant])
    os.kill(away.pid, signal.SIGSTOP)
    try:
        # The coordinator shard's request-id table forgets the decision's id and the client's:
        # as many new ids as it keeps push out every older one. They are written more than the
        # clock-skew margin later: a table that forgets ids that young refuses even fresh
        # requests for a while (they might be retries of what it forgot).
        time.sleep(limits.MAX_CLOCK_SKEW_MS / 1000 + 1)
        assert len(fill) >= MAX_REQUEST_IDS
        with cluster.client() as client:
            for key in fill[:MAX_REQUEST_IDS]:
                client.put(key, b"1")
        # The retry, as the client's docs say (same request id, same first attempt), while the
        # participant is away: its prepare there fails; its abort is answered with the commit.
        with Client(cluster.endpoints, timeout_s=6, max_attempts=1) as once:
            retry = once.txn([], ops, request_id="away-1", first_attempt_unix_ms=first_ms)
        assert retry.replayed and retry.succeeded and retry.shard == coordinator
    finally:
        os.kill(away.pid, signal.SIGCONT)
    wait_until(lambda: not prepared(cluster), 60, interval_s=0.5, what="the participant to resolve by itself")
    with cluster.client() as client:
        assert client.get(b).value == b"moved" and client.get(a).kv.version == 1
    wait_until(lambda: sum(n.metric("kvstore_txn_decisions_pending") for n in cluster.nodes) == 0, 30,
               interval_s=0.5, what="the coordinator to forget the decision")

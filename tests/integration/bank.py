"""The bank over cross-shard transactions (docs/design.md §10), for real nodes: accounts on every
shard, each starting at `START`; transfers between random accounts are cross-shard Txns whose
compares check both balances (the failure branch reads them back), and read-only Txns sum every
account. What must hold, whatever the faults: every sum equals the total, the accounts end at the
total, and no account was written more often than the transfers that may have touched it
(acknowledged plus unknown: nothing applied twice, nothing acknowledged lost).

Used by tests/integration/test_transactions.py and the robustness campaign (tests/robustness).
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Sequence

from kvstore.client import Client, Compare, KvError, Op, TxnConflict
from kvstore.core.sharding import shard_of
from kvstore.dev.demo import outcome_of
from tests.integration.registers import Observer
from tests.waiting import wait_until

START = 100


def account_keys(count: int, shards: int, prefix: str = "acct") -> list[bytes]:
    """`count` account keys, every shard holding at least one."""
    keys = [f"{prefix}-{i}".encode() for i in range(count)]
    assert {shard_of(k, shards) for k in keys} == set(range(shards)), "every shard holds an account"
    return keys


class Bank:
    """Transfers and sums from threads, each with its own client."""

    def __init__(self, endpoints: Sequence[str], keys: list[bytes], *, observe: Observer | None = None,
                 seed: int = 0, sum_pause_s: float = 0.1, max_backoff_s: float = 0.2) -> None:
        self.endpoints = list(endpoints)
        self.max_backoff_s = max_backoff_s
        self.keys = keys
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sums: list[int] = []
        self.acked: dict[bytes, int] = dict.fromkeys(keys, 0)  # transfers acknowledged, per account
        self.unknown: dict[bytes, int] = dict.fromkeys(keys, 0)  # transfers whose outcome stayed unknown
        self.outcomes: collections.Counter[str] = collections.Counter()  # how transfers ended, for the report
        self.threads: list[threading.Thread] = []
        self._observe = observe
        self._seed = seed
        self._sum_pause_s = sum_pause_s

    def open_accounts(self) -> None:
        with self._client() as client:
            for key in self.keys:
                client.put(key, str(START).encode())

    def start(self, transferers: int = 4, summers: int = 1) -> None:
        for i in range(transferers):
            self.threads.append(threading.Thread(target=self._transfers, args=(i,), daemon=True, name=f"bank-{i}"))
        for _ in range(summers):
            self.threads.append(threading.Thread(target=self._sums, daemon=True, name="bank-sum"))
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in self.threads), "a bank thread hangs"

    def _client(self) -> Client:
        return Client(self.endpoints, timeout_s=30, max_attempts=200, max_backoff_s=self.max_backoff_s)

    def _observed(self, kind: str, outcome: str, started: float) -> None:
        if self._observe is not None:
            self._observe(kind, outcome, started, time.monotonic())

    def _transfers(self, index: int) -> None:
        rng = random.Random(self._seed * 1000 + index)
        with self._client() as client:
            known: dict[bytes, bytes] = {}
            serial = 0
            while not self.stop.is_set():
                a, b = rng.sample(self.keys, 2)
                if a not in known or b not in known:
                    started = time.monotonic()
                    try:
                        snapshot = client.txn([], [Op.get(a), Op.get(b)])
                    except KvError:
                        self._observed("bank-read", "failed", started)
                        time.sleep(0.05)
                        continue
                    self._observed("bank-read", "ok", started)
                    known[a], known[b] = snapshot.results[0].value or b"", snapshot.results[1].value or b""
                amount = rng.randint(1, 5)
                va, vb = int(known[a]), int(known[b])
                serial += 1
                started = time.monotonic()
                try:
                    result = client.txn([Compare.value(a, "==", known[a]), Compare.value(b, "==", known[b])],
                                        [Op.put(a, str(va - amount).encode()), Op.put(b, str(vb + amount).encode())],
                                        [Op.get(a), Op.get(b)], request_id=f"t{self._seed}-{index}-{serial}")
                except KvError as exc:
                    # Unknown (UnknownOutcome, a deadline, a retry refused past the horizon): it may
                    # have been applied. Anything else is definite: nothing was applied.
                    outcome = outcome_of(exc)
                    self._observed("bank-transfer", outcome, started)
                    with self.lock:
                        self.outcomes["unknown" if outcome == "unknown" else type(exc).__name__] += 1
                        if outcome == "unknown":
                            self.unknown[a] += 1
                            self.unknown[b] += 1
                    known.pop(a, None)  # read again
                    known.pop(b, None)
                    if not isinstance(exc, TxnConflict):
                        time.sleep(0.05)
                    continue
                self._observed("bank-transfer", "ok", started)
                with self.lock:
                    self.outcomes["succeeded" if result.succeeded else "compare failed"] += 1
                if result.succeeded:
                    known[a], known[b] = str(va - amount).encode(), str(vb + amount).encode()
                    with self.lock:
                        self.acked[a] += 1
                        self.acked[b] += 1
                else:
                    known[a], known[b] = result.results[0].value or b"", result.results[1].value or b""

    def _sums(self) -> None:
        with self._client() as client:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    snapshot = client.txn([], [Op.get(k) for k in self.keys])
                except KvError:
                    self._observed("bank-sum", "failed", started)
                    time.sleep(0.05)
                    continue
                self._observed("bank-sum", "ok", started)
                total = sum(int(r.value) for r in snapshot.results if r.found)
                with self.lock:
                    self.sums.append(total)
                # A sum locks every account (shared) until it resolves: back to back, sums would
                # make transfers wait out their lock bound (docs/design.md §10).
                time.sleep(self._sum_pause_s)

    @property
    def total(self) -> int:
        return START * len(self.keys)

    def check(self, client: Client, timeout_s: float = 60.0) -> list[str]:
        """Once the threads finished: the anomalies found (empty: the bank is whole)."""
        anomalies = [f"a read-only Txn summed {s}, not {self.total}" for s in sorted(set(self.sums)) if s != self.total]

        def final() -> list[tuple[bytes, int, int]] | None:
            try:
                snapshot = client.txn([], [Op.get(k) for k in self.keys])
            except KvError:
                return None
            return [(k, int(r.value), r.kv.version) for k, r in zip(self.keys, snapshot.results, strict=True)]

        accounts = wait_until(final, timeout_s, interval_s=0.5, what="the accounts read")
        final_sum = sum(balance for _, balance, _ in accounts)
        if final_sum != self.total:
            anomalies.append(f"the accounts end at {final_sum}, not {self.total}")
        for key, _, version in accounts:  # one write per applied transfer, after the first put
            applied = version - 1
            if not self.acked[key] <= applied <= self.acked[key] + self.unknown[key]:
                anomalies.append(f"{key!r}: {applied} transfers applied, {self.acked[key]} acknowledged, "
                                 f"{self.unknown[key]} unknown")
        return anomalies

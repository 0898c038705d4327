"""Single-key registers over real nodes, checked for linearizability with the project's own checker
(tests/sim/linearizability.py, the one the simulation uses).

Client threads put, delete, compare-and-set (a Txn: if value == expected then put else get) and
read (linearizable) a few keys through `kvstore.client.Client`, recording each operation's
invocation and completion on one monotonic clock. A write whose outcome the client could not
learn (W7: unknown outcome, deadline) is recorded without a completion: the checker may place it
anywhere after its invocation, or nowhere. A write the client reported failed is recorded as
taking no effect, so a write "failed" but applied shows up as a violation; a failed read is
dropped (it observed nothing).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from kvstore.client import Client, Compare, GetResult, KvError, Op
from kvstore.dev.demo import outcome_of
from tests.sim import linearizability
from tests.sim.client import Kind, Operation, Outcome, Output

# An observer of every attempt: (operation kind, "ok" | "failed" | "unknown", start and end on
# time.monotonic()); the robustness campaign's timeline.
Observer = Callable[[str, str, float, float], None]


class Registers:
    def __init__(self, endpoints: Sequence[str], keys: Sequence[bytes], *, threads: int = 4, seed: int = 0,
                 pause_s: float = 0.01, rotate_s: float | None = None, observe: Observer | None = None,
                 max_backoff_s: float = 0.1) -> None:
        """`rotate_s`: every so many seconds the threads move on to fresh copies of `keys` (the
        key plus `/<epoch>`), so that no key's history grows past what the checker can search in
        a long run (checking is exponential in the operations that overlap on one key)."""
        self._endpoints = list(endpoints)
        self._max_backoff_s = max_backoff_s
        self._base = list(keys)
        self.keys = list(keys) if rotate_s is None else []  # every key used, for the check
        self._rotate_s = rotate_s
        self._epoch = -1
        self._started = time.monotonic()
        self._observe = observe
        self._threads = [threading.Thread(target=self._run, args=(i, random.Random(seed * 1000 + i)), daemon=True,
                                          name=f"register-{i}") for i in range(threads)]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pause_s = pause_s
        self.history: list[Operation] = []
        self.errors: list[str] = []

    def start(self) -> Registers:
        self._started = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    @property
    def completed(self) -> int:
        with self._lock:
            return sum(1 for op in self.history if op.outcome is Outcome.OK)

    def check(self) -> str | None:
        """None if the history is linearizable, else the checker's explanation."""
        with self._lock:
            history = list(self.history)
        by_key: dict[bytes, list[Operation]] = {}
        for op in history:
            by_key.setdefault(op.key, []).append(op)
        for key, ops in sorted(by_key.items()):
            verdict = linearizability.check(linearizability.relevant(ops))
            if verdict is not None:
                return f"key {key!r}: {verdict}"
        return None

    def _current_keys(self) -> list[bytes]:
        """The keys of this moment (every key ever used stays in `keys`, for the check)."""
        if self._rotate_s is None:
            return self._base
        epoch = int((time.monotonic() - self._started) / self._rotate_s)
        keys = [k + f"/{epoch}".encode() for k in self._base]
        with self._lock:
            if epoch > self._epoch:
                self._epoch = epoch
                self.keys.extend(k for k in keys if k not in self.keys)
        return keys

    def _run(self, index: int, rng: random.Random) -> None:
        with Client(self._endpoints, timeout_s=15, max_attempts=100, max_backoff_s=self._max_backoff_s) as client:
            counter = 0
            while not self._stop.is_set():
                counter += 1
                key = rng.choice(self._current_keys())
                kind = rng.choices([Kind.PUT, Kind.CAS, Kind.GET, Kind.DELETE], [4, 3, 4, 1])[0]
                value = f"{index}-{counter}".encode()
                expected = None if rng.random() < 0.3 else self._last_value(key, rng)
                op = Operation(client=index, kind=kind, key=key, value=value if kind in (Kind.PUT, Kind.CAS) else None,
                               expected=expected if kind is Kind.CAS else None, request_id=uuid.uuid4().hex,
                               invoke=time.monotonic_ns(), first_attempt_ms=0)
                try:
                    op.output = self._call(client, op)
                    op.complete = time.monotonic_ns()
                    op.outcome = Outcome.OK
                    self._observed(kind, "ok", op.invoke)
                except KvError as error:
                    outcome = outcome_of(error)
                    self._observed(kind, outcome, op.invoke)
                    if kind is Kind.GET:
                        continue  # a failed read observed nothing
                    op.outcome = Outcome.UNKNOWN if outcome == "unknown" else Outcome.FAILED
                    op.complete = time.monotonic_ns() if op.outcome is Outcome.FAILED else None
                    with self._lock:
                        self.errors.append(f"{kind.value} {key!r}: {type(error).__name__}: {error}")
                        del self.errors[:-1000]  # the latest, bounded
                with self._lock:
                    self.history.append(op)
                time.sleep(self._pause_s)

    def _observed(self, kind: Kind, outcome: str, invoke_ns: int) -> None:
        if self._observe is not None:
            self._observe(f"register-{kind.value}", outcome, invoke_ns / 1e9, time.monotonic())

    def _last_value(self, key: bytes, rng: random.Random) -> bytes | None:
        with self._lock:
            written = [op.value for op in self.history[-50:] if op.key == key and op.value is not None]
        return rng.choice(written) if written else None

    @staticmethod
    def _call(client: Client, op: Operation) -> Output:
        if op.kind is Kind.PUT:
            assert op.value is not None
            put = client.put(op.key, op.value, op.request_id)
            return ("put", put.version)
        if op.kind is Kind.DELETE:
            return ("delete", client.delete(op.key, op.request_id).deleted)
        if op.kind is Kind.GET:
            got = client.get(op.key)
            return ("get", got.found, got.value, got.kv.version if got.kv is not None else 0)
        assert op.value is not None
        compare = (Compare.version(op.key, "==", 0) if op.expected is None
                   else Compare.value(op.key, "==", op.expected))
        result = client.txn([compare], [Op.put(op.key, op.value)], [Op.get(op.key)], op.request_id)
        if result.succeeded:
            version = result.results[0].version  # type: ignore[union-attr]
            return ("cas", True, version)
        read = result.results[0]
        assert isinstance(read, GetResult), read
        return ("cas", False, read.found, read.value, read.kv.version if read.kv is not None else 0)

"""`kvstore load FILE`: bulk-load a dataset into the store through the shard leaders, idempotently.

The dataset is Parquet, CSV (RFC 4180, with a header row) or JSON lines, with columns `key`,
`value` and an optional boolean `delete` (true: delete the key; its value is ignored, and may be
left out). Keys and values are string (stored as UTF-8, as the client encodes a str) or binary.
A CSV field has no null: an empty `value` is the empty value there, while a null value of a put
row in Parquet or JSON is refused (did the row mean to delete?).

How it runs, and why:

* **Checked before anything is written.** One Spark pass counts the bad rows (missing or
  mistyped columns, null or empty keys, keys or values over the store's limits, a `delete` that
  is not a boolean) and refuses the whole load naming them: a half-loaded dataset is worse than
  none.
* **By shard, with the store's own rule.** Spark computes `pmod(crc32(key), S)` (S = the WAL
  topic's partition count, checked against the cluster's shard map) and shuffles each shard's
  rows into `TASKS_PER_SHARD` partitions (by another hash of the key), sorted by key; the task
  of a partition writes to its shard's leader (the client routes, follows leader hints and
  refreshes its map on a failover).
* **Duplicate keys: the last row wins.** A batch may touch a key twice (the store applies both, so
  the key would get version 2), so each key is written once per load: the row that comes last in
  (file path, position in the file) order, which is the order a person reads the files in and
  does not depend on how Spark splits them.
* **Large batches, several in flight.** A shard's rows, in key order, are cut into batches of up
  to `--batch-rows` (default DEFAULT_BATCH_ROWS, at most MAX_BATCH_MUTATIONS) puts/deletes and at
  most `BATCH_BYTES_BUDGET` bytes (under MAX_REQUEST_BYTES and under the WAL's record limit),
  each written with the store's batch RPC (`Client.write_batch`: one WAL record, no compares, no
  per-row answers). `IN_FLIGHT_BATCHES` batches per task are in flight, so the leader's group
  commit puts several in each WAL transaction.
* **Never applied twice (W7).** A batch's request id is a hash of the shard count, the shard and
  the batch's rows (keys, values, deletes): the same dataset cut the same way gives the same ids,
  in any run. The store applies an id at most once, so a retry after an unknown outcome (same id
  and `first_attempt_unix_ms`), a retried Spark task, or a rerun of the whole load applies each
  batch at most once. Content is the identity: loading again, within the horizon, a batch
  identical to one already loaded changes nothing, whatever happened to its keys since. The same
  rows cut differently (another `--batch-rows`, shard count or TASKS_PER_SHARD) are other ids.
  Limits: the store remembers ids for its request-id horizon, 1 h or 100k ids per shard,
  whichever comes first (`kvstore.limits`); a rerun after that applies the rows again (versions
  grow). A load makes rows / (S * batch rows) ids per shard: past 100k (100M rows per shard at
  1000 rows per batch) a rerun applies its earliest batches again. A retried Spark task sends the
  load's start time as its first attempt, so the store refuses ("expired, outcome unknown"),
  rather than applies again, a batch whose id it may have forgotten meanwhile; such a task (or
  one retried more than the horizon after the load started) fails the load.
* **Failover.** An unknown outcome or a definite refusal (no leader yet, overloaded) is retried
  with the same id, each batch within `BATCH_DEADLINE_S`; beyond it the task fails naming the batch
  and whether its outcome is unknown. A rerun is then the way to finish: it is safe.
* **Applied or replayed.** The store marks an answer it repeats for a known request id
  (`WriteResult.replayed`). A replayed batch whose WAL offset lies at or above the shard's high
  watermark at the load's start was committed during this load (an earlier attempt whose answer
  was lost): it counts as applied. Below it, an earlier load applied it: replayed. (Two loads of
  the same rows running at once would count each other's batches as applied.)

Result: `rows` (dataset rows), `applied`, `replayed`, `duplicates` (rows superseded by a later
row of the same key; rows = applied + replayed + duplicates), `batches`, `seconds` (from reading
the file to the last answer; Spark's start-up excluded) and `keys_per_s` ((applied + replayed) /
seconds). While it runs, the driver prints progress to stderr every `PROGRESS_INTERVAL_S`: the
running stage's tasks and the rows written by the tasks that finished.
Executors must reach the store's nodes at `--endpoints` and import `kvstore`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import itertools
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TextIO

from kvstore import limits
from kvstore.output import Printer
from kvstore.pipeline.errors import PipelineError
from kvstore.pipeline.target import WalTarget

# A batch's byte budget, counted as key + value + OP_OVERHEAD_BYTES per op: below the request
# limit and below the WAL's record limit (the entry also holds the request id, the leader time
# and a stored answer of a few bytes), with room to spare.
BATCH_BYTES_BUDGET = min(limits.MAX_REQUEST_BYTES, limits.MAX_WAL_RECORD_BYTES) - 32 * 1024
OP_OVERHEAD_BYTES = 16  # protobuf tags and lengths of a mutation around its key and value, rounded up
assert limits.MAX_KEY_BYTES + limits.MAX_VALUE_BYTES + OP_OVERHEAD_BYTES <= BATCH_BYTES_BUDGET, \
    "the largest row must fit a batch alone"
DEFAULT_BATCH_ROWS = 1_000  # large enough to amortise a call and a record, small enough to retry cheaply
# Each shard's rows go to this many tasks (by a hash of the key, so all rows of a key meet in one
# task): progress in steps finer than a shard, less to redo when a task is retried, and more
# than one executor per leader. Part of the id scheme: the cut into batches depends on it.
TASKS_PER_SHARD = 4
IN_FLIGHT_BATCHES = 8  # per task; the leader folds those waiting into its next WAL transaction
BATCH_DEADLINE_S = 120.0  # one batch, retries included: well above a failover (session timeout + bootstrap)
CALL_TIMEOUT_S = 30.0  # one client call (its own retries included); the batch loop calls again
RETRY_PAUSE_S = 0.2
PROGRESS_INTERVAL_S = 3.0
# The id scheme's version: a change of scheme must change it. load1- were Txns (a replay of one
# answers a TxnResponse); load2- are WriteBatch parts, sent as "load2-<hash>/<shard>".
REQUEST_ID_PREFIX = "load2-"
_ID_DOMAIN = b"kvstore.load.v1\0"
_FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".ndjson": "json"}
_ERROR_MARK = re.compile(r"<<kvstore-load>>(.*?)<</kvstore-load>>", re.DOTALL)

# What each write task gives back: one row per shard it wrote (normally one).
STATS_SCHEMA = ("shard int, task int, rows long, duplicates long, batches long, applied long, replayed long, "
                "applied_on_retry long, unknown_attempts long")


class LoadError(PipelineError):
    """The load refused the input or could not finish; the message says which and what to do."""


class LoadTaskError(Exception):
    """A task could not write a batch. Carried through Spark as text, so the message is marked
    and the driver lifts it out of Spark's wrapping (a Python traceback inside a Java one)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"<<kvstore-load>>{message}<</kvstore-load>>")


# ---------------------------------------------------------------------------------------------
# Pure parts: one key per row, the cut into batches, the request id.

Row = tuple[bytes, bytes | None, bool]  # key, value (None for a delete), delete


def last_per_key(rows: Iterable[Row]) -> Iterator[Row]:
    """Rows sorted by key (ties in dataset order) -> the last row of each key. The caller counts
    duplicates as rows in minus rows out."""
    previous: Row | None = None
    for row in rows:
        if previous is not None and row[0] != previous[0]:
            yield previous
        previous = row
    if previous is not None:
        yield previous


def op_bytes(row: Row) -> int:
    key, value, delete = row
    return len(key) + (0 if delete or value is None else len(value)) + OP_OVERHEAD_BYTES


def cut_batches(rows: Iterable[Row], max_ops: int, max_bytes: int = BATCH_BYTES_BUDGET) -> Iterator[list[Row]]:
    """Consecutive rows into batches of at most `max_ops` ops and `max_bytes` (op_bytes). Depends
    on the rows alone, so the same rows are cut the same way in every run (the ids rely on it)."""
    assert 1 <= max_ops <= limits.MAX_BATCH_MUTATIONS, f"ops per batch {max_ops}"
    batch: list[Row] = []
    size = 0
    for row in rows:
        need = op_bytes(row)
        if batch and (len(batch) >= max_ops or size + need > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append(row)
        size += need
    if batch:
        yield batch


def request_id(shard_count: int, shard: int, batch: Sequence[Row]) -> str:
    """The batch's idempotency key: what it writes and where, so any run derives the same one."""
    h = hashlib.blake2b(digest_size=16)
    h.update(_ID_DOMAIN + shard_count.to_bytes(4, "big") + shard.to_bytes(4, "big"))
    for key, value, delete in batch:
        h.update(len(key).to_bytes(4, "big") + key)
        if delete:
            h.update(b"D")
        else:
            data = value or b""
            h.update(b"P" + len(data).to_bytes(4, "big") + data)
    return REQUEST_ID_PREFIX + h.hexdigest()


# ---------------------------------------------------------------------------------------------
# The task side: one Spark task writes the rows of its partition (one shard, normally).


@dataclasses.dataclass(frozen=True)
class TaskPlan:
    """What every task needs, pickled once into the stage's closure."""

    endpoints: tuple[str, ...]
    shard_count: int
    batch_rows: int
    start_offsets: dict[int, int]  # per shard, the WAL's high watermark when the load started
    job_start_unix_ms: int
    in_flight: int = IN_FLIGHT_BATCHES
    batch_deadline_s: float = BATCH_DEADLINE_S
    call_timeout_s: float = CALL_TIMEOUT_S


@dataclasses.dataclass
class ShardStats:
    batches: int = 0
    applied: int = 0
    replayed: int = 0
    applied_on_retry: int = 0  # applied by an earlier attempt of this load whose answer was lost
    unknown_attempts: int = 0


class _TaskWriter:
    """Writes batches with up to `plan.in_flight` outstanding; the first failure stops it."""

    def __init__(self, plan: TaskPlan, client: Any, first_attempt_unix_ms: Callable[[], int]) -> None:
        self._plan = plan
        self._client = client
        self._first_ms = first_attempt_unix_ms
        self._slots = threading.BoundedSemaphore(plan.in_flight)
        self._pool = concurrent.futures.ThreadPoolExecutor(plan.in_flight, thread_name_prefix="kvstore-load")
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self.stats: dict[int, ShardStats] = {}

    def submit(self, shard: int, batch: list[Row]) -> None:
        self._raise_failure()
        # Bounded wait for a slot: a batch holds one for at most its deadline.
        if not self._slots.acquire(timeout=self._plan.batch_deadline_s + self._plan.call_timeout_s + 10):
            raise LoadTaskError(f"shard {shard}: no batch finished within {self._plan.batch_deadline_s} s")
        self._raise_failure()
        self._pool.submit(self._write, shard, batch).add_done_callback(self._done)

    def _done(self, future: concurrent.futures.Future[None]) -> None:
        if future.cancelled():  # never ran (abandon): it held a slot nobody waits for now
            return
        with self._lock:
            error = future.exception()
            if error is not None and self._failure is None:
                self._failure = error
        self._slots.release()

    def _raise_failure(self) -> None:
        with self._lock:
            failure = self._failure
        if failure is not None:
            raise failure

    def finish(self) -> None:
        """Wait for every batch (each bounded by its deadline), then raise the first failure."""
        self._pool.shutdown(wait=True)
        self._raise_failure()

    def abandon(self) -> None:
        """After a failure: let outstanding batches end by their own deadlines, start no more."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _stats(self, shard: int) -> ShardStats:
        with self._lock:
            return self.stats.setdefault(shard, ShardStats())

    def _write(self, shard: int, batch: list[Row]) -> None:
        from kvstore.client import BatchIncomplete, InvalidArgument, KvError, Op, RequestExpired, UnknownOutcome

        plan = self._plan
        rid = request_id(plan.shard_count, shard, batch)
        ops = [Op.delete(key) if delete else Op.put(key, value or b"") for key, value, delete in batch]
        first_ms = self._first_ms()
        where = f"shard {shard}: batch {rid} ({len(batch)} rows, keys {_show(batch[0][0])}..{_show(batch[-1][0])})"
        deadline = time.monotonic() + plan.batch_deadline_s
        unknown = 0
        last: KvError | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                outcome = ("its outcome is unknown (it may have been applied)" if unknown
                           else "it was not applied")
                raise LoadTaskError(f"{where}: gave up after {plan.batch_deadline_s:.0f} s, {outcome}; last error: "
                                    f"{last}. Rerunning the same load is safe: applied batches are not applied again")
            try:
                try:
                    batch_result = self._client.write_batch(ops, request_id=rid, first_attempt_unix_ms=first_ms,
                                                            timeout_s=min(remaining, plan.call_timeout_s))
                except BatchIncomplete as incomplete:  # one shard, one part: its own error
                    raise incomplete.errors[shard] from None
                [result] = batch_result.shards
            except RequestExpired as exc:
                raise LoadTaskError(f"{where}: {exc}") from None
            except InvalidArgument as exc:
                state = "; an earlier attempt's outcome is unknown" if unknown else ""
                raise LoadTaskError(f"{where}: refused by the store: {exc}{state}") from None
            except UnknownOutcome as exc:
                unknown += 1
                last = exc
            except KvError as exc:  # definite for this call (no leader yet, overloaded, a deadline)
                last = exc
            else:
                stats = self._stats(shard)
                with self._lock:
                    stats.batches += 1
                    stats.unknown_attempts += unknown
                    if not result.replayed:
                        stats.applied += len(batch)
                    elif result.revision is not None and result.revision >= plan.start_offsets.get(shard, 0):
                        stats.applied += len(batch)
                        stats.applied_on_retry += len(batch)
                    else:
                        stats.replayed += len(batch)
                return
            time.sleep(min(RETRY_PAUSE_S, max(0.0, deadline - time.monotonic())))


def _show(key: bytes) -> str:
    text = key.decode("utf-8", "backslashreplace")
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _task_rows(batches: Iterable[Any]) -> Iterator[tuple[int, Row]]:
    """Arrow batches (shard, key, value, delete) -> (shard, row)."""
    for rb in batches:
        columns = rb.to_pydict()
        for shard, key, value, delete in zip(columns["shard"], columns["key"], columns["value"], columns["delete"],
                                             strict=True):
            yield int(shard), (bytes(key), None if value is None else bytes(value), bool(delete))


def write_partition(plan: TaskPlan, rows_done: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """The body of one write task (`mapInArrow`): its rows arrive sorted by (shard, key, dataset
    order); it writes the last row of each key and yields one stats row per shard it wrote."""
    import pyarrow as pa
    from pyspark import TaskContext

    from kvstore.client import Client

    context = TaskContext.get()
    task = context.partitionId() if context is not None else -1
    retried = context is not None and context.attemptNumber() > 0

    def first_attempt_unix_ms() -> int:
        # A retried task may resend ids an earlier attempt committed: claiming the job's start
        # makes the store refuse one it may have forgotten instead of applying it again.
        return plan.job_start_unix_ms if retried else int(time.time() * 1000)

    client = Client(list(plan.endpoints), timeout_s=plan.call_timeout_s, max_attempts=50, max_backoff_s=0.5)
    writer = _TaskWriter(plan, client, first_attempt_unix_ms)
    counts: dict[int, list[int]] = {}  # shard -> [rows in, rows kept]: normally one shard
    try:
        for shard, group in itertools.groupby(_task_rows(batches), key=lambda item: item[0]):
            count = counts.setdefault(shard, [0, 0])

            def counted(group: Iterator[tuple[int, Row]], count: list[int] = count) -> Iterator[Row]:
                for _shard, row in group:
                    count[0] += 1
                    yield row

            for batch in cut_batches(last_per_key(counted(group)), plan.batch_rows):
                count[1] += len(batch)
                writer.submit(shard, batch)
        writer.finish()
        rows_done.add(sum(rows for rows, _kept in counts.values()))
    except BaseException:
        writer.abandon()
        raise
    finally:
        client.close()
    shards = sorted(counts)
    stats = [writer.stats.get(s, ShardStats()) for s in shards]
    yield pa.RecordBatch.from_pydict({
        "shard": pa.array(shards, pa.int32()),
        "task": pa.array([task] * len(shards), pa.int32()),
        "rows": pa.array([counts[s][0] for s in shards], pa.int64()),
        "duplicates": pa.array([counts[s][0] - counts[s][1] for s in shards], pa.int64()),
        "batches": pa.array([st.batches for st in stats], pa.int64()),
        "applied": pa.array([st.applied for st in stats], pa.int64()),
        "replayed": pa.array([st.replayed for st in stats], pa.int64()),
        "applied_on_retry": pa.array([st.applied_on_retry for st in stats], pa.int64()),
        "unknown_attempts": pa.array([st.unknown_attempts for st in stats], pa.int64()),
    })


# ---------------------------------------------------------------------------------------------
# The driver side.


@dataclasses.dataclass(frozen=True)
class LoadResult:
    rows: int
    applied: int
    replayed: int
    duplicates: int
    batches: int
    seconds: float
    applied_on_retry: int = 0  # of applied: committed by an attempt of this load whose answer was lost
    tasks: int = 0  # tasks that wrote rows: S * TASKS_PER_SHARD unless a (shard, part) had no rows
    unknown_attempts: int = 0  # client calls that ended in UnknownOutcome (not the client's own retries)

    @property
    def keys_per_s(self) -> float:
        return (self.applied + self.replayed) / self.seconds if self.seconds > 0 else 0.0

    def record(self) -> dict[str, Any]:
        return {"rows": self.rows, "applied": self.applied, "replayed": self.replayed,
                "duplicates": self.duplicates, "batches": self.batches, "seconds": round(self.seconds, 3),
                "keys_per_s": round(self.keys_per_s, 1)}


def format_of(path: str, given: str | None) -> str:
    if given:
        return given
    name = path.rstrip("/").lower()
    for ext, fmt in _FORMATS.items():
        if name.endswith(ext):
            return fmt
    raise LoadError(f"cannot tell the format of {path!r} from its name: give --format parquet, csv or json")


def check_batch_rows(batch_rows: int | None) -> int:
    if batch_rows is None:
        return DEFAULT_BATCH_ROWS
    if not 1 <= batch_rows <= limits.MAX_BATCH_MUTATIONS:
        raise LoadError(f"--batch-rows must be between 1 and {limits.MAX_BATCH_MUTATIONS} (MAX_BATCH_MUTATIONS, "
                        f"the mutations one write to a shard may hold): {batch_rows}")
    return batch_rows


def command(args: argparse.Namespace, target: WalTarget | None, printer: Printer) -> int:
    """`kvstore load FILE`: the CLI's entry (kvstore.pipeline.commands)."""
    from kvstore.pipeline import commands

    assert target is not None, "load writes to a WAL: the CLI resolves its target"
    fmt = format_of(args.file, args.format)
    batch_rows = check_batch_rows(args.batch_rows)
    endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    if not endpoints:
        raise LoadError("--endpoints is empty: the load writes through the store's nodes")
    spark = commands.spark_for(args, "kvstore-load")
    result = load(spark, args.file, fmt, target, endpoints, batch_rows=batch_rows,
                  timeout_s=max(args.timeout, 10.0), progress=sys.stderr)
    if printer.json:
        printer.record(result.record())
    else:
        printer.line(f"loaded {args.file}: {result.rows} rows, {result.applied} applied, {result.replayed} replayed "
                     f"(already loaded), {result.duplicates} superseded by a later row of the same key; "
                     f"{result.batches} batches in {result.seconds:.1f} s ({result.keys_per_s:.0f} keys/s)")
    return 0


def load(spark: Any, path: str, fmt: str, target: WalTarget, endpoints: Sequence[str], *,
         batch_rows: int = DEFAULT_BATCH_ROWS, timeout_s: float = 10.0, progress: TextIO | None = None,
         in_flight: int = IN_FLIGHT_BATCHES) -> LoadResult:
    """Check the dataset, then write it; see the module docstring. Raises LoadError."""
    batch_rows = check_batch_rows(batch_rows)
    started = time.monotonic()
    job_start_ms = int(time.time() * 1000)
    _check_cluster(target, endpoints, timeout_s)
    start_offsets = _high_watermarks(target, timeout_s)
    say = _Say(progress)
    say(f"reading and checking {path} ({fmt})")
    frame = _normalized(_read(spark, path, fmt), fmt, path)
    rows = _check_rows(frame, path, fmt)
    if rows == 0:
        return LoadResult(0, 0, 0, 0, 0, time.monotonic() - started)
    say(f"writing {rows} rows to {target.shards} shards")
    plan = TaskPlan(tuple(endpoints), target.shards, batch_rows, start_offsets, job_start_ms, in_flight=in_flight)
    rows_done = spark.sparkContext.accumulator(0)
    stage = _write_stage(spark, frame, plan, rows_done)
    stats = _run_with_progress(spark, stage, say, lambda: f"{rows_done.value}/{rows} rows done", started)
    total = {k: sum(int(r[k]) for r in stats) for k in
             ("rows", "duplicates", "batches", "applied", "replayed", "applied_on_retry", "unknown_attempts")}
    if total["rows"] != rows or total["applied"] + total["replayed"] + total["duplicates"] != rows:
        raise LoadError(f"internal: the tasks accounted for {total} of {rows} rows")
    tasks = len({int(r["task"]) for r in stats if int(r["rows"])})
    return LoadResult(rows, total["applied"], total["replayed"], total["duplicates"], total["batches"],
                      time.monotonic() - started, applied_on_retry=total["applied_on_retry"], tasks=tasks,
                      unknown_attempts=total["unknown_attempts"])


class _Say:
    def __init__(self, out: TextIO | None) -> None:
        self._out = out

    def __call__(self, text: str) -> None:
        if self._out is not None:
            self._out.write(f"kvstore load: {text}\n")
            self._out.flush()


def _check_cluster(target: WalTarget, endpoints: Sequence[str], timeout_s: float) -> None:
    """The shard rule needs the cluster's S: a topic with another partition count would send
    rows to the wrong shard's leader (refused there, but better said at once)."""
    from kvstore.client import Client, KvError

    try:
        with Client(list(endpoints), timeout_s=timeout_s) as client:
            smap = client.shard_map()
    except KvError as exc:
        raise LoadError(f"no store node answered at {','.join(endpoints)}: {exc}") from None
    if smap.shard_count != target.shards or (smap.topic and smap.topic != target.topic):
        raise LoadError(f"the cluster at {','.join(endpoints)} has {smap.shard_count} shards on topic {smap.topic!r}, "
                        f"but the WAL given is {target.topic!r} with {target.shards} partitions")


def _high_watermarks(target: WalTarget, timeout_s: float) -> dict[int, int]:
    """Each shard's WAL end now: a replayed answer at or above it was committed by this load."""
    from confluent_kafka import KafkaException

    from wal.clients import PartitionEnds

    ends = PartitionEnds(target.bootstrap_servers, timeout_s, target.security)
    out: dict[int, int] = {}
    try:
        for shard in range(target.shards):
            for attempt in range(5):  # the admin call fails retriably while partition leadership moves
                try:
                    out[shard] = ends.high_watermark(target.topic, shard)
                    break
                except KafkaException as exc:
                    if attempt == 4:
                        raise LoadError(f"cannot read the WAL's end offsets from {target.bootstrap_servers}: "
                                        f"{exc}") from None
                    time.sleep(0.5)
    finally:
        ends.close()
    return out


def _spark_message(exc: BaseException) -> str:
    """The useful line of a Spark error: ours if a task raised it, else Spark's first line."""
    text = str(exc)
    marked = _ERROR_MARK.search(text)
    if marked:
        return " ".join(marked.group(1).split())
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    return first if len(first) <= 400 else first[:397] + "..."


def _read(spark: Any, path: str, fmt: str) -> Any:
    from kvstore.pipeline.commands import local_path

    local = local_path(path)
    if local is not None and not local.exists() and not any(c in path for c in "*?[{"):
        # Said before Spark logs its own stack trace for it.
        raise LoadError(f"cannot read {path}: no such file or directory")
    reader = spark.read.format(fmt)
    if fmt == "csv":
        # RFC 4180 quoting (a quote inside a quoted field is doubled), as Python's csv module,
        # pandas and spreadsheets write it; Spark's default escape is a backslash.
        reader = reader.option("header", "true").option("mode", "FAILFAST").option("escape", '"')
    elif fmt == "json":
        reader = reader.option("mode", "FAILFAST")
    try:
        return reader.load(path)
    except Exception as exc:  # AnalysisException (no such path), a failed schema inference, ...
        raise LoadError(f"cannot read {path} as {fmt}: {_spark_message(exc)}") from None


def _normalized(df: Any, fmt: str, path: str) -> Any:
    """(key, value, delete, bad_delete, file, block, row): key and value as bytes, delete a
    boolean, bad_delete where it was not one, and the row's place in the dataset."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    fields = {f.name: f.dataType for f in df.schema.fields}
    text_or_bytes = (T.StringType, T.BinaryType)
    # A dataset of deletes only may leave the value out.
    needed = ("key", "value") if "delete" not in fields else ("key",)
    for name in needed:
        if name not in fields:
            found = ", ".join(fields) or "none"
            raise LoadError(f"{path}: no {name!r} column (columns found: {found}); a load needs key and value, "
                            f"and optionally delete")
    for name in ("key", "value"):
        if name in fields and not isinstance(fields[name], text_or_bytes):
            raise LoadError(f"{path}: column {name!r} is {fields[name].simpleString()}; it must be string or binary")
    key = F.col("key").cast("binary")
    value = F.col("value").cast("binary") if "value" in fields else F.lit(None).cast("binary")
    if fmt == "csv" and "value" in fields:  # CSV has no null: an empty field is the empty value
        value = F.coalesce(value, F.lit(b""))
    if "delete" in fields:
        raw = F.col("delete")
        kind = fields["delete"]
        if isinstance(kind, T.BooleanType):
            flag = raw
        elif isinstance(kind, T.StringType):
            flag = F.trim(raw).try_cast("boolean")
        elif isinstance(kind, T.IntegralType):
            flag = F.when(raw.isin(0, 1), raw.cast("boolean"))
        else:
            raise LoadError(f"{path}: column 'delete' is {kind.simpleString()}; it must be boolean")
        raw_present = raw.isNotNull()
    else:
        flag, raw_present = F.lit(False), F.lit(False)
    return df.select(
        key.alias("key"), value.alias("value"),
        F.coalesce(flag, F.lit(False)).alias("delete"),
        (raw_present & flag.isNull()).alias("bad_delete"),
        F.col("_metadata.file_path").alias("file"),
        F.col("_metadata.file_block_start").alias("block"),
        F.monotonically_increasing_id().alias("row"),
    )


def _check_rows(frame: Any, path: str, fmt: str) -> int:
    """Count every kind of bad row in one pass; refuse the load if there is any."""
    from pyspark.sql import functions as F

    key, value, delete = F.col("key"), F.col("value"), F.col("delete")
    key_len = F.octet_length(key)
    put = ~delete
    checks = {
        "null_key": key.isNull(),
        "empty_key": key.isNotNull() & (key_len == 0),
        "long_key": key_len > limits.MAX_KEY_BYTES,
        "null_value": put & key.isNotNull() & value.isNull(),
        "long_value": put & (F.octet_length(value) > limits.MAX_VALUE_BYTES),
        "bad_delete": F.col("bad_delete"),
    }
    aggs = [F.count(F.lit(1)).alias("rows")]
    for name, cond in checks.items():
        aggs.append(F.count_if(cond).alias(name))
        example = F.col("file") if name == "null_key" else F.substring(key, 1, 40)
        aggs.append(F.first(F.when(cond, example), ignorenulls=True).alias(name + "_example"))
    try:
        counts = frame.agg(*aggs).collect()[0].asDict()
    except Exception as exc:  # an unreadable file, a malformed line (FAILFAST), ...
        raise LoadError(f"cannot read {path} as {fmt}: {_spark_message(exc)}") from None
    problems = []
    what = {
        "null_key": "a null key (first in {})",
        "empty_key": "an empty key (the store refuses empty keys; first: {})",
        "long_key": f"a key over MAX_KEY_BYTES={limits.MAX_KEY_BYTES} bytes (first starts {{}})",
        "null_value": "a null value but delete not true (first key: {}); a put needs a value",
        "long_value": f"a value over MAX_VALUE_BYTES={limits.MAX_VALUE_BYTES} bytes (first key: {{}})",
        "bad_delete": "a delete that is not a boolean (first key: {})",
    }
    for name, text in what.items():
        n = int(counts[name])
        if n:
            example = counts[name + "_example"]
            shown = _show(bytes(example)) if isinstance(example, bytes | bytearray) else str(example)
            problems.append(f"{n} row{'s' if n != 1 else ''} with " + text.format(shown))
    if problems:
        raise LoadError(f"{path}: nothing loaded, the dataset has " + "; ".join(problems))
    return int(counts["rows"])


_PARTITION_KEYS: dict[int, list[int]] = {}  # per partition count: a Spark job saved per later load


def _partition_keys(spark: Any, partitions: int) -> list[int]:
    """For each partition p a bigint that Spark's hash partitioning sends to p, so that
    `repartition(n, col)` puts each (shard, part) in a task of its own (hashing the numbers
    themselves would put two in one task, and leave another idle, about a third of the time).
    If Spark ever hashed otherwise, a task would just write more than one (shard, part)."""
    from pyspark.sql import functions as F

    if partitions in _PARTITION_KEYS:
        return _PARTITION_KEYS[partitions]
    rows = (spark.range(0, 64 * partitions)
            .select(F.col("id"), F.pmod(F.hash(F.col("id")), F.lit(partitions)).alias("p"))
            .groupBy("p").agg(F.min("id").alias("id")).collect())
    found = {int(r["p"]): int(r["id"]) for r in rows}
    keys = _PARTITION_KEYS[partitions] = [found.get(p, p) for p in range(partitions)]
    return keys


def _write_stage(spark: Any, frame: Any, plan: TaskPlan, rows_done: Any) -> Any:
    """Rows -> one task per (part, shard), rows sorted by (key, dataset order), written by
    `write_partition`. Task p = part * S + shard: Spark starts tasks in order, so the first ones
    go to different leaders."""
    from pyspark.sql import functions as F

    shards = plan.shard_count
    partitions = shards * TASKS_PER_SHARD
    shard = F.pmod(F.crc32(F.col("key")), F.lit(shards)).cast("int")
    part = F.pmod(F.xxhash64(F.col("key")), F.lit(TASKS_PER_SHARD)).cast("int")
    keys = _partition_keys(spark, partitions)
    task = F.element_at(F.array(*[F.lit(k).cast("bigint") for k in keys]), part * shards + shard + 1)
    return (frame.select("key", "value", "delete", "file", "block", "row", shard.alias("shard"), task.alias("task"))
            .repartition(partitions, "task")
            .sortWithinPartitions("shard", "key", "file", "block", "row")
            .select("shard", "key", "value", "delete")
            .mapInArrow(functools.partial(write_partition, plan, rows_done), STATS_SCHEMA))


def _run_with_progress(spark: Any, stage: Any, say: _Say, done: Callable[[], str], started: float) -> list[Any]:
    """Run the write job in a thread of its own job group; print its tasks' progress meanwhile."""
    sc = spark.sparkContext
    group = f"kvstore-load-{time.time_ns()}"
    outcome: dict[str, Any] = {}

    def run() -> None:
        sc.setJobGroup(group, "kvstore load", interruptOnCancel=True)
        try:
            outcome["rows"] = stage.collect()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="kvstore-load-job", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(PROGRESS_INTERVAL_S)
            if thread.is_alive():
                say(f"{_progress_line(sc, group)}; {done()} (by finished tasks); "
                    f"{time.monotonic() - started:.0f} s")
    except BaseException:
        sc.cancelJobGroup(group)
        thread.join(30)
        raise
    if "error" in outcome:
        raise LoadError(f"the load failed: {_spark_message(outcome['error'])}") from None
    rows: list[Any] = outcome["rows"]
    return rows


def _progress_line(sc: Any, group: str) -> str:
    """Tasks of the load's stages so far; the last stage has one writer task per shard."""
    tracker = sc.statusTracker()
    stages = []
    for job_id in tracker.getJobIdsForGroup(group):
        job = tracker.getJobInfo(job_id)
        for stage_id in (job.stageIds if job is not None else ()):
            info = tracker.getStageInfo(stage_id)
            if info is not None:
                stages.append(info)
    parts = [f"stage {s.stageId} {s.numCompletedTasks}/{s.numTasks} tasks done, {s.numActiveTasks} running"
             + (f", {s.numFailedTasks} failed" if s.numFailedTasks else "")
             for s in sorted(stages, key=lambda s: int(s.stageId))
             if s.numActiveTasks or s.numFailedTasks or 0 < s.numCompletedTasks < s.numTasks]
    return "; ".join(parts) or "starting"
